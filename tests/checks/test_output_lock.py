"""One writer per output_dir (hf_grpo.checks.output_lock), as a library user's ``GRPOTrainer(...).train()`` meets it:
the lock is held while the run trains and gone after it, a folder held by a live run is refused naming the holder,
and a lock whose holder is gone is taken over. The launched recipe is in tests/distributed/test_launcher_death.py."""

import json
import logging
import os
import socket
import sys

import pytest
from tests.launching import start_launch
from tests.test_trainer import make_trainer
from transformers import TrainerCallback

from hf_grpo.checks.output_lock import LOCK_FILE, OutputDirLocked, _process_start_ticks


class LockSeen(TrainerCallback):
    """Records the lock file's content at each step; raises at the end of step ``fail_at`` if given."""

    def __init__(self, path, fail_at=None):
        self.path, self.fail_at, self.seen = path, fail_at, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(json.loads(self.path.read_text()))
        if state.global_step == self.fail_at:
            raise RuntimeError("a failure inside the run")


def write_lock(out, **record):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_FILE).write_text(json.dumps(record))


@pytest.fixture
def other_process():
    """A live process of this host other than this one, as a run holding the folder would be."""
    process = start_launch([sys.executable, "-c", "import time; time.sleep(120)"], processes=1)
    yield process
    process.kill()
    process.wait()


def test_the_lock_names_this_run_while_it_trains_and_is_gone_after_it_ends_and_after_an_exception(tmp_path):
    lock = tmp_path / "out" / LOCK_FILE
    trainer = make_trainer(tmp_path, max_steps=2)
    seen = LockSeen(lock)
    trainer.add_callback(seen)
    trainer.train()
    assert [(r["pid"], r["host"]) for r in seen.seen] == [(os.getpid(), socket.gethostname())] * 2
    assert sys.argv[0] in seen.seen[0]["command"] and seen.seen[0]["started"].endswith(" UTC")
    assert not lock.exists()

    failing = make_trainer(tmp_path, max_steps=3)
    failing.add_callback(LockSeen(lock, fail_at=1))
    with pytest.raises(RuntimeError, match="a failure inside the run"):
        failing.train()
    assert not lock.exists()  # the next run into the folder is not refused by a lock nobody holds
    make_trainer(tmp_path, max_steps=1).train()


def test_a_run_into_a_folder_a_live_run_holds_is_refused_naming_it_and_trains_nothing(tmp_path, other_process):
    out = tmp_path / "out"
    holder = dict(host=socket.gethostname(), pid=other_process.pid, started="2026-01-02 03:04:05 UTC",
                  pid_start_ticks=_process_start_ticks(other_process.pid), command="accelerate launch train.py")
    write_lock(out, **holder)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(OutputDirLocked) as err:
        trainer.train()
    message = str(err.value)
    assert (f"is in use by another run (pid {other_process.pid} on host {socket.gethostname()!r}, started "
            f"2026-01-02 03:04:05 UTC, command: accelerate launch train.py), which is still running") in message
    assert f"kill {other_process.pid}" in message and "choose another --output_dir" in message
    assert trainer.state.global_step == 0
    assert json.loads((out / LOCK_FILE).read_text()) == holder  # the holder's lock is left alone


def test_a_lock_from_another_host_is_refused_and_says_how_to_clear_it(tmp_path):
    out = tmp_path / "out"
    write_lock(out, host="node-7", pid=4242, started="2026-01-02 03:04:05 UTC", command="python train.py")
    with pytest.raises(OutputDirLocked) as err:
        make_trainer(tmp_path, max_steps=1).train()
    message = str(err.value)
    assert "pid 4242 on host 'node-7'" in message and "on another host" in message
    assert f"cannot check whether that process still runs. If it does not (check on 'node-7'), delete " \
           f"{out / LOCK_FILE} and start again" in message


def test_a_lock_whose_holder_is_gone_is_taken_over_with_a_log_line(tmp_path, caplog, other_process):
    dead = start_launch([sys.executable, "-c", "pass"], processes=1)
    dead.wait()
    out = tmp_path / "out"
    write_lock(out, host=socket.gethostname(), pid=dead.pid, started="2026-01-02 03:04:05 UTC", command="old run")
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        make_trainer(tmp_path, max_steps=1).train()
    assert (f"taking over the lock of a run that is gone (pid {dead.pid} on host {socket.gethostname()!r}, started "
            f"2026-01-02 03:04:05 UTC, command: old run)") in caplog.text
    assert not (out / LOCK_FILE).exists()

    # a pid now used by another process than the one that wrote the lock (its start time differs): gone too
    ticks = _process_start_ticks(other_process.pid)
    if ticks is None:
        pytest.skip("no /proc start times on this system")
    write_lock(out, host=socket.gethostname(), pid=other_process.pid, pid_start_ticks=ticks - 1, command="older run")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        make_trainer(tmp_path, max_steps=1).train()
    assert f"taking over the lock of a run that is gone (pid {other_process.pid} " in caplog.text


def test_the_lock_appears_whole_and_leaves_no_draft_behind(tmp_path):
    """The record is written before the lock's name exists (a reader never finds it empty), and a second create
    of the same name fails without touching the first."""
    from hf_grpo.checks import output_lock

    path = str(tmp_path / LOCK_FILE)
    assert output_lock._create(path, {"pid": 1, "host": "a"})
    assert not output_lock._create(path, {"pid": 2, "host": "b"})
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == {"pid": 1, "host": "a"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]


# ---- no secret in the lock ----------------------------------------------------------------------------

SECRET_ARGV = ["train.py", "--hub_token", "hf_SPACEFORM", "--wandb_api_key=EQUALSFORM", "--push_to_hub",
               "--db_password", "PW", "--output_dir", "out"]


def test_the_lock_records_the_command_without_secret_values_and_only_its_owner_reads_it(tmp_path, monkeypatch):
    from hf_grpo.checks import output_lock

    monkeypatch.setattr(sys, "argv", SECRET_ARGV)
    previous = os.umask(0o022)  # the usual umask, under which a plain open() makes a world-readable file
    try:
        assert output_lock.acquire(str(tmp_path))
        lock = tmp_path / LOCK_FILE
        command = json.loads(lock.read_text())["command"]
        mode = lock.stat().st_mode & 0o777
        output_lock.release(str(tmp_path))
    finally:
        os.umask(previous)
    for secret in ("hf_SPACEFORM", "EQUALSFORM", "PW"):
        assert secret not in command
    assert "train.py --hub_token *** --wandb_api_key=*** --push_to_hub --db_password *** --output_dir out" in command
    assert mode == 0o600


def test_a_refusal_shows_the_holders_command_without_its_secrets(tmp_path):
    """Even a lock written with the secrets in it (by an earlier version) is shown redacted to whoever is refused."""
    out = tmp_path / "out"
    write_lock(out, host="node-7", pid=4242, started="2026-01-02 03:04:05 UTC",
               command="python " + " ".join(SECRET_ARGV))
    with pytest.raises(OutputDirLocked) as err:
        make_trainer(tmp_path, max_steps=1).train()
    message = str(err.value)
    assert "command: python train.py --hub_token *** --wandb_api_key=*** --push_to_hub --db_password *** " in message
    assert not any(secret in message for secret in ("hf_SPACEFORM", "EQUALSFORM", "PW "))
