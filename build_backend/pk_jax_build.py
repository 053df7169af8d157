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
``setting``, ``reason``), generated through ``[[tool.scikit-build.generate]]``
from a template this backend writes to build/pk_jax_build_info.py.in.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from scikit_build_core import build as _skbuild

from pk_jax_build_cuda import cuda_decision, find_nvcc

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
]

# What CMakeLists.txt imports from the build environment for the extension.
CUDA_BUILD_REQUIRES = ["nanobind>=2.0", "jax>=0.10.2", "nvidia-cutlass>=3.5"]
# Must match template-path in pyproject.toml's [[tool.scikit-build.generate]].
BUILD_INFO_TEMPLATE = pathlib.Path("build", "pk_jax_build_info.py.in")


def _config(config_settings, *, write_info: bool = False):
    """The config settings for scikit-build-core, and whether CUDA is on."""
    cuda, setting, reason = cuda_decision()
    settings = dict(config_settings or {})
    if cuda:
        settings.setdefault("cmake.define.PK_JAX_CUDA", "ON")
        nvcc = find_nvcc()
        if not os.environ.get("CUDACXX") and shutil.which("nvcc") is None:
            # Found outside PATH (toolkit home): tell CMake where.
            settings.setdefault("cmake.define.CMAKE_CUDA_COMPILER", nvcc)
    else:
        settings.setdefault("wheel.cmake", "false")
    if write_info:
        print(f"pk_jax: CUDA extension {'ON' if cuda else 'OFF'} ({reason})", flush=True)
        text = ('"""How this copy of pk_jax was built (written by the build backend, '
                'build_backend/pk_jax_build.py)."""\n\n'
                f"cuda = {cuda!r}  # the CUDA extension was built\n"
                f"setting = {setting!r}  # PK_JAX_BUILD_CUDA: '1', '0' or 'auto'\n"
                f"reason = {reason!r}\n")
        BUILD_INFO_TEMPLATE.parent.mkdir(parents=True, exist_ok=True)
        # string.Template placeholders: a literal $ is written $$.
        BUILD_INFO_TEMPLATE.write_text(text.replace("$", "$$"), encoding="utf-8")
    return settings, cuda


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
    settings, _ = _config(config_settings, write_info=True)
    return _skbuild.build_wheel(wheel_directory, settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    settings, _ = _config(config_settings, write_info=True)
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
