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
import zipfile

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


def test_build_info_says_what_a_cuda_build_holds(tmp_path, monkeypatch):
    """The build backend's record of a CUDA build (pk_jax._build_info's
    template): the GPU code of CMakeLists.txt (or of -C overrides), nvcc's
    release, CUTLASS required unless turned off. nvcc is a fake here."""
    pytest.importorskip("scikit_build_core")
    monkeypatch.syspath_prepend(str(ROOT / "build_backend"))
    import pk_jax_build as backend
    fake = _fake_tools(tmp_path / "tools", nvcc="Cuda compilation tools, release 13.0, V13.0.88")
    monkeypatch.setenv("PATH", fake + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("PK_JAX_BUILD_CUDA", "1")
    monkeypatch.delenv("CUDACXX", raising=False)
    (tmp_path / "CMakeLists.txt").write_text((ROOT / "CMakeLists.txt").read_text())
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "build" / "pk_jax_build_info.py.in"

    settings, cuda = backend._config({}, write_info=True)
    assert cuda and settings["cmake.define.PK_JAX_REQUIRE_CUTLASS"] == "ON"
    info = template.read_text()
    assert "cuda = True" in info and "reason = 'PK_JAX_BUILD_CUDA=1'" in info
    assert "sm_90a kernels compiled by nvcc 13.0, CUTLASS GEMMs included" in info, info
    # The sources' commit: none here (tmp_path is no git checkout), the
    # repository's own from its root.
    assert "commit = ''" in info, info
    monkeypatch.chdir(ROOT)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert backend.source_commit().startswith(head)
    monkeypatch.chdir(tmp_path)

    two = "-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100a,code=sm_100a"
    backend._config({"cmake.define.PK_JAX_REQUIRE_CUTLASS": "OFF",
                     "cmake.define.PK_CUDA_GENCODE": two}, write_info=True)
    info = template.read_text()
    assert "sm_90a, sm_100a kernels compiled by nvcc 13.0, CUTLASS GEMMs if found" in info, info

    monkeypatch.setenv("PK_JAX_BUILD_CUDA", "0")
    settings, cuda = backend._config({}, write_info=True)
    assert not cuda and settings["wheel.cmake"] == "false"
    assert "kernels = ''" in template.read_text()


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


# What the extension may link: the C and C++ runtimes a manylinux system
# provides. No CUDA library (the runtime is static, the driver is loaded with
# dlopen at run time), so the wheel installs where no CUDA toolkit exists.
SYSTEM_LIBRARIES = ("libc.so.", "libm.so.", "libstdc++.so.", "libgcc_s.so.", "libdl.so.",
                    "libpthread.so.", "librt.so.", "ld-linux-x86-64.so.")


def _needed(shared_object: pathlib.Path) -> list[str]:
    """The DT_NEEDED entries of an ELF shared object."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    with open(shared_object, "rb") as f:
        return [tag.needed for section in ELFFile(f).iter_sections()
                if isinstance(section, DynamicSection)
                for tag in section.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]


def _built(mode: str) -> compile_check.Plan:
    """The compile check's plan once its build (mode `mode`) succeeded;
    skips where it does not run here or runs the other mode, fails with the
    log's tail where the build failed."""
    p, rc = compile_check.result()
    if p.skip is not None:
        pytest.skip(p.skip)
    if p.mode != mode:
        pytest.skip(f"the compile check runs mode {p.mode} (PK_JAX_COMPILE_CHECK={mode} "
                    "runs this one)")
    needs = compile_check.BUILD_MODULES[mode] + (("elftools",) if mode == "wheel" else ())
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    assert not missing, f"the compile check needs {missing}: pip install -e '.[test]'"
    if rc != 0:
        tail = "\n".join(p.log.read_text(errors="replace").splitlines()[-60:])
        pytest.fail(f"the CUDA sources do not build (mode {mode}, full log: {p.log}):\n{tail}")
    return p


def test_covering_holds_every_name_part():
    names = ["gemm_bf16_bf16", "gemm_bf16_bf16_at", "gemm_f16_f16_bt", "gemm_fp8_e4m3_f32_block"]
    chosen = compile_check.covering(names)
    assert chosen == ["gemm_fp8_e4m3_f32_block", "gemm_bf16_bf16_at", "gemm_f16_f16_bt"]
    assert compile_check.covering([]) == []
    # Every kernel folder: each part of each instantiation's name is compiled.
    sources = compile_check.kernel_sources()
    for folder in ROOT.glob("csrc/kernels/*/instantiations"):
        stems = [f.stem for f in folder.glob("*.cu")]
        picked = [s.stem for s in sources if s.parent == folder.relative_to(ROOT)]
        assert picked and set().union(*(set(n.split("_")) for n in picked)) == \
            set().union(*(set(n.split("_")) for n in stems)), folder
    assert pathlib.Path("xla_ffi/module.cc") in sources
    assert compile_check.object_of(pathlib.Path("xla_ffi/module.cc")).parts[1] == \
        "_pk_jax_ext.dir"


def test_unit_groups_compile_each_unit_as_alone():
    """The check's translation units (one per folder and set of preprocessor
    lines) hold each covering instantiation once; units that define a macro
    before their header (ring attention's head dim 256) compile apart."""
    groups = compile_check.unit_groups()
    units = [u for _, us in groups for u in us]
    assert sorted(units) == sorted(s for s in compile_check.kernel_sources()
                                   if s.parent.name == "instantiations")
    assert len({g for g, _ in groups}) == len(groups)
    for _, us in groups:
        assert len({u.parent for u in us}) == 1
        assert len({compile_check._preprocessor_lines(u) for u in us}) == 1
    d256 = [us for _, us in groups if any("_d256" in u.stem for u in us)]
    assert d256 and all(all("_d256" in u.stem for u in us) for us in d256)


def test_cuda_sources_compile():
    """The default compile check (tests/helpers/compile_check.py, built in
    the background while the other tests run; conftest.py runs this test
    last): wherever nvcc exists, the extension's sources compile for sm_90a
    with the wheel build's CMake settings: every source that is not a kernel
    instantiation, and instantiations holding every element type, head dim,
    layout, tile shape, scaling recipe and mechanism. Skipped where the
    install itself compiled the extension (the test above checks that one)."""
    p = _built("kernels")
    absent = [o for o in p.objects if not (p.build / o).is_file()]
    assert not absent, f"built without writing {absent}"
    # The check's sources are CMake's: every object of the configured build,
    # the instantiations aside, is among them (a source CMakeLists.txt adds
    # elsewhere is not left out).
    targets = re.findall(r"^build (CMakeFiles/(?:pk_cuda|_pk_jax_ext)\.dir/\S+\.o):",
                         (p.build / "build.ninja").read_text(), flags=re.M)
    assert targets, "no object targets in build.ninja"
    others = {t for t in targets if "/instantiations/" not in t}
    compiled = {o.as_posix() for o in p.objects}
    assert others <= compiled, others - compiled
    # Each covering instantiation was compiled, in its group's translation unit.
    for generated, units in compile_check.unit_groups():
        assert f"{generated.as_posix()}.o" in compiled
        included = re.findall(r'^#include "(.*)"$', (p.build / generated).read_text(), flags=re.M)
        assert included == [(ROOT / u).as_posix() for u in units], included


def test_wheel_carries_the_kernels(tmp_path):
    """The release check (PK_JAX_COMPILE_CHECK=wheel; about 20 minutes on
    two cores): `PK_JAX_BUILD_CUDA=1 pip wheel` builds the wheel a release
    ships. It holds the sm_90a extension (CUTLASS kernels required), says so
    in _build_info, links no CUDA toolkit library, is a manylinux wheel by
    auditwheel's reading (repaired to that tag), and its extension imports
    on this machine and registers the FFI targets the Python side lowers to."""
    p = _built("wheel")
    wheels = sorted(p.dist.glob("pk_jax-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {p.dist}, found {wheels}"
    wheel = wheels[0]
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert f"-{tag}-{tag}-linux_x86_64.whl" in wheel.name, wheel.name

    unpacked = tmp_path / "wheel"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
    built = sorted((unpacked / "pk_jax").glob("_pk_jax_ext*.so"))
    assert len(built) == 1, f"no _pk_jax_ext module in {wheel.name}"
    needed = _needed(built[0])
    foreign = [lib for lib in needed if not lib.startswith(SYSTEM_LIBRARIES)]
    assert not foreign, f"the extension needs {foreign} (all: {needed})"
    info = (unpacked / "pk_jax" / "_build_info.py").read_text()
    assert "cuda = True" in info and "sm_90a kernels compiled by nvcc" in info \
        and "CUTLASS GEMMs included" in info, info

    # auditwheel: the platform tag the wheel's symbols allow, and the repair
    # that writes it into the wheel (nothing to graft: no external library).
    env = {**os.environ, "PATH": compile_check.tool_path()}
    show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                          capture_output=True, text=True, env=env)
    assert show.returncode == 0, show.stdout + show.stderr
    found = re.search(r'platform tag:\s*"(manylinux_\d+_\d+_x86_64)"', show.stdout)
    assert found, show.stdout
    repaired = tmp_path / "wheelhouse"
    repair = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "-w", str(repaired),
                             "--plat", found.group(1), str(wheel)],
                            capture_output=True, text=True, env=env)
    assert repair.returncode == 0, repair.stdout + repair.stderr
    assert [w.name for w in repaired.glob("*.whl")] == \
        [wheel.name.replace("linux_x86_64", found.group(1))], repair.stderr

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
