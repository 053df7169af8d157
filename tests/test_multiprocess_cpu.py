"""pk_jax in a job of several processes, on CPU: 2 processes x 4 fake devices
started by `python -m pk_jax.launch`, jax.distributed on 127.0.0.1 and XLA's
CPU collectives over gloo (tests/scripts/multiprocess_worker.py does the checks in
each process).

same_host: values of all_gather, the tensor-parallel MLP and ring attention
over a mesh spanning both processes; the CUDA lowering (a stand-in for the
native extension) of programs lowered in opposite orders is identical on
both processes (channels and regions agreed through the key-value store);
workspaces are exchanged; zero-copy gathers turn to the copy engine across
processes (forced: an error); check_errors() is collective. two_hosts: a
group spanning hosts falls back to XLA (auto) or raises naming the axis
(forced); the 2-D recipe (pk inside a host, XLA across) lowers as intended.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from conftest import child_env


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _launch(scenario: str, out: pathlib.Path) -> str:
    worker = ROOT / "tests" / "scripts" / "multiprocess_worker.py"
    proc = subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", "2",
                           "--gpus-per-process", "0", str(worker), scenario, str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=600,
                          cwd=worker.parent)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert log.count("WORKER_DONE") == 2, log[-6000:]
    return log


def test_same_host(tmp_path):
    log = _launch("same_host", tmp_path)
    assert "OK causal zigzag ring attention across processes" in log
    assert log.count("OK ring attention's gradient lowers to the fused backward") == 2
    assert log.count("OK the tensor-parallel MLP's gradient lowers to one backward call") == 2
    hlo = [json.loads((tmp_path / f"hlo_{p}.json").read_text()) for p in (0, 1)]
    assert hlo[0].keys() == hlo[1].keys() and len(hlo[0]) == 6
    for name in hlo[0]:
        assert hlo[0][name] == hlo[1][name], f"{name}: the processes compiled different programs"


def test_two_hosts(tmp_path):
    log = _launch("two_hosts", tmp_path)
    for line in ("auto on an axis that spans hosts takes XLA's all_gather",
                 "a forced mechanism on an axis that spans hosts raises, naming the axis",
                 "2-D mesh: pk all_gather on the intra-host axis"):
        assert log.count(f"OK {line}") == 2, line
