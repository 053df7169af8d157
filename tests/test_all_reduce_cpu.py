"""pk_jax.all_reduce / pk_jax.reduce_scatter on 8 fake CPU devices: values
against lax.psum / lax.psum_scatter, types, gradients, scans, input checks,
and the CUDA lowering (cross-lowered: the custom call and its attributes)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import tuning
from pk_jax._warnings import PkJaxFallbackWarning
from pk_jax.ops.all_reduce import MECHANISMS
from conftest import cpu_mesh, ffi_attr

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32]


def _data(rng, shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-1000, 1000, size=shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _run(mesh, fn, x, in_spec, out_spec, check_vma=True):
    x = jax.device_put(x, NamedSharding(mesh, in_spec))
    f = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma)
    return np.asarray(jax.jit(f)(x).astype(jnp.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_all_reduce_matches_psum(rng, sharding_mode, dtype, mechanism):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    x = _data(rng, (8, 12, 3), dtype)
    ours = _run(mesh, lambda a: pk_jax.all_reduce(a, "y", mechanism=mechanism), x,
                P("x", "y"), P("x"))
    ref = _run(mesh, lambda a: lax.psum(a, "y"), x, P("x", "y"), P("x"))
    np.testing.assert_array_equal(ours, ref)
    # and the math: the sum of the four column blocks
    blocks = np.asarray(x.astype(jnp.float32)).reshape(8, 4, 3, 3).sum(axis=1)
    np.testing.assert_allclose(ours, blocks, rtol=2e-2 if dtype != jnp.float32 else 1e-5,
                               atol=5e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("dim,tiled", [(0, True), (1, True), (2, False), (-1, False)])
def test_reduce_scatter_matches_psum_scatter(rng, sharding_mode, dtype, mechanism, dim, tiled):
    mesh = cpu_mesh((8,), ("x",))
    x = _data(rng, (64, 8, 8), dtype)
    fn = lambda a: pk_jax.reduce_scatter(a, "x", scatter_dimension=dim, tiled=tiled,
                                         mechanism=mechanism)
    ref_fn = lambda a: lax.psum_scatter(a, "x", scatter_dimension=dim % 3, tiled=tiled)
    ours = _run(mesh, fn, x, P("x"), P("x"))
    ref = _run(mesh, ref_fn, x, P("x"), P("x"))
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_earlier_one_shot_name_is_deprecated(rng, op):
    """"ld_st_oneshot" (the name before "one_shot") still works, with a
    DeprecationWarning, and binds the same config as "one_shot"."""
    mesh = cpu_mesh((8,), ("x",))
    x = _data(rng, (64, 8), jnp.float32)
    fn = lambda m: lambda a: getattr(pk_jax, op)(a, "x", mechanism=m)
    with pytest.warns(DeprecationWarning, match="'ld_st_oneshot' is deprecated, use 'one_shot'"):
        old = jax.make_jaxpr(jax.shard_map(fn("ld_st_oneshot"), mesh=mesh, in_specs=P("x"),
                                           out_specs=P("x"), check_vma=False))(x)
    new = jax.make_jaxpr(jax.shard_map(fn("one_shot"), mesh=mesh, in_specs=P("x"),
                                       out_specs=P("x"), check_vma=False))(x)
    assert str(old) == str(new) and "one_shot" in str(new)


@pytest.mark.parametrize("names", [("x", "y"), ("y", "x")])
def test_tuple_axes(rng, names):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    x = _data(rng, (8, 64), jnp.float32)
    ours = _run(mesh, lambda a: pk_jax.reduce_scatter(a, names, scatter_dimension=1), x,
                P("x", "y"), P("x", "y"))
    ref = _run(mesh, lambda a: lax.psum_scatter(a, names, scatter_dimension=1, tiled=True), x,
               P("x", "y"), P("x", "y"))
    np.testing.assert_array_equal(ours, ref)
    ours = _run(mesh, lambda a: pk_jax.all_reduce(a, names), x, P("x", "y"), P())
    ref = _run(mesh, lambda a: lax.psum(a, names), x, P("x", "y"), P())
    np.testing.assert_array_equal(ours, ref)


def test_invariant_input_is_summed_n_times(rng):
    """psum of a value replicated over the axis is n times it (lax's rule)."""
    mesh = cpu_mesh((4,), ("x",))
    x = _data(rng, (6,), jnp.float32)
    ours = _run(mesh, lambda a: pk_jax.all_reduce(a, "x"), x, P(), P())
    np.testing.assert_array_equal(ours, 4 * np.asarray(x))


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_result_types_match_lax(rng, op):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seen = {}

    def body(a):
        if op == "all_reduce":
            ours, ref = pk_jax.all_reduce(a, "y"), lax.psum(a, "y")
        else:
            ours = pk_jax.reduce_scatter(a, "y", scatter_dimension=1)
            ref = lax.psum_scatter(a, "y", scatter_dimension=1, tiled=True)
        seen["ours"], seen["ref"] = jax.typeof(ours), jax.typeof(ref)
        return ours

    x = _data(rng, (8, 16), jnp.float32)
    out_spec = P("x") if op == "all_reduce" else P("x", "y")
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=out_spec))(x)
    assert seen["ours"] == seen["ref"]


# (check_vma, P("x")) is no program: an invariant result cannot be out_specs P("x").
@pytest.mark.parametrize("check_vma,out_spec", [(True, P()), (False, P()), (False, P("x"))])
def test_all_reduce_gradient_matches_psum(rng, check_vma, out_spec):
    mesh = cpu_mesh((8,), ("x",))
    x = jax.device_put(_data(rng, (16, 5), jnp.float32), NamedSharding(mesh, P("x")))
    w = _data(rng, (2, 5), jnp.float32)

    def loss(reduce):
        f = jax.shard_map(lambda a: reduce(a * a, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=out_spec, check_vma=check_vma)
        return lambda a: jnp.sum(jnp.sin(f(a)) * jnp.tile(w, (f(a).shape[0] // 2, 1)))

    ours = jax.jit(jax.grad(loss(pk_jax.all_reduce)))(x)
    ref = jax.jit(jax.grad(loss(lax.psum)))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dim,tiled", [(0, True), (1, False)])
def test_reduce_scatter_gradient_matches_psum_scatter(rng, check_vma, dim, tiled):
    mesh = cpu_mesh((8,), ("x",))
    x = jax.device_put(_data(rng, (64, 8), jnp.float32), NamedSharding(mesh, P("x")))

    def loss(reduce):
        f = jax.shard_map(lambda a: reduce(a * a, "x", dim, tiled), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"), check_vma=check_vma)
        return lambda a: jnp.sum(jnp.cos(f(a)) * jnp.arange(f(a).size).reshape(f(a).shape))

    ours_fn = lambda a, n, d, t: pk_jax.reduce_scatter(a, n, scatter_dimension=d, tiled=t)
    ref_fn = lambda a, n, d, t: lax.psum_scatter(a, n, scatter_dimension=d, tiled=t)
    ours = jax.jit(jax.grad(loss(ours_fn)))(x)
    ref = jax.jit(jax.grad(loss(ref_fn)))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6, atol=1e-5)


def test_jvp_matches_psum(rng):
    mesh = cpu_mesh((4,), ("x",))
    x = jax.device_put(_data(rng, (8, 3), jnp.float32), NamedSharding(mesh, P("x")))
    t = jax.device_put(_data(rng, (8, 3), jnp.float32), NamedSharding(mesh, P("x")))
    f = lambda r: jax.shard_map(lambda a: r(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    out, tan = jax.jvp(f(pk_jax.all_reduce), (x,), (t,))
    out_ref, tan_ref = jax.jvp(f(lax.psum), (x,), (t,))
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(tan, tan_ref)


def test_1000_calls_in_scan(rng):
    mesh = cpu_mesh((4,), ("x",))

    def step(reduce, scatter):
        def body(carry, _):
            s = reduce(carry, "x")                       # replicated sum
            part = scatter(carry * 2, "x")               # our quarter of 2 * sum
            r = lax.axis_index("x")
            carry = (carry + lax.dynamic_slice_in_dim(s, 0, carry.shape[0])
                     + jnp.tile(part, 4)[: carry.shape[0]] + r) % 1009
            return carry, s[0]
        return jax.shard_map(lambda c: lax.scan(body, c, None, length=1000), mesh=mesh,
                             in_specs=P("x"), out_specs=(P("x"), P()), check_vma=False)

    x = jnp.asarray(rng.integers(0, 1000, size=(4 * 8,)), jnp.int32)
    ours = jax.jit(step(pk_jax.all_reduce,
                        lambda a, n: pk_jax.reduce_scatter(a, n)))(x)
    ref = jax.jit(step(lax.psum, lambda a, n: lax.psum_scatter(a, n, tiled=True)))(x)
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(a, b)


def test_unsupported_dtype_falls_back_with_warning(rng, monkeypatch):
    """Where kernels could run, every mechanism warns once and takes lax."""
    monkeypatch.setattr(pk_jax.runtime, "available", lambda: True)
    monkeypatch.setattr("pk_jax._warnings._seen", set())
    mesh = cpu_mesh((2,), ("x",))
    x = jnp.asarray(rng.integers(-50, 50, size=(4, 2)), jnp.int8)
    with pytest.warns(PkJaxFallbackWarning, match="int8"):
        ours = _run(mesh, lambda a: pk_jax.all_reduce(a, "x", mechanism="two_shot"), x,
                    P("x"), P())
    np.testing.assert_array_equal(ours, _run(mesh, lambda a: lax.psum(a, "x"), x, P("x"), P()))
    with pytest.warns(PkJaxFallbackWarning, match="reduce_scatter.*int8"):
        _run(mesh, lambda a: pk_jax.reduce_scatter(a, "x"), x, P("x"), P("x"))


def test_bool_is_summed_as_int32_like_psum():
    mesh = cpu_mesh((2,), ("x",))
    x = jnp.asarray([True, False, True, True])
    ours = _run(mesh, lambda a: pk_jax.all_reduce(a, "x"), x, P("x"), P())
    np.testing.assert_array_equal(ours, _run(mesh, lambda a: lax.psum(a, "x"), x, P("x"), P()))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(mechanism="nvls"), ValueError, "mechanism must be one of"),
    (dict(scatter_dimension=2), ValueError, "scatter_dimension=2 out of range"),
    (dict(scatter_dimension=True), TypeError, "scatter_dimension must be an int"),
    (dict(scatter_dimension=0.0), TypeError, "scatter_dimension must be an int.*0.0"),
    (dict(tiled="yes"), TypeError, "tiled must be a bool"),
    (dict(scatter_dimension=1), ValueError, "scatter_dimension=1 has size 3, not a multiple"),
    (dict(scatter_dimension=0, tiled=False), ValueError,
     "scatter_dimension=0 has size 4; tiled=False"),
])
def test_reduce_scatter_bad_arguments(kwargs, exc, match):
    mesh = cpu_mesh((2,), ("x",))
    f = jax.shard_map(lambda a: pk_jax.reduce_scatter(a, "x", **kwargs), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(exc, match=match):
        jax.jit(f)(jnp.ones((8, 3)))


@pytest.mark.parametrize("shape,tiled,want", [((0, 3), True, (0, 3)), ((2, 0), False, (0,)),
                                              ((4, 0), True, (2, 0))])
def test_reduce_scatter_of_empty_arrays(shape, tiled, want):
    """An empty x gives the empty chunk (lax refuses some of these shapes)."""
    mesh = cpu_mesh((2,), ("x",))
    f = jax.shard_map(lambda a: pk_jax.reduce_scatter(a, "x", tiled=tiled), mesh=mesh,
                      in_specs=P(), out_specs=P("x"))
    out = jax.jit(f)(jnp.ones(shape))
    assert out.shape == (want[0] * 2,) + want[1:]  # the chunks of 2 devices


def test_all_reduce_bad_mechanism():
    with pytest.raises(ValueError, match="all_reduce: mechanism must be one of"):
        pk_jax.all_reduce(jnp.ones(4), "x", mechanism="chunked")  # a matmul_all_reduce mechanism


def test_unbound_axis_name():
    mesh = cpu_mesh((2,), ("x",))
    f = jax.shard_map(lambda a: pk_jax.all_reduce(a, "nope"), mesh=mesh,
                      in_specs=P("x"), out_specs=P())
    with pytest.raises(NameError, match="nope"):
        jax.jit(f)(jnp.ones((4, 2)))


def test_auto_table_is_the_provisional_one():
    assert tuning.all_reduce_mechanism("all_reduce", 8 << 10) == "one_shot"
    assert tuning.all_reduce_mechanism("all_reduce", 256 << 10) == "one_shot"
    assert tuning.all_reduce_mechanism("all_reduce", (256 << 10) + 1) == "two_shot"
    assert tuning.all_reduce_mechanism("reduce_scatter", 8 << 10) == "two_shot"


# ---- the CUDA lowering, cross-lowered on CPU --------------------------------------
def _calls(hlo):
    return re.findall(r"custom_call @pk_all_reduce\(.*?\{(.*?)\}, operand_layouts", hlo)


def _slot(call, which):
    body = re.search(which + r" = \{(.*?)\}", call).group(1)
    return int(re.search(r"slot = (\d+)", body).group(1))


def _lower(fn, mesh, in_spec, out_spec, shape, dtype=jnp.float32, check_vma=False):
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, in_spec))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                              check_vma=check_vma))
    return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mechanism,mech_id,kbytes", [
    ("auto", 0, 4), ("auto", 1, 1024), ("one_shot", 0, 4), ("two_shot", 1, 4),
    ("copy_engine", 2, 4)])
def test_all_reduce_custom_call(cuda_lowering, mechanism, mech_id, kbytes):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    elems = kbytes * 1024 // 2  # bf16, per device
    hlo = _lower(lambda a: pk_jax.all_reduce(a, "y", mechanism=mechanism), mesh, P("y"), P(),
                 (4 * elems,), jnp.bfloat16, check_vma=True)
    assert "stablehlo.all_reduce" not in hlo
    call, = _calls(hlo)
    assert ffi_attr(call, "group_ids") == "dense<[0, 1, 2, 3, 4, 5, 6, 7]>"
    assert ffi_attr(call, "group_size") == "4"
    assert ffi_attr(call, "kind") == "0" and ffi_attr(call, "mechanism") == str(mech_id)
    assert ffi_attr(call, "rows") == "1" and ffi_attr(call, "stride") == str(elems)
    assert ffi_attr(call, "chunk") == str(-(-elems // 4 // 8) * 8)  # 16-byte chunks
    first = int(re.search(r"channel = \{.*?data_bytes = (\d+)", call).group(1))
    if mech_id == 0:
        assert first >= 4 * elems * 2  # n slots of the whole block
        assert _slot(call, "channel2") == _slot(call, "channel")  # unused
    else:
        assert first >= 4 * elems // 4 * 2
        assert _slot(call, "channel2") != _slot(call, "channel")


def test_reduce_scatter_custom_call(cuda_lowering):
    mesh = cpu_mesh((8,), ("x",))
    hlo = _lower(lambda a: pk_jax.reduce_scatter(a, "x", scatter_dimension=1), mesh, P("x"),
                 P("x"), (16, 24, 5))
    assert "stablehlo.reduce_scatter" not in hlo
    call, = _calls(hlo)
    # local [2, 24, 5] f32, scattered along 1: 2 rows of 8 chunks of 3 x 5
    assert ffi_attr(call, "kind") == "1" and ffi_attr(call, "mechanism") == "1"
    assert ffi_attr(call, "rows") == "2" and ffi_attr(call, "stride") == "120"
    assert ffi_attr(call, "chunk") == "15"
    assert "tensor<2x3x5xf32>" in hlo


def test_mechanisms_get_their_own_channels(cuda_lowering):
    mesh = cpu_mesh((8,), ("x",))

    def body(a):
        return (pk_jax.all_reduce(a, "x", mechanism="two_shot")
                + pk_jax.all_reduce(a, "x", mechanism="copy_engine")
                + pk_jax.all_reduce(a, "x", mechanism="two_shot"))

    hlo = _lower(body, mesh, P("x"), P("x"), (64,))
    calls = _calls(hlo)
    assert len(calls) == 3
    slots = [(_slot(c, "channel"), _slot(c, "channel2")) for c in calls]
    assert slots[0] == slots[2] and len(set(slots[0] + slots[1])) == 4


def test_gradients_lower_to_kernels(cuda_lowering):
    """reduce_scatter's transpose is pk's all_gather; unchecked psum's is psum."""
    mesh = cpu_mesh((8,), ("x",))
    x = jax.ShapeDtypeStruct((64, 4), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    f = jax.shard_map(lambda a: pk_jax.all_reduce(pk_jax.reduce_scatter(a, "x"), "x"),
                      mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    g = jax.jit(jax.grad(lambda a: jnp.sum(f(a) ** 2)))
    hlo = g.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_calls(hlo)) == 3  # forward pair + the backward all_reduce
    assert "custom_call @pk_all_gather" in hlo
    assert "stablehlo.all_reduce" not in hlo and "stablehlo.all_gather" not in hlo


def test_unsupported_dtype_lowers_to_xla(cuda_lowering, monkeypatch):
    monkeypatch.setattr("pk_jax._warnings._seen", set())
    mesh = cpu_mesh((8,), ("x",))
    with pytest.warns(PkJaxFallbackWarning):
        hlo = _lower(lambda a: pk_jax.all_reduce(a, "x"), mesh, P("x"), P("x"), (64,), jnp.int8)
    assert not _calls(hlo) and "stablehlo.all_reduce" in hlo


def test_forced_xla_is_lax(cuda_lowering):
    mesh = cpu_mesh((8,), ("x",))
    hlo = _lower(lambda a: pk_jax.all_reduce(a, "x", mechanism="xla"), mesh, P("x"), P("x"),
                 (64,))
    assert not _calls(hlo) and "stablehlo.all_reduce" in hlo


def test_custom_call_on_auto_and_explicit_meshes(cuda_lowering, sharding_mode):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    hlo = _lower(lambda a: (pk_jax.all_reduce(a, "y")
                            + jnp.tile(pk_jax.reduce_scatter(a, "y"), (4, 1))),
                 mesh, P("y"), P("y"), (32, 8), check_vma=False)
    assert len(_calls(hlo)) == 2 and "stablehlo.all_reduce" not in hlo


def test_pytrees_like_lax(rng):
    mesh = cpu_mesh((4,), ("x",))
    x = _data(rng, (32, 4), jnp.float32)
    tree = lambda a: {"a": a, "b": (a * 2, a[:, :2])}
    ours = jax.jit(jax.shard_map(lambda a: pk_jax.all_reduce(tree(a), "x"), mesh=mesh,
                                 in_specs=P("x"), out_specs=P()))(x)
    ref = jax.jit(jax.shard_map(lambda a: lax.psum(tree(a), "x"), mesh=mesh,
                                in_specs=P("x"), out_specs=P()))(x)
    jax.tree.map(np.testing.assert_array_equal, ours, ref)
    ours = jax.jit(jax.shard_map(lambda a: pk_jax.reduce_scatter(tree(a), "x", scatter_dimension=0),
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    ref = jax.jit(jax.shard_map(lambda a: lax.psum_scatter(tree(a), "x", tiled=True),
                                mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    jax.tree.map(np.testing.assert_array_equal, ours, ref)
