"""pk_jax.configure and environment variables."""

import subprocess
import sys

import pytest

import pk_jax
from pk_jax import runtime


def test_configure_round_trip():
    saved = pk_jax.get_config()
    try:
        cfg = pk_jax.configure(timeout_s=0.5)
        assert cfg.timeout_s == 0.5 and cfg.timeout_ns == 500_000_000
        assert pk_jax.get_config() == cfg
    finally:
        pk_jax.configure(timeout_s=saved.timeout_s)


def test_configured_restores_what_it_changed():
    before = pk_jax.get_config()
    with pk_jax.configured(timeout_s=0.25) as cfg:
        assert cfg.timeout_s == 0.25
        assert pk_jax.get_config() == cfg
    assert pk_jax.get_config() == before
    with pytest.raises(RuntimeError, match="boom"):
        with pk_jax.configured(timeout_s=7.0):
            raise RuntimeError("boom")
    assert pk_jax.get_config() == before
    with pytest.raises(TypeError):
        with pk_jax.configured(no_such_setting=1):
            pass
    with pytest.raises(ValueError, match="timeout_s"):
        with pk_jax.configured(timeout_s=0):
            pass
    assert pk_jax.get_config() == before


def test_workspace_size_only_before_allocation():
    saved = pk_jax.get_config().workspace_bytes
    if runtime.initialized():  # a GPU test ran first in this process
        with pytest.raises(RuntimeError, match="before the first pk_jax op"):
            pk_jax.configure(workspace_bytes=saved + 4096)
        assert pk_jax.get_config().workspace_bytes == saved
        return
    try:
        assert pk_jax.configure(workspace_bytes=1 << 20).workspace_bytes == 1 << 20
    finally:
        pk_jax.configure(workspace_bytes=saved)


@pytest.mark.parametrize("kwargs,match", [
    (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=1e-12), "timeout_s"),
    (dict(timeout_s=1e10), "timeout_s"), (dict(timeout_s=float("inf")), "timeout_s"),
    (dict(timeout_s=float("nan")), "timeout_s"), (dict(workspace_bytes=-1), "workspace_bytes"),
    (dict(workspace_bytes=1 << 50), "workspace_bytes"),
    (dict(workspace_bytes=1.9), "workspace_bytes must be a whole number, got 1.9"),
    (dict(workspace_bytes=float("nan")), "workspace_bytes must be finite"),
    (dict(workspace_bytes=float("inf")), "workspace_bytes must be finite")])
def test_configure_rejects_bad_values(kwargs, match):
    before = pk_jax.get_config()
    with pytest.raises(ValueError, match=match):
        pk_jax.configure(**kwargs)
    assert pk_jax.get_config() == before


@pytest.mark.parametrize("kwargs,match", [
    (dict(timeout_s=True), "timeout_s must be a real number, got True \\(bool\\)"),
    (dict(timeout_s="abc"), "timeout_s must be a real number, got 'abc'"),
    (dict(workspace_bytes="1e9"), "workspace_bytes must be an integer, got '1e9'"),
    (dict(workspace_bytes=False), "workspace_bytes must be an integer")])
def test_configure_rejects_bad_types(kwargs, match):
    before = pk_jax.get_config()
    with pytest.raises(TypeError, match=match):
        pk_jax.configure(**kwargs)
    assert pk_jax.get_config() == before


def test_configure_takes_integral_floats_and_numpy_numbers():
    import numpy as np
    saved = pk_jax.get_config()
    try:
        cfg = pk_jax.configure(timeout_s=np.float32(0.5))
        assert cfg.timeout_s == 0.5 and type(cfg.timeout_s) is float
        if not runtime.initialized():  # the workspace size is still free
            cfg = pk_jax.configure(workspace_bytes=2e6)
            assert cfg.workspace_bytes == 2_000_000 and type(cfg.workspace_bytes) is int
    finally:
        pk_jax.configure(workspace_bytes=saved.workspace_bytes, timeout_s=saved.timeout_s)


def _config_in_subprocess(env):
    code = ("import pk_jax; c = pk_jax.get_config(); "
            "print(c.workspace_bytes, c.timeout_s)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_environment_variables(monkeypatch):
    import os
    env = dict(os.environ, PK_JAX_WORKSPACE_BYTES="4096", PK_JAX_TIMEOUT_S="2.5")
    proc = _config_in_subprocess(env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["4096", "2.5"]


@pytest.mark.parametrize("name,raw,why", [
    ("PK_JAX_TIMEOUT_S", "soon", "not a valid number"),
    ("PK_JAX_TIMEOUT_S", "nan", "must be finite"),
    ("PK_JAX_WORKSPACE_BYTES", "1GB", "not a valid integer"),
    ("PK_JAX_WORKSPACE_BYTES", "1.9", "must be a whole number"),
    ("PK_JAX_WORKSPACE_BYTES", "-4096", "workspace_bytes must be")])
def test_bad_environment_variable_is_named(name, raw, why):
    import os
    proc = _config_in_subprocess(dict(os.environ, **{name: raw}))
    assert proc.returncode != 0 and f"{name}={raw!r}" in proc.stderr and why in proc.stderr, \
        proc.stderr[-500:]


def test_integral_float_environment_variable(monkeypatch):
    import os
    proc = _config_in_subprocess(dict(os.environ, PK_JAX_WORKSPACE_BYTES="1e6"))
    assert proc.returncode == 0 and proc.stdout.split()[0] == "1000000", proc.stderr
