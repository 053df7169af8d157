"""Test setup: 8 fake CPU devices for the CPU tests (always run), and
fixtures that give GPU meshes or skip with a reason."""

import os

# Before JAX initializes its backends: CPU tests run on 8 fake host devices
# (this also holds on GPU machines, where the CPU backend exists beside CUDA).
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Multicast stays off on shared hosts, also for NCCL inside XLA.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402


def gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    n = int(np.prod(shape))
    devices = np.array(jax.devices("cpu")[:n]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def gpu_mesh(n: int, name: str = "x") -> Mesh:
    devices = gpus()
    if len(devices) < n:
        pytest.skip(f"needs {n} GPUs, found {len(devices)}")
    return Mesh(np.array(devices[:n]), (name,), axis_types=(AxisType.Auto,))


@pytest.fixture
def rng():
    # Fresh inputs every run: a kernel tuned to fixed data cannot pass.
    return np.random.default_rng()


@pytest.fixture
def backward_kernel():
    """pk_jax.configure(ring_backward_kernel=True) for one test."""
    import pk_jax
    saved = pk_jax.get_config().ring_backward_kernel
    pk_jax.configure(ring_backward_kernel=True)
    yield
    pk_jax.configure(ring_backward_kernel=saved)
