"""Every fused op, compiled once and called again on fresh inputs (new buffer
addresses), against XLA. Run by tests/test_graph_update_gpu.py in a process
where XLA puts even a single custom call into a CUDA graph: each new call then
re-traces our handler and updates the instantiated graph in place, which CUDA
allows for a limited set of node changes (pk/copy_rows.h)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: helpers, conftest

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax.ops.all_reduce.primitive import KERNEL_MECHANISMS as ALL_REDUCE_MECHANISMS  # noqa: E402
from conftest import gpu_mesh, rel_err  # noqa: E402
from helpers.gpu_util import captured  # noqa: E402

CALLS = 3
SEQ = P(None, "sp")


def assert_captured(f, args, targets, what):
    """The premise of every case: XLA put each of the op's custom calls
    (`targets`) into a command buffer of f's compiled module (else a new
    call runs the handler and there is no graph to update)."""
    found = captured(f.lower(*args)).targets
    missing = set(targets) - found
    assert not missing, f"{what}: {sorted(missing)} not in a command buffer ({sorted(found)})"


def _fresh_calls(f, draw, check, what, targets):
    """f compiled once, called CALLS times on new inputs; every earlier result
    stays alive, so no call gets the previous call's buffers back. The
    custom calls `targets` must be in a command buffer."""
    rng = np.random.default_rng()
    kept = []
    for i in range(CALLS):
        args = draw(rng)
        if i == 0:
            assert_captured(f, args, targets, what)
        out = f(*args)
        kept.append((args, out))
        check(args, out, f"{what}, call {i}")
    pk_jax.check_errors()


def check_ring(mesh, *, mechanism="copy_engine", grad=False):
    """Causal zigzag ring attention (B = 2, so every piece copy spans two
    batch rows), its output or its (dq, dk, dv), against fp32 XLA."""
    n, b, s, hq, hkv, d, bf16 = mesh.size, 2, mesh.size * 512, 8, 2, 128, jnp.bfloat16
    sharding = NamedSharding(mesh, SEQ)
    ring = jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True, layout="zigzag",
                                              mechanism=mechanism),
        mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    loss = lambda attend, w: lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * w)

    def draw(rng):
        shapes = [(b, s, h, d) for h in (hq, hkv, hkv)] + [(b, s, hq, d)]
        q, k, v, w = (rng.standard_normal(sh, np.float32) for sh in shapes)
        z = lambda a, dt: jax.device_put(pk_jax.zigzag_shard(jnp.asarray(a, dt), n), sharding)
        return z(q, bf16), z(k, bf16), z(v, bf16), z(w, jnp.float32)

    if grad:
        f = jax.jit(lambda q, k, v, w: jax.grad(loss(ring, w), argnums=(0, 1, 2))(q, k, v))
        ref = jax.jit(lambda q, k, v, w: jax.grad(loss(plain, w), argnums=(0, 1, 2))(q, k, v))
    else:
        f = jax.jit(lambda q, k, v, w: ring(q, k, v))
        ref = jax.jit(lambda q, k, v, w: (plain(q, k, v),))

    def check(args, out, what):  # in natural order, on the first GPU
        natural = lambda a: jax.device_put(pk_jax.zigzag_unshard(a, n), mesh.devices.flat[0])
        args = [natural(a) for a in args]
        out = [natural(o) for o in (out if grad else (out,))]
        exact = ref(*(a.astype(jnp.float32) for a in args[:3]), args[3])
        same = ref(*args)
        for g, e, h in zip(out, exact, same):
            err, base = rel_err(g, e), rel_err(h, e)
            assert np.isfinite(err) and err <= 2 * base + 5e-3, f"{what}: {err:.3g} vs {base:.3g}"

    targets = {"pk_ring_attention"} | ({"pk_ring_attention_bwd"} if grad else set())
    _fresh_calls(f, draw, check, f"ring {mechanism}" + (" grad" if grad else ""), targets)


def check_all_gather(mesh, mechanism):
    """Gather along axis 1 of [4, m] blocks: four rows per rank block."""
    f = jax.jit(jax.shard_map(
        lambda x: pk_jax.all_gather(x, "x", axis=1, tiled=True, mechanism=mechanism),
        mesh=mesh, in_specs=P(None, "x"), out_specs=P(None, "x"), check_vma=False))
    ref = jax.jit(jax.shard_map(lambda x: lax.all_gather(x, "x", axis=1, tiled=True),
                                mesh=mesh, in_specs=P(None, "x"), out_specs=P(None, "x"),
                                check_vma=False))
    draw = lambda rng: (jax.device_put(
        rng.integers(0, 2**32, size=(4, mesh.size * 4096), dtype=np.uint32),
        NamedSharding(mesh, P(None, "x"))),)

    def check(args, out, what):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref(*args)), err_msg=what)

    _fresh_calls(f, draw, check, f"all_gather {mechanism}", {"pk_all_gather"})


def check_tp(mesh):
    """all_gather_matmul then matmul_reduce_scatter, against fp32 XLA."""
    put = lambda a, s: jax.device_put(jnp.asarray(a, jnp.bfloat16), NamedSharding(mesh, s))
    specs = (P("x"), P(None, "x"), P("x", None))

    def body(x, w1, w2):
        h = pk_jax.all_gather_matmul(x, w1, "x", mechanism="chunked")
        return pk_jax.matmul_reduce_scatter(h, w2, "x", mechanism="chunked")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x")))
    draw = lambda rng: (put(rng.standard_normal((1024, 512)), specs[0]),
                        put(rng.standard_normal((512, 1024)) / 22, specs[1]),
                        put(rng.standard_normal((1024, 512)) / 32, specs[2]))

    def check(args, out, what):
        x, w1, w2 = (np.asarray(a, np.float64) for a in args)
        exact = (x @ w1) @ w2
        err = rel_err(out, exact)
        assert err <= 2e-2, f"{what}: rel err {err:.3g}"

    _fresh_calls(f, draw, check, "all_gather_matmul + matmul_reduce_scatter",
                 {"pk_all_gather_matmul", "pk_matmul_reduce_scatter"})


def check_matmul_all_reduce(mesh, mechanism):
    """psum(x @ w) against fp32 XLA; chunked: 2048 rows per rank, two pieces
    pushed from the side stream."""
    put = lambda a, s: jax.device_put(jnp.asarray(a, jnp.bfloat16), NamedSharding(mesh, s))
    specs = (P(None, "x"), P("x", None))
    f = jax.jit(jax.shard_map(
        lambda x, w: pk_jax.matmul_all_reduce(x, w, "x", mechanism=mechanism),
        mesh=mesh, in_specs=specs, out_specs=P()))
    draw = lambda rng: (put(rng.standard_normal((4096, 1024)), specs[0]),  # 2 pieces
                        put(rng.standard_normal((1024, 512)) / 32, specs[1]))

    def check(args, out, what):
        x, w = (np.asarray(a, np.float64) for a in args)
        err = rel_err(out, x @ w)
        assert err <= 1e-2, f"{what}: rel err {err:.3g}"

    _fresh_calls(f, draw, check, f"matmul_all_reduce {mechanism}", {"pk_matmul_all_reduce"})


if __name__ == "__main__":
    mesh, sp = gpu_mesh(2), gpu_mesh(2, "sp")
    checks = [("ring copy_engine", lambda: check_ring(sp)),
              ("ring ld_st", lambda: check_ring(sp, mechanism="ld_st")),
              ("ring grad", lambda: check_ring(sp, grad=True)),
              ("all_gather copy_engine", lambda: check_all_gather(mesh, "copy_engine")),
              ("all_gather ld_st_push", lambda: check_all_gather(mesh, "ld_st_push")),
              ("tp matmuls", lambda: check_tp(mesh)),
              ("matmul_all_reduce chunked", lambda: check_matmul_all_reduce(mesh, "chunked")),
              ("matmul_all_reduce one_shot", lambda: check_matmul_all_reduce(mesh, "one_shot"))]
    from helpers.all_reduce_checks import check_fresh_buffers
    checks += [(f"all_reduce {m}", lambda m=m: check_fresh_buffers(mesh, m))
               for m in ALL_REDUCE_MECHANISMS]
    failed = []
    for name, run in checks:
        try:
            run()
            print(f"OK {name}", flush=True)
        except Exception as e:  # report every case, then fail
            failed.append(name)
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:600]}", flush=True)
    print("SUBPROCESS_OK" if not failed else f"SUBPROCESS_FAILED {failed}")
