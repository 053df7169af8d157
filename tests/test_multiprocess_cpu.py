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
fail-fast: a process failing after pk_jax.distributed.initialize() (sys.exit
or an uncaught exception) while its peer computes or waits for it ends the
job within seconds, with its exit code; a clean exit still waits for the
peer in JAX's shutdown.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

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


# ---- fail-fast -----------------------------------------------------------------------
# From the failure to the launcher's return. On two cores a do-nothing launch
# of two processes that import jax and join takes about 5 s (imports, the
# coordinator, JAX's shutdown), not counted here; the failure itself costs
# the launcher's grace before SIGKILL (--kill-after-failure, 2 s: the peer
# that joined JAX's runtime takes SIGTERM as a preemption notice) and a poll.
FAIL_FAST_S = 5.0


@pytest.mark.parametrize("case,failing,code", [("exit", 1, 7), ("raise", 1, 1),
                                               ("raise", 0, 1)])
def test_a_failing_process_ends_the_job_at_once(tmp_path, case, failing, code):
    """exit: process 1 calls sys.exit(7) while process 0 computes for 40 s
    (before the fix: 45 s, process 1 held in JAX's shutdown); raise: an
    uncaught exception while the peer waits in sync_global_devices (before:
    both hung until gloo's 30 s timeout), also in process 0, which holds
    the coordinator."""
    worker = ROOT / "tests" / "scripts" / "fail_fast_worker.py"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", "2",
                           "--gpus-per-process", "0", str(worker), case, str(failing),
                           str(tmp_path)], env=child_env(), capture_output=True, text=True,
                          timeout=300, cwd=worker.parent)
    ended, took = time.time(), time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == code, log[-6000:]
    assert "WORKER_DONE" not in log, log[-6000:]
    if case == "raise":
        assert f"[{failing}] RuntimeError: fail_fast_worker: failing on purpose" in log, log[-6000:]
    after_failure = ended - float((tmp_path / "failed_at").read_text())
    assert after_failure < FAIL_FAST_S, (after_failure, took, log[-6000:])


def test_a_clean_exit_waits_for_the_peer(tmp_path):
    """Process 1 exits with 0 at once while process 0 computes for 5 s: JAX's
    shutdown keeps process 1 until process 0 is done (the fail-fast exit is
    only for failures)."""
    worker = ROOT / "tests" / "scripts" / "fail_fast_worker.py"
    proc = subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", "2",
                           "--gpus-per-process", "0", str(worker), "clean", "1",
                           str(tmp_path)], env=child_env(), capture_output=True, text=True,
                          timeout=300, cwd=worker.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    times = {name: float((tmp_path / name).read_text())
             for name in ("done_0", "done_1", "after_1")}
    assert times["done_1"] < times["done_0"] - 3  # process 1 was done seconds earlier
    assert times["after_1"] >= times["done_0"]    # and left once process 0 was done
