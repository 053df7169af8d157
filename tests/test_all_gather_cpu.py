"""pk_jax.all_gather on 8 fake CPU devices: semantics, types, gradients and
input checks (the reference path and the primitive's plumbing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax._compat import varying_axes
from pk_jax._warnings import PkJaxFallbackWarning
from conftest import cpu_mesh


def _gather_both(mesh, spec, fn_kwargs, x, names):
    def run(gather):
        f = jax.shard_map(lambda a: gather(a, names, **fn_kwargs), mesh=mesh,
                          in_specs=spec, out_specs=spec, check_vma=False)
        return np.asarray(jax.jit(f)(x))
    return run(pk_jax.all_gather), run(lax.all_gather)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.bfloat16, jnp.float32, jnp.int64])
@pytest.mark.parametrize("axis,tiled", [(0, False), (0, True), (1, True), (2, False), (-1, False)])
def test_matches_lax_all_gather(rng, dtype, axis, tiled):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    with jax.enable_x64(True) if dtype == jnp.int64 else _null():
        x = jnp.asarray(rng.integers(0, 200, size=(8, 12, 3)), dtype=dtype)
        ours, ref = _gather_both(mesh, P("x", "y"), dict(axis=axis, tiled=tiled), x, "y")
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("names", [("x", "y"), ("y", "x")])
def test_tuple_axes(rng, names):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    x = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
    ours, ref = _gather_both(mesh, P("x", "y"), dict(tiled=True), x, names)
    np.testing.assert_array_equal(ours, ref)


def test_result_keeps_varying_axes(rng):
    mesh = cpu_mesh((8,), ("x",))
    seen = {}

    def body(a):
        ours, ref = pk_jax.all_gather(a, "x"), lax.all_gather(a, "x")
        seen["ours"], seen["ref"] = jax.typeof(ours), jax.typeof(ref)
        seen["axes"] = varying_axes(ours)
        return ours

    x = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    assert seen["ours"] == seen["ref"]
    assert seen["axes"] == frozenset({"x"})


@pytest.mark.parametrize("n", [3, 4, 8])
def test_rings_of_other_sizes(rng, n):
    mesh = cpu_mesh((n,), ("x",))
    x = jnp.asarray(rng.standard_normal((n * 5, 3)), jnp.float32)
    ours, ref = _gather_both(mesh, P("x"), dict(axis=1, tiled=False), x, "x")
    np.testing.assert_array_equal(ours, ref)


def test_gradient_matches_lax(rng):
    mesh = cpu_mesh((8,), ("x",))
    x = jax.device_put(jnp.asarray(rng.standard_normal((16, 5)), jnp.float32),
                       NamedSharding(mesh, P("x")))
    w = jnp.asarray(rng.standard_normal((16 * 8 // 8, 5)), jnp.float32)

    def loss(gather, a):
        f = jax.shard_map(lambda s: jnp.sin(gather(s, "x", axis=1, tiled=False)) * w[:2, None, :],
                          mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return jnp.sum(f(a) ** 2)

    g_ours = jax.jit(jax.grad(lambda a: loss(pk_jax.all_gather, a)))(x)
    g_ref = jax.jit(jax.grad(lambda a: loss(lax.all_gather, a)))(x)
    np.testing.assert_allclose(g_ours, g_ref, rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(g_ref).sum()) > 0


def test_jvp_matches_lax(rng):
    mesh = cpu_mesh((4,), ("x",))
    x = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)

    def f(gather):
        return jax.shard_map(lambda a: gather(a, "x", tiled=True), mesh=mesh,
                             in_specs=P("x"), out_specs=P("x"))

    out, tan = jax.jvp(f(pk_jax.all_gather), (x,), (t,))
    out_ref, tan_ref = jax.jvp(f(lax.all_gather), (x,), (t,))
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(tan, tan_ref)


def test_repeated_calls_in_scan(rng):
    mesh = cpu_mesh((8,), ("x",))

    def step(gather):
        def body(carry, _):
            y = gather(carry, "x", tiled=True)            # [8 * m]
            r = lax.axis_index("x")
            nxt = lax.dynamic_slice_in_dim(y, ((r + 1) % 8) * carry.shape[0], carry.shape[0])
            carry = nxt * 3 + carry + 1
            return carry, y[0]
        return jax.shard_map(lambda c: lax.scan(body, c, None, length=20), mesh=mesh,
                             in_specs=P("x"), out_specs=(P("x"), P("x")))

    x = jnp.asarray(rng.integers(0, 1000, size=(8 * 4,)), jnp.uint32)
    ours = jax.jit(step(pk_jax.all_gather))(x)
    ref = jax.jit(step(lax.all_gather))(x)
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(a, b)


def test_unsupported_dtype_falls_back_with_warning(rng, monkeypatch):
    """Where kernels could run, auto warns once and takes XLA; a forced
    mechanism raises, naming the dtype."""
    monkeypatch.setattr(pk_jax.runtime, "available", lambda: True)
    monkeypatch.setattr("pk_jax._warnings._seen", set())
    mesh = cpu_mesh((2,), ("x",))
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((4, 2)) + 1j, jnp.complex128)  # 16 bytes
        with pytest.warns(PkJaxFallbackWarning, match="complex128"):
            ours, ref = _gather_both(mesh, P("x"), {}, x, "x")
        np.testing.assert_array_equal(ours, ref)
        with pytest.raises(ValueError, match="mechanism='ld_st_push'.*complex128"):
            _gather_both(mesh, P("x"), {"mechanism": "ld_st_push"}, x, "x")


def test_bad_mechanism():
    with pytest.raises(ValueError, match="mechanism must be one of"):
        pk_jax.all_gather(jnp.ones(4), "x", mechanism="nvls")


def test_bad_axis():
    mesh = cpu_mesh((2,), ("x",))
    f = jax.shard_map(lambda a: pk_jax.all_gather(a, "x", axis=3), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match="axis=3 out of range"):
        jax.jit(f)(jnp.ones((4, 2)))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(axis=None), TypeError, "axis must be an int .*None"),
    (dict(axis="0"), TypeError, "axis must be an int .*'0'"),
    (dict(axis=1.0), TypeError, "axis must be an int"),
    (dict(tiled="no"), TypeError, "tiled must be a bool"),
    (dict(num_blocks=2**31), ValueError, "num_blocks must be in 1..2147483647, got 2147483648"),
    (dict(num_blocks=0), ValueError, "num_blocks must be in 1.."),
    (dict(num_blocks=4.0), TypeError, "num_blocks must be an int"),
])
def test_bad_arguments_are_named(kw, exc, match):
    mesh = cpu_mesh((2,), ("x",))
    f = jax.shard_map(lambda a: pk_jax.all_gather(a, "x", **kw), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(exc, match=match):
        jax.jit(f)(jnp.ones((4, 2)))


def test_repeated_axis_in_a_tuple_is_named():
    mesh = cpu_mesh((2, 2), ("x", "y"))
    f = jax.shard_map(lambda a: pk_jax.all_gather(a, ("x", "y", "x")), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match="names mesh axis x more than once"):
        jax.jit(f)(jnp.ones((4, 2)))


@pytest.mark.parametrize("mechanism", ["auto", "ld_st_push", "xla"])
@pytest.mark.parametrize("shape,axis,tiled,want", [((0, 3), 0, True, (0, 3)),
                                                   ((0,), -1, True, (0,)),
                                                   ((4, 0), 1, True, (4, 0)),
                                                   ((0, 3), 0, False, (2, 0, 3))])
def test_empty_shards(mechanism, shape, axis, tiled, want):
    """Zero-size shards, also along the gathered axis (which lax refuses):
    the empty result of the right shape."""
    mesh = cpu_mesh((2,), ("x",))
    f = jax.shard_map(lambda a: pk_jax.all_gather(a, "x", axis=axis, tiled=tiled,
                                                  mechanism=mechanism),
                      mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    assert jax.jit(f)(jnp.ones(shape)).shape == want


def test_unbound_axis_name():
    """An axis the enclosing shard_map lacks, a call outside shard_map and
    None as the axis name: errors naming the op, the axis and what to do."""
    mesh = cpu_mesh((2,), ("x",))
    f = jax.shard_map(lambda a: pk_jax.all_gather(a, "nope"), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(NameError, match="pk_jax.all_gather: axis_name 'nope' is not an axis "
                       "bound here \\(the axes bound here are 'x'\\); call pk_jax.all_gather "
                       "inside jax.shard_map over a mesh with axis 'nope'"):
        jax.jit(f)(jnp.ones((4, 2)))
    with pytest.raises(NameError, match="'nope' is not an axis bound here \\(no mesh axis is "
                       "bound here: the call is not inside jax.shard_map\\); call "
                       "pk_jax.all_gather inside jax.shard_map over a mesh with axis 'nope'"):
        pk_jax.all_gather(jnp.ones((4, 2)), "nope")
    with pytest.raises(TypeError, match="pk_jax.all_gather: axis_name must name a mesh axis "
                       "\\(a str, or a tuple of them\\), got None; pk_jax.all_gather runs "
                       "inside jax.shard_map over a mesh with that axis"):
        pk_jax.all_gather(jnp.ones((4, 2)), None)
    with pytest.raises(NameError, match="axis_name 'y' is not an axis bound here"):
        jax.jit(jax.shard_map(lambda a: pk_jax.all_gather(a, ("x", "y")), mesh=mesh,
                              in_specs=P("x"), out_specs=P()))(jnp.ones((4, 2)))
    ok = jax.shard_map(lambda a: pk_jax.all_gather(a, ("x",), tiled=True), mesh=mesh,
                       in_specs=P("x"), out_specs=P(), check_vma=False)
    x = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_array_equal(jax.jit(ok)(x), x)  # a bound axis, as a tuple: gathers


def test_forced_xla_mechanism_is_lax(rng):
    mesh = cpu_mesh((4,), ("x",))
    x = jnp.asarray(rng.standard_normal((8, 2)), jnp.float32)
    f = jax.shard_map(lambda a: pk_jax.all_gather(a, "x", mechanism="xla"), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"), check_vma=False)
    hlo = jax.jit(f).lower(x).as_text()
    assert "all_gather" in hlo or "all-gather" in hlo
