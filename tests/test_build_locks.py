"""A lock left by an interrupted extension build is named, with its fix, before DeepSpeed waits on it."""

import logging
import os
import time

from hf_grpo.build_locks import STALE_AFTER_S, stale_build_locks, warn_about_stale_build_locks


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
