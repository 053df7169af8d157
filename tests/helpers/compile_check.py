"""The CUDA compile check (tests/test_build_cpu.py::test_wheel_carries_the_kernels):
wherever nvcc exists, the wheel a release ships is built in the background
while the other tests run: `PK_JAX_BUILD_CUDA=1 pip wheel --no-build-isolation`
(the sm_90a kernels, CUTLASS required) into build/compile-check-<python>
(kept, so a rerun recompiles only what changed), the wheel to
build/compile-check-<python>/dist. conftest.py starts it once collection has
picked that test (at the lowest CPU priority, so the tests keep theirs) and
runs the test last; the test waits for the build, then checks the wheel
(auditwheel's manylinux tag, no CUDA toolkit library needed, the extension
importing and registering its FFI targets).

PK_JAX_COMPILE_CHECK=0 skips it, =1 runs it even where the install itself
compiled the extension (test_build_cpu.py checks that one otherwise);
PK_JAX_COMPILE_CHECK_JOBS sets the build's parallelism (default: the CPUs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEST_NAME = "test_wheel_carries_the_kernels"


@dataclasses.dataclass(frozen=True)
class Plan:
    skip: str | None                  # why the check does not run here, or None
    build: pathlib.Path | None = None
    commands: tuple[tuple[str, ...], ...] = ()
    env: dict | None = None           # the commands' environment

    @property
    def log(self) -> pathlib.Path:
        return self.build / "compile-check.log"

    @property
    def dist(self) -> pathlib.Path:
        """Where the wheel is written (emptied before each build)."""
        return self.build / "dist"


# What `pip wheel --no-build-isolation` takes from this environment (the test
# extra): the build backend's requirements and those of a CUDA build.
BUILD_MODULES = ("scikit_build_core", "nanobind", "cutlass_library", "jax")
# README's wheel command takes these too (tests/test_readme_cpu.py checks).
WHEEL_FLAGS = ("--no-build-isolation", "--no-deps")


def decision_module():
    """build_backend/pk_jax_build_cuda.py (the install's CUDA decision), loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "pk_jax_build_cuda", ROOT / "build_backend" / "pk_jax_build_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_info():
    """pk_jax._build_info (what the install's build decided), or None where
    pk_jax was not installed by its build backend."""
    try:
        from pk_jax import _build_info
    except ImportError:
        return None
    return _build_info


def tool_path() -> str:
    """PATH with this environment's bin directory first (for the build and auditwheel)."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def plan() -> Plan:
    """Whether the check runs here and, if so, its build directory and commands."""
    forced = os.environ.get("PK_JAX_COMPILE_CHECK", "")
    if forced == "0":
        return Plan("PK_JAX_COMPILE_CHECK=0")
    nvcc = decision_module().find_nvcc()
    if nvcc is None:
        return Plan("nvcc not found: no CUDA compile check on this machine")
    info = build_info()
    if forced != "1" and info is not None and info.cuda:
        return Plan(f"the install compiled the extension ({info.reason})")
    tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
    build = ROOT / "build" / f"compile-check-{tag}"
    jobs = os.environ.get("PK_JAX_COMPILE_CHECK_JOBS") or str(os.cpu_count() or 2)
    env = {**os.environ, "PK_JAX_BUILD_CUDA": "1", "CMAKE_BUILD_PARALLEL_LEVEL": jobs,
           "PATH": tool_path()}
    if shutil.which("nvcc", path=env["PATH"]) is None and not os.environ.get("CUDACXX"):
        env["CUDACXX"] = nvcc
    nice = ("nice", "-n", "19") if shutil.which("nice") else ()
    wheel = (*nice, sys.executable, "-m", "pip", "wheel", "-v", *WHEEL_FLAGS, "--no-index",
             "-C", f"build-dir={build}", "-w", str(build / "dist"), str(ROOT))
    return Plan(None, build, (wheel,), env)


class _Run:
    """The plan's commands in a thread (one at a time, output to the log);
    rc: the first failing command's exit status, else 0."""

    def __init__(self, p: Plan):
        self.plan, self.rc = p, None
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._go, daemon=True)
        self._thread.start()

    def _go(self) -> None:
        build = self.plan.build
        build.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.plan.dist, ignore_errors=True)  # only this build's wheel
        rc = 0
        with open(self.plan.log, "w") as out:
            for cmd in self.plan.commands:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                if self._stopped:
                    rc = -1
                    break
                # Its own process group (stop() ends the compilers with it) in
                # the tests' session: Linux's autogroup scheduling shares the CPU
                # fairly between sessions, which would void the build's nice 19.
                group = ({"process_group": 0} if sys.version_info >= (3, 11)
                         else {"preexec_fn": os.setpgrp})
                self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              env=self.plan.env, **group)
                rc = self._proc.wait()
                if rc != 0:
                    break
        self.rc = rc

    def wait(self) -> int:
        self._thread.join()
        return self.rc

    def stop(self) -> None:
        self._stopped = True
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait()


_run: _Run | None = None


def start() -> Plan:
    """Start the build (once per session) if the check runs here; its plan."""
    global _run
    if _run is not None:
        return _run.plan
    p = plan()
    if p.skip is None:
        _run = _Run(p)
    return p


def stop() -> None:
    """End a build still running (the session ended before its test ran)."""
    if _run is not None:
        _run.stop()


def result() -> tuple[Plan, int | None]:
    """The plan and, when it ran, the build's exit status (waits for it;
    starts it first if conftest did not)."""
    p = start()
    return p, (_run.wait() if _run is not None else None)
