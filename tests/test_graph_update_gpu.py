"""Fused ops under XLA command buffers (CUDA graphs) with new buffers on
every call: XLA re-traces each handler and updates the instantiated graph in
place, so a handler that records something CUDA cannot update (a 2-D memcpy
node, pk/copy_rows.h) fails on the second call. The cases live in
tests/scripts/graph_update_checks.py and run in a subprocess whose XLA puts every custom
call into a graph (--xla_gpu_graph_min_graph_size=1); the training test of
tests/test_attention_bwd_gpu.py meets the same update in a real program."""

import os
import subprocess
import sys

import pytest

from conftest import gpu_mesh
from pk_jax import runtime

pytestmark = pytest.mark.gpu


def test_fresh_buffers_under_command_buffers():
    gpu_mesh(2)
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1").strip()
    # This process already holds most of each GPU's memory (XLA preallocates):
    # the child allocates on demand from what is left.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts",
                          "graph_update_checks.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=400)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "SUBPROCESS_OK" in proc.stdout, report
