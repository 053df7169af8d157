"""The CUDA compile checks, run wherever nvcc exists, in the background while
the other tests run (conftest.py starts the build once collection has
picked the check's test, at the lowest CPU priority so the tests keep
theirs, and runs that test last; it waits for the build; under
pytest-xdist the controller runs the build and the worker given the test
waits for the status it writes):

- `kernels` (the default): CMake configures the extension exactly as the
  wheel build does (sm_90a, CUTLASS required, Release) into
  build/compile-check-<python>/kernels, and Ninja compiles every source that
  is not a kernel instantiation plus, from each kernel folder's
  instantiations/, a few files (a greedy cover) whose names together hold
  every name part of the folder: every element type, head dim, layout, tile
  shape, scaling recipe and mechanism compiled at least once. The covering
  units of a folder that have the same preprocessor lines compile as one
  translation unit (a generated .cu in the build folder's pk-check/ that
  includes them, compiled with the command CMake gives the first of them):
  the CUTLASS/CuTe headers and what the units share are compiled once, not
  once per unit (about a minute of one core each); an error still names
  its unit's file. Test: test_cuda_sources_compile.
- `wheel`: `PK_JAX_BUILD_CUDA=1 pip wheel --no-build-isolation` builds the
  wheel a release ships (every instantiation) in
  build/compile-check-<python>/wheel, the wheel to its dist/; its test
  checks auditwheel's manylinux tag, that no CUDA toolkit library is needed
  and that the extension imports and registers its FFI targets. Test:
  test_wheel_carries_the_kernels. The release check: about 20 minutes on
  two cores, which is why the test suite does not run it by default.

PK_JAX_COMPILE_CHECK=0 skips both, =kernels or =wheel picks one (also where
the install itself compiled the extension, which test_build_cpu.py checks
otherwise and the default then skips); PK_JAX_COMPILE_CHECK_JOBS sets the
build's parallelism (default: the CPUs). The build folder is kept, so a
rerun recompiles only what changed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODES = ("kernels", "wheel")
# The check's test for each mode (test_build_cpu.py); conftest.py runs them last.
TEST_NAMES = {"kernels": "test_cuda_sources_compile", "wheel": "test_wheel_carries_the_kernels"}


@dataclasses.dataclass(frozen=True)
class Step:
    """A plan's step run in this process: fn(build folder, log) -> exit status."""
    name: str
    fn: object


@dataclasses.dataclass(frozen=True)
class Plan:
    skip: str | None                  # why the check does not run here, or None
    mode: str = ""                    # one of MODES when it runs
    build: pathlib.Path | None = None
    commands: tuple = ()                # argument tuples, or Steps
    env: dict | None = None           # the commands' environment
    objects: tuple[pathlib.Path, ...] = ()  # what mode kernels compiles (in build)

    @property
    def log(self) -> pathlib.Path:
        return self.build / "compile-check.log"

    @property
    def dist(self) -> pathlib.Path:
        """Where mode wheel writes the wheel (emptied before each build)."""
        return self.build / "dist"


# What each mode takes from this environment (the test extra): mode wheel,
# `pip wheel --no-build-isolation`, the build backend's requirements and
# those of a CUDA build; mode kernels, what CMakeLists.txt imports and the
# CMake and Ninja it runs.
BUILD_MODULES = {"wheel": ("scikit_build_core", "nanobind", "cutlass_library", "jax"),
                 "kernels": ("nanobind", "cutlass_library", "jax", "cmake", "ninja")}
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


def covering(names: list[str]) -> list[str]:
    """A few of `names` (file stems such as "gemm_f16_f16_at") whose
    "_"-separated parts together hold every part of all of them: a greedy
    cover, the name adding most new parts first (ties: the first in sorted
    order)."""
    names = sorted(names)
    parts = {n: set(n.split("_")) for n in names}
    missing = set().union(*parts.values()) if names else set()
    chosen = []
    while missing:
        best = max(names, key=lambda n: len(parts[n] & missing))  # first of equals
        chosen.append(best)
        missing -= parts[best]
    return chosen


def kernel_sources() -> list[pathlib.Path]:
    """Mode kernels' sources (relative to ROOT), by CMakeLists.txt's globs:
    every source of the extension that is not a kernel instantiation, and
    the covering() instantiations of each kernel folder."""
    plain = [*ROOT.glob("csrc/pk/*.cu"), *ROOT.glob("csrc/kernels/*/*.cu"),
             *ROOT.glob("csrc/runtime/*.cc"), *ROOT.glob("xla_ffi/*.cc")]
    chosen = []
    for folder in sorted(ROOT.glob("csrc/kernels/*/instantiations")):
        stems = covering([f.stem for f in folder.glob("*.cu")])
        chosen += [folder / f"{stem}.cu" for stem in stems]
    return [f.relative_to(ROOT) for f in sorted(plain) + chosen]


# In mode kernels' build folder: the generated translation units (unit_groups()).
CHECK_FOLDER = "pk-check"
CHECK_NINJA = "pk-check.ninja"


def _preprocessor_lines(source: pathlib.Path) -> tuple[str, ...]:
    return tuple(line.strip() for line in (ROOT / source).read_text().splitlines()
                 if line.lstrip().startswith("#"))


def unit_groups() -> list[tuple[pathlib.Path, tuple[pathlib.Path, ...]]]:
    """Mode kernels' instantiation units (those of kernel_sources()) as the
    translation units that compile them: (the generated source, relative to
    the build folder; the units it includes, relative to ROOT). One per
    kernel folder and set of preprocessor lines: a unit that defines a macro
    before its header (or includes another) compiles apart from those that
    do not, so each unit sees exactly the code it sees alone."""
    groups: dict = {}
    for s in kernel_sources():
        if s.parent.name == "instantiations":
            groups.setdefault((s.parent, _preprocessor_lines(s)), []).append(s)
    out, counts = [], {}
    for (folder, _), units in groups.items():
        op = folder.parent.name
        counts[op] = counts.get(op, 0) + 1
        out.append((pathlib.Path(CHECK_FOLDER, f"{op}_{counts[op]}.cu"), tuple(units)))
    return out


def _write_if_changed(path: pathlib.Path, text: str) -> None:
    """Keep an unchanged file's timestamp (Ninja then skips its object)."""
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def write_check_ninja(build: pathlib.Path, out) -> int:
    """After CMake's configure: unit_groups()' sources, and CHECK_NINJA: one
    edge for each, the edge of its first unit's object (rule, flags,
    includes) with source and object swapped, then the configured
    build.ninja. (Its edges come first in the file, so Ninja starts them
    first: a minute or more each, the other sources seconds.)"""
    manifest = (build / "build.ninja").read_text()
    rules = (build / "CMakeFiles" / "rules.ninja").read_text()
    head = ["# Generated by tests/helpers/compile_check.py: the compile check's translation\n"
            "# units, then the configured build.ninja.\n"]
    edges, copied = [], set()
    for generated, units in unit_groups():
        _write_if_changed(build / generated, "".join(
            [f"// Generated by tests/helpers/compile_check.py: {len(units)} instantiation "
             f"unit(s) of {units[0].parent.as_posix()} in one translation unit.\n"]
            + [f'#include "{(ROOT / u).as_posix()}"\n' for u in units]))
        obj = object_of(units[0]).as_posix()
        edge = re.search(rf"^build {re.escape(obj)}: (\S+) \S+(.*)\n((?:  .*\n)*)",
                         manifest, flags=re.M)
        if edge is None:
            out.write(f"no edge for {obj} in build.ninja\n")
            return 1
        rule, rest, variables = edge.groups()
        if rule not in copied:  # build.ninja defines it (its include) after our edges
            body = re.search(rf"^rule {re.escape(rule)}\n((?:  .*\n)*)", rules, flags=re.M)
            if body is None:
                out.write(f"no rule {rule} in CMakeFiles/rules.ninja\n")
                return 1
            head.append(f"rule pk_check_{rule}\n{body.group(1)}")
            copied.add(rule)
        target = f"{generated.as_posix()}.o"
        variables = re.sub(r"^(  DEP_FILE = ).*$", rf"\g<1>{target}.d", variables, flags=re.M)
        variables = re.sub(r"^(  OBJECT_FILE_DIR = ).*$", rf"\g<1>{CHECK_FOLDER}", variables,
                           flags=re.M)
        edges.append(f"build {target}: pk_check_{rule} {(build / generated).as_posix()}{rest}\n"
                     f"{variables}")
    _write_if_changed(build / CHECK_NINJA, "\n".join(head + edges + ["include build.ninja\n"]))
    return 0


def object_of(source: pathlib.Path) -> pathlib.Path:
    """The Ninja target (relative to the build folder) compiling `source`:
    CMake's object path in its target's folder (xla_ffi/module.cc is the
    Python module's, every other source the pk_cuda library's)."""
    target = "_pk_jax_ext" if source.as_posix() == "xla_ffi/module.cc" else "pk_cuda"
    return pathlib.Path("CMakeFiles", f"{target}.dir", f"{source.as_posix()}.o")


def plan() -> Plan:
    """Whether the check runs here and, if so, its mode, build folder and commands."""
    forced = os.environ.get("PK_JAX_COMPILE_CHECK", "")
    if forced == "0":
        return Plan("PK_JAX_COMPILE_CHECK=0")
    if forced and forced not in MODES:
        raise ValueError(f"PK_JAX_COMPILE_CHECK={forced!r}: expected 0, "
                         + " or ".join(MODES) + " (unset: kernels)")
    mode = forced or "kernels"
    nvcc = decision_module().find_nvcc()
    if nvcc is None:
        return Plan("nvcc not found: no CUDA compile check on this machine")
    info = build_info()
    if not forced and info is not None and info.cuda:
        return Plan(f"the install compiled the extension ({info.reason})")
    tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
    build = ROOT / "build" / f"compile-check-{tag}" / mode
    jobs = os.environ.get("PK_JAX_COMPILE_CHECK_JOBS") or str(os.cpu_count() or 2)
    env = {**os.environ, "PK_JAX_BUILD_CUDA": "1", "CMAKE_BUILD_PARALLEL_LEVEL": jobs,
           "PATH": tool_path()}
    if shutil.which("nvcc", path=env["PATH"]) is None and not os.environ.get("CUDACXX"):
        env["CUDACXX"] = nvcc
    nice = ("nice", "-n", "19") if shutil.which("nice") else ()
    if mode == "wheel":
        wheel = (*nice, sys.executable, "-m", "pip", "wheel", "-v", *WHEEL_FLAGS, "--no-index",
                 "-C", f"build-dir={build}", "-w", str(build / "dist"), str(ROOT))
        return Plan(None, mode, build, (wheel,), env)
    # The wheel build's CMake settings (build_backend/pk_jax_build.py: _config).
    configure = (*nice, "cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
                 "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DPK_JAX_CUDA=ON",
                 "-DPK_JAX_REQUIRE_CUTLASS=ON")
    objects = tuple([pathlib.Path(f"{g.as_posix()}.o") for g, _ in unit_groups()]
                    + [object_of(s) for s in kernel_sources() if s.parent.name != "instantiations"])
    ninja = shutil.which("ninja", path=env["PATH"]) or "ninja"
    compile_ = (*nice, ninja, "-C", str(build), "-f", CHECK_NINJA, "-j", jobs,
                *(o.as_posix() for o in objects))
    return Plan(None, mode, build, (configure, Step("write " + CHECK_NINJA, write_check_ninja),
                                    compile_), env, objects)


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
        shutil.rmtree(self.plan.dist, ignore_errors=True)  # only this build's wheel
        rc = 0
        with open(self.plan.log, "w") as out:
            for cmd in self.plan.commands:
                out.write("$ " + (cmd.name if isinstance(cmd, Step) else " ".join(cmd)) + "\n")
                out.flush()
                if self._stopped:
                    rc = -1
                    break
                if isinstance(cmd, Step):
                    try:
                        rc = cmd.fn(build, out)
                    except Exception as e:  # noqa: BLE001 (the log says what failed)
                        out.write(f"{cmd.name}: {e!r}\n")
                        rc = 1
                    out.flush()
                    if rc != 0:
                        break
                    continue
                # Its own process group (stop() ends the compilers with it) in
                # the tests' session: Linux's autogroup scheduling shares the CPU
                # fairly between sessions, which would void the build's nice 19.
                group = ({"process_group": 0} if sys.version_info >= (3, 11)
                         else {"preexec_fn": os.setpgrp})
                try:
                    self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                  env=self.plan.env, **group)
                except OSError as e:  # e.g. no cmake on PATH
                    out.write(f"could not start {cmd[0]!r}: {e}\n")
                    rc = 127
                    break
                rc = self._proc.wait()
                if rc != 0:
                    break
        self.rc = rc
        _status(self.plan).write_text(f"{rc}\n")

    def wait(self) -> int:
        self._thread.join()
        return self.rc

    def stop(self) -> None:
        self._stopped = True
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait()


_run: _Run | None = None


# In the build folder: the build's exit status once it ended, and the id of
# the process that started it (pytest-xdist's workers wait for a build their
# controller started: result()).
def _status(p: Plan) -> pathlib.Path:
    return p.build / "compile-check.status"


def _owner(p: Plan) -> pathlib.Path:
    return p.build / "compile-check.owner"


def start() -> Plan:
    """Start the build (once per session) if the check runs here; its plan."""
    global _run
    if _run is not None:
        return _run.plan
    p = plan()
    if p.skip is None:
        p.build.mkdir(parents=True, exist_ok=True)
        _status(p).unlink(missing_ok=True)
        _owner(p).write_text(f"{os.getpid()}\n")
        _run = _Run(p)
    return p


def stop() -> None:
    """End a build still running (the session ended before its test ran)."""
    if _run is not None:
        _run.stop()


def _started_by_parent(p: Plan) -> bool:
    try:
        return int(_owner(p).read_text()) == os.getppid()
    except (OSError, ValueError):
        return False


def result() -> tuple[Plan, int | None]:
    """The plan and, when it ran, the build's exit status (waits for it;
    starts it first if conftest did not). In a pytest-xdist worker whose
    controller started the build (conftest.py), waits for the status the
    controller's build writes."""
    if _run is None and os.environ.get("PYTEST_XDIST_WORKER"):
        p = plan()
        if p.skip is None and _started_by_parent(p):
            while not _status(p).is_file():
                if not _started_by_parent(p):  # the controller ended
                    return p, -1
                time.sleep(1)
            return p, int(_status(p).read_text())
    p = start()
    return p, (_run.wait() if _run is not None else None)
