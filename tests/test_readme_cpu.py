"""README.md runs as written: its Python blocks, in order, as one program on
8 fake CPU devices (the mesh the README builds with jax.make_mesh), and its
shell commands (the install steps are CI's: .ci/run runs the README's test
command; GPU-only commands are checked to exist)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)


def _env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_python_blocks_run_in_order():
    code = "\n\n".join(body for lang, body in BLOCKS if lang == "python")
    assert "jax.make_mesh" in code and code.count("\n") > 30
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _commands():
    for lang, body in BLOCKS:
        if lang != "bash":
            continue
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                yield line


def test_ci_runs_the_readme_test_command():
    commands = list(_commands())
    assert commands[1].endswith("pytest -q tests")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def _segments() -> list[str]:
    """The README's shell commands split at `&&`."""
    return sorted({s.strip() for c in _commands() for s in c.split("&&")})


@pytest.mark.parametrize("segment", _segments())
def test_shell_commands(segment):
    """Each command of the README's shell blocks: install steps and the test
    suite itself are CI's (above), the wheel build the compile check's; GPU
    scripts must exist; the rest runs."""
    words = shlex.split(segment)
    if words[:3] == ["python3", "-m", "venv"] or words[0] == "." or words[:2] == ["pip", "install"]:
        pytest.skip("an install step: .ci/run runs it on a clean machine")
    if words[:2] == ["pytest", "-q"]:
        pytest.skip("the test suite itself")
    if words[:3] == ["PK_JAX_BUILD_CUDA=1", "pip", "wheel"] or words[:2] == ["auditwheel", "repair"]:
        from helpers import compile_check
        assert words[0] == "auditwheel" or set(compile_check.WHEEL_FLAGS) <= set(words), segment
        pytest.skip("the wheel build: the compile check builds this wheel and repairs it "
                    "(test_build_cpu.py::test_wheel_carries_the_kernels)")
    if words[0].startswith("tools/"):
        assert os.access(ROOT / words[0], os.X_OK), f"{words[0]} is not an executable script"
        pytest.skip(f"{words[0]} needs GPUs")
    assert words[0] == "python", f"a README command this test does not know how to run: {segment}"
    proc = subprocess.run([sys.executable, *words[1:]], env=_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for what in PRINTS.get(segment, ()):
        assert what in proc.stdout, (what, proc.stdout[-4000:])


# What a command must print besides exiting 0: the quickstart's checks (each
# asserts inside the script; these lines show that every part ran).
PRINTS = {"python examples/quickstart.py": ("all_gather matches", "gradient checked",
                                            "tensor-parallel MLP",
                                            "ring attention over 8 devices")}


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
