"""python -m pk_jax.launch without JAX in the children: every process is
watched (a failure of process 1 is seen while process 0 blocks forever),
the others are stopped (SIGTERM, then SIGKILL for one that ignores it), the
first failing exit code is returned, and bad flags are refused."""

from __future__ import annotations

import os
import time

import pytest

from pk_jax import launch

# Each child runs this with its process id; it reads what to do from argv.
CHILD = """
import os, pathlib, signal, sys, time
me = int(os.environ["PK_JAX_PROCESS_ID"])
roles, ready = sys.argv[1:-1], pathlib.Path(sys.argv[-1])
role = roles[me]
if role == "ok":
    sys.exit(0)
if role.startswith("fail"):  # once every blocking process is set up (pid file written)
    blocking = [i for i, r in enumerate(roles) if r in ("block", "stubborn")]
    while not all((ready.parent / f"pid{i}").exists() for i in blocking):
        time.sleep(0.01)
    sys.exit(int(role[4:]))
if role == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(ready.parent / f"pid{me}").write_text(str(os.getpid()))
ready.touch()
while True:  # blocked on a peer that is gone
    time.sleep(1)
"""


def _run(tmp_path, roles, kill_after="0.5"):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    start = time.monotonic()
    code = launch.main(["-n", str(len(roles)), "--gpus-per-process", "0", "--kill-after",
                        kill_after, str(script), *roles, str(tmp_path / "ready")])
    return code, time.monotonic() - start


def _gone(tmp_path, i) -> bool:
    pid = int((tmp_path / f"pid{i}").read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


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


@pytest.mark.parametrize("flags,match", [
    (["-n", "0"], "-n/--num-processes must be >= 1"),
    (["-n", "2", "--gpus-per-process", "-1"], "--gpus-per-process must be >= 0"),
    (["-n", "2", "--kill-after", "-1"], "--kill-after must be a finite number"),
    (["-n", "2", "--kill-after", "nan"], "--kill-after must be a finite number"),
    (["-n", "two"], "invalid int value"),
])
def test_bad_flags_are_refused(capsys, flags, match):
    with pytest.raises(SystemExit) as info:
        launch.main([*flags, "script.py"])
    assert info.value.code == 2 and match in capsys.readouterr().err


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
