"""The CUDA compile check (tests/test_build_cpu.py::test_extension_compiles),
run in the background while the other tests run: wherever nvcc exists, CMake
builds the extension with CUDA and CUTLASS on into build/compile-check-<python>
(kept, so a rerun recompiles only what changed). conftest.py starts it once
collection has picked that test (at the lowest CPU priority, so the tests
keep theirs) and runs the test last; the test waits for the build and checks
it. On CI's two cores the build (about 10 minutes of both) otherwise ran
alone after the tests' own quarter hour.

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
TEST_NAME = "test_extension_compiles"


@dataclasses.dataclass(frozen=True)
class Plan:
    skip: str | None                  # why the check does not run here, or None
    build: pathlib.Path | None = None
    generator: str = ""               # CMake's generator (a cache made with another is wiped)
    commands: tuple[tuple[str, ...], ...] = ()

    @property
    def log(self) -> pathlib.Path:
        return self.build / "compile-check.log"


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


def tool(name: str) -> str | None:
    """A tool from this environment's bin directory first (the test extra's
    cmake and ninja), then PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which(name, path=path)


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
    cmake = tool("cmake")
    if cmake is None:
        return Plan("cmake not found (pip install -e '.[test]' brings it)")
    tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
    build = ROOT / "build" / f"compile-check-{tag}"
    ninja = tool("ninja")
    generator = "Ninja" if ninja is not None else "Unix Makefiles"
    configure = [cmake, "-S", str(ROOT), "-B", str(build), "-DPK_JAX_CUDA=ON",
                 "-DPK_JAX_REQUIRE_CUTLASS=ON", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={sys.executable}", "-G", generator]
    if ninja is not None:
        configure.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
    if shutil.which("nvcc") is None and not os.environ.get("CUDACXX"):
        configure.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    jobs = os.environ.get("PK_JAX_COMPILE_CHECK_JOBS") or str(os.cpu_count() or 2)
    nice = ("nice", "-n", "19") if shutil.which("nice") else ()
    return Plan(None, build, generator,
                (tuple(configure), (*nice, cmake, "--build", str(build), "--parallel", jobs)))


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
        cache = build / "CMakeCache.txt"
        if cache.exists() and \
                f"CMAKE_GENERATOR:INTERNAL={self.plan.generator}\n" not in cache.read_text():
            shutil.rmtree(build)  # configured with another generator: start over
            build.mkdir(parents=True)
        rc = 0
        with open(self.plan.log, "w") as out:
            for cmd in self.plan.commands:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                if self._stopped:
                    rc = -1
                    break
                # Its own process group: stop() ends the compilers with it.
                self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True)
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
