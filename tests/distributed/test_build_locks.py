"""A lock left by an interrupted extension build is named, with its fix, before DeepSpeed waits on it."""

import logging
import os
import time

from hf_grpo.distributed.build_locks import STALE_AFTER_S, stale_build_locks, warn_about_stale_build_locks


def _lock(path, age_s):
    path.parent.mkdir(parents=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_old_locks_are_found_in_both_layouts_and_a_running_build_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    flat = _lock(tmp_path / "cpu_adam" / "lock", STALE_AFTER_S + 60)  # TORCH_EXTENSIONS_DIR/<op>/lock
    nested = _lock(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", 3 * 3600)  # cache/<py_cu>/<op>/lock
    _lock(tmp_path / "py311_cpu" / "fused_adam" / "lock", 30)  # a build started 30 s ago: still running
    (tmp_path / "py311_cpu" / "other").mkdir()
    (tmp_path / "py311_cpu" / "other" / "cpu_adam.so").touch()
    assert stale_build_locks() == sorted([flat, nested])


def test_the_warning_names_the_file_and_how_to_remove_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path / "cpu_adam" / "lock", 3600)
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        assert warn_about_stale_build_locks(is_main_process=True) == [lock]
    assert f"rm {lock}" in caplog.text and "60 minutes ago" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        warn_about_stale_build_locks(is_main_process=False)  # said once, by the main process
    assert caplog.text == ""
    lock.unlink()
    assert warn_about_stale_build_locks() == []


def test_deepspeed_runs_are_told_at_launch_and_by_the_trainer_not_by_the_config(tmp_path, monkeypatch, caplog,
                                                                                 make_config):
    """Building a config has no side effect; a recipe's launch (before its config, whose build may already build
    DeepSpeed's CPU communication op) and the trainer (for code that builds its own config) name the lock."""
    from hf_grpo.distributed import build_locks
    from hf_grpo.distributed.build_locks import launched_with_deepspeed
    from hf_grpo.recipe_support.launch import parse_recipe_args

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(build_locks, "_named", set())
    lock = _lock(tmp_path / "ext" / "deepspeed_shm_comm" / "lock", 3600)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert not launched_with_deepspeed(None)
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        assert build_locks.warn_if_launched_with_deepspeed(None) == []
    assert str(lock) not in caplog.text  # no DeepSpeed, no word about its locks
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as accelerate launch's DeepSpeed launcher sets it
    assert launched_with_deepspeed(None) and launched_with_deepspeed("ds_config.json")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setattr(build_locks, "launched_with_deepspeed", lambda field: True)
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        make_config()
    assert str(lock) not in caplog.text  # the config says nothing: a config is data
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        parse_recipe_args({}, ["--output_dir", str(tmp_path / "out"), "--tiny", "true"])
    assert caplog.text.count(f"rm {lock}") == 1
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        assert build_locks.warn_if_launched_with_deepspeed("ds_config.json") == [lock]
    assert caplog.text.count(f"rm {lock}") == 1  # named once a process, not again by the trainer


def test_the_trainer_names_stale_locks_under_deepspeed(monkeypatch):
    """GRPOTrainer checks for the locks among its input checks, before TRL prepares the model."""
    from hf_grpo.distributed import build_locks
    from hf_grpo.trainer import GRPOTrainer

    asked = []
    monkeypatch.setattr(build_locks, "warn_if_launched_with_deepspeed", lambda field: asked.append(field))
    monkeypatch.setattr("hf_grpo.checks.inputs.check_train_dataset", lambda dataset: None)
    monkeypatch.setattr("hf_grpo.checks.inputs.check_generation_backend_installed", lambda backend: None)

    class Args:
        generation_backend, deepspeed = "hf", "ds_config.json"

    GRPOTrainer._check_inputs(model=object(), args=Args())
    assert asked == ["ds_config.json"]
