"""One process of a two-process CPU job (tests/test_multiprocess_cpu.py,
started by `python -m pk_jax.launch -n 2`) in which one process fails after
`pk_jax.distributed.initialize()` while the other one works or waits for it:

    python tests/scripts/fail_fast_worker.py {exit,raise,clean} FAILING_ID OUT_DIR

exit: the failing process calls sys.exit(7) while the other computes for 40
s. raise: it raises an uncaught exception while the other waits for it in
`sync_global_devices`. clean: it exits with 0 while the other computes for 5
s (JAX's normal shutdown, which waits for the peer). Once both processes
have joined, the failing one writes the time it fails (OUT_DIR/failed_at) and
fails; in "clean", each process writes when it finished its work
(OUT_DIR/done_<id>) and when JAX's shutdown let it go (OUT_DIR/after_<id>).
"""

from __future__ import annotations

import atexit
import os
import pathlib
import sys
import time

case, failing, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
me = int(os.environ["PK_JAX_PROCESS_ID"])
# Registered before jax is imported: runs after JAX's exit-time shutdown.
atexit.register(lambda: (out / f"after_{me}").write_text(repr(time.time())))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import pk_jax.distributed  # noqa: E402

pk_jax.distributed.initialize()
multihost_utils.sync_global_devices("both joined")


def compute(seconds: float) -> None:
    """Small jitted steps for `seconds`."""
    step = jax.jit(lambda x: jnp.tanh(x @ x.T)[:, :64])
    x, end = jnp.ones((64, 64)), time.monotonic() + seconds
    while time.monotonic() < end:
        x = step(x).block_until_ready()


if me == failing:
    time.sleep(1)  # the other process is computing / waiting by now
    (out / "failed_at").write_text(repr(time.time()))
    if case == "exit":
        sys.exit(7)
    if case == "raise":
        raise RuntimeError("fail_fast_worker: failing on purpose")
elif case == "raise":
    multihost_utils.sync_global_devices("never reached by the failing process")
else:
    compute(40 if case == "exit" else 5)
(out / f"done_{me}").write_text(repr(time.time()))
print("WORKER_DONE", flush=True)
