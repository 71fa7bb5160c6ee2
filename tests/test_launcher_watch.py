"""Only a process a launcher started watches its launcher (hf_grpo.distributed.launcher_watch): a script run from a
shell with a launcher's variable exported (ACCELERATE_USE_CPU is also a setting users export) keeps running when
its shell ends, as with nohup. The launches themselves are tests/test_launcher_death.py."""

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
