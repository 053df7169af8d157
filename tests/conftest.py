"""Test setup: 8 fake CPU devices for the CPU tests (always run), and
fixtures that give GPU meshes or skip with a reason."""

import os
import re

# Before JAX initializes its backends: CPU tests run on 8 fake host devices
# (this also holds on GPU machines, where the CPU backend exists beside CUDA).
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Multicast stays off on shared hosts, also for NCCL inside XLA.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _no_gpu_here() -> bool:
    return not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES")


# On machines without a GPU (CI) the suite's time is XLA:CPU compiling
# thousands of small programs: compile them at LLVM -O0, with XLA:CPU's
# elemental emitters for fusions instead of its MLIR fusion emitters, and
# each program as one LLVM module (the two flags: the suite's CPU time
# -38%); the tests time nothing, and results may move by an ulp, within
# every tolerance. PK_JAX_TEST_FAST_COMPILE=0 turns it off; a flag already in
# XLA_FLAGS keeps its value. (A persistent compilation cache shared by the
# tests was faster still, but XLA:CPU aborted loading some of its
# executables, and a hit skips the partitioning callbacks that the routing
# tests record: benchmarks/NOTES.md.)
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_cpu_use_fusion_emitters=false",
                      "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("PK_JAX_TEST_FAST_COMPILE", "1" if _no_gpu_here() else "0") == "1":
    for _opt in FAST_COMPILE_FLAGS:
        if _opt.split("=")[0] + "=" not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + _opt

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402

from pk_jax import runtime  # noqa: E402


def child_env() -> dict:
    """The environment of a child Python process that must import the pk_jax
    this process imported: the source tree of an editable install, or an
    installed wheel (the folder holding the package goes first on PYTHONPATH;
    start the child outside the repository root, whose pk_jax/ would shadow a
    wheel). XLA_FLAGS is left out: each child sets its own device count."""
    import pk_jax

    env = dict(os.environ)
    home = os.path.dirname(os.path.dirname(os.path.abspath(pk_jax.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p)
    env.pop("XLA_FLAGS", None)
    return env


def gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# The axis type cpu_mesh gives (the `sharding_mode` fixture switches it).
_mesh_axis_type = AxisType.Auto


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh of fake CPU devices, Auto axes unless a test runs under the
    `sharding_mode` fixture's "explicit" parameter."""
    n = int(np.prod(shape))
    devices = np.array(jax.devices("cpu")[:n]).reshape(shape)
    return Mesh(devices, names, axis_types=(_mesh_axis_type,) * len(names))


@pytest.fixture(params=["auto", "explicit"])
def sharding_mode(request):
    """Run a test twice: with cpu_mesh giving Auto axes, then Explicit axes
    (what jax.make_mesh gives by default)."""
    global _mesh_axis_type
    saved = _mesh_axis_type
    _mesh_axis_type = AxisType.Explicit if request.param == "explicit" else AxisType.Auto
    try:
        yield request.param
    finally:
        _mesh_axis_type = saved


def gpu_mesh(n: int, name: str = "x") -> Mesh:
    devices = gpus()
    if len(devices) < n:
        pytest.skip(f"needs {n} GPUs, found {len(devices)}")
    return Mesh(np.array(devices[:n]), (name,), axis_types=(AxisType.Auto,))


def cuda_home(need: str = "include/cuda_runtime.h") -> str | None:
    """A CUDA toolkit root holding `need` (a glob under it): CUDA_HOME,
    /usr/local/cuda, nvcc's, then /usr/local/cuda-*; None if none."""
    import glob
    import os
    import shutil
    nvcc = shutil.which("nvcc")
    bases = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else ""]
    bases += sorted(glob.glob("/usr/local/cuda-*"))
    return next((b for b in bases if b and glob.glob(os.path.join(b, need))), None)


def build_native(source: str, exe, includes=(), opt: str = "-O1") -> str:
    """Compile tests/native/<source> for the host (headers from csrc/ after
    `includes`) into `exe`; skip the test when there is no C++ compiler."""
    import os
    import shutil
    import subprocess
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip(f"no host C++ compiler to build {source}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = [f for inc in (*includes, os.path.join(root, "csrc")) for f in ("-I", str(inc))]
    subprocess.run([cxx, "-std=c++17", opt, *flags,
                    os.path.join(root, "tests", "native", source), "-o", str(exe)], check=True)
    return str(exe)


def mutated_header(tmp_path, header: str, old: str, new: str):
    """A copy of csrc/<header> with `old` replaced by `new`, under tmp_path
    (pass tmp_path to build_native's includes, ahead of csrc/): how the host
    checks show that they fail on a broken kernel header."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = open(os.path.join(root, "csrc", header)).read()
    broken = src.replace(old, new)
    assert broken != src, f"{old!r} is not in {header}"
    path = tmp_path / header
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(broken)
    return tmp_path


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64: the relative error the value checks use."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def rng():
    # Fresh inputs every run: a kernel tuned to fixed data cannot pass.
    return np.random.default_rng()


class _FakeExtension:
    """What the CUDA lowering rules read from the native module."""

    has_gemm = True

    @staticmethod
    def cublaslt_version():
        return 130100

    @staticmethod
    def device_info(ordinal):
        return {"pci_bus_id": f"0000:{ordinal:02x}:00.0", "compute_capability": (9, 0),
                "supported": True}

    @staticmethod
    def can_access(ordinal, pci_bus_id):
        return True

    @staticmethod
    def connect_group(ids):
        pass


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Pretend the extension and GPUs exist so the CUDA rule runs."""
    monkeypatch.setattr(runtime, "available", lambda: True)
    monkeypatch.setattr(runtime, "ensure_ready", lambda: _FakeExtension())
    monkeypatch.setattr(runtime, "extension", lambda: _FakeExtension())

    def lower(fn, mesh, spec, shape, dtype=jnp.float32):
        x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
        return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    return lower


def ffi_attr(call: str, name: str) -> str:
    """The value of FFI attribute `name` in a lowered custom call's attributes."""
    return re.search(name + r" = (dense<\[?[-\d, ]*\]?>|[-\d]+)", call).group(1)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without a GPU, a run of the suite or of folders of it (not of named
    files or tests) spreads its tests over pytest-xdist's workers, one a
    CPU up to 4 (the tests are XLA:CPU compiling, about a core each, and a
    worker holds about 2.5 GB); `-n 0` (or `-n N`) says otherwise, and GPU
    machines and --pdb run in one process (the GPU tests take every GPU)."""
    if (config.option.collectonly or config.option.usepdb
            or not config.pluginmanager.hasplugin("xdist")
            or getattr(config.option, "numprocesses", 0) is not None
            or os.environ.get("PYTEST_XDIST_WORKER") or not _no_gpu_here()):
        return
    if all(os.path.isdir(a) for a in config.args):
        workers = min(os.cpu_count() or 1, 4)
        if workers > 1:
            config.option.numprocesses = workers


def pytest_collection_modifyitems(session, config, items):
    """The CUDA compile check (tests/helpers/compile_check.py) builds in the
    background from now on (under pytest-xdist in the controller, once the
    workers collected its test), and its tests run last, when the build has
    had the whole session."""
    from helpers import compile_check
    names = set(compile_check.TEST_NAMES.values())
    check = [it for it in items if it.name in names]
    if not check or config.option.collectonly:
        return
    items[:] = [it for it in items if it.name not in names] + check
    try:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            compile_check.plan()  # the controller starts it: the setting's check only
        else:
            compile_check.start()
    except ValueError as e:  # PK_JAX_COMPILE_CHECK set to no mode
        raise pytest.UsageError(str(e)) from None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller: a worker collected the compile check's test."""
    from helpers import compile_check
    names = set(compile_check.TEST_NAMES.values())
    if any(i.rsplit("::", 1)[-1] in names for i in ids):
        try:
            compile_check.start()
        except ValueError:  # the workers stop the session with a usage error
            pass


def pytest_unconfigure(config):
    from helpers import compile_check
    compile_check.stop()
