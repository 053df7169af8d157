"""The README's first command runs examples/quickstart.py: it must keep
running (every check inside it asserts) on 8 fake CPU devices."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_runs_and_checks():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, str(_PATH)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    for what in ("all_gather matches", "gradient checked", "tensor-parallel MLP",
                 "ring attention over 8 devices"):
        assert what in res.stdout, res.stdout
