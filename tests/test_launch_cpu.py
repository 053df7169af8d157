"""python -m pk_jax.launch without JAX in the children: every process is
watched (a failure of process 1 is seen while process 0 blocks forever),
the others are stopped (SIGTERM, then SIGKILL for one that ignores it), the
first failing exit code is returned, SIGTERM / SIGINT / SIGHUP to the
launcher reach every process group (SIGKILL after --kill-after, no process
left, exit code 128 + the signal), and bad flags are refused."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import child_env
from pk_jax import launch

# Each child runs this with its process id; it reads what to do from argv.
# "spawn" starts a grandchild that ignores SIGTERM (its pid in gpid<i>).
CHILD = """
import os, pathlib, signal, subprocess, sys, time
me = int(os.environ["PK_JAX_PROCESS_ID"])
roles, ready = sys.argv[1:-1], pathlib.Path(sys.argv[-1])
def publish(name, text):  # whole or absent: a reader that sees the file reads the pid
    tmp = ready.parent / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, ready.parent / name)
role = roles[me]
if role == "ok":
    sys.exit(0)
if role.startswith("fail"):  # once every blocking process is set up (pid file written)
    blocking = [i for i, r in enumerate(roles) if r in ("block", "stubborn", "spawn")]
    while not all((ready.parent / f"pid{i}").exists() for i in blocking):
        time.sleep(0.01)
    sys.exit(int(role[4:]))
if role == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if role == "spawn":
    grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                   "print('up', flush=True); time.sleep(600)"],
                                  stdout=subprocess.PIPE)
    grandchild.stdout.readline()  # its SIGTERM handler is set
    publish(f"gpid{me}", str(grandchild.pid))
publish(f"pid{me}", str(os.getpid()))
ready.touch()
while True:  # blocked on a peer that is gone
    time.sleep(1)
"""


def _run(tmp_path, roles, kill_after="0.5"):
    """launch.main on `roles` with --kill-after-failure `kill_after`: (its
    code, seconds)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    start = time.monotonic()
    code = launch.main(["-n", str(len(roles)), "--gpus-per-process", "0",
                        "--kill-after-failure", kill_after, str(script), *roles,
                        str(tmp_path / "ready")])
    return code, time.monotonic() - start


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by
    whichever process adopted it, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(tmp_path, i, prefix="pid") -> bool:
    """Whether the process whose pid the child i wrote (`prefix`: "pid"
    itself, "gpid" its grandchild) has ended (within 2 s: an orphan's
    SIGKILL is asynchronous)."""
    pid = int((tmp_path / f"{prefix}{i}").read_text())
    deadline = time.monotonic() + 2
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


def test_all_succeed(tmp_path):
    assert _run(tmp_path, ["ok", "ok", "ok"])[0] == 0


def test_a_later_process_failing_stops_a_blocked_one(tmp_path):
    """Process 1 fails while process 0 blocks forever: seen at once (not
    after process 0 ends), process 0 terminated, process 1's code returned."""
    code, took = _run(tmp_path, ["block", "fail3"], kill_after="30")
    assert code == 3 and took < 20, took  # SIGTERM sufficed: no wait for the grace period
    assert _gone(tmp_path, 0)


def test_a_process_ignoring_sigterm_is_killed(tmp_path):
    code, took = _run(tmp_path, ["stubborn", "block", "fail5"], kill_after="0.5")
    assert code == 5 and 0.5 <= took < 20, took
    assert _gone(tmp_path, 0) and _gone(tmp_path, 1)


def _signalled(tmp_path, roles, sig, kill_after):
    """The launcher started as a command, with `roles`, sent `sig` once
    every child is set up: (its exit code, seconds from the signal to its
    exit)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, "-m", "pk_jax.launch", "-n", str(len(roles)),
                             "--gpus-per-process", "0", "--kill-after", kill_after, str(script),
                             *roles, str(tmp_path / "ready")], env=child_env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{i}").exists() for i in range(len(roles))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.02)
        start = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        return code, time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_launcher_reaches_every_process(tmp_path, sig):
    """The signal reaches each child's group (the grandchild that ignores
    it gets SIGKILL once its parent is gone), the launcher exits with 128 +
    the signal's number, no process of the job is left."""
    code, took = _signalled(tmp_path, ["block", "spawn", "block"], sig, kill_after="30")
    assert code == 128 + sig and took < 10, (code, took)  # no wait for the grace period
    assert all(_gone(tmp_path, i) for i in range(3)) and _gone(tmp_path, 1, "gpid")


def test_a_process_ignoring_a_forwarded_sigterm_is_killed(tmp_path):
    code, took = _signalled(tmp_path, ["stubborn", "block"], signal.SIGTERM, kill_after="0.5")
    assert code == 128 + signal.SIGTERM and 0.5 <= took < 10, (code, took)
    assert _gone(tmp_path, 0) and _gone(tmp_path, 1)


def test_a_failure_stops_what_the_others_started(tmp_path):
    """The failing process's peers are stopped with what they started (a
    grandchild ignoring SIGTERM included); the launcher itself keeps its
    signal handlers as they were (main() restores them)."""
    before = {s: signal.getsignal(s) for s in launch.FORWARDED}
    code, _ = _run(tmp_path, ["spawn", "fail4"], kill_after="30")
    assert code == 4 and _gone(tmp_path, 0) and _gone(tmp_path, 0, "gpid")
    assert {s: signal.getsignal(s) for s in launch.FORWARDED} == before


@pytest.mark.parametrize("flags,match", [
    (["-n", "0"], "-n/--num-processes must be >= 1"),
    (["-n", "2", "--gpus-per-process", "-1"], "--gpus-per-process must be >= 0"),
    (["-n", "2", "--kill-after", "-1"], "--kill-after must be a finite number"),
    (["-n", "2", "--kill-after", "nan"], "--kill-after must be a finite number"),
    (["-n", "2", "--kill-after-failure", "0"], "--kill-after-failure must be a finite number"),
    (["-n", "two"], "invalid int value"),
])
def test_bad_flags_are_refused(capsys, flags, match):
    with pytest.raises(SystemExit) as info:
        launch.main([*flags, "script.py"])
    assert info.value.code == 2 and match in capsys.readouterr().err


def test_help_shows_the_example_and_what_script_and_args_are(capsys, monkeypatch):
    """--help: the description carries its example (no colon left dangling
    before it) and every argument says what it is."""
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps the help to the terminal's width
    with pytest.raises(SystemExit) as info:
        launch.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "on this host:\n\n    python -m pk_jax.launch -n 2 train.py --steps 100\n" in out
    assert not out.rstrip().endswith(":") and "SIGTERM, SIGINT and SIGHUP" in out
    for arg, what in (("script", "the Python script each process runs"),
                      ("args", "the script's own arguments"),
                      ("--kill-after SECONDS", "after SIGTERM, SIGINT or SIGHUP"),
                      ("--kill-after-failure SECONDS", "after a process fails")):
        assert re.search(rf"\n  {re.escape(arg)}\s+{re.escape(what)}", out), (arg, out)


# ---- what pk_jax.distributed.initialize reads --------------------------------------
@pytest.mark.parametrize("env,match", [
    ({"PK_JAX_NUM_PROCESSES": "two"}, "PK_JAX_NUM_PROCESSES='two' must be an integer"),
    ({"PK_JAX_NUM_PROCESSES": "0"}, "PK_JAX_NUM_PROCESSES='0' must be >= 1"),
    ({"PK_JAX_PROCESS_ID": "2"}, "PK_JAX_PROCESS_ID='2' must be in 0..1"),
    ({"PK_JAX_PROCESS_ID": ""}, "PK_JAX_PROCESS_ID='' must be an integer"),
    ({"PK_JAX_LOCAL_DEVICE_IDS": "0,x"}, "PK_JAX_LOCAL_DEVICE_IDS='0,x' must be a comma"),
])
def test_bad_launch_environment_is_named(monkeypatch, env, match):
    from pk_jax import distributed
    base = {"PK_JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "PK_JAX_NUM_PROCESSES": "2",
            "PK_JAX_PROCESS_ID": "1"}
    for name, value in {**base, **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        distributed.launch_settings()
    monkeypatch.setenv("PK_JAX_LOCAL_DEVICE_IDS", "2,3")
    for name, value in base.items():
        monkeypatch.setenv(name, value)
    assert distributed.launch_settings() == {
        "coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 1,
        "local_device_ids": [2, 3]}


# How the script ends -> (exit status, whether Python's normal shutdown ran).
ENDINGS = {
    "sys.exit(7)": (7, False),
    "def main():\n    with contextlib.suppress(ValueError):\n        sys.exit(7)\nmain()": (7, False),
    "try:\n    sys.exit(7)\nfinally:\n    print('FINALLY')": (7, False),
    "try:\n    sys.exit(7)\nexcept SystemExit:\n    print('CLEANUP')\n    raise": (7, False),
    "sys.exit('a message')": (1, False),
    "raise ValueError('uncaught')": (1, False),
    "raise KeyboardInterrupt": (130, False),
    # caught and survived, clean, or not through sys.exit: the normal shutdown
    "def main():\n    try:\n        sys.exit(7)\n    except SystemExit:\n        pass\nmain()":
        (0, True),
    "with contextlib.suppress(SystemExit):\n    sys.exit(7)": (0, True),
    "t = threading.Thread(target=sys.exit, args=(7,))\nt.start()\nt.join()": (0, True),
    "sys.exit(0)": (0, True),
    "sys.exit()": (0, True),
    "pass": (0, True),
    "raise SystemExit(7)": (7, True),
    "try:\n    1 / 0\nexcept ZeroDivisionError:\n    sys.excepthook(*sys.exc_info())": (0, True),
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_failing_exit_skips_the_shutdown(tmp_path, ending):
    """After pk_jax.distributed.initialize() (its exit hooks installed here
    without a job): an uncaught exception or a sys.exit with a failing status
    that nothing caught ends the process at once (what it prints and its
    finally blocks kept), skipping Python's shutdown and JAX's wait there; a
    clean exit, a SystemExit caught or raised in a thread keep the normal
    shutdown (an atexit function registered before the hooks shows it)."""
    status, normal = ENDINGS[ending]
    script = tmp_path / "script.py"
    script.write_text("import atexit, contextlib, sys, threading\n"
                      "atexit.register(lambda: print('NORMAL_SHUTDOWN', flush=True))\n"
                      "from pk_jax import distributed\n"
                      "distributed._fail_fast()\n"
                      "print('BEFORE', flush=False)\n" + ending + "\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=child_env(), cwd=tmp_path)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert ("NORMAL_SHUTDOWN" in proc.stdout) == normal, proc.stdout
    assert "BEFORE" in proc.stdout  # buffered output flushed before the exit
    for printed in ("FINALLY", "CLEANUP"):
        assert (printed in proc.stdout) == (printed in ending)
    if "uncaught" in ending:
        assert "ValueError: uncaught" in proc.stderr
    if "message" in ending:
        assert proc.stderr.strip() == "a message"


def test_initialize_twice_says_so(tmp_path):
    """The second call is refused with what to do (not jax's message about
    backends initialized before it)."""
    import subprocess
    import sys
    code = ("import pk_jax, socket\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            "kw = dict(coordinator_address=f'127.0.0.1:{port}', num_processes=1, process_id=0)\n"
            "pk_jax.distributed.initialize(**kw)\n"
            "try:\n"
            "    pk_jax.distributed.initialize(**kw)\n"
            "except RuntimeError as e:\n"
            "    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PK_JAX_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert "REFUSED pk_jax.distributed.initialize: this process already joined" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-2000:]
