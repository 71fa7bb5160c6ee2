"""A lock naming pid 1 or a parent of this process (hf_grpo.checks.output_lock) is refused without advising to
stop that process: in a container pid 1 is the init (``kill 1`` ends the container), and a lock naming it comes
from a run in another PID namespace, such as a previous container, or was copied with the folder."""

import json
import os
import socket

import pytest

from hf_grpo.checks.output_lock import LOCK_FILE, OutputDirLocked, _process_start_ticks, acquire, release


def lock_naming(out, pid):
    out.mkdir(parents=True, exist_ok=True)
    record = dict(host=socket.gethostname(), pid=pid, pid_start_ticks=_process_start_ticks(pid),
                  started="2026-01-02 03:04:05 UTC", command="python train.py")
    (out / LOCK_FILE).write_text(json.dumps(record))
    return record


@pytest.mark.parametrize("who", ["pid 1", "parent"])
def test_a_lock_naming_this_process_init_or_parent_says_to_delete_it_not_to_kill(tmp_path, who):
    pid = 1 if who == "pid 1" else os.getppid()
    if _process_start_ticks(pid) is None or os.getpid() == 1:
        pytest.skip(f"no /proc entry for pid {pid} here, or this process is pid 1 (the lock would be its own)")
    out = tmp_path / "out"
    record = lock_naming(out, pid)
    with pytest.raises(OutputDirLocked) as err:
        acquire(str(out))
    message = str(err.value)
    assert "kill" not in message
    which = "this PID namespace's init" if pid == 1 else "a parent of this process"
    assert f"pid {pid} here is {which}, not a run writing into this folder" in message
    assert f"If no run is writing into this folder, delete {out / LOCK_FILE} and start again" in message
    assert json.loads((out / LOCK_FILE).read_text()) == record  # left alone: only the user can tell


def test_a_lock_naming_pid_1_from_another_pid_namespace_is_taken_over(tmp_path):
    """The init here started at another time than the process the lock names (a previous container's run)."""
    ticks = _process_start_ticks(1)
    if ticks is None:
        pytest.skip("no /proc start times here")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps(dict(host=socket.gethostname(), pid=1, pid_start_ticks=ticks + 1)))
    assert acquire(str(out))
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    release(str(out))
