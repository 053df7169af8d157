"""`pk_jax.dot_general` / `pk_jax.matmul`: `lax.dot_general` for plain `jax.jit`
programs whose operands carry shardings, routed to pk_jax's fused
tensor-parallel matmuls where the shardings call for a collective.

Each call becomes a `custom_partitioning` op. Shardy (or GSPMD) propagates
shardings through it with an einsum-like rule; when XLA partitions the
program, the partition callback reads the operand shardings (and the one the
program wants for the result), picks a route (`_dot_plan.plan_dot`: rows
sharded like the weight's output features -> `all_gather_matmul`; sharded
contraction -> `matmul_reduce_scatter` or `matmul_all_reduce` (dot + psum
for operands it does not take); else the local dot),
fixes the operand and result shardings explicitly, and emits the per-device
program.

Gradients: `jax.custom_vjp`; both cotangents are themselves partitioned
dot_generals (so the backward pass is routed too: the transpose of an
all_gather_matmul is a matmul_reduce_scatter and vice versa), each given its
primal operand as a shape-and-sharding template ("like") so that its result
gets the primal's sharding. First-order only.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pk_jax import _args
from pk_jax.ops.tp_matmul import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from pk_jax.partitioning._dot_plan import DotDims, DotPlan, plan_dot
from pk_jax._explicit import (explicit_mesh, replicated_fun, reshard, spec_of,
                                           type_sharding)
from pk_jax.partitioning._specs import Route, dim_axes, named, record, spec

_FUSED = {"all_gather_matmul": all_gather_matmul,
          "matmul_reduce_scatter": matmul_reduce_scatter,
          "matmul_all_reduce": matmul_all_reduce}


# ---- per-device programs -------------------------------------------------------
def _local_dot(lhs, rhs, dims: DotDims, precision, out_dtype):
    y = lax.dot_general(lhs, rhs, dims.dimension_numbers, precision=precision,
                        preferred_element_type=out_dtype)
    return jnp.transpose(y, dims.out_perm)


def _fused_dot(lhs, rhs, dims: DotDims, plan: DotPlan, out_dtype):
    """The fused op on [m, rest..., K] @ [K, N], dim `plan.lhs_dim` of the
    lhs as the rows it gathers / scatters; back to dot order, then out_perm."""
    lf, rf, i = dims.lf, dims.rf, plan.lhs_dim
    rest = tuple(d for d in lf if d != i)
    x = jnp.transpose(lhs, (i,) + rest + dims.lc)
    x = x.reshape(x.shape[:1 + len(rest)] + (-1,))
    w = jnp.transpose(rhs, dims.rc + rf)
    w = w.reshape(x.shape[-1], -1)
    y = _FUSED[plan.route](x, w, plan.axes, preferred_element_type=out_dtype)
    y = y.reshape(y.shape[:-1] + tuple(rhs.shape[j] for j in rf))
    y = jnp.moveaxis(y, 0, lf.index(i))
    return jnp.transpose(y, dims.out_perm)


# ---- the custom_partitioning op ------------------------------------------------
def _rule(dims: DotDims, with_like: bool) -> tuple[str, dict]:
    """Einsum-like Shardy rule and its special factors.

    The contracting factors are reduction factors. The lhs free factors
    (rows) are declared permutation factors: they still propagate (a
    data-parallel batch stays sharded), but when rows and output features
    ask for the same mesh axis, the features get it, which is the layout
    all_gather_matmul produces (plain einsum factors let the larger operand
    win, and Shardy would then reshard the fused op's result)."""
    lhs, rhs = [""] * dims.lhs_ndim, [""] * dims.rhs_ndim
    for t, (i, j) in enumerate(zip(dims.lb, dims.rb)):
        lhs[i] = rhs[j] = f"b{t}"
    for t, (i, j) in enumerate(zip(dims.lc, dims.rc)):
        lhs[i] = rhs[j] = f"c{t}"
    for t, i in enumerate(dims.lf):
        lhs[i] = f"i{t}"
    for t, j in enumerate(dims.rf):
        rhs[j] = f"j{t}"
    dot = [lhs[i] for i in dims.lb] + [lhs[i] for i in dims.lf] + [rhs[j] for j in dims.rf]
    out = " ".join(dot[p] for p in dims.out_perm)
    operands = [" ".join(lhs), " ".join(rhs)] + ([out] if with_like else [])
    return f"{', '.join(operands)} -> {out}", {
        "reduction_factors": tuple(f"c{t}" for t in range(len(dims.lc))),
        "permutation_factors": tuple(f"i{t}" for t in range(len(dims.lf)))}


def _fusable(arg_shapes, out_dtype) -> bool:
    """Whether the fused pk ops can take these operands at all."""
    dtypes = [a.dtype for a in arg_shapes[:2]] + ([out_dtype] if out_dtype else [])
    return (all(jnp.issubdtype(d, jnp.floating) for d in dtypes)
            and all(a.size > 0 for a in arg_shapes[:2]))


def _plan(dims, out_dtype, mesh, arg_shapes, want_sharding) -> DotPlan:
    lhs, rhs = arg_shapes[0], arg_shapes[1]
    want = (None if not isinstance(want_sharding, NamedSharding)
            else dim_axes(want_sharding, len(dims.out_perm), mesh))
    return plan_dot(dims, dim_axes(lhs.sharding, lhs.ndim, mesh),
                    dim_axes(rhs.sharding, rhs.ndim, mesh), want, dict(mesh.shape),
                    lhs.shape, _fusable(arg_shapes, out_dtype))


@functools.lru_cache(maxsize=None)
def _op(dims: DotDims, precision: Any, out_dtype: Any, kind: str, with_like: bool,
        explicit_out: Optional[P]) -> custom_partitioning:
    """The partitioned op `f(lhs, rhs[, like])` of one static configuration
    (`like`, for the gradients, only lends its sharding to the result).
    Under explicit sharding `explicit_out` is the result's planned spec
    (_explicit.py); None otherwise."""

    def fun(lhs, rhs, *like):
        return _local_dot(lhs, rhs, dims, precision, out_dtype)

    op = custom_partitioning(fun if explicit_out is None else
                             replicated_fun(lambda a, b, *_: fun(a, b), explicit_out))

    def want_of(arg_shapes, result_shape):
        return arg_shapes[2].sharding if with_like else getattr(result_shape, "sharding", None)

    def partition(mesh, arg_shapes, result_shape):
        plan = _plan(dims, out_dtype, mesh, arg_shapes, want_of(arg_shapes, result_shape))
        in_shardings = [named(mesh, plan.lhs), named(mesh, plan.rhs)]
        if with_like:
            in_shardings.append(arg_shapes[2].sharding)
        record(Route(kind, plan.route, plan.axes, tuple(spec(a) for a in (plan.lhs, plan.rhs)),
                     (spec(plan.out),)))

        def lower(lhs, rhs, *like):
            if plan.route in _FUSED:
                return _fused_dot(lhs, rhs, dims, plan, out_dtype)
            y = _local_dot(lhs, rhs, dims, precision, out_dtype)
            return lax.psum(y, plan.axes) if plan.route == "all_reduce" else y

        return mesh, lower, named(mesh, plan.out), tuple(in_shardings)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD propagation
        want = arg_shapes[2].sharding if with_like else None
        return named(mesh, _plan(dims, out_dtype, mesh, arg_shapes, want).out)

    rule, factors = _rule(dims, with_like)
    op.def_partition(partition, infer_sharding_from_operands=infer,
                     propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
                     sharding_rule=rule, **factors)
    return op


# ---- gradients -----------------------------------------------------------------
def _ranks(dims_seq) -> dict[int, int]:
    """Rank of each dim index among the sorted indices."""
    return {d: r for r, d in enumerate(sorted(dims_seq))}


def _transpose_dims(dims: DotDims) -> tuple[DotDims, DotDims]:
    """Layouts of d_lhs = dot(g, rhs) and d_rhs = dot(lhs, g), each permuted
    into its primal operand's layout (g is in dot order: batch, lf, rf)."""
    nb, nlf = len(dims.lb), len(dims.lf)
    g_ndim = nb + nlf + len(dims.rf)
    g_b = tuple(range(nb))
    g_lf = tuple(range(nb, nb + nlf))
    g_rf = tuple(range(nb + nlf, g_ndim))
    rc_rank, lc_rank = _ranks(dims.rc), _ranks(dims.lc)
    perm_l = []
    for p in range(dims.lhs_ndim):
        if p in dims.lb:
            perm_l.append(dims.lb.index(p))
        elif p in dims.lf:
            perm_l.append(nb + dims.lf.index(p))
        else:
            perm_l.append(nb + nlf + rc_rank[dims.rc[dims.lc.index(p)]])
    perm_r = []
    for p in range(dims.rhs_ndim):
        if p in dims.rb:
            perm_r.append(dims.rb.index(p))
        elif p in dims.rc:
            perm_r.append(nb + lc_rank[dims.lc[dims.rc.index(p)]])
        else:
            perm_r.append(nb + len(dims.lc) + dims.rf.index(p))
    d_lhs = DotDims(g_ndim, dims.rhs_ndim, g_rf, dims.rf, g_b, dims.rb, tuple(perm_l))
    d_rhs = DotDims(dims.lhs_ndim, g_ndim, dims.lf, g_lf, dims.lb, g_b, tuple(perm_r))
    return d_lhs, d_rhs


def _call(dims: DotDims, precision, out_dtype, kind: str, lhs, rhs, like=None,
          want: Optional[P] = None):
    """The partitioned op on (lhs, rhs[, like]). Under explicit sharding the
    route is planned here from the operands' types (the partition callback
    plans the same), and the result is resharded to `like`'s sharding or
    `want` when the route produces another."""
    args = (lhs, rhs) if like is None else (lhs, rhs, like)
    mesh = explicit_mesh(*args)
    if mesh is None:
        return _op(dims, precision, out_dtype, kind, like is not None, None)(*args)
    if like is not None:
        want = type_sharding(like).spec
    sizes = dict(mesh.shape)
    want_axes = None if want is None else dim_axes(NamedSharding(mesh, want),
                                                   len(dims.out_perm), mesh)
    plan = plan_dot(dims, dim_axes(type_sharding(lhs), lhs.ndim, mesh),
                    dim_axes(type_sharding(rhs), rhs.ndim, mesh), want_axes, sizes, lhs.shape,
                    _fusable(args, out_dtype))
    y = _op(dims, precision, out_dtype, kind, like is not None, spec(plan.out))(*args)
    return y if want is None else reshard(y, mesh, want)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dot(lhs, rhs, dims: DotDims, precision, out_dtype, want):
    return _call(dims, precision, out_dtype, "dot_general", lhs, rhs, want=want)


def _dot_fwd(lhs, rhs, dims, precision, out_dtype, want):
    return _dot(lhs, rhs, dims, precision, out_dtype, want), (lhs, rhs)


def _dot_bwd(dims, precision, out_dtype, want, res, g):
    lhs, rhs = res
    dims_l, dims_r = _transpose_dims(dims)
    d_lhs = _call(dims_l, precision, jnp.dtype(lhs.dtype), "dot_general_transpose",
                  g.astype(rhs.dtype), rhs, lhs)
    d_rhs = _call(dims_r, precision, jnp.dtype(rhs.dtype), "dot_general_transpose",
                  lhs, g.astype(lhs.dtype), rhs)
    return d_lhs, d_rhs


_dot.defvjp(_dot_fwd, _dot_bwd)


# ---- public API ----------------------------------------------------------------
def _check_dimension_numbers(dimension_numbers) -> None:
    """((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), each a
    sequence of ints, or a TypeError saying what is expected."""
    def ints(ds) -> bool:
        return isinstance(ds, (tuple, list)) and all(
            isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) for d in ds)

    def pair(p) -> bool:
        return isinstance(p, (tuple, list)) and len(p) == 2 and all(ints(ds) for ds in p)
    if not (isinstance(dimension_numbers, (tuple, list)) and len(dimension_numbers) == 2
            and all(pair(p) for p in dimension_numbers)):
        raise TypeError("pk_jax.dot_general: dimension_numbers must be ((lhs_contracting, "
                        "rhs_contracting), (lhs_batch, rhs_batch)), each a tuple of ints (as "
                        "in lax.dot_general, e.g. (((1,), (0,)), ((), ())) for a matmul), got "
                        f"{dimension_numbers!r}")


def _check_out_sharding(op: str, out_sharding, explicit) -> None:
    """The result sharding: None, a Sharding (e.g. NamedSharding) or a
    PartitionSpec (TypeError otherwise); a PartitionSpec needs a mesh naming
    its axes: the operands' (explicit sharding) or the `jax.set_mesh`
    context's."""
    if out_sharding is None or isinstance(out_sharding, jax.sharding.Sharding):
        return
    if not isinstance(out_sharding, P):
        raise TypeError(f"pk_jax.{op}: out_sharding must be a NamedSharding, a PartitionSpec "
                        f"or None, got {out_sharding!r} ({type(out_sharding).__name__}); a "
                        "PartitionSpec names the mesh axes of each result dimension, e.g. "
                        "PartitionSpec(None, 'x')")
    mesh = explicit if explicit is not None else jax.sharding.get_abstract_mesh()
    names = set(getattr(mesh, "axis_names", ()) or ())
    if not names:
        raise ValueError(f"pk_jax.{op}: out_sharding={out_sharding} is a PartitionSpec, "
                         "which needs a mesh to name its axes, and none is set: pass a "
                         "NamedSharding(mesh, spec), or call under `with jax.set_mesh(mesh):`")
    used = [a for e in out_sharding if e is not None
            for a in ((e,) if isinstance(e, str) else tuple(e))]
    unknown = [a for a in used if a not in names]
    if unknown:
        raise ValueError(f"pk_jax.{op}: out_sharding={out_sharding} names mesh axes "
                         f"{unknown} that the mesh does not have (its axes: {sorted(names)})")


def _normalize(dimension_numbers, lhs: jax.Array, rhs: jax.Array) -> DotDims:
    (lc, rc), (lb, rb) = dimension_numbers
    norm = lambda ds, nd: tuple(int(d) % nd if -nd <= int(d) < nd else int(d) for d in ds)
    lc, lb = norm(lc, lhs.ndim), norm(lb, lhs.ndim)
    rc, rb = norm(rc, rhs.ndim), norm(rb, rhs.ndim)
    n_out = lhs.ndim + rhs.ndim - 2 * len(lc) - len(lb)
    return DotDims(lhs.ndim, rhs.ndim, lc, rc, lb, rb, tuple(range(n_out)))


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision: Any = None,
                preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """`jax.lax.dot_general`, partitioned by pk_jax under `jax.jit`.

    Same arguments and result as `lax.dot_general`. With sharded operands
    under jit (NamedShardings over a mesh), the per-device program is chosen
    from the shardings when XLA partitions the program:
      * lhs rows (a free dim) sharded over mesh axes A and the rhs's output
        features sharded over the same A: `pk_jax.all_gather_matmul` (the
        rows gathered, the result sharded on features, rows replicated);
      * contraction sharded over A on both operands: the local dot, then
        `pk_jax.matmul_reduce_scatter` when the result is wanted sharded on
        rows over A, else `pk_jax.matmul_all_reduce` over A (result
        replicated over A; the local dot + psum with batch dims);
      * anything else: the local dot with the operands' shardings.
    Leading lhs free dims (e.g. [batch, seq, features] activations) flatten
    into rows, as in the tensor-parallel ops. The rules are in
    `pk_jax/partitioning/_dot_plan.py`; `pk_jax.partitioning.record_routes`
    shows the decisions. Without a multi-device mesh (eager, one device,
    inside shard_map) it is the plain dot.

    Args:
      lhs, rhs: the operands.
      dimension_numbers: ((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch)), as in `lax.dot_general`.
      precision: passed to the local dots (the fused ops run at their
        kernel's own precision: fp32 accumulation).
      preferred_element_type: the result dtype.
      out_sharding: optional sharding of the result (applied as a sharding
        constraint; it also tells the route what the result should be): a
        NamedSharding, or a PartitionSpec of the operands' explicit mesh or
        of the `jax.set_mesh` context's mesh (a ValueError when there is
        none, or when it names axes the mesh lacks).

    Returns:
      The dot_general result. Differentiable (first order) w.r.t. floating
      operands; the backward dots are routed the same way.
    """
    _check_dimension_numbers(dimension_numbers)
    return _dot_general("dot_general", jnp.asarray(lhs), jnp.asarray(rhs), dimension_numbers,
                        precision, preferred_element_type, out_sharding)


def _dot_general(op: str, lhs, rhs, dimension_numbers, precision, preferred_element_type,
                 out_sharding) -> jax.Array:
    """`dot_general` once its dimension numbers are known to be well formed;
    `op` ("dot_general", "matmul") names the call in errors."""
    if preferred_element_type is not None:
        preferred_element_type = _args.dtype(op, "preferred_element_type",
                                             preferred_element_type)
    # lax's own checks and error messages for shapes, dims and dtypes
    # (on unsharded shapes: the sharding is this op's to decide)
    out = jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                                           precision=precision,
                                           preferred_element_type=preferred_element_type),
                         *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (lhs, rhs)))
    out_dtype = None if preferred_element_type is None else jnp.dtype(out.dtype)
    mesh = explicit_mesh(lhs, rhs)
    explicit = mesh is not None
    _check_out_sharding(op, out_sharding, mesh)
    want = spec_of(out_sharding) if explicit else None
    if lhs.ndim == 0 or rhs.ndim == 0:  # nothing to route
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type,
                               out_sharding=out_sharding if explicit else None)
    dims = _normalize(dimension_numbers, lhs, rhs)
    if jnp.issubdtype(lhs.dtype, jnp.inexact) and jnp.issubdtype(rhs.dtype, jnp.inexact):
        y = _dot(lhs, rhs, dims, precision, out_dtype, want)
    else:  # no gradients of integer dots
        y = _call(dims, precision, out_dtype, "dot_general", lhs, rhs, want=want)
    if out_sharding is not None and not explicit:
        y = lax.with_sharding_constraint(y, out_sharding)
    return y


def matmul(a: jax.Array, b: jax.Array, *, precision: Any = None,
           preferred_element_type: Any = None,
           out_sharding: Optional[Any] = None) -> jax.Array:
    """`a @ b` through `pk_jax.dot_general` (routed the same way).

    Args:
      a: [..., K] (leading dims are rows) or, with a batched b, [batch..., M, K].
      b: the weight [K, N], or [batch..., K, N] with the same batch dims as a.
      precision, preferred_element_type, out_sharding: as in `dot_general`.

    Returns:
      [..., N] (or [batch..., M, N]).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 1 or b.ndim < 2:
        raise ValueError(f"pk_jax.matmul: expected a [..., K] and b [K, N] (or batched "
                         f"[batch..., K, N]), got a {a.shape} and b {b.shape}")
    if b.ndim == 2:
        dims = (((a.ndim - 1,), (0,)), ((), ()))
    elif a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2]:
        batch = tuple(range(a.ndim - 2))
        dims = (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch))
    else:
        raise ValueError(f"pk_jax.matmul: a batched b needs a with the same batch dims "
                         f"(no broadcasting), got a {a.shape} and b {b.shape}")
    return _dot_general("matmul", a, b, dims, precision, preferred_element_type, out_sharding)
