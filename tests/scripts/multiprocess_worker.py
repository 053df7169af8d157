"""One process of a multi-process CPU job (started by tests/test_multiprocess_cpu.py
through `python -m pk_jax.launch -n 2`): 4 fake CPU devices each, XLA's CPU
collectives over gloo, jax.distributed on 127.0.0.1.

    python tests/scripts/multiprocess_worker.py {same_host,two_hosts} OUT_DIR

same_host: the ops' values across processes (the reference path); the CUDA
lowering (with a stand-in for the native extension) of programs lowered in
different orders on the two processes, written to OUT_DIR to be compared;
zero-copy all_gather turning to the copy engine across processes; and the
collective check_errors(). two_hosts: every process claims its own host
(PK_JAX_HOST_ID): a group spanning hosts falls back (auto) or raises
(forced); the recipe of a 2-D mesh with the pk axis inside a host works.
Exits non-zero on the first failed check.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import pk_jax  # noqa: E402
import pk_jax.distributed  # noqa: E402
from pk_jax import _cluster, runtime  # noqa: E402


class FakeExtension:
    """What the runtime and the CUDA lowering rules use of the native module,
    without a GPU: records what it is asked to do."""

    has_gemm = True
    has_attention = True

    @staticmethod
    def cublaslt_version():
        return 0

    def __init__(self, errors=()):
        self._init = False
        self.imported: dict[int, tuple[bytes, str]] = {}
        self.errors = list(errors)
        self.resets = 0

    def registrations(self):
        return {}

    def initialized(self):
        return self._init

    def init_runtime(self, devices, data_bytes):
        self._init, self.data = True, data_bytes

    def data_bytes(self):
        return self.data

    def device_info(self, ordinal):
        return {"pci_bus_id": f"{jax.process_index()}:{ordinal}", "compute_capability": (9, 0),
                "supported": True}

    def export_workspace(self, ordinal):
        return bytes([jax.process_index(), ordinal]) * 32

    def import_peer(self, global_id, handle, pci, data_bytes=-1):
        self.imported[global_id] = (handle, pci)

    def can_access(self, ordinal, pci):
        return True

    def connect_group(self, ids):
        pass

    def synchronize(self, timeout_s):
        pass

    def pending_errors(self):
        return list(self.errors)

    def reset(self, timeout_s):
        self.resets += 1
        self.errors = []


def fake_runtime(ext: FakeExtension) -> None:
    """The runtime with `ext` as its native module, driving the local CPU
    devices as if they were GPUs."""
    runtime._ext = ext
    runtime.gpu_devices = lambda: jax.local_devices()


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"OK {what}", flush=True)


def lowered(fn, mesh, specs, shapes, dtype=jnp.float32):
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, p))
            for s, p in zip(shapes, specs)]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def put(mesh, spec, a):
    return jax.device_put(a, NamedSharding(mesh, spec))


def local_rows(out, want):
    """Every addressable shard of `out` equals that slice of `want`."""
    return all(np.allclose(np.asarray(s.data, np.float32), want[s.index], rtol=2e-2, atol=2e-2)
               for s in out.addressable_shards)


def values(mesh):
    """The ops across processes on the CPU (reference) path."""
    rng = np.random.default_rng(0)  # the same global inputs on every process
    x = rng.standard_normal((16, 8)).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda a: pk_jax.all_gather(a, "x", tiled=True), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False))
    check(local_rows(f(put(mesh, P("x"), x)), np.tile(x, (8, 1))), "all_gather across processes")
    w1 = rng.standard_normal((8, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 8)).astype(np.float32)

    def mlp(x, w1, w2):
        return pk_jax.matmul_reduce_scatter(jnp.tanh(pk_jax.all_gather_matmul(x, w1, "x")), w2,
                                            "x")
    g = jax.jit(jax.shard_map(mlp, mesh=mesh, in_specs=(P("x"), P(None, "x"), P("x", None)),
                              out_specs=P("x")))
    out = g(put(mesh, P("x"), x), put(mesh, P(None, "x"), w1), put(mesh, P("x", None), w2))
    check(local_rows(out, np.tanh(x @ w1) @ w2), "tensor-parallel MLP across processes")
    q, k, v = (rng.standard_normal((1, 8 * 16, 2, 8)).astype(np.float32) for _ in range(3))
    ring = jax.jit(jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "x", causal=True, layout="zigzag"),
        mesh=mesh, in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x")))
    zz = [put(mesh, P(None, "x"), np.asarray(pk_jax.zigzag_shard(a, 8))) for a in (q, k, v)]
    want = np.asarray(pk_jax.zigzag_shard(jax.nn.dot_product_attention(q, k, v, is_causal=True),
                                          8))
    check(local_rows(ring(*zz), want), "causal zigzag ring attention across processes")


PROGRAMS = {
    "all_gather_copy_engine": (lambda a: pk_jax.all_gather(a, "x", mechanism="copy_engine"),
                               [P("x")], [(8, 1024)], jnp.float32),
    "all_gather_auto_large": (lambda a: pk_jax.all_gather(a, "x"), [P("x")], [(8, 16384)],
                              jnp.float32),
    "tp_mlp": (lambda x, w1, w2: pk_jax.matmul_reduce_scatter(
        pk_jax.all_gather_matmul(x, w1, "x"), w2, "x"),
        [P("x"), P(None, "x"), P("x", None)], [(256, 128), (128, 512), (512, 128)],
        jnp.bfloat16),
    # Its gradient: each op's backward is one call (dx and dw), channels agreed too.
    "tp_mlp_grad": (lambda x, w1, w2: jax.grad(lambda x: jnp.sum(pk_jax.matmul_reduce_scatter(
        pk_jax.all_gather_matmul(x, w1, "x"), w2, "x").astype(jnp.float32)))(x),
        [P("x"), P(None, "x"), P("x", None)], [(256, 128), (128, 512), (512, 128)],
        jnp.bfloat16),
    "ring_attention": (lambda q: pk_jax.ring_attention(q, q, q, "x", causal=True,
                                                       layout="zigzag"),
                       [P(None, "x")], [(1, 8 * 256, 4, 128)], jnp.bfloat16),
    # Its gradient: the fused backward's channel and region are agreed too.
    "ring_attention_grad": (lambda q: jax.grad(lambda x: jnp.sum(pk_jax.ring_attention(
        x, x, x, "x", causal=True, layout="zigzag").astype(jnp.float32)))(q),
        [P(None, "x")], [(1, 8 * 256, 4, 128)], jnp.bfloat16),
}


def cuda_lowering(mesh, out_dir: pathlib.Path):
    """Lower every program for CUDA in this process's order; write the HLO."""
    names = list(PROGRAMS)
    if jax.process_index() % 2:
        names.reverse()  # the other process lowers in the opposite order
    texts = {}
    for name in names:
        fn, specs, shapes, dtype = PROGRAMS[name]
        body = jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=specs[0],
                             check_vma=False)
        texts[name] = lowered(body, mesh, specs, shapes, dtype)
    (out_dir / f"hlo_{jax.process_index()}.json").write_text(json.dumps(texts))
    for name, text in texts.items():
        check("custom_call @pk_" in text, f"{name} lowers to a pk kernel across processes")
    check("custom_call @pk_all_gather_matmul_bwd" in texts["tp_mlp_grad"]
          and "custom_call @pk_matmul_reduce_scatter_bwd" in texts["tp_mlp_grad"],
          "the tensor-parallel MLP's gradient lowers to one backward call per op across "
          "processes")
    check("custom_call @pk_ring_attention_bwd" in texts["ring_attention_grad"],
          "ring attention's gradient lowers to the fused backward across processes")
    ag = re.search(r"custom_call @pk_all_gather\(.*?mechanism = (\d+)",
                   texts["all_gather_auto_large"])
    check(ag and ag.group(1) == "1",
          "auto takes the copy engine (staged) for a group that spans processes")
    try:
        lowered(jax.shard_map(lambda a: pk_jax.all_gather(a, "x", mechanism="ld_st_push"),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False),
                mesh, [P("x")], [(8, 16384)])
    except ValueError as e:
        check("span processes" in str(e), "a forced zero-copy mechanism across processes raises")
    else:
        check(False, "a forced zero-copy mechanism across processes raises")
    peers = {int(i) for i in runtime._ext.imported}
    others = {d.id for d in jax.devices() if d.process_index != jax.process_index()}
    check(peers == others, "every process mapped the workspaces of the host's other processes")


def collective_check_errors():
    failing = jax.process_index() == 1
    runtime._ext.errors = ["pk_jax.all_gather timed out (test)"] if failing else []
    try:
        runtime.check_errors()
    except pk_jax.PkJaxTimeoutError as e:
        check(("timed out (test)" in str(e)) if failing else ("process(es) [1]" in str(e)),
              "check_errors raises on every process when one recorded a failure")
    else:
        check(False, "check_errors raises on every process when one recorded a failure")
    check(runtime._ext.resets == 1, "every process reset its workspaces")
    runtime.check_errors()  # clear now: no error, no reset
    check(runtime._ext.resets == 1, "a clean check_errors does not reset")


def two_hosts(mesh8):
    """Each process is its own host: groups over both processes span hosts."""
    body = jax.shard_map(lambda a: pk_jax.all_gather(a, "x"), mesh=mesh8, in_specs=P("x"),
                         out_specs=P("x"), check_vma=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = lowered(body, mesh8, [P("x")], [(8, 64)])
    check("custom_call @pk_all_gather" not in text and "all_gather" in text,
          "auto on an axis that spans hosts takes XLA's all_gather")
    check(any("spans 2 hosts" in str(w.message) for w in caught),
          "with a one-time warning saying why")
    forced = jax.shard_map(lambda a: pk_jax.all_gather(a, "x", mechanism="copy_engine"),
                           mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    try:
        lowered(forced, mesh8, [P("x")], [(8, 64)])
    except ValueError as e:
        check("('x',)" in str(e) and "spans 2 hosts" in str(e),
              "a forced mechanism on an axis that spans hosts raises, naming the axis")
    else:
        check(False, "a forced mechanism on an axis that spans hosts raises")
    # The recipe: the pk axis inside a host ("tp": each process's 4 devices),
    # XLA's collectives across hosts ("dp").
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices())

    def step(a):
        b = pk_jax.all_gather(a, "tp", tiled=True)
        return jax.lax.psum(b, "dp")
    body = jax.shard_map(step, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P(None, "tp"),
                         check_vma=False)
    text = lowered(body, mesh, [P("dp", "tp")], [(8, 64)])
    check("custom_call @pk_all_gather" in text, "2-D mesh: pk all_gather on the intra-host axis")
    check("all_reduce" in text, "2-D mesh: XLA's psum across hosts")


def main() -> None:
    scenario, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    if scenario == "two_hosts":
        os.environ["PK_JAX_HOST_ID"] = f"host-{os.environ['PK_JAX_PROCESS_ID']}"
    pk_jax.distributed.initialize()
    check(jax.process_count() == 2 and len(jax.devices()) == 8, "2 processes x 4 devices")
    mesh = jax.make_mesh((8,), ("x",), devices=jax.devices())
    if scenario == "same_host":
        values(mesh)
        fake_runtime(FakeExtension())
        cuda_lowering(mesh, out_dir)
        collective_check_errors()
    else:
        fake_runtime(FakeExtension())
        two_hosts(mesh)
    check(len(set(_cluster.hosts())) == (1 if scenario == "same_host" else 2),
          "the processes agree on the hosts")
    print("WORKER_DONE", flush=True)


if __name__ == "__main__":
    main()
