"""Print the scheduled order of the collectives and custom calls that XLA
compiled for ring attention's forward + backward (one line per instruction,
per computation), to see whether the backward's K/V and dK/dV hops overlap
the block kernels. Usage: python tools/show_schedule.py [--seq 16384] [--causal]"""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax

KEEP = re.compile(r"collective-permute|custom-call|all-reduce|all-gather|reduce-scatter|"
                  r"\bwhile\(|copy-start|copy-done|send|recv")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    spec = P(None, "sp")
    layout = "zigzag" if a.causal else "contiguous"
    ring = jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=a.causal, layout=layout),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    loss = lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32))
    x = jax.ShapeDtypeStruct((1, a.seq, 16, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, spec))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().as_text()
    print(f"{n} devices, S={a.seq}, causal={a.causal}")
    header = None
    for line in hlo.splitlines():
        if re.match(r"(ENTRY )?%[\w.\-]+ \(", line):
            header = line.split(" (")[0]
        elif KEEP.search(line):
            if header:
                print("\n" + header)
                header = None
            name = line.strip().split(" = ")[0]
            op = re.search(r"= .*? ([\w-]+)\(", line)
            target = re.search(r'custom_call_target="([^"]+)"', line)
            print(f"  {name:<48} {op.group(1) if op else ''} {target.group(1) if target else ''}")

if __name__ == "__main__":
    main()
