"""pk_jax's PEP 517 build backend: scikit-build-core, with the CUDA extension
built only where it is wanted.

PK_JAX_BUILD_CUDA picks (pk_jax_build_cuda.py):

  1     build the CUDA extension (needs nvcc)
  0     Python only: CMake does not run
  auto  (unset) build it when nvcc is found AND an NVIDIA GPU is visible
        (`nvidia-smi -L` lists one, or /dev/nvidia0 exists); Python only
        otherwise, so a CPU-only machine installs in seconds

A Python-only build asks for nothing beyond scikit-build-core and passes
``wheel.cmake=false``; a CUDA build adds the packages CMakeLists.txt needs
(nanobind, jax for the XLA FFI headers, nvidia-cutlass for the CUTLASS
headers) to the isolated build environment and passes
``cmake.define.PK_JAX_CUDA=ON``. Every hook decides the same way, so the
metadata pip prepares matches the wheel it builds.

The decision is recorded in the package as ``pk_jax._build_info`` (``cuda``,
``setting``, ``reason``, ``kernels``: the GPU code, nvcc release and CUTLASS
of a CUDA build, and ``commit``: the sources' git commit), generated through
``[[tool.scikit-build.generate]]`` from a template this backend writes to
build/pk_jax_build_info.py.in.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import subprocess

import scikit_build_core
from scikit_build_core import build as _skbuild

try:
    import tomllib
except ImportError:  # Python 3.10: scikit-build-core depends on tomli there
    import tomli as tomllib

from pk_jax_build_cuda import cuda_decision, find_nvcc

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
]

# What CMakeLists.txt imports from the build environment for the extension,
# and always PyPI's CMake and Ninja. scikit-build-core asks for them only
# where it finds no usable one, and that answer changes once the test extra
# puts the cmake and ninja packages in the environment: another CMake writes
# other compile commands, another Ninja may discard the build log, and either
# way the next install would recompile the whole extension.
CUDA_BUILD_REQUIRES = ["nanobind>=2.0", "jax>=0.10.2", "nvidia-cutlass>=3.5",
                       "cmake>=3.24", "ninja"]

# Must match template-path in pyproject.toml's [[tool.scikit-build.generate]].
BUILD_INFO_TEMPLATE = pathlib.Path("build", "pk_jax_build_info.py.in")


def default_gencode() -> str:
    """The nvcc target flags CMakeLists.txt compiles by default (PK_CUDA_GENCODE)."""
    text = pathlib.Path("CMakeLists.txt").read_text(encoding="utf-8")
    found = re.search(r'set\(PK_CUDA_GENCODE "([^"]+)"', text)
    return found.group(1) if found else ""


def nvcc_release(nvcc: str) -> str:
    """nvcc's release ("13.0"), or "" when it does not say."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else ""


def source_commit() -> str:
    """The short git commit of the sources being built, suffixed "-dirty" when
    tracked files differ from it; '' outside a git checkout (an sdist)."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("-dirty" if dirty else "")


def _config(config_settings, *, write_info: bool = False):
    """The config settings for scikit-build-core, and whether CUDA is on."""
    cuda, setting, reason = cuda_decision()
    settings = dict(config_settings or {})
    kernels = ""
    if cuda:
        settings.setdefault("cmake.define.PK_JAX_CUDA", "ON")
        # A CUDA build holds the CUTLASS kernels or fails (CUDA_BUILD_REQUIRES
        # brings nvidia-cutlass); -C cmake.define.PK_JAX_REQUIRE_CUTLASS=OFF
        # allows a build without them (their ops then run XLA's path).
        settings.setdefault("cmake.define.PK_JAX_REQUIRE_CUTLASS", "ON")
        nvcc = find_nvcc()
        if not os.environ.get("CUDACXX") and shutil.which("nvcc") is None:
            # Found outside PATH (toolkit home): tell CMake where.
            settings.setdefault("cmake.define.CMAKE_CUDA_COMPILER", nvcc)
        if write_info:
            gencode = settings.get("cmake.define.PK_CUDA_GENCODE") or default_gencode()
            arches = ", ".join(re.findall(r",code=(\w+)", gencode)) or gencode or "(unknown)"
            cutlass = settings["cmake.define.PK_JAX_REQUIRE_CUTLASS"].upper() in \
                ("ON", "1", "TRUE", "YES")
            kernels = (f"{arches} kernels compiled by nvcc {nvcc_release(nvcc) or '(unknown)'}"
                       f"{', CUTLASS GEMMs included' if cutlass else ', CUTLASS GEMMs if found'}"
                       "; CUDA runtime linked statically, the driver loaded at run time")
    else:
        settings.setdefault("wheel.cmake", "false")
    if write_info:
        print(f"pk_jax: CUDA extension {'ON' if cuda else 'OFF'} ({reason})", flush=True)
        text = ('"""How this copy of pk_jax was built (written by the build backend, '
                'build_backend/pk_jax_build.py)."""\n\n'
                f"cuda = {cuda!r}  # the CUDA extension was built\n"
                f"setting = {setting!r}  # PK_JAX_BUILD_CUDA: '1', '0' or 'auto'\n"
                f"reason = {reason!r}\n"
                f"kernels = {kernels!r}  # what the extension holds ('' without one)\n"
                f"commit = {source_commit()!r}  # the sources' git commit ('' outside a checkout)\n")
        BUILD_INFO_TEMPLATE.parent.mkdir(parents=True, exist_ok=True)
        # string.Template placeholders: a literal $ is written $$.
        BUILD_INFO_TEMPLATE.write_text(text.replace("$", "$$"), encoding="utf-8")
    return settings, cuda


def _keep_build_cache(config_settings) -> None:
    """Let a CUDA rebuild from a new isolated build environment keep the
    object files of the persistent build directory.

    scikit-build-core (0.10+) records the path of the scikit-build-core that
    configured a build directory in .skbuild-info.json and, when the next
    build runs from another one (pip makes a new isolated environment for
    every install), deletes CMakeCache.txt and CMakeFiles/, which holds every
    object file: `pip install -e .` then `pip install -e '.[test]'` would
    compile the whole extension twice. The cache has to go (it holds paths
    into the old environment, and the CMake found there may be another
    version), the objects need not: delete CMakeCache.txt here and point the
    record at this scikit-build-core, so CMake configures afresh and ninja
    recompiles only what changed. CMakeLists.txt mirrors the nanobind, XLA
    FFI and CUTLASS headers into the build directory, so unchanged headers
    keep their paths and timestamps. The source-directory check stays. Best
    effort: anything unexpected leaves the directory to scikit-build-core.
    """
    try:
        pattern = (config_settings or {}).get("build-dir") or os.environ.get("SKBUILD_BUILD_DIR")
        if not pattern:
            with open("pyproject.toml", "rb") as f:
                pattern = tomllib.load(f)["tool"]["scikit-build"].get("build-dir")
        if not pattern or not isinstance(pattern, str):
            return
        here = os.fspath(pathlib.Path.cwd().resolve())
        ours = os.fspath(pathlib.Path(scikit_build_core.__file__).parent.resolve())
        for info_path in glob.glob(os.path.join(re.sub(r"\{[^}]*\}", "*", pattern),
                                                ".skbuild-info.json")):
            with open(info_path, encoding="utf-8") as f:
                info = json.load(f)
            if info.get("source_dir") != here or info.get("skbuild_path") in (None, ours):
                continue
            build_dir = os.path.dirname(info_path)
            cache = os.path.join(build_dir, "CMakeCache.txt")
            if os.path.exists(cache):
                os.remove(cache)
            info["skbuild_path"] = ours
            with open(info_path, "w", encoding="utf-8") as f:
                json.dump(info, f, indent=2)
            print(f"pk_jax: {build_dir} was configured from another build environment: "
                  "configuring afresh, keeping its object files", flush=True)
    except Exception as err:  # noqa: BLE001 - only an optimization
        print(f"pk_jax: not reusing the build directory's cache ({err!r})", flush=True)


def get_requires_for_build_wheel(config_settings=None):
    settings, cuda = _config(config_settings)
    extra = CUDA_BUILD_REQUIRES if cuda else []
    return [*_skbuild.get_requires_for_build_wheel(settings), *extra]


def get_requires_for_build_editable(config_settings=None):
    settings, cuda = _config(config_settings)
    extra = CUDA_BUILD_REQUIRES if cuda else []
    return [*_skbuild.get_requires_for_build_editable(settings), *extra]


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild.get_requires_for_build_sdist(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    settings, cuda = _config(config_settings, write_info=True)
    if cuda:
        _keep_build_cache(settings)
    return _skbuild.build_wheel(wheel_directory, settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    settings, cuda = _config(config_settings, write_info=True)
    if cuda:
        _keep_build_cache(settings)
    return _skbuild.build_editable(wheel_directory, settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _skbuild.build_sdist(sdist_directory, config_settings)


# scikit-build-core offers these only when the metadata can be known before
# building; the wheel's tags (pure or platform) follow the decision, so they
# are decided the same way here.
if hasattr(_skbuild, "prepare_metadata_for_build_wheel"):

    def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
        settings, _ = _config(config_settings)
        return _skbuild.prepare_metadata_for_build_wheel(metadata_directory, settings)

    __all__ += ["prepare_metadata_for_build_wheel"]

if hasattr(_skbuild, "prepare_metadata_for_build_editable"):

    def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
        settings, _ = _config(config_settings)
        return _skbuild.prepare_metadata_for_build_editable(metadata_directory, settings)

    __all__ += ["prepare_metadata_for_build_editable"]
