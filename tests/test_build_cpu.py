"""The build: the install compiles the CUDA extension only when asked for
(PK_JAX_BUILD_CUDA=1) or when nvcc and a GPU are found (build_backend/), the
extension still gets a compile check wherever nvcc exists, the package
imports without it, and the handler sources keep to what CUDA graphs can
update."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import compile_check
from pk_jax import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The FFI targets the Python side lowers to (every ffi_lowering("pk_...") in
# pk_jax/): the extension (xla_ffi/module.cc) must register exactly these.
REGISTRATIONS = {m.group(1) for f in (ROOT / "pk_jax").rglob("*.py")
                 for m in re.finditer(r'ffi_lowering\(\s*"(pk_[a-z0-9_]+)"', f.read_text())}


def _fake_tools(tmp_path, **scripts) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name, output in scripts.items():
        tool = bin_dir / name.replace("_", "-")
        tool.write_text(f"#!/bin/sh\necho '{output}'\n")
        tool.chmod(0o755)
    return str(bin_dir)


def test_build_decision(tmp_path, monkeypatch):
    """PK_JAX_BUILD_CUDA=1 builds, =0 does not, unset builds only with nvcc
    and a GPU in sight (here faked: scripts named nvcc and nvidia-smi)."""
    cuda = compile_check.decision_module()
    monkeypatch.setattr(cuda, "DEFAULT_CUDA_HOME", "/nonexistent")
    nvcc_only = _fake_tools(tmp_path / "a", nvcc="nvcc")
    gpu = _fake_tools(tmp_path / "b", nvcc="nvcc",
                      nvidia_smi="GPU 0: NVIDIA H200 (UUID: GPU-0)")
    no_gpu = _fake_tools(tmp_path / "c", nvcc="nvcc", nvidia_smi="")
    empty = _fake_tools(tmp_path / "d")
    no_nodes = ("/nonexistent/nvidia0",)

    def decide(path, value=None):
        env = {"PATH": path}
        if value is not None:
            env[cuda.ENV] = value
        return cuda.cuda_decision(env, device_nodes=no_nodes)

    assert decide(gpu)[:2] == (True, "auto")
    assert "NVIDIA H200" in decide(gpu)[2]
    assert decide(no_gpu)[:2] == (False, "auto")
    assert decide(nvcc_only)[:2] == (False, "auto")
    assert decide(empty)[:2] == (False, "auto")
    assert decide(gpu, "0")[:2] == (False, "0")
    assert decide(nvcc_only, "1")[:2] == (True, "1")
    assert decide(gpu, "auto")[0] and decide(gpu, "")[0]
    # A device node stands in for nvidia-smi (containers without it).
    node = tmp_path / "nvidia0"
    node.touch()
    env = {"PATH": nvcc_only}
    assert cuda.cuda_decision(env, device_nodes=(str(node),))[0]
    with pytest.raises(RuntimeError, match="no nvcc"):
        decide(empty, "1")
    with pytest.raises(RuntimeError, match="use 1"):
        decide(gpu, "maybe")


def test_installed_extension_follows_the_build_decision():
    """The installed package has the extension exactly when its build decided
    to compile it (pk_jax._build_info), and an automatic decision not to
    build it was not made on a machine that has nvcc and a GPU."""
    info = compile_check.build_info()
    if info is None:
        pytest.skip("pk_jax was not installed by its build backend (no pk_jax._build_info)")
    ext = runtime.extension()
    if info.cuda:
        assert ext is not None, (f"the build compiled the extension ({info.reason}) but it "
                                 f"does not load: {runtime.extension_error()}")
        assert set(ext.registrations()) == REGISTRATIONS
        assert ext.max_ranks >= 8
        return
    assert ext is None, f"a Python-only build ({info.reason}), yet an extension loads"
    if info.setting == "auto":
        cuda = compile_check.decision_module()
        env = {k: v for k, v in os.environ.items() if k != cuda.ENV}
        now, _, why = cuda.cuda_decision(env)
        assert not now, (f"installed without the CUDA extension ({info.reason}), but here "
                         f"{why}: reinstall; PK_JAX_BUILD_CUDA=1 forces the build")


def test_extension_compiles():
    """The compile check (tests/helpers/compile_check.py, built in the background
    while the other tests run; conftest.py runs this test last): wherever
    nvcc exists, the extension builds with CUDA and CUTLASS on, the built
    module imports on this machine and registers its FFI targets. Skipped
    where the install itself compiled the extension (the test above checks
    that one). PK_JAX_COMPILE_CHECK=0 skips it, =1 runs it even then."""
    p, rc = compile_check.result()
    if p.skip is not None:
        pytest.skip(p.skip)
    missing = [m for m in ("nanobind", "cutlass_library", "jax")
               if importlib.util.find_spec(m) is None]
    assert not missing, f"the compile check needs {missing}: pip install -e '.[test]'"
    if rc != 0:
        tail = "\n".join(p.log.read_text(errors="replace").splitlines()[-60:])
        pytest.fail(f"the CUDA extension does not build (full log: {p.log}):\n{tail}")
    build = p.build

    built = sorted(build.glob("_pk_jax_ext*.so"))
    assert built, f"no _pk_jax_ext module in {build}"
    # In a subprocess: its own copy of the module, never mixed with an installed one.
    probe = ("import importlib.util, json, sys\n"
             "spec = importlib.util.spec_from_file_location('_pk_jax_ext', sys.argv[1])\n"
             "m = importlib.util.module_from_spec(spec)\n"
             "spec.loader.exec_module(m)\n"
             "print(json.dumps({'registrations': sorted(m.registrations()),"
             " 'max_ranks': int(m.max_ranks)}))\n")
    done = subprocess.run([sys.executable, "-c", probe, str(built[0])],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(found["registrations"]) == REGISTRATIONS
    assert found["max_ranks"] >= 8


def test_import_needs_no_gpu():
    # Importing and querying never touches a driver on a machine without one.
    assert isinstance(runtime.available(), bool)
    runtime.check_errors()  # nothing initialized: a no-op


def test_no_multi_dimensional_copies_in_handler_code():
    """Every handler runs inside XLA's CUDA graphs, whose in-place updates take
    only 1-D memcpy and memset nodes (csrc/pk/copy_rows.h): a 2-D or 3-D copy
    passes every single-call test and fails the second call of a training
    loop. Strided copies go through pk::copy_rows."""
    root = ROOT
    banned = re.compile(r"\b(cudaMemcpy[23]D\w*|cudaMemset[23]D\w*|cuMemcpy[23]D\w*)\s*\(")
    offenders = []
    for path in [*root.glob("csrc/**/*.c*"), *root.glob("csrc/**/*.h"), *root.glob("xla_ffi/*")]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if banned.search(code):
                offenders.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_jax_version_check():
    """An older jax is refused at import with what to install; a newer,
    untested one gets a warning; the tested range passes silently."""
    import warnings
    from pk_jax._compat import check_jax_version
    with pytest.raises(ImportError, match="jax >= 0.10.2"):
        check_jax_version("0.9.9")
    with pytest.warns(RuntimeWarning, match="tested with jax"):
        check_jax_version("0.12.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_jax_version("0.10.2")
        check_jax_version("0.11.2.dev20261201")
