"""The dependent chains of tests/helpers/gpu_chains.py on two GPUs, in a
process of its own: tests/test_all_gather_gpu.py runs it with XLA command
buffers off. Prints SUBPROCESS_OK."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: helpers, conftest

from conftest import gpu_mesh  # noqa: E402
from pk_jax.ops.all_gather.primitive import KERNEL_MECHANISMS  # noqa: E402
from helpers.gpu_chains import check_all_gather_chain, check_tp_chain  # noqa: E402

if __name__ == "__main__":
    mesh = gpu_mesh(2)
    for mech in KERNEL_MECHANISMS:
        check_all_gather_chain(mesh, mech, 200)
    check_tp_chain(mesh)
    print("SUBPROCESS_OK")
