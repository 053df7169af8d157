"""The command-buffer check of the GPU tests against real XLA output.

`helpers.gpu_util.captured` reads which custom calls XLA put into command
buffers (CUDA graphs) when it compiles a module: outlined `command_buffer`
computations in the module's text, or (jax 0.11's XLA, which forms them
from the thunk sequence and outlines nothing) kCommandBuffer thunks in the
thunk sequence it dumps; the replay test (test_safe_abort_gpu.py) and the
graph-update tests (tests/scripts/graph_update_checks.py,
helpers/all_reduce_checks.py) assert their premise with it. On CPU it reads
hand-written HLO and a real H100 dump (test_lowering_cpu.py). Here a real pk call is compiled by XLA for the GPU,
once with every custom call in a command buffer and once with command
buffers off (tests/scripts/command_buffer_check.py, a process each): the
check must find the call in the first module and not in the second, which
still holds it, so neither a parser that never matches nor one that always
does passes.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import gpu_mesh
from pk_jax import runtime

pytestmark = pytest.mark.gpu

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts",
                      "command_buffer_check.py")
FLAGS = {"captured": "--xla_gpu_graph_min_graph_size=1",
         "uncaptured": "--xla_gpu_enable_command_buffer="}


def _check(case: str, mode: str, tmp_path) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAGS[mode]).strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process holds most of each GPU
    hlo = tmp_path / f"{case}_{mode}.txt"
    proc = subprocess.run([sys.executable, SCRIPT, case, str(hlo)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["hlo"] = str(hlo)  # the module's text, kept for a failure's report
    return result


@pytest.mark.parametrize("case,gpus", [("fp8_quantize", 1), ("all_gather", 2)])
def test_command_buffer_check_on_real_compiled_modules(tmp_path, case, gpus):
    gpu_mesh(gpus)
    if not runtime.available():
        pytest.skip(f"the pk_jax kernels cannot run here ({runtime.extension_error()})")
    captured = _check(case, "captured", tmp_path)
    target = captured["target"]
    assert captured["values_ok"], captured
    assert captured["command_buffers"] >= 1, captured      # XLA outlined one
    assert target in captured["captured"], captured        # and the check finds the call in it
    uncaptured = _check(case, "uncaptured", tmp_path)
    assert uncaptured["values_ok"], uncaptured
    assert uncaptured["occurrences"] >= 1, uncaptured      # the call is in the module
    assert uncaptured["command_buffers"] == 0, uncaptured
    assert target not in uncaptured["captured"], uncaptured  # outside every command buffer
