"""One pk_jax call compiled and run on real GPUs, and what
`helpers.gpu_util.captured` (the check the replay and graph-update GPU tests
rely on) reads of its compiled module: outlined `command_buffer`
computations in its text, or kCommandBuffer thunks in the thunk sequence
XLA dumps (the form of jax 0.11's XLA). Run by
tests/test_command_buffer_gpu.py twice per case: with XLA putting every
custom call into a command buffer (--xla_gpu_graph_min_graph_size=1) and
with command buffers off (--xla_gpu_enable_command_buffer=).

    python tests/scripts/command_buffer_check.py {fp8_quantize,all_gather} HLO_OUT

fp8_quantize: pk_fp8_quantize on one GPU; all_gather: pk_all_gather
(ld_st_push) over two. Writes the compiled module's text to HLO_OUT and
prints one line, RESULT {json}: the targets the check finds in command
buffers, the pk target, how many times it occurs in the module, how many
command_buffer computations the module has, and whether the call's values
were right.
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from helpers.gpu_util import captured  # noqa: E402


def fp8_quantize():
    """(target, lowered, run) of a tensor-scaled e4m3 quantization of x [256, 512]."""
    x = jax.device_put(np.random.default_rng().standard_normal((256, 512), np.float32),
                       jax.devices("gpu")[0])
    f = jax.jit(lambda x: pk_jax.fp8_quantize(x, "tensor"))

    def run():
        q, _, factor, _ = f(x)
        deq = np.asarray(q.astype(jnp.float32)) * np.asarray(factor)[0]
        want = np.asarray(x)
        return bool(np.linalg.norm(deq - want) / np.linalg.norm(want) < 0.06)
    return "pk_fp8_quantize", f.lower(x), run


def all_gather():
    """(target, lowered, run) of a tiled ld_st_push gather of 4096 int32 per GPU."""
    mesh = Mesh(np.array(jax.devices("gpu")[:2]), ("x",))
    host = np.arange(2 * 4096, dtype=np.int32)
    x = jax.device_put(host, NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(
        lambda a: pk_jax.all_gather(a, "x", mechanism="ld_st_push", tiled=True),
        mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    run = lambda: bool(np.array_equal(np.asarray(f(x)), np.concatenate([host, host])))
    return "pk_all_gather", f.lower(x), run


if __name__ == "__main__":
    case, out = sys.argv[1], pathlib.Path(sys.argv[2])
    target, lowered, run = {"fp8_quantize": fp8_quantize, "all_gather": all_gather}[case]()
    found = captured(lowered)
    out.write_text(found.text)
    result = {"target": target, "captured": sorted(found.targets),
              "occurrences": found.text.count(f'custom_call_target="{target}"'),
              "command_buffers": found.count,
              "values_ok": all(run() for _ in range(3))}  # recorded, then replayed
    pk_jax.check_errors()
    print("RESULT " + json.dumps(result), flush=True)
