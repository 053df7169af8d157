"""User-settable knobs: workspace size and wait timeout.

Each knob has an environment variable (read once, at import) and a
`pk_jax.configure(...)` keyword. The workspace is allocated when the first
pk_jax kernel is lowered, so its size can only change before that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Iterator

import numpy as np

_MIB = 1 << 20
MAX_WORKSPACE_BYTES = 1 << 40
MIN_TIMEOUT_S = 1e-3   # a wait shorter than a kernel launch fails at once
MAX_TIMEOUT_S = 86400.0  # one day; the bound is a 64-bit count of nanoseconds


def _number(name: str, value, integral: bool):
    """`value` as an int (integral) or a float: a Python or NumPy number (an
    integral float such as 1e9 counts as an int; a bool, a string, NaN or
    an infinity is refused), or a TypeError / ValueError naming `name`."""
    kind = "an integer" if integral else "a real number"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise TypeError(f"pk_jax: {name} must be {kind}, got {value!r} "
                        f"({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"pk_jax: {name} must be finite, got {value!r}")
    if integral:
        if value != int(value):
            raise ValueError(f"pk_jax: {name} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def _env(name: str, default, integral: bool):
    """The environment variable `name` as a number (see `_number`; "1e9" is
    a whole number too), or `default` when it is unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        try:
            value = int(raw) if integral else float(raw)
        except ValueError:
            value = float(raw)  # "1e9" bytes; "1.5" is then refused as not whole
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid "
                         f"{'integer' if integral else 'number'}") from None
    try:
        return _number(name, value, integral)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}={raw!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Config:
    """pk_jax settings.

    Attributes:
      workspace_bytes: data area of each GPU's symmetric workspace, used by
        staged mechanisms (the copy engine receives whole blocks there).
        Env: PK_JAX_WORKSPACE_BYTES. Default 1 GiB.
      timeout_s: bound of every cross-GPU wait inside a kernel. A wait that
        exceeds it records an error instead of hanging the GPU.
        Env: PK_JAX_TIMEOUT_S. Default 5 s.
    """

    workspace_bytes: int = 1024 * _MIB
    timeout_s: float = 5.0

    def __post_init__(self):
        # Types first (a bool is not a number; 1.9 bytes is not a size), then ranges.
        object.__setattr__(self, "workspace_bytes",
                           _number("workspace_bytes", self.workspace_bytes, integral=True))
        object.__setattr__(self, "timeout_s", _number("timeout_s", self.timeout_s,
                                                      integral=False))
        if not 0 <= self.workspace_bytes <= MAX_WORKSPACE_BYTES:
            raise ValueError(f"workspace_bytes must be 0..{MAX_WORKSPACE_BYTES} (1 TiB), got "
                             f"{self.workspace_bytes}")
        if not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be {MIN_TIMEOUT_S}..{MAX_TIMEOUT_S:.0f} seconds "
                             f"(the bound of every wait for a peer GPU), got {self.timeout_s}")

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)


def _from_environment() -> Config:
    values = {"workspace_bytes": ("PK_JAX_WORKSPACE_BYTES", True),
              "timeout_s": ("PK_JAX_TIMEOUT_S", False)}
    config = Config()
    for field, (name, integral) in values.items():
        value = _env(name, getattr(config, field), integral)
        try:
            config = dataclasses.replace(config, **{field: value})
        except ValueError as e:
            raise ValueError(f"{name}={os.environ[name]!r}: {e}") from None
    return config


_config = _from_environment()
_allocated = False  # set by the runtime once the workspace exists


def get_config() -> Config:
    """The settings in force."""
    return _config


def workspace_allocated() -> None:
    """Called by the runtime when it allocates the workspace: its size is fixed."""
    global _allocated
    _allocated = True


def configure(*, workspace_bytes: int | None = None,
              timeout_s: float | None = None) -> Config:
    """Change pk_jax's settings; returns the new settings.

    `workspace_bytes` can only change before the first pk_jax kernel is
    lowered (the workspace is allocated then). `timeout_s` applies to ops
    lowered afterwards (it is baked into each compiled call).

    Args:
      workspace_bytes: a whole number of bytes, 0..2^40 (an int, or an
        integral float such as 1e9; not a bool or a string).
      timeout_s: seconds, a finite real number in 1e-3..86400 (not a bool).
    """
    global _config
    changes = {}
    if workspace_bytes is not None:
        changes["workspace_bytes"] = workspace_bytes
    if timeout_s is not None:
        changes["timeout_s"] = timeout_s
    new = dataclasses.replace(_config, **changes)  # validates types and values
    if new.workspace_bytes != _config.workspace_bytes and _allocated:
        raise RuntimeError(
            "pk_jax.configure(workspace_bytes=...) must be called before the first "
            "pk_jax op is compiled: the workspace is already allocated with "
            f"{_config.workspace_bytes} bytes")
    _config = new
    return _config


@contextlib.contextmanager
def configured(**changes) -> Iterator[Config]:
    """`configure(**changes)` for the body of a `with` block; the settings it
    changed go back to their previous values afterwards, also on errors."""
    previous = {name: getattr(_config, name) for name in changes if hasattr(_config, name)}
    new = configure(**changes)  # rejects unknown names and bad values
    try:
        yield new
    finally:
        configure(**previous)
