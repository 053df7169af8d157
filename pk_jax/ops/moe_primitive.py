"""The primitive of the MoE token exchange (pk_jax.moe_dispatch /
moe_combine, mechanism "ld_st").

`pk_moe_exchange`: (src [M, ...], peer [M] int32, index [M] int32,
valid [N] int32) -> out [N, ...]: source row i goes to rank peer[i], row
index[i] of that rank's output (nowhere when peer[i] < 0); output row p is
what landed there where valid[p] >= 0, else zeros. The routing arrays stay
on the device. Dispatch and combine are this exchange with the roles
swapped; pk_jax/ops/moe.py pairs them as each other's transposes
(custom_vjp), so the primitive has no AD rules. Lowering: on CUDA with the
extension built, the FFI kernel of xla_ffi/moe.cc; elsewhere (and where the
kernel cannot run on the axis under "auto") a dense `lax.all_to_all` of
[n, N] blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax.ops._lowering import channel_attr, kernel_group


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """Static part of one exchange: the axes, their size, whether the user
    forced the kernel (mechanism="ld_st": an error where it cannot run)."""
    names: tuple[str, ...]
    n: int
    forced: bool = True


moe_exchange_p = Primitive("pk_moe_exchange")


def _abstract_eval(src, peer, index, valid, *, cfg: ExchangeConfig):
    return src.update(shape=(valid.shape[0],) + src.shape[1:])


def reference_exchange(src, peer, index, valid, names: tuple[str, ...], n: int):
    """The exchange's semantics with XLA collectives (dense, n x N rows)."""
    rows = valid.shape[0]
    ok = (peer >= 0) & (peer < n) & (index >= 0) & (index < rows)
    buf = jnp.zeros((n, rows) + src.shape[1:], src.dtype)
    buf = buf.at[jnp.where(ok, peer, n), jnp.where(ok, index, 0)].set(src, mode="drop")
    got = lax.all_to_all(buf, names[0] if len(names) == 1 else names, 0, 0)
    out = jnp.sum(got, axis=0)  # each output row has at most one source
    return jnp.where((valid >= 0).reshape((-1,) + (1,) * (src.ndim - 1)), out, 0)


def _reference_lowering(ctx, src, peer, index, valid, *, cfg: ExchangeConfig):
    fn = lambda *a: reference_exchange(*a, cfg.names, cfg.n)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, src, peer, index, valid)


def _cuda_lowering(ctx, src, peer, index, valid, *, cfg: ExchangeConfig):
    table = kernel_group(ctx, "moe", cfg.names, cfg.n, forced="ld_st" if cfg.forced else None)
    if table is None:
        return _reference_lowering(ctx, src, peer, index, valid, cfg=cfg)
    src_aval, _, _, valid_aval = ctx.avals_in
    row_bytes = int(np.prod(src_aval.shape[1:], dtype=np.int64)) * \
        np.dtype(src_aval.dtype).itemsize
    attr = channel_attr(table, "moe", "exchange", valid_aval.shape[0] * row_bytes)
    return jax.ffi.ffi_lowering("pk_moe_exchange")(
        ctx, src, peer, index, valid, row_bytes=np.int64(row_bytes), **attr)


moe_exchange_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(moe_exchange_p, _reference_lowering)
mlir.register_lowering(moe_exchange_p, _cuda_lowering, platform="cuda")
