"""README.md runs as written: its Python blocks, in order, as one program on
8 fake CPU devices (the mesh the README builds with jax.make_mesh), and its
shell commands: the quickstart and then the Flax block, each after its own
install, in one fresh environment, the test command CI's (.ci/run runs it), the wheel
recipe the compile check's; GPU-only commands are checked to exist."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE_FLAGS

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)


def _env() -> dict:
    env = dict(os.environ)
    # 8 fake devices, and conftest.py's XLA:CPU compile flags where it set them.
    env["XLA_FLAGS"] = " ".join(["--xla_force_host_platform_device_count=8"]
                                + [f for f in FAST_COMPILE_FLAGS
                                   if f in os.environ.get("XLA_FLAGS", "").split()])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_python_blocks_run_in_order():
    code = "\n\n".join(body for lang, body in BLOCKS if lang == "python")
    assert "jax.make_mesh" in code and code.count("\n") > 30
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _block_commands(body: str) -> list[str]:
    """A shell block's commands, comments left out."""
    lines = (line.split("#", 1)[0].strip() for line in body.splitlines())
    return [line for line in lines if line]


def _commands():
    for lang, body in BLOCKS:
        if lang == "bash":
            yield from _block_commands(body)


def _segments() -> list[str]:
    """The README's shell commands split at `&&`."""
    return sorted({s.strip() for c in _commands() for s in c.split("&&")})


COMMANDS = list(_commands())
# The quickstart (a fresh environment, its install and script) and then the
# Flax block (its own install, then its commands), in the reader's order in
# one fresh virtual environment (test_commands_run_after_their_own_install).
QUICKSTART = [s.strip() for s in COMMANDS[0].split("&&")]
FLAX_BLOCK = next(_block_commands(body) for lang, body in BLOCKS
                  if lang == "bash" and "examples/flax_transformer.py" in body)
# Making and entering the reader's environment: the test makes its own.
FRESH_ENV = ["python3 -m venv .venv", ". .venv/bin/activate"]


def test_ci_runs_the_readme_test_command():
    assert COMMANDS[1].endswith("pytest -q tests")
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text()


def test_every_command_is_run_or_checked():
    """Each command of the README's shell blocks is run by a test here (the
    quickstart and the Flax block), is CI's own (.ci/run runs the test
    command as written), is the wheel recipe, whose build the compile check
    runs (PK_JAX_COMPILE_CHECK=wheel: test_build_cpu.py::
    test_wheel_carries_the_kernels, with the recipe's flags), or is a GPU
    script (executable; it needs GPUs)."""
    from helpers import compile_check
    assert QUICKSTART[:2] == FRESH_ENV and QUICKSTART[-1] == "python examples/quickstart.py"
    ci = [s.strip() for s in COMMANDS[1].split("&&")]
    run = set(QUICKSTART) | set(FLAX_BLOCK) | set(ci)
    for segment in _segments():
        words = shlex.split(segment)
        if segment in run:
            continue
        if words[:3] == ["PK_JAX_BUILD_CUDA=1", "pip", "wheel"]:
            assert set(compile_check.WHEEL_FLAGS) <= set(words), segment
        elif words[:2] == ["auditwheel", "repair"] or words[:2] == ["pip", "install"]:
            assert "wheel" in segment or "auditwheel" in segment, segment  # the wheel recipe's
        elif words[0].startswith("tools/"):
            assert os.access(ROOT / words[0], os.X_OK), f"{words[0]} is not an executable script"
        else:
            raise AssertionError(f"a README command no test runs or checks: {segment}")


def test_commands_run_after_their_own_install(tmp_path):
    """The README's quickstart (`pip install -e .`, then the quickstart) and
    then its Flax block (`pip install -e '.[flax]'`, then the Flax example and
    the step breakdown), in the order a reader meets them, in one fresh
    virtual environment: each install run as written from the repository,
    then its commands with that environment's python. The quickstart runs
    with its own install only (flax is checked absent there); the Flax
    block's install holds the quickstart's, so the environment after it is
    what `pip install -e '.[flax]'` alone gives. Python only
    (PK_JAX_BUILD_CUDA=0: the kernels are not what this checks, and a GPU
    machine would compile them for minutes). Each install takes about 20 s
    from pip's index (CI's own install reaches it), the commands 10-20 s, on
    two cores."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in _env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env["PK_JAX_BUILD_CUDA"] = "0"
    python = lambda code: subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env,
                                         capture_output=True, text=True, timeout=300)
    for block in (QUICKSTART, FLAX_BLOCK):
        commands = [c for c in block if c not in FRESH_ENV]
        assert [c for c in commands if shlex.split(c)[:2] == ["pip", "install"]] == commands[:1]
        if block is FLAX_BLOCK:
            absent = python("import flax")
            assert absent.returncode != 0, "the quickstart's install alone brought flax"
        for command in commands:
            proc = subprocess.run(command, shell=True, env=env, capture_output=True, text=True,
                                  timeout=900, cwd=ROOT)
            assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-4000:])
            for what in PRINTS.get(command, ()):
                assert what in proc.stdout, (what, proc.stdout[-4000:])
    where = python("import pk_jax; print(pk_jax.__file__)")
    assert where.stdout.strip() == str(ROOT / "pk_jax" / "__init__.py"), where  # this checkout


# What a command must print besides exiting 0: the quickstart's checks (each
# asserts inside the script; these lines show that every part ran).
PRINTS = {"python examples/quickstart.py": ("all_gather matches", "gradient checked",
                                            "tensor-parallel MLP",
                                            "ring attention over 8 devices"),
          "python examples/flax_transformer.py --steps 20 --collectives both":
              ("step time: pk", "largest relative loss difference")}


def test_printed_commands_are_in_the_readme():
    assert set(PRINTS) <= set(_segments())


# A ratio quoted in prose: "248x", "1.04-1.14x", "1.5 x" (not a count or a shape such as
# "2 x NVIDIA H200", "128 x 7168"); the code blocks are left out.
_RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:\s?-\s?(\d+(?:\.\d+)?))?"
                    r"(?:x|\sx(?!\s*(?:\d|NVIDIA|H\d|GPU)))(?!\w)")


def quoted_ratios(text: str) -> list[str]:
    """Every value of every ratio quoted outside the code blocks (both ends
    of a range)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [v for m in _RATIO.finditer(prose) for v in m.groups() if v is not None]


def unbacked_ratios(readme: str, results: str) -> list[str]:
    """The README's ratios that no ratio of the results shows (at the
    README's precision: "1.3x" is backed by "1.30x" or "1.34x")."""
    held = [m.group(1) for m in re.finditer(r"(?<![\w.])(\d+(?:\.\d+)?)\s?x(?!\w)", results)]
    decimals = lambda v: len(v.split(".")[1]) if "." in v else 0
    return [v for v in quoted_ratios(readme)
            if not any(round(float(h), decimals(v)) == float(v) for h in held)]


def test_ratio_extraction():
    text = ("dispatch + combine 248x, fwd+bwd 1.04-1.14x and 7 - 18x; 1.5 x the baseline; "
            "2 x NVIDIA H200, 128 x 7168, 0x1f, sm_90a\n```python\ny = 3x\n```")
    assert quoted_ratios(text) == ["248", "1.04", "1.14", "7", "18", "1.5"]
    results = "| a | 1.04x |\n| b | 1.141x |\n| c | 7.00x | 18.2 x |"
    assert unbacked_ratios(text, results) == ["248", "1.5"]


def test_readme_ratios_are_in_the_results():
    """Every ratio README.md quotes is one benchmarks/RESULTS.md holds, so a
    headline cannot outlive the measurement it came from."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert unbacked_ratios(README, results) == []
