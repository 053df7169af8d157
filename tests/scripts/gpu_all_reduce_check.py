"""all_reduce / reduce_scatter on GPUs, outside the test process
(the checks live in tests/helpers/all_reduce_checks.py).

Across two processes (prints one line per check, then
ALL_REDUCE_CHECKS_DONE; exits non-zero on the first failure):

    python -m pk_jax.launch -n 2 --gpus-per-process 0 tests/scripts/gpu_all_reduce_check.py

`graphs`: one process, every custom call in a CUDA graph, called on fresh
buffers (tests/test_all_reduce_gpu.py runs it with
XLA_FLAGS=--xla_gpu_graph_min_graph_size=1; prints GRAPHS_OK).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: helpers

import jax  # noqa: E402
import numpy as np  # noqa: E402

from helpers.all_reduce_checks import check_fresh_buffers, run_multiprocess_checks  # noqa: E402
from pk_jax.ops.all_reduce.primitive import KERNEL_MECHANISMS  # noqa: E402
from helpers.multiprocess_util import check, local, two_process_setup  # noqa: E402


def main() -> None:
    mesh, put, sm = two_process_setup()
    run_multiprocess_checks(mesh, put, sm, local, check, np.random.default_rng(4321))
    print("ALL_REDUCE_CHECKS_DONE", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["graphs"]:  # run with XLA_FLAGS=--xla_gpu_graph_min_graph_size=1
        from jax.sharding import AxisType, Mesh
        mesh = Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))
        for m in KERNEL_MECHANISMS:
            check_fresh_buffers(mesh, m)
            print(f"OK fresh buffers {m} on {mesh.devices.size} GPU(s)", flush=True)
        print("GRAPHS_OK", flush=True)
    else:
        main()
