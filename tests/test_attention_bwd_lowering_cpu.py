"""The ring backward's kernels, checked on a CPU-only machine: cross-lowered
for CUDA the backward is one fused pk_ring_attention_bwd call (rings of 2 or
more) with its attributes and channel, or, with the XLA transport, one
pk_attention_block_bwd call per ring step with their attributes and traced
ranks; the CPU lowerings are the reference's; kernel_problem names what the
block kernel does not take."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _channels, reference, runtime, tuning
from pk_jax._warnings import PkJaxFallbackWarning
from pk_jax.ops.ring_attention.attention_bwd_primitive import block_bwd, kernel_problem
from pk_jax.ops.ring_attention import bwd_primitive as ring_bwd
from pk_jax.ops.ring_attention.primitive import RingConfig
from conftest import cpu_mesh, ffi_attr


def _block_calls(hlo):
    """(attributes, operand and result types) of each kernel call."""
    return re.findall(r"custom_call @pk_attention_block_bwd\(.*?\{(.*?)\}, operand_layouts.*"
                      r"\} : (\(.*)$", hlo, flags=re.M)


def _grad_hlo(mechanism, layout, shape=(1, 2 * 512, 8, 128), n=2, deterministic=False):
    mesh = cpu_mesh((n,), ("sp",))
    spec = P(None, "sp")
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    kv = jax.ShapeDtypeStruct(shape[:2] + (2, shape[3]), jnp.bfloat16,
                              sharding=NamedSharding(mesh, spec))

    def loss(q, k, v):
        f = jax.shard_map(lambda q, k, v: pk_jax.ring_attention(
            q, k, v, "sp", causal=True, layout=layout, scale=0.25, mechanism=mechanism,
            deterministic=deterministic),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    return grad.trace(x, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


def _fused_calls(hlo):
    """(attributes, operand and result types) of each fused backward call."""
    return re.findall(r"custom_call @pk_ring_attention_bwd\(.*?\{(.*?)\}, operand_layouts.*"
                      r"\} : (\(.*)$", hlo, flags=re.M)


@pytest.fixture
def xla_transport(monkeypatch):
    """The backward's transport as before the fused call: XLA's
    collective-permutes between block kernels."""
    monkeypatch.setattr(tuning, "RING_ATTENTION_BWD_TRANSPORT", "xla")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [2, 4])
def test_ring_backward_is_one_fused_call(cuda_lowering, layout, n):
    """copy_engine's backward on a ring of n >= 2: one pk_ring_attention_bwd
    call (the whole ring: block kernels and pk's transport) with the mask
    and scale as attributes, a channel of the ring's group with a staging
    region of the size the host sequence needs, k and v as they are (no
    stacking) and dk, dv as results, the rank table as an int32 [n]
    operand; no XLA collective and no separate block kernel call is left."""
    hlo = _grad_hlo("copy_engine", layout, shape=(1, n * 512, 8, 128), n=n)
    calls = _fused_calls(hlo)
    assert len(calls) == 1, hlo
    attrs, types = calls[0]
    assert ("zigzag = true" in attrs) == (layout == "zigzag")
    assert "causal = true" in attrs and "scale = 2.500000e-01" in attrs
    assert ffi_attr(attrs, "group_size") == str(n)
    e = 2 * 512 * 2 * 128  # K and V elements of one block
    # Two K/V slots and one fp32 partial slot, whatever n.
    assert int(ffi_attr(attrs, "data_bytes")) == _channels.size_class(8 * e)
    kv = "tensor<1x512x2x128xbf16>"
    assert f"tensor<1x8x512xf32>, {kv}, {kv}, tensor<{n}xi32>) -> (" in types
    assert f"-> (tensor<1x512x8x128xf32>, {kv}, {kv}, tensor<{512 + 10 * e}xui8>)" in types
    assert _block_calls(hlo) == [] and "concatenate" not in hlo
    assert "collective_permute" not in hlo and "all_gather" not in hlo
    # Only delta = rowsum(dO * O) is a dot left outside the kernels.
    assert hlo.count("dot_general") == 1


def test_world_size_one_keeps_the_block_kernel(cuda_lowering):
    """One rank: no ring to walk; one block kernel call on k and v as they
    are, writing dk and dv in their dtype (nothing stacked, sliced or cast
    around it)."""
    hlo = _grad_hlo("copy_engine", "zigzag", shape=(1, 512, 8, 128), n=1)
    calls = _block_calls(hlo)
    assert _fused_calls(hlo) == [] and len(calls) == 1
    kv = "tensor<1x512x2x128xbf16>"
    assert f"{kv}, {kv}, tensor<i32>, tensor<i32>) -> (" in calls[0][1]
    assert f"-> (tensor<1x512x8x128xf32>, {kv}, {kv})" in calls[0][1]
    assert "concatenate" not in hlo and "slice" not in hlo


def test_fused_backward_falls_back_when_staging_does_not_fit(cuda_lowering, monkeypatch):
    """A region larger than the workspace data area: a one-time warning and
    the XLA-collective ring of block kernels (what ran before)."""
    # Room for the forward's region (2 MiB), not for the backward's (16 MiB).
    monkeypatch.setitem(_channels._used, "data", 0)
    monkeypatch.setattr(runtime, "workspace_data_bytes", lambda: 4 << 20)
    with pytest.warns(PkJaxFallbackWarning, match="fused backward"):
        hlo = _grad_hlo("copy_engine", "zigzag", shape=(1, 2 * 2048, 8, 128))
    assert _fused_calls(hlo) == [] and len(_block_calls(hlo)) == 2
    assert "collective_permute" in hlo


def test_fused_backward_region_is_bounded_in_n():
    """The staging region does not grow with the ring: two K/V slots and
    one fp32 dK/dV slot, i.e. 8 bf16 K blocks, at n = 2, 4, 8 and 16."""
    k_shape = (1, 4096, 16, 128)
    k_block = int(np.prod(k_shape)) * 2  # bytes of one bf16 K block
    sizes = [ring_bwd.region_bytes(n, k_shape) for n in (2, 4, 8, 16)]
    assert sizes == [8 * k_block] * 4


@pytest.mark.parametrize("n", [2, 4])
def test_fused_backward_fits_the_default_workspace_at_16k(cuda_lowering, monkeypatch, n):
    """S_local = 16k, 16 K/V heads, D = 128, bf16: the forward's region and
    the fused backward's both fit the default 1 GiB workspace (n = 4: 384
    MiB -> a 512 MiB class and 512 MiB), so the backward is the fused call,
    with no fallback warning. (At n = 8 the forward's region alone, 7 K/V
    blocks = 896 MiB, takes the whole 1 GiB class.)"""
    monkeypatch.setitem(_channels._used, "data", 0)
    monkeypatch.setattr(_channels, "_regions", {})
    monkeypatch.setattr(runtime, "workspace_data_bytes", lambda: 1 << 30)
    s_local, heads, d = 16384, 16, 128
    mesh = cpu_mesh((n,), ("sp",))
    spec = P(None, "sp")
    x = jax.ShapeDtypeStruct((1, n * s_local, heads, d), jnp.bfloat16,
                             sharding=NamedSharding(mesh, spec))

    def loss(q, k, v):
        f = jax.shard_map(lambda q, k, v: pk_jax.ring_attention(
            q, k, v, "sp", causal=True, mechanism="copy_engine"),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    with warnings.catch_warnings():
        warnings.simplefilter("error", PkJaxFallbackWarning)
        hlo = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, x, x).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = _fused_calls(hlo)
    assert len(calls) == 1 and "collective_permute" not in hlo
    k_block = s_local * heads * d * 2
    assert int(ffi_attr(calls[0][0], "data_bytes")) == 8 * k_block == 512 << 20
    assert _channels._used["data"] <= 1 << 30


def test_fused_primitive_carries_the_config():
    """The jaxpr binds pk_ring_attention_bwd for the kernel mechanisms on
    rings of 2 or more (cfg.bwd_transport "pk"), not for one rank nor with
    deterministic=True."""
    def fused(n, **kw):
        f = jax.shard_map(lambda q: pk_jax.ring_attention(q, q, q, "sp", causal=True, **kw),
                          mesh=cpu_mesh((n,), ("sp",)), in_specs=P(None, "sp"),
                          out_specs=P(None, "sp"), check_vma=False)
        g = jax.grad(lambda q: jnp.sum(f(q).astype(jnp.float32)))
        jaxpr = jax.make_jaxpr(g)(jax.ShapeDtypeStruct((1, n * 256, 4, 64), jnp.bfloat16))
        return [e.params["cfg"] for j in _sub_jaxprs(jaxpr.jaxpr) for e in j.eqns
                if e.primitive.name == "pk_ring_attention_bwd"]
    (cfg,) = fused(2, mechanism="copy_engine")
    assert (cfg.bwd_transport, cfg.block_grads, cfg.n) == ("pk", "kernel", 2)
    assert fused(1, mechanism="copy_engine") == []
    assert fused(2, mechanism="copy_engine", deterministic=True) == []
    assert fused(2, mechanism="xla") == []


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_backward_calls_the_block_kernel(cuda_lowering, xla_transport, layout):
    """With the XLA transport each ring step is one pk_attention_block_bwd
    call (in the scan body, and the last step after it) with the mask, scale
    and ring size as attributes and both ranks as int32 scalar operands;
    the ppermute ring stays, and no einsum of the scores is left."""
    hlo = _grad_hlo("copy_engine", layout)
    calls = _block_calls(hlo)
    assert len(calls) == 2, hlo
    for attrs, types in calls:
        assert ("zigzag = true" in attrs) == (layout == "zigzag")
        assert "causal = true" in attrs
        assert "scale = 2.500000e-01" in attrs
        assert ffi_attr(attrs, "n") == "2"
        # K and V travel stacked (one hop each step); the kernel takes them
        # apart and writes fp32 shares, summed in ring order.
        kv = "tensor<1x512x2x128xbf16>"
        assert f"{kv}, {kv}, tensor<i32>, tensor<i32>) -> (" in types
        assert ("-> (tensor<1x512x8x128xf32>, tensor<1x512x2x128xf32>, "
                "tensor<1x512x2x128xf32>)") in types
    assert "collective_permute" in hlo and _fused_calls(hlo) == []
    # Only delta = rowsum(dO * O) is a dot left outside the kernel.
    assert hlo.count("dot_general") == 1


def _sub_jaxprs(jaxpr):
    """Every jaxpr nested in `jaxpr`'s equations (scan bodies, shard_map, pjit,
    custom_vjp), depth first, `jaxpr` included."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _sub_jaxprs(sub)


def _hops_after_kernel(jaxpr) -> tuple[int, int]:
    """(ppermutes, ppermutes that read a value downstream of a block kernel
    call) among `jaxpr`'s own equations."""
    from_kernel, hops, late = set(), 0, 0
    for eqn in jaxpr.eqns:
        tainted = eqn.primitive.name == "pk_attention_block_bwd" or any(
            not isinstance(a, jax.extend.core.Literal) and a in from_kernel for a in eqn.invars)
        if eqn.primitive.name == "ppermute":
            hops, late = hops + 1, late + tainted
        if tainted:
            from_kernel.update(eqn.outvars)
    return hops, late


@pytest.mark.parametrize("n", [2, 3, 4])
def test_backward_hops_overlap_the_block_kernel(cuda_lowering, xla_transport, n):
    """The backward ring's schedule. A scan carry must be complete at each
    iteration boundary, so a hop inside the scan body that read the body's
    block gradients would sit between two kernels. Inside the scan (steps
    1 .. n-2) every hop (the next K/V block, the incoming partial dK/dV)
    reads only the step's inputs; steps 0 and n-1 are unrolled (n = 2: no
    scan), where XLA is free to overlap the hops with the kernels."""
    mesh = cpu_mesh((n,), ("sp",))
    spec = P(None, "sp")
    shape = (1, n * 512, 8, 128)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    kv = jax.ShapeDtypeStruct(shape[:2] + (2, 128), jnp.bfloat16,
                              sharding=NamedSharding(mesh, spec))
    f = jax.shard_map(lambda q, k, v: pk_jax.ring_attention(
        q, k, v, "sp", causal=True, layout="zigzag", mechanism="copy_engine"),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))
    closed = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, kv, kv)
    kernel_calls, bodies = 0, []
    for jaxpr in _sub_jaxprs(closed.jaxpr):
        for eqn in jaxpr.eqns:
            kernel_calls += eqn.primitive.name == "pk_attention_block_bwd"
            if eqn.primitive.name == "scan" and any(
                    e.primitive.name == "pk_attention_block_bwd"
                    for e in eqn.params["jaxpr"].jaxpr.eqns):
                bodies.append(eqn.params["jaxpr"].jaxpr)
    assert kernel_calls == min(n, 3), f"{kernel_calls} block kernel calls in the jaxpr"
    assert len(bodies) == (n > 2), f"{len(bodies)} scans around the block kernel"
    for body in bodies:
        hops, late = _hops_after_kernel(body)
        assert hops == 2 and late == 0, (
            f"scan body: {hops} hops (want the stacked K/V and dK/dV), {late} read the block "
            "gradients")


def test_xla_mechanism_keeps_the_pure_jax_backward(cuda_lowering):
    hlo = _grad_hlo("xla", "zigzag")
    assert _block_calls(hlo) == [] and _fused_calls(hlo) == []
    assert hlo.count("dot_general") > 1


def test_deterministic_keeps_the_pure_jax_backward(cuda_lowering):
    """deterministic=True: einsum block gradients in the ring's fixed order,
    never the block kernel."""
    hlo = _grad_hlo("copy_engine", "zigzag", deterministic=True)
    assert _block_calls(hlo) == [] and _fused_calls(hlo) == []
    assert hlo.count("dot_general") > 1


def test_deterministic_must_be_a_bool():
    f = jax.shard_map(lambda q: pk_jax.ring_attention(q, q, q, "sp", deterministic="yes"),
                      mesh=cpu_mesh((2,), ("sp",)), in_specs=P(None, "sp"),
                      out_specs=P(None, "sp"), check_vma=False)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
def test_cpu_lowering_is_block_grads(rng, layout, hq, hkv):
    """On CPU the primitive is the reference's block gradients."""
    n, b, s, d = 4, 2, 256, 64
    cfg = RingConfig(names=(), n=n, causal=True, scale=0.125, layout=layout,
                     mechanism="copy_engine", block_grads="kernel")
    f32 = jnp.float32
    draw = lambda shape, dt=jnp.bfloat16: jnp.asarray(rng.standard_normal(shape), dt)
    q, do = draw((b, s, hq, d)), draw((b, s, hq, d))
    k, v = draw((b, s, hkv, d)), draw((b, s, hkv, d))
    lse, delta = (draw((b, hq, s), f32) + 4 for _ in range(2))
    for (q_rank, k_rank), grad_dtype in zip(((1, 0), (2, 2), (0, 3)),
                                            (f32, jnp.bfloat16, f32)):
        got = jax.jit(lambda *a: block_bwd(*a, cfg, grad_dtype))(
            q, do, lse, delta, k, v, jnp.int32(q_rank), jnp.int32(k_rank))
        dq, dk, dv = reference.attention_block_grads(
            q, do, lse, delta, k, v, reference.positions(jnp.int32(q_rank), n, s, layout),
            reference.positions(jnp.int32(k_rank), n, s, layout), causal=True, scale=0.125)
        for a, w, dtype in zip(got, (dq, dk, dv), (f32, grad_dtype, grad_dtype)):
            assert a.dtype == dtype and a.shape == w.shape
            tol = 2e-4 if dtype == f32 else 2e-2
            np.testing.assert_allclose(np.asarray(a, f32), np.asarray(w), rtol=tol, atol=tol)


def test_block_bwd_refuses_other_gradient_dtypes():
    cfg = RingConfig(names=(), n=1, causal=False, scale=0.125, layout="contiguous",
                     mechanism="copy_engine", block_grads="kernel")
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="grad_dtype must be float32 or k's dtype"):
        block_bwd(x, x, lse, lse, x, x, 0, 0, cfg, jnp.float16)


@pytest.mark.parametrize("q_shape,k_shape,dtype,layout,what", [
    ((1, 256, 4, 64), (1, 256, 4, 64), jnp.float32, "contiguous", "dtype float32"),
    ((1, 256, 4, 96), (1, 256, 4, 96), jnp.bfloat16, "contiguous", "head_dim 96"),
    ((1, 256, 6, 64), (1, 256, 4, 64), jnp.bfloat16, "contiguous", "not a multiple"),
    ((1, 200, 4, 128), (1, 256, 4, 128), jnp.bfloat16, "contiguous", "S=200"),
    ((1, 256, 4, 64), (1, 192, 4, 64), jnp.float16, "contiguous", "T=192"),
    ((1, 128, 4, 64), (1, 256, 4, 64), jnp.bfloat16, "zigzag", "S=128"),
    ((1, 128, 4, 128), (1, 128, 4, 128), jnp.bfloat16, "zigzag", "T=128"),
])
def test_kernel_problem_names_the_reason(q_shape, k_shape, dtype, layout, what):
    q, k = jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(k_shape, dtype)
    assert what in kernel_problem(q, k, layout)


def test_kernel_problem_takes_the_forward_shapes():
    for d, s, layout in ((128, 64, "contiguous"), (64, 128, "contiguous"), (128, 256, "zigzag"),
                         (64, 512, "zigzag")):
        kv = 128 * (2 if layout == "zigzag" else 1)
        q = jax.ShapeDtypeStruct((2, s, 8, d), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((2, max(kv, s), 1, d), jnp.bfloat16)
        assert kernel_problem(q, k, layout) is None
