"""all_gather_matmul / matmul_reduce_scatter on 8 fake CPU devices: values
and gradients against the unsharded computation, shapes, and input checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err
from helpers.tp_models import mlp_loss


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _ag_fn(mesh, **kw):
    return jax.jit(jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", **kw),
                                 mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=P(None, "tp")))


def _rs_fn(mesh, **kw):
    return jax.jit(jax.shard_map(lambda x, w: pk_jax.matmul_reduce_scatter(x, w, "tp", **kw),
                                 mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                 out_specs=P("tp")))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_gather_matmul_values(rng, n, dtype):
    mesh = cpu_mesh((n,), ("tp",))
    x, w = _normal(rng, (16 * n, 24), dtype), _normal(rng, (24, 8 * n), dtype)
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert rel_err(_ag_fn(mesh)(x, w), ref) < (1e-6 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_matmul_reduce_scatter_values(rng, n):
    mesh = cpu_mesh((n,), ("tp",))
    x, w = _normal(rng, (8 * n, 16 * n)), _normal(rng, (16 * n, 24))
    out = _rs_fn(mesh)(x, w)
    assert out.shape == (8 * n, 24)
    assert rel_err(out, np.asarray(x) @ np.asarray(w)) < 1e-6


def test_batch_dims_and_gathered(rng):
    mesh = cpu_mesh((4,), ("tp",))
    x, w = _normal(rng, (8, 3, 16)), _normal(rng, (16, 32))
    f = jax.jit(jax.shard_map(
        lambda a, b: pk_jax.all_gather_matmul(a, b, "tp", return_gathered=True),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=(P(None, None, "tp"), P()),
        check_vma=False))
    out, gathered = f(x, w)
    assert out.shape == (8, 3, 32) and gathered.shape == (8, 3, 16)
    np.testing.assert_array_equal(gathered, x)
    assert rel_err(out, np.einsum("bsk,kn->bsn", x, w)) < 1e-6


def test_preferred_element_type(rng):
    mesh = cpu_mesh((2,), ("tp",))
    x, w = _normal(rng, (8, 16), jnp.bfloat16), _normal(rng, (16, 16), jnp.bfloat16)
    assert _ag_fn(mesh, preferred_element_type=jnp.float32)(x, w).dtype == jnp.float32
    assert _rs_fn(mesh, preferred_element_type=jnp.float32)(x, w).dtype == jnp.float32
    for fn in (_ag_fn, _rs_fn):
        with pytest.raises(TypeError, match="preferred_element_type must be a dtype.*'bogus'"):
            fn(mesh, preferred_element_type="bogus")(x, w)
        with pytest.raises(TypeError, match="_scatter|all_gather_matmul: preferred_element_type "
                           "must be a dtype of numbers \\(bool, integer, floating or complex, "
                           "e.g. jnp.float32\\) or None, got <class 'object'>"):
            fn(mesh, preferred_element_type=object)(x, w)
    # outside shard_map the dtype is named first, then the axis
    with pytest.raises(TypeError, match="all_gather_matmul: preferred_element_type.*object"):
        pk_jax.all_gather_matmul(x, w, "tp", preferred_element_type=object)
    with pytest.raises(NameError, match="pk_jax.all_gather_matmul: axis_name 'tp' is not an "
                       "axis bound here.*inside jax.shard_map over a mesh with axis 'tp'"):
        pk_jax.all_gather_matmul(x, w, "tp")


def test_mlp_pair_gradients_match_xla(rng):
    mesh = cpu_mesh((4,), ("tp",))
    x, w1, w2 = _normal(rng, (32, 16)), _normal(rng, (16, 64)), _normal(rng, (64, 16))
    grad = lambda pk: jax.jit(jax.grad(lambda *a: mlp_loss(mesh, "tp", pk, *a), (0, 1, 2)))(
        x, w1, w2)
    for ours, ref in zip(grad(True), grad(False)):
        assert rel_err(ours, ref) < 1e-5


def _gathered_output_loss(mesh, pk, x, w):
    """sum(out ** 2) + sum(cos(gathered)) in fp32, from all_gather_matmul with
    return_gathered (pk) or from XLA's all_gather and dot (fp32 accumulation,
    rounded to the input dtype)."""
    def body(x, w):
        if pk:
            out, g = pk_jax.all_gather_matmul(x, w, "tp", return_gathered=True)
        else:
            g = lax.all_gather(x, "tp", tiled=True)
            out = jnp.dot(g, w, preferred_element_type=jnp.float32).astype(g.dtype)
        return (jnp.sum(out.astype(jnp.float32) ** 2)[None]
                + jnp.sum(jnp.cos(g.astype(jnp.float32)))[None])
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp"))
    return jnp.sum(f(x, w))


def test_gradient_through_gathered_output(rng):
    mesh = cpu_mesh((4,), ("tp",))
    x, w = _normal(rng, (16, 8)), _normal(rng, (8, 16))
    loss = functools.partial(_gathered_output_loss, mesh)
    for ours, ref in zip(jax.grad(lambda *a: loss(True, *a), (0, 1))(x, w),
                         jax.grad(lambda *a: loss(False, *a), (0, 1))(x, w)):
        assert rel_err(ours, ref) < 1e-5


def test_repeated_calls_in_scan(rng):
    mesh = cpu_mesh((4,), ("tp",))
    w1, w2 = _normal(rng, (16, 32)) / 4, _normal(rng, (32, 16)) / 6

    def run(pk):
        def body(x, w1, w2):
            def step(c, _):
                if pk:
                    h = pk_jax.all_gather_matmul(c, w1, "tp")
                    return pk_jax.matmul_reduce_scatter(jnp.tanh(h), w2, "tp"), None
                h = lax.all_gather(c, "tp", tiled=True) @ w1
                return lax.psum_scatter(jnp.tanh(h) @ w2, "tp", tiled=True), None
            return lax.scan(step, x, None, length=6)[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"),
                                                                 P("tp", None)),
                                     out_specs=P("tp")))
    x = _normal(rng, (16, 16))
    assert rel_err(run(True)(x, w1, w2), run(False)(x, w1, w2)) < 1e-5


@pytest.mark.parametrize("call,match,error", [
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8)), jnp.ones((6, 8)), "tp"),
     "contraction mismatch", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 8), jnp.int32),
                                      "tp"), "floating point", TypeError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((8,)), jnp.ones((8, 8)), "tp"),
     "expected x", ValueError),
    (lambda: pk_jax.matmul_reduce_scatter(jnp.ones((3, 8)), jnp.ones((8, 8)), "tp"),
     "must divide", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((0, 8)), jnp.ones((8, 8)), "tp"),
     "empty operands", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8)), jnp.ones((8, 8)), "tp", mechanism="nccl"),
     "mechanism must be", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8)), jnp.ones((8, 8)), "tp",
                                      mechanism="chunked"), "bf16 or fp16", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8), jnp.bfloat16),
                                      jnp.ones((8, 8), jnp.bfloat16), "tp", mechanism="fused"),
     "mechanism must be", ValueError),
    (lambda: pk_jax.matmul_reduce_scatter(jnp.ones((256, 8), jnp.bfloat16),
                                          jnp.ones((8, 8), jnp.bfloat16), "tp",
                                          mechanism="fused"), "mechanism must be", ValueError),
])
def test_bad_input(call, match, error):
    mesh = cpu_mesh((2,), ("tp",))
    f = jax.shard_map(lambda: call(), mesh=mesh, in_specs=(), out_specs=P(), check_vma=False)
    with pytest.raises(error, match=match):
        jax.jit(f)()


# ---- the backward passes: dx and dw in one call ------------------------------------
def _primitives(jaxpr) -> list[str]:
    """Every primitive's name in `jaxpr` and the jaxprs in its equations' params."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names += _primitives(inner)
    return names


def _op_grads(mesh, op, mechanism, x, w, t, **kw):
    """jax.grad of sum(op(x, w) * t), with the jaxpr it ran."""
    ag = op == "all_gather_matmul"
    specs = (P("tp"), P(None, "tp"), P(None, "tp")) if ag else (P(None, "tp"), P("tp", None),
                                                                  P("tp"))
    x, w, t = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, t), specs))
    f = jax.shard_map(lambda x, w: getattr(pk_jax, op)(x, w, "tp", mechanism=mechanism, **kw),
                      mesh=mesh, in_specs=specs[:2], out_specs=specs[2])
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t)
    g = jax.jit(jax.grad(loss, (0, 1)))
    return g(x, w), _primitives(jax.make_jaxpr(g)(x, w).jaxpr)


def _op_inputs(rng, op, n, m=12, k=16, n_cols=24):
    """bf16 x, w and an fp32 output cotangent of one op, per-rank sizes m, k, n_cols."""
    ag = op == "all_gather_matmul"
    x = _normal(rng, (n * m, k) if ag else (n * m, n * k), jnp.bfloat16)
    w = _normal(rng, (k, n * n_cols) if ag else (n * k, n_cols), jnp.bfloat16) / 4
    t = _normal(rng, (n * m, n * n_cols if ag else n_cols))
    return x, w, t


_BWD = {"all_gather_matmul": "pk_all_gather_matmul_bwd",
        "matmul_reduce_scatter": "pk_matmul_reduce_scatter_bwd"}


@pytest.mark.parametrize("op", list(_BWD))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_backward_is_one_call_computing_dx_and_dw(rng, sharding_mode, op, n):
    """bf16 operands: the backward is the op's one backward primitive (dx and
    dw, no dot left for dw), its gradients those of XLA's path on the same
    inputs and of the fp32 computation."""
    mesh = cpu_mesh((n,), ("tp",))
    x, w, t = _op_inputs(rng, op, n)
    # (one device: `auto` runs XLA's dot, test_one_device_auto_runs_xla_dot)
    (dx, dw), prims = _op_grads(mesh, op, "auto" if n > 1 else "chunked", x, w, t)
    assert prims.count(_BWD[op]) == 1 and "dot_general" not in prims, prims
    (rx, rw), ref_prims = _op_grads(mesh, op, "xla", x, w, t)
    assert _BWD[op] not in ref_prims and "dot_general" in ref_prims  # the check can fail
    (ex, ew), _ = _op_grads(mesh, op, "xla", x.astype(jnp.float32), w.astype(jnp.float32), t)
    for name, ours, xla, exact in (("dx", dx, rx, ex), ("dw", dw, rw, ew)):
        assert ours.dtype == jnp.bfloat16 and ours.shape == exact.shape, name
        assert rel_err(ours, xla) < 1e-6, name  # the same products, rounded the same
        assert rel_err(ours, exact) < 2e-2, name


@pytest.mark.parametrize("op", list(_BWD))
def test_one_device_auto_runs_xla_dot(rng, sharding_mode, op):
    """On an axis of one device `auto` runs XLA's dot forward and backward
    (tuning.single_gpu_gemm): no pk primitive, the gradients of
    mechanism="xla" bit for bit; "chunked" still runs the kernels' path."""
    mesh = cpu_mesh((1,), ("tp",))
    x, w, t = _op_inputs(rng, op, 1)
    (dx, dw), prims = _op_grads(mesh, op, "auto", x, w, t)
    (rx, rw), ref_prims = _op_grads(mesh, op, "xla", x, w, t)
    assert prims == ref_prims and "dot_general" in prims and _BWD[op] not in prims, prims
    assert np.array_equal(np.asarray(dx), np.asarray(rx))
    assert np.array_equal(np.asarray(dw), np.asarray(rw))
    _, forced = _op_grads(mesh, op, "chunked", x, w, t)
    assert forced.count(_BWD[op]) == 1, forced  # the check can fail


@pytest.mark.parametrize("op", list(_BWD))
def test_backward_falls_back_to_two_steps_for_fp32_cotangents(rng, op):
    """An fp32 output (preferred_element_type) gives an fp32 dy, which the
    kernels do not take with bf16 operands: the two-step backward (XLA's dot
    for dw), with the same gradients."""
    mesh = cpu_mesh((2,), ("tp",))
    x, w, t = _op_inputs(rng, op, 2)
    (dx, dw), prims = _op_grads(mesh, op, "auto", x, w, t, preferred_element_type=jnp.float32)
    assert _BWD[op] not in prims and "dot_general" in prims, prims
    (ex, ew), _ = _op_grads(mesh, op, "xla", x.astype(jnp.float32), w.astype(jnp.float32), t)
    assert rel_err(dx, ex) < 2e-2 and rel_err(dw, ew) < 2e-2


def test_fused_backward_through_gathered_output(rng):
    """bf16 all_gather_matmul with return_gathered: the gathered output's
    cotangent is scattered onto the fused call's dx."""
    mesh = cpu_mesh((4,), ("tp",))
    x, w = _normal(rng, (16, 16), jnp.bfloat16), _normal(rng, (16, 64), jnp.bfloat16) / 4
    loss = functools.partial(_gathered_output_loss, mesh)
    g = jax.jit(jax.grad(lambda *a: loss(True, *a), (0, 1)))
    assert "pk_all_gather_matmul_bwd" in _primitives(jax.make_jaxpr(g)(x, w).jaxpr)
    ours = g(x, w)
    ref = jax.grad(lambda *a: loss(False, *a), (0, 1))(x.astype(jnp.float32),
                                                       w.astype(jnp.float32))
    for o, r in zip(ours, ref):
        assert rel_err(o, r) < 2e-2


def test_benchmark_smoke_produces_every_row():
    """benchmarks/tp_matmul.py --smoke on 8 fake CPU devices: every op's
    rows, each checked against "xla" before timing (a row that fails the
    check is left out and named), XLA's windowed-einsum flags accepted or
    the row's absence explained, and the FP8 rows beside XLA's FP8 dots."""
    import os
    import pathlib
    import subprocess
    import sys
    bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    proc = subprocess.run([sys.executable, "tp_matmul.py", "--smoke"], cwd=bench,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0 and "SMOKE_OK" in proc.stdout, proc.stdout + proc.stderr
    assert "FAILED the check" not in proc.stdout
    rows = {tuple(c.strip() for c in line.split("|")[1:4:2])
            for line in proc.stdout.splitlines() if line.startswith("| ")}
    want = {"all_gather_matmul": {"pk", "xla", "gemm_only"},
            "matmul_reduce_scatter": {"pk", "xla", "gemm_only"},
            "matmul_all_reduce": {"pk", "pk_chunked", "pk_one_shot", "xla", "gemm_only"},
            "gemm_world_size_1": {"pk", "xla"},
            "mlp_fwd_bwd": {"pk", "xla", "gemm_only"},
            "fp8_all_gather_matmul": {"pk_fp8_current", "pk_fp8_block", "xla",
                                      "xla_fp8_dq_f32", "xla_fp8_dq_bf16", "xla_fp8_direct"},
            "fp8_matmul_reduce_scatter": {"pk_fp8_current", "pk_fp8_block", "xla",
                                          "xla_fp8_dq_f32", "xla_fp8_dq_bf16",
                                          "xla_fp8_direct"},
            "fp8_gemm_world_size_1": {"pk_ag_current", "pk_rs_current", "pk_ag_block",
                                      "pk_rs_block", "gemm_only", "xla_fp8_dq_f32",
                                      "xla_fp8_dq_bf16", "xla_fp8_direct"}}
    for op, impls in want.items():
        assert impls <= {impl for o, impl in rows if o == op}, (op, rows)
    windowed = [line for line in proc.stdout.splitlines() if line.startswith("xla_windowed")]
    assert len(windowed) == 4, proc.stdout  # AG, RS, AR, MLP: accepted, or why not
