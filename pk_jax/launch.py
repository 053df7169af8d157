"""Run a script as a job of several processes on this host:

    python -m pk_jax.launch -n 2 train.py --steps 100

starts `-n` copies of the script, each with the settings that
`pk_jax.distributed.initialize()` reads (a coordinator on 127.0.0.1, the
process count and id, and, with GPUs, `--gpus-per-process` GPUs each: process
i drives GPUs i*k .. i*k+k-1). The script calls
`pk_jax.distributed.initialize()` before using JAX. Output lines are
prefixed with the process id; the launcher returns the first non-zero exit
code (and stops the other processes when one fails).

Every process is watched: when one exits with an error, the others get
SIGTERM, then SIGKILL if they are still running `--kill-after-failure`
seconds later (2 by default: a process blocked on a dead peer may never
notice the SIGTERM, and one that joined JAX's distributed runtime takes it
as a preemption notice and keeps running). A process that fails after
`pk_jax.distributed.initialize()` exits at once, without JAX's exit-time
wait for its peers, so the launcher returns its code within seconds.

Each process runs in a process group of its own (with whatever it starts).
SIGTERM, SIGINT and SIGHUP sent to the launcher (a scheduler's cancel or
preemption, `timeout`, Ctrl-C, a closed terminal) are forwarded to every
group; a script still running `--kill-after` seconds later gets SIGKILL, and
the launcher exits with 128 + the signal's number, as a shell reports a
process that signal ended. When the job ends, whichever way, every group
gets SIGKILL (whatever the scripts started and left behind): no process of
the job outlives the launcher.

Under SLURM (`srun`) or Open MPI (`mpirun`), start the script with them
instead: `pk_jax.distributed.initialize()` then is `jax.distributed.initialize()`,
which finds the job's layout itself.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
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


KILL_AFTER_S = 10.0  # default grace between a signal passed on and SIGKILL
FAILURE_KILL_AFTER_S = 2.0  # default grace between SIGTERM after a failure and SIGKILL
_POLL_S = 0.05
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _code(p: subprocess.Popen) -> int | None:
    """p's exit code (-s if signal s ended it), None while it runs. p is not
    reaped (waitid's WNOWAIT): until `stop` reaps it, its pid, which is its
    process group's id, cannot be taken by another process."""
    if p.returncode is not None:
        return p.returncode
    info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """`sig` to p's process group (p and what it started)."""
    if p.returncode is None:  # not reaped: the group id is still p's
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:  # nothing left in the group
            pass


def stop(procs: list[subprocess.Popen], kill_after_s: float,
         sig: int = signal.SIGTERM) -> None:
    """`sig` (SIGTERM) to the process group of every process still running;
    once all have exited, or `kill_after_s` seconds later, SIGKILL to every
    group (a process still running then, and whatever the processes left
    behind), then reap them all."""
    for p in procs:
        if _code(p) is None:
            _signal_group(p, sig)
    deadline = time.monotonic() + kill_after_s
    while any(_code(p) is None for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()


def supervise(procs: list[subprocess.Popen], kill_after_s: float, failure_kill_after_s: float,
              received: list[int] | None = None) -> int:
    """Wait for every process (polling all of them, not only the first
    still running); on the first failure stop the others (`stop`, SIGKILL
    after `failure_kill_after_s`) and return its exit code; 0 when all exit
    with 0. A signal appended to `received` (by the launcher's handler) is
    passed on to every process group (`stop` with that signal, SIGKILL
    after `kill_after_s`) and gives 128 + its number."""
    received = [] if received is None else received
    try:
        while True:
            if received:
                stop(procs, kill_after_s, received[0])
                return 128 + received[0]
            codes = [_code(p) for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                stop(procs, failure_kill_after_s)
                return failed
            if all(c == 0 for c in codes):
                stop(procs, failure_kill_after_s)  # what they left behind
                return 0
            time.sleep(_POLL_S)
    except BaseException:  # an error of the launcher itself: no orphans
        stop(procs, failure_kill_after_s)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pk_jax.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-processes", type=int, required=True,
                        help="processes to start (>= 1)")
    parser.add_argument("--gpus-per-process", type=int, default=None,
                        help="GPUs each process drives (>= 0; default: 1 when GPUs are "
                             "visible; 0: set none)")
    parser.add_argument("--kill-after", type=float, default=KILL_AFTER_S, metavar="SECONDS",
                        help="after SIGTERM, SIGINT or SIGHUP to the launcher: seconds between "
                             "passing it on and SIGKILL for the processes still running (their "
                             "time to stop cleanly, e.g. to save a checkpoint at JAX's "
                             f"preemption sync point; > 0, default {KILL_AFTER_S:g})")
    parser.add_argument("--kill-after-failure", type=float, default=FAILURE_KILL_AFTER_S,
                        metavar="SECONDS",
                        help="after a process fails: seconds between SIGTERM for the others "
                             f"and SIGKILL (> 0, default {FAILURE_KILL_AFTER_S:g})")
    parser.add_argument("script", help="the Python script each process runs (it calls "
                        "pk_jax.distributed.initialize() before using JAX)")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="the script's own arguments, passed to every process as given")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the job that `argv` (the command line's arguments) describes;
    returns the launcher's exit code (module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"-n/--num-processes must be >= 1, got {args.num_processes}")
    if args.gpus_per_process is not None and args.gpus_per_process < 0:
        parser.error(f"--gpus-per-process must be >= 0 (0: set no GPUs), got "
                     f"{args.gpus_per_process}")
    for flag in ("kill_after", "kill_after_failure"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{flag.replace('_', '-')} must be a finite number of seconds > 0, "
                         f"got {value}")
    gpus = args.gpus_per_process
    if gpus is None:
        gpus = 1 if os.path.exists("/dev/nvidia0") else 0
    address = f"127.0.0.1:{_free_port()}"
    procs, pumps, received = [], [], []
    # The handler only records: the supervising loop passes the signal on.
    # (Python sets handlers from the main thread only.)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (FORWARDED if main_thread else ())}
    try:
        try:
            for i in range(args.num_processes):
                if received:  # stopped while starting: start no more
                    break
                env = dict(os.environ)
                env.update({ENV_COORDINATOR: address,
                            ENV_NUM_PROCESSES: str(args.num_processes), ENV_PROCESS_ID: str(i)})
                if gpus:
                    env[ENV_LOCAL_DEVICES] = ",".join(str(i * gpus + g) for g in range(gpus))
                env.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
                proc = subprocess.Popen([sys.executable, args.script, *args.args], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # a process group of its own
                procs.append(proc)
                pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{i}] ", sys.stdout),
                                        daemon=True)
                pump.start()
                pumps.append(pump)
        except BaseException:
            stop(procs, args.kill_after_failure)
            raise
        code = supervise(procs, args.kill_after, args.kill_after_failure, received)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for pump in pumps:
        pump.join(timeout=5)
    return code if code >= 0 else 128 - code  # killed by signal s: 128 + s, as a shell says


if __name__ == "__main__":
    sys.exit(main())
