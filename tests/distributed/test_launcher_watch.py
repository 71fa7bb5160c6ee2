"""Only a process a launcher started watches its launcher (hf_grpo.distributed.launcher_watch): a script run from a
shell with a launcher's variable exported (ACCELERATE_USE_CPU is also a setting users export) keeps running when
its shell ends, as with nohup. The launches themselves are tests/distributed/test_launcher_death.py."""

import os
import signal

import pytest

from hf_grpo.distributed import launcher_watch


@pytest.mark.parametrize("variable", launcher_watch.LAUNCHER_ENV)
def test_a_launchers_variable_alone_does_not_arm_the_watch(monkeypatch, variable):
    monkeypatch.setenv(variable, "false")
    monkeypatch.setattr(launcher_watch, "_parent_command", lambda pid: "bash -c python train.py")
    assert not launcher_watch.launched_by_launcher()


@pytest.mark.parametrize("parent", [
    "/venv/bin/python /venv/bin/accelerate launch --num_processes 1 recipes/quickstart.py",
    # the module and console-script forms of both launchers (built from the words the watch looks for)
    *(f"/venv/bin/python -m {word} --num_processes 2 train.py" for word in launcher_watch.LAUNCHER_WORDS),
])
def test_a_launcher_parent_with_its_variable_arms_it(monkeypatch, parent):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setattr(launcher_watch, "_parent_command", lambda pid: parent)
    assert launcher_watch.launched_by_launcher()


def test_a_launcher_parent_without_its_variable_does_not(monkeypatch):
    for name in launcher_watch.LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launcher_watch, "_parent_command", lambda pid: "/venv/bin/accelerate launch x.py")
    assert not launcher_watch.launched_by_launcher()


def test_sigterm_releases_the_lock_before_the_process_ends(monkeypatch):
    """accelerate 1.16 passes SIGTERM on to the training process when the launcher is stopped: the lock goes first."""
    events = []
    monkeypatch.setattr("hf_grpo.checks.output_lock.release_all", lambda: events.append("released"))

    def exit_(status):
        events.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(launcher_watch.os, "_exit", exit_)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        launcher_watch._release_on_sigterm()
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with pytest.raises(SystemExit):
            handler(signal.SIGTERM, None)
        assert events == ["released", 128 + signal.SIGTERM]
        # a handler of the user's (or another library's) is left in place
        own = lambda signum, frame: None  # noqa: E731
        signal.signal(signal.SIGTERM, own)
        launcher_watch._release_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_held_lock_is_released_by_the_exit_hooks_the_watch_runs(tmp_path, monkeypatch, caplog):
    """The watch ends the process through runtime.exit_hooks, not by importing the lock: the lock registered its
    release there. A hook that raises is logged and the others still run."""
    from hf_grpo.checks import output_lock
    from hf_grpo.runtime import exit_hooks

    monkeypatch.setattr(exit_hooks, "_hooks", dict(exit_hooks._hooks))  # this test's hooks go with it
    ran = []
    exit_hooks.register("first", lambda: 1 / 0)
    assert output_lock.acquire(str(tmp_path))
    exit_hooks.register("last", lambda: ran.append("last"))
    assert exit_hooks.run_all() == ["first"]
    assert not os.path.exists(output_lock.lock_path(str(tmp_path))) and ran == ["last"]
    assert "the exit hook 'first' failed" in caplog.text
