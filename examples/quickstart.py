"""pk_jax quickstart: an all_gather, a tensor-parallel MLP and causal ring
attention inside jax.shard_map, each checked against XLA.

Runs on GPUs (pk_jax kernels) or, with no GPU, on 8 fake CPU devices (the
same code; XLA's collective underneath).

    python examples/quickstart.py
"""

import os

# Only affects the CPU backend: gives 8 fake devices when there is no GPU.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax import runtime  # noqa: E402


def main() -> None:
    devices = jax.devices()[:8]
    n = len(devices)
    mesh = jax.make_mesh((n,), ("tp",), devices=devices)  # Explicit axes (jax's default)
    kernels = devices[0].platform == "gpu" and runtime.available()
    print(f"{n} x {devices[0].device_kind}; pk_jax kernels: {'yes' if kernels else 'no (XLA path)'}")

    # Each device holds [1024, 512] of x; the gather rebuilds all rows on every device.
    x = jax.random.normal(jax.random.key(0), (n * 1024, 512), jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("tp")))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    def gather_rows(shard):
        return pk_jax.all_gather(shard, "tp", axis=0, tiled=True)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    def gather_rows_xla(shard):
        return lax.all_gather(shard, "tp", axis=0, tiled=True)

    ours, ref = gather_rows(x), gather_rows_xla(x)
    assert ours.shape == (n * n * 1024, 512)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
    print("all_gather matches lax.all_gather bit for bit:", ours.shape, ours.dtype)

    # Gradients flow through it (its transpose is a reduce-scatter). Every
    # device computes sum(all_gather(x) * w), so the total is n * sum(x * w)
    # and its gradient is n * w.
    w = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)

    def loss(v):
        @jax.shard_map(mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
        def per_device(shard):
            full = pk_jax.all_gather(shard.astype(jnp.float32), "tp", tiled=True)
            return jnp.sum(full * w)[None]
        return jnp.sum(per_device(v))

    g = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(np.asarray(g, np.float32), n * np.asarray(w), rtol=1e-2, atol=1e-2)
    print(f"gradient checked: d/dx sum over devices of sum(all_gather(x) * w) == {n} * w")

    # Tensor parallelism: a column-parallel then a row-parallel layer, with the
    # all-gather and the reduce-scatter fused into the matmuls.
    d, ffn = 512, 1024
    w1 = jax.device_put(jax.random.normal(jax.random.key(2), (d, ffn), jnp.bfloat16) / d ** 0.5,
                        NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(jax.random.normal(jax.random.key(3), (ffn, d), jnp.bfloat16) / ffn ** 0.5,
                        NamedSharding(mesh, P("tp", None)))

    def mlp(fused):
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
                       out_specs=P("tp"))
        def f(x, w1, w2):
            if fused:
                h = pk_jax.all_gather_matmul(x, w1, "tp")
                return pk_jax.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp")
            h = lax.all_gather(x, "tp", tiled=True) @ w1
            return lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", tiled=True)
        return f

    ours, ref = (np.asarray(mlp(fused)(x, w1, w2), np.float32) for fused in (True, False))
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 2e-2, rel
    print(f"tensor-parallel MLP (all_gather_matmul -> matmul_reduce_scatter) matches XLA: "
          f"relative difference {rel:.1e}")

    # Sequence parallelism: causal ring attention over the sequence, zigzag
    # layout (every device gets the same causal work), GQA (8 query heads
    # share 2 K/V heads). zigzag_shard reorders the global arrays once.
    s_local, heads, kv_heads, hd = 256, 8, 2, 64
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (1, n * s_local, heads, hd), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, n * s_local, kv_heads, hd), jnp.bfloat16)
            for kk in keys[1:])
    seq = NamedSharding(mesh, P(None, "tp"))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(None, "tp"),) * 3, out_specs=P(None, "tp"))
    def attend(q, k, v):
        return pk_jax.ring_attention(q, k, v, "tp", causal=True, layout="zigzag")

    out = attend(*(jax.device_put(pk_jax.zigzag_shard(a, n), seq) for a in (q, k, v)))
    out = np.asarray(pk_jax.zigzag_unshard(out, n), np.float32)
    ref = np.asarray(jax.nn.dot_product_attention(
        *(a.astype(jnp.float32) for a in (q, k, v)), is_causal=True))
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < 2e-2, rel
    print(f"causal zigzag ring attention over {n} devices matches attention on the whole "
          f"sequence: relative difference {rel:.1e}")
    pk_jax.check_errors()


if __name__ == "__main__":
    main()
