"""Small shims over JAX internals that differ between supported versions
(jax 0.10.2, the oldest supported, to 0.11.x)."""

from __future__ import annotations

import functools
import inspect
import warnings

import jax

# The jax versions pk_jax is tested with: the CPU suite on the oldest, the GPU
# runs on the newest minor release.
JAX_MIN = (0, 10, 2)
JAX_TESTED_BELOW = (0, 12)


def check_jax_version(version: str = jax.__version__) -> None:
    """ImportError for a jax older than JAX_MIN; a warning for one newer than
    the tested releases (pk_jax reaches into jax internals that move)."""
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if parts < JAX_MIN:
        raise ImportError(f"pk_jax needs jax >= {'.'.join(map(str, JAX_MIN))}, found jax "
                          f"{version}: pip install -U 'jax>={'.'.join(map(str, JAX_MIN))}'")
    if parts[:2] >= JAX_TESTED_BELOW:
        warnings.warn(f"pk_jax is tested with jax {'.'.join(map(str, JAX_MIN))} to "
                      f"{JAX_TESTED_BELOW[0]}.{JAX_TESTED_BELOW[1] - 1}.x, found {version}; "
                      "its kernels may not lower with it", RuntimeWarning, stacklevel=3)


def make_varying(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Mark `x` as varying over `names` where it is not yet, as XLA's own
    collectives do before binding (shard_map's check_vma type system)."""
    try:
        from jax._src.lax.parallel import insert_collective_pvary
    except ImportError:  # older/newer JAX without the helper: nothing to do
        return x
    return insert_collective_pvary(names, x)


def varying_axes(x: jax.Array) -> frozenset:
    """The mesh axes `x` varies over inside shard_map (empty when unchecked)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax >= 0.11
    if vma is None:
        mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", ()) if mat is not None else ()
    return frozenset(vma)


def vary_alike(*args: jax.Array, names: tuple[str, ...] = ()) -> tuple[jax.Array, ...]:
    """`args`, each made to vary over every axis any of them (or `names`)
    varies over: one varying-axes type for all operands of a primitive whose
    outputs take its inputs' type (shard_map's check_vma)."""
    axes = tuple(sorted(set(names).union(*(varying_axes(x) for x in args))))
    return tuple(make_varying(x, axes) for x in args) if axes else args


def sum_to_type_of(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Sum a cotangent over the mesh axes it varies over but its primal does
    not (a weight replicated over "sp" gets the sum of every sp shard's
    gradient), as JAX's own transpose rules do; a no-op when unchecked."""
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


def drop_varying(aval, names: tuple[str, ...]):
    """`aval` made invariant over `names` (the type of a psum's result under
    shard_map's check_vma); unchanged when unchecked."""
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    if mat is not None and hasattr(mat, "varying"):  # jax 0.10
        return aval.update(manual_axis_type=mat.update(
            varying=frozenset(a for a in mat.varying if a not in names)))
    vma = getattr(aval, "vma", None)  # jax >= 0.11
    if vma is not None:
        return aval.update(vma=frozenset(a for a in vma if a not in names))
    return aval


def result_aval(aval, shape: tuple, dtype=None, **kwargs):
    """The type of a primitive's result of `shape` (and `dtype`) derived from
    its operand's `aval` (its varying axes, mesh and memory space). Where the
    rank changes, the result's sharding spec gets one unsharded entry per
    dimension (jax >= 0.11 checks the spec's length against the rank; these
    results are per-device arrays, replicated or inside shard_map)."""
    shape = tuple(shape)
    sharding = getattr(aval, "sharding", None)
    if "sharding" not in kwargs and sharding is not None and len(shape) != len(aval.shape):
        spec = getattr(sharding, "spec", None)
        if spec is not None and any(p is not None for p in spec):
            raise ValueError(f"a result of rank {len(shape)} from an operand sharded as {spec}: "
                             "pk_jax's primitives take per-device (unsharded) operands")
        if spec is not None:
            kwargs["sharding"] = sharding.update(spec=jax.sharding.PartitionSpec(
                *([None] * len(shape))))
    return aval.update(shape=shape, dtype=dtype, **kwargs)


def bound_axis_names() -> tuple | None:
    """The axis names bound where this runs, in a trace (a shard_map's mesh
    axes, vmap's axis_name), or None where this jax does not tell."""
    try:
        from jax._src import core
        return tuple(core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):
        return None


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                  is_causal: bool) -> jax.Array:
    """`jax.nn.dot_product_attention` (XLA's attention), usable on every
    backend. For half-precision inputs JAX pins its dots to an explicit
    algorithm (BF16_BF16_F32 / F16_F16_F32), which XLA:CPU's elemental
    emitter rejects at compile time for small dots (B = S = H = 1 in bf16,
    most tiny fp16 shapes); on CPU the inputs are upcast to float32 (the
    same math at higher precision) and the result cast back."""
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal)
    if not any(x.dtype in (jax.numpy.bfloat16, jax.numpy.float16) for x in (q, k, v)):
        return xla(q, k, v)
    f32 = lambda q, k, v: xla(*(x.astype(jax.numpy.float32) for x in (q, k, v))).astype(q.dtype)
    return jax.lax.platform_dependent(q, k, v, cpu=f32, default=xla)


def cudnn_available() -> bool:
    """Whether this process can trace cuDNN's fused attention (JAX checks
    for cuDNN when tracing implementation="cudnn": a GPU build of jaxlib
    with cuDNN 9 or newer loaded)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # noqa: BLE001 - no CUDA plugin, no cuDNN, no GPU: not available
        return False


CUDNN_MAX_HEAD_DIM = 256  # cuDNN's flash attention on Hopper: multiples of 8 up to 256


def cudnn_operand_problem(q: jax.Array) -> str | None:
    """None when cuDNN's fused attention takes q's dtype and head dim
    (bf16/fp16, a multiple of 8 up to 256), else why not."""
    half = (jax.numpy.dtype(jax.numpy.bfloat16), jax.numpy.dtype(jax.numpy.float16))
    d = q.shape[-1]
    if jax.numpy.dtype(q.dtype) not in half:
        return f"dtype {q.dtype} (cuDNN's attention takes bfloat16 and float16)"
    if not (0 < d <= CUDNN_MAX_HEAD_DIM and d % 8 == 0):
        return (f"head_dim {d} (cuDNN's attention takes multiples of 8 up to "
                f"{CUDNN_MAX_HEAD_DIM})")
    return None


def cudnn_takes(q: jax.Array, k: jax.Array) -> bool:
    """Whether cuDNN's fused attention (through jax.nn.dot_product_attention)
    takes these operands: `cudnn_operand_problem`'s dtypes and head dims, as
    many keys as queries."""
    return (cudnn_operand_problem(q) is None and q.shape[1] == k.shape[1]
            and q.shape[1] > 0)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                    is_causal: bool) -> jax.Array:
    """cuDNN's fused attention on CUDA (jax.nn.dot_product_attention with
    implementation="cudnn", its own backward included), `xla_attention`
    on every other platform. The caller checked `cudnn_takes`."""
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal, implementation="cudnn")
    other = lambda q, k, v: xla_attention(q, k, v, scale=scale, is_causal=is_causal)
    return jax.lax.platform_dependent(q, k, v, cuda=cudnn, default=other)


# ---- cuDNN's attention blocks for a ring (jax's private cuDNN module) -------------
# A ring needs two pieces jax.nn.dot_product_attention does not give: the
# forward's log-sum-exp in fp32 (to merge the steps' blocks), and the backward
# fed the whole ring's output and log-sum-exp instead of the block's own (so
# each step's gradients are that block's share). Both come from
# jax._src.cudnn.fused_attention_stablehlo, whose operand names are read from
# the installed jax: an unknown signature makes `cudnn_blocks_available` False
# (then `auto` takes the pure-JAX ring, and mechanism "cudnn" its einsum blocks).
_BWD_UNUSED = {"bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
               "page_table_v"}
_BWD_GIVEN = {"query", "key", "value", "activation", "fwd_output", "grad_output"}
_BWD_ATTRS = {"scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
              "sliding_window_length"}


@functools.cache
def _cudnn_module():
    """(jax's private cuDNN attention module, the backward primitive's
    operand names, its attribute names), or None: no such module, or an API
    these blocks do not know."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
        fwd = inspect.signature(fa.dot_product_attention).parameters
        names = list(inspect.signature(fa._dot_product_attention_bwd_impl).parameters)
        fa._dot_product_attention_bwd_p_wrapper  # noqa: B018 - present or AttributeError
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    if "return_residual" not in fwd or "scale" not in names:
        return None
    operands, attrs = names[:names.index("scale")], names[names.index("scale"):]
    if set(operands) - _BWD_UNUSED - _BWD_GIVEN or set(attrs) - _BWD_ATTRS:
        return None
    return fa, tuple(operands), tuple(attrs)


def cudnn_blocks_available() -> bool:
    """Whether cuDNN's attention blocks can run here: `cudnn_available` and
    a jax whose private cuDNN module has the API `cudnn_block` and
    `cudnn_block_bwd` bind."""
    return cudnn_available() and _cudnn_module() is not None


def cudnn_block(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool):
    """cuDNN's attention of q [B, T, Hq, D] to one K/V block [B, S, Hkv, D]
    (causal: top-left aligned): (out in q's dtype, log-sum-exp [B, Hq, T]
    fp32, natural log of the scaled scores). Traces only where
    `cudnn_blocks_available`; CUDA only."""
    fa, _, _ = _cudnn_module()
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    out, lse = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, qkv_layout="BTNH",
                                        return_residual=True)
    return out, lse.astype(jax.numpy.float32)


def cudnn_block_bwd(q, k, v, out, lse, dout, *, scale: float, causal: bool):
    """cuDNN's attention backward of one block with the given statistics:
    `out` and `lse` [B, Hq, T] are the final output and log-sum-exp of these
    query rows over every block, so (dq, dk, dv), in the inputs' dtypes, are
    this block's share of the gradients (dq summed over blocks gives the
    whole dq; dk, dv are the block's, summed over the query rows). Same
    conditions as `cudnn_block`."""
    fa, operands, attr_names = _cudnn_module()
    empty = jax.numpy.zeros(0, q.dtype)
    given = {"query": q, "key": k, "value": v, "activation": lse.astype(jax.numpy.float32),
             "fwd_output": out.astype(q.dtype), "grad_output": dout.astype(q.dtype)}
    attrs = dict(scale=float(scale), seed=42, dropout_rate=0.0, variadic_args=(False, False),
                 mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK,
                 layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        *(given.get(nm, empty) for nm in operands), **{a: attrs[a] for a in attr_names})
    return grads[0], grads[1], grads[2]
