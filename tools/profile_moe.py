"""Each kernel of the MoE exchange on one device, pk against the sort +
gather baseline (benchmarks/moe.py's rows "dispatch" and "dispatch_combine"),
for Nsight Compute:

    ncu --profile-from-start off --clock-control none --csv \
        --metrics gpu__time_duration.sum python tools/profile_moe.py --shape wide

Each implementation runs once (after a warm-up) between
cudaProfilerStart/Stop, in the order it prints; the kernels of one call are
the ones between two of its "marker" lines (a cupy kernel named
mark_<implementation>, when cupy is there). Without ncu it prints the
interleaved timings (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import cuda_profiler, interleaved_ms, one_axis_mesh  # noqa: E402
from moe import SHAPES, _materialized, _routing, exchanges  # noqa: E402


def _marker(name: str):
    """A launch of an empty kernel named mark_<name> (ncu lists it between
    the implementations), or nothing without cupy."""
    try:
        import cupy
    except ImportError:
        return lambda: None
    kernel = cupy.RawKernel(f'extern "C" __global__ void mark_{name}() {{}}', f"mark_{name}")
    return lambda: (kernel((1,), (1,), ()), cupy.cuda.Device().synchronize())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="wide", choices=sorted(SHAPES))
    a = ap.parse_args()
    t, h, e, k, _ = SHAPES[a.shape]
    mesh = one_axis_mesh(jax.devices()[:1], "ep")
    ids, w = _routing(np.random.default_rng(0), 1, t, k, e)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((t, h)), jnp.bfloat16)
    ids, w = jnp.asarray(ids), jnp.asarray(w)
    spec = P("ep")
    fns = {}
    for name, (dispatch, combine, _) in exchanges(1, 0).items():
        if name == "pk_xla" or name == "sort_gather+scatter_add":
            continue
        def d(x, ids, w, dispatch=dispatch):
            return dispatch(x, ids, "ep", e)[:2]

        def dc(x, ids, w, dispatch=dispatch, combine=combine):
            rows, sizes, state = dispatch(x, ids, "ep", e)
            return combine(_materialized(rows, sizes), w, state)
        short = name.split("+")[0]
        for op, f in (("dispatch", d), ("dc", dc)):
            fns[f"{short}_{op}"] = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3,
                                                         out_specs=spec))
    with jax.set_mesh(mesh):
        for f in fns.values():
            jax.block_until_ready(f(x, ids, w))
        marks = {name: _marker(name) for name in fns}
        cuda_profiler(True)
        for name, f in fns.items():
            marks[name]()
            jax.block_until_ready(f(x, ids, w))
        cuda_profiler(False)
        times = interleaved_ms({name: (lambda f=f: f(x, ids, w)) for name, f in fns.items()},
                               rounds=3)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
