"""Every op across two processes on GPUs (tests/scripts/gpu_multiprocess_check.py,
started by `python -m pk_jax.launch -n 2`): one GPU each, or both processes
sharing one GPU when there is only one (the workspaces still travel between
processes through CUDA IPC). Skipped with a reason without GPUs or kernels."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from conftest import child_env, gpus
from pk_jax import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


def _launch(n: int, script: str, done: str) -> None:
    """`python -m pk_jax.launch -n n` on tests/scripts/<script> (every process on GPU 0
    where there are fewer GPUs); each of the n processes must print `done`."""
    if not gpus():
        pytest.skip("needs a GPU")
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels")
    scripts = ROOT / "tests" / "scripts"
    proc = subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", str(n),
                           "--gpus-per-process", "0", str(scripts / script)],
                          env=child_env(), capture_output=True, text=True, timeout=900,
                          cwd=scripts)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and log.count(done) == n, log[-8000:]


def test_every_op_across_two_processes():
    _launch(2, "gpu_multiprocess_check.py", "GPU_MULTIPROCESS_DONE")


def test_fused_ring_backward_across_four_processes():
    """The fused ring attention backward on a ring of 4 processes
    (tests/scripts/gpu_ring_bwd_check.py; all on GPU 0 where there are fewer than 4):
    3 ring steps, so its two K/V slots and its partial slot are reused under
    the per-slot credits within each call."""
    _launch(4, "gpu_ring_bwd_check.py", "GPU_RING_BWD_DONE")
