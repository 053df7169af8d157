"""Small shims over JAX internals that differ between supported versions
(jax 0.10.2, the oldest supported, to 0.11.x)."""

from __future__ import annotations

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


def cudnn_takes(q: jax.Array, k: jax.Array) -> bool:
    """Whether cuDNN's fused attention (through jax.nn.dot_product_attention)
    takes these operands: bf16/fp16, a head dim that is a multiple of 8 up
    to 256, as many keys as queries."""
    half = (jax.numpy.dtype(jax.numpy.bfloat16), jax.numpy.dtype(jax.numpy.float16))
    d = q.shape[-1]
    return (jax.numpy.dtype(q.dtype) in half and 0 < d <= 256 and d % 8 == 0
            and q.shape[1] == k.shape[1] and q.shape[1] > 0)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                    is_causal: bool) -> jax.Array:
    """cuDNN's fused attention on CUDA (jax.nn.dot_product_attention with
    implementation="cudnn", its own backward included), `xla_attention`
    on every other platform. The caller checked `cudnn_takes`."""
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal, implementation="cudnn")
    other = lambda q, k, v: xla_attention(q, k, v, scale=scale, is_causal=is_causal)
    return jax.lax.platform_dependent(q, k, v, cuda=cudnn, default=other)
