"""User-settable knobs: workspace size and wait timeout.

Each knob has an environment variable (read once, at import) and a
`pk_jax.configure(...)` keyword. The workspace is allocated when the first
pk_jax kernel is lowered, so its size can only change before that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator

_MIB = 1 << 20
MAX_WORKSPACE_BYTES = 1 << 40
MIN_TIMEOUT_S = 1e-3   # a wait shorter than a kernel launch fails at once
MAX_TIMEOUT_S = 86400.0  # one day; the bound is a 64-bit count of nanoseconds


def _env(name: str, default, parse):
    """An environment variable parsed with `parse` (int or float), or `default`."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {parse.__name__}") from None


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
        if not 0 <= self.workspace_bytes <= MAX_WORKSPACE_BYTES:
            raise ValueError(f"workspace_bytes must be 0..{MAX_WORKSPACE_BYTES} (1 TiB), got "
                             f"{self.workspace_bytes}")
        if not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be {MIN_TIMEOUT_S}..{MAX_TIMEOUT_S:.0f} seconds "
                             f"(the bound of every wait for a peer GPU), got {self.timeout_s}")

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)


_config = Config(
    workspace_bytes=_env("PK_JAX_WORKSPACE_BYTES", Config.workspace_bytes, int),
    timeout_s=_env("PK_JAX_TIMEOUT_S", Config.timeout_s, float),
)
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
    """
    global _config
    changes = {}
    if workspace_bytes is not None:
        changes["workspace_bytes"] = int(workspace_bytes)
    if timeout_s is not None:
        changes["timeout_s"] = float(timeout_s)
    new = dataclasses.replace(_config, **changes)  # validates
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
