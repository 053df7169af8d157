"""Run a script as a job of several processes on this host:

    python -m pk_jax.launch -n 2 train.py --steps 100

starts `-n` copies of the script, each with the settings that
`pk_jax.distributed.initialize()` reads (a coordinator on 127.0.0.1, the
process count and id, and, with GPUs, `--gpus-per-process` GPUs each: process
i drives GPUs i*k .. i*k+k-1). The script calls
`pk_jax.distributed.initialize()` before using JAX. Output lines are
prefixed with the process id; the launcher returns the first non-zero exit
code (and stops the other processes when one fails).

Under SLURM (`srun`) or Open MPI (`mpirun`), start the script with them
instead: `pk_jax.distributed.initialize()` then is `jax.distributed.initialize()`,
which finds the job's layout itself.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

from pk_jax.distributed import (ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES,
                                ENV_PROCESS_ID)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pk_jax.launch", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--gpus-per-process", type=int, default=None,
                        help="GPUs each process drives (default: 1 when GPUs are visible; "
                             "0: set none)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error("-n must be >= 1")
    gpus = args.gpus_per_process
    if gpus is None:
        gpus = 1 if os.path.exists("/dev/nvidia0") else 0
    address = f"127.0.0.1:{_free_port()}"
    procs, pumps = [], []
    for i in range(args.num_processes):
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(args.num_processes),
                    ENV_PROCESS_ID: str(i)})
        if gpus:
            env[ENV_LOCAL_DEVICES] = ",".join(str(i * gpus + g) for g in range(gpus))
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
        proc = subprocess.Popen([sys.executable, args.script, *args.args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{i}] ", sys.stdout),
                                daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and not code:
            code = failed[0]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.1)
    for pump in pumps:
        pump.join(timeout=5)
    return code or next((p.returncode for p in procs if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
