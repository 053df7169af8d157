"""Whether pk_jax's build compiles the CUDA extension (PK_JAX_BUILD_CUDA).

  1     build it (needs nvcc)
  0     Python only
  auto  (unset) build it when nvcc is found AND an NVIDIA GPU is visible
        (`nvidia-smi -L` lists one, or /dev/nvidia0 exists)

Plain Python, no scikit-build-core: the build backend (pk_jax_build.py) and
the tests (tests/test_build_cpu.py) both use it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

ENV = "PK_JAX_BUILD_CUDA"
_ON = {"1", "on", "true", "yes"}
_OFF = {"0", "off", "false", "no"}
DEFAULT_CUDA_HOME = "/usr/local/cuda"
_NVCC_PLACES = "$CUDACXX, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin"


def find_nvcc(environ=os.environ) -> str | None:
    """nvcc where CMake would look: $CUDACXX, PATH, then the toolkit homes."""
    cudacxx = environ.get("CUDACXX")
    if cudacxx:
        return shutil.which(cudacxx, path=environ.get("PATH"))
    found = shutil.which("nvcc", path=environ.get("PATH"))
    if found:
        return found
    for home in (environ.get("CUDA_HOME"), environ.get("CUDA_PATH"), DEFAULT_CUDA_HOME):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def find_gpu(environ=os.environ, device_nodes=("/dev/nvidia0",)) -> str | None:
    """What shows an NVIDIA GPU on this machine, or None."""
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60,
                                 env=dict(environ)).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        gpus = [line.strip() for line in out.splitlines() if line.startswith("GPU ")]
        if gpus:
            return f"nvidia-smi -L lists {len(gpus)} GPU(s), {gpus[0]}"
    for node in device_nodes:
        if os.path.exists(node):
            return f"{node} exists"
    return None


def cuda_decision(environ=os.environ, device_nodes=("/dev/nvidia0",)) -> tuple[bool, str, str]:
    """(build the CUDA extension?, the setting: "1", "0" or "auto", why)."""
    raw = environ.get(ENV, "").strip()
    setting = raw.lower() or "auto"
    if setting in _ON:
        if find_nvcc(environ) is None:
            raise RuntimeError(f"{ENV}={raw} asks for the CUDA extension, but no nvcc was "
                               f"found ({_NVCC_PLACES})")
        return True, "1", f"{ENV}={raw}"
    if setting in _OFF:
        return False, "0", f"{ENV}={raw}"
    if setting != "auto":
        raise RuntimeError(f"{ENV}={raw!r}: use 1 (build the CUDA extension), 0 (Python "
                           "only) or auto (build it when nvcc and an NVIDIA GPU are found)")
    nvcc = find_nvcc(environ)
    if nvcc is None:
        return False, "auto", f"{ENV} unset (auto): no nvcc ({_NVCC_PLACES})"
    gpu = find_gpu(environ, device_nodes)
    if gpu is None:
        return False, "auto", (f"{ENV} unset (auto): nvcc at {nvcc} but no NVIDIA GPU "
                               "(none in nvidia-smi -L, no /dev/nvidia0)")
    return True, "auto", f"{ENV} unset (auto): nvcc at {nvcc}, {gpu}"
