"""User-settable knobs: workspace size, wait timeout, ring attention's piece
order and backward kernel.

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
RING_PIECE_ORDERS = ("rows", "heads")


def _flag(raw: str) -> bool:
    """An environment switch: 1/true/yes/on or 0/false/no/off."""
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _env(name: str, default, parse):
    """An environment variable parsed with `parse` (int or float), or `default`."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError:
        kind = "switch (0 or 1)" if parse is _flag else parse.__name__
        raise ValueError(f"{name}={raw!r} is not a valid {kind}") from None


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
      ring_piece_order: how the fused ring attention (copy engines) cuts each
        K/V block it pushes to a peer into posted pieces. "rows": row ranges of
        every head (strided copies of the block as it is). "heads": the block is
        transposed to head-major first (one XLA transpose of K and V) and the
        pieces are head groups (contiguous copies), so the heads the first
        CTAs compute (the launch is heads-outer) arrive after 1/P of the block
        instead of all of it. Read when the forward is traced.
        Env: PK_JAX_RING_PIECE_ORDER. Default "rows".
      ring_backward_kernel: run each step of ring attention's backward ring
        (mechanisms "copy_engine" and "ld_st", or "auto" where it takes the
        kernel) as the block-backward kernel instead of the pure-JAX block
        gradients (einsums over a whole block's scores). False keeps the
        einsums (a fallback, e.g. to rule the kernel out when debugging).
        Read when the backward is traced.
        Env: PK_JAX_RING_BACKWARD_KERNEL=0/1. Default True.
    """

    workspace_bytes: int = 1024 * _MIB
    timeout_s: float = 5.0
    ring_piece_order: str = "rows"
    ring_backward_kernel: bool = True

    def __post_init__(self):
        if self.workspace_bytes < 0:
            raise ValueError(f"workspace_bytes must be >= 0, got {self.workspace_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.ring_piece_order not in RING_PIECE_ORDERS:
            raise ValueError(f"ring_piece_order must be one of {RING_PIECE_ORDERS}, "
                             f"got {self.ring_piece_order!r}")

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)


_config = Config(
    workspace_bytes=_env("PK_JAX_WORKSPACE_BYTES", Config.workspace_bytes, int),
    timeout_s=_env("PK_JAX_TIMEOUT_S", Config.timeout_s, float),
    ring_piece_order=_env("PK_JAX_RING_PIECE_ORDER", Config.ring_piece_order, str),
    ring_backward_kernel=_env("PK_JAX_RING_BACKWARD_KERNEL", Config.ring_backward_kernel, _flag),
)


def get_config() -> Config:
    """The settings in force."""
    return _config


def configure(*, workspace_bytes: int | None = None, timeout_s: float | None = None,
              ring_piece_order: str | None = None,
              ring_backward_kernel: bool | None = None) -> Config:
    """Change pk_jax's settings; returns the new settings.

    `workspace_bytes` can only change before the first pk_jax kernel is
    lowered (the workspace is allocated then). `timeout_s` applies to ops
    lowered afterwards (it is baked into each compiled call);
    `ring_piece_order` and `ring_backward_kernel` to ops traced afterwards.
    """
    global _config
    from pk_jax import runtime  # late: runtime imports this module

    changes = {}
    if workspace_bytes is not None:
        changes["workspace_bytes"] = int(workspace_bytes)
    if timeout_s is not None:
        changes["timeout_s"] = float(timeout_s)
    if ring_piece_order is not None:
        changes["ring_piece_order"] = str(ring_piece_order)
    if ring_backward_kernel is not None:
        changes["ring_backward_kernel"] = bool(ring_backward_kernel)
    new = dataclasses.replace(_config, **changes)  # validates
    if new.workspace_bytes != _config.workspace_bytes and runtime.initialized():
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
