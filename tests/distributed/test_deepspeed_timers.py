"""DeepSpeed's throughput timer measures without waiting for the device (``distributed.deepspeed_timers``), unless the
user's DeepSpeed config sets it. That the engine accelerate builds then takes it is checked in a CPU launch
(``tests/distributed/test_packed_launch.py``)."""

from __future__ import annotations

import pytest

from hf_grpo.distributed import deepspeed_timers


def test_an_unset_throughput_timer_measures_without_device_waits():
    config = {"zero_optimization": {"stage": 2}, "steps_per_print": float("inf")}
    assert deepspeed_timers.unsynchronized(config)
    assert config["timers"] == {"throughput": {"enabled": True, "synchronized": False}}
    assert config["zero_optimization"] == {"stage": 2}  # nothing else touched


def test_the_change_to_the_users_config_is_logged_and_a_choice_of_theirs_is_not(caplog):
    with caplog.at_level("INFO", logger="hf_grpo"):
        deepspeed_timers.unsynchronized({})
    assert "timers.throughput" in caplog.text and "without device waits" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="hf_grpo"):
        deepspeed_timers.unsynchronized({"timers": {"throughput": {"enabled": False}}})
    assert caplog.text == ""


def test_only_the_main_process_says_it_though_every_rank_sets_it(caplog):
    config = {}
    with caplog.at_level("INFO", logger="hf_grpo"):
        assert deepspeed_timers.unsynchronized(config, is_main_process=False)
    assert config["timers"]["throughput"] == {"enabled": True, "synchronized": False}
    assert caplog.text == ""


def test_other_timers_the_user_set_are_kept_beside_it():
    config = {"timers": {"other": {"enabled": False}}}
    assert deepspeed_timers.unsynchronized(config)
    assert config["timers"] == {"other": {"enabled": False}, "throughput": {"enabled": True, "synchronized": False}}


@pytest.mark.parametrize("mine", [{"enabled": True, "synchronized": True}, {"enabled": False}, {}])
def test_the_users_own_throughput_timer_is_left_as_it_is(mine):
    config = {"timers": {"throughput": dict(mine)}}
    assert not deepspeed_timers.unsynchronized(config)
    assert config == {"timers": {"throughput": mine}}


def test_without_deepspeed_nothing_is_set():
    assert not deepspeed_timers.unsynchronized(None)


def test_deepspeed_reads_the_setting_as_written_here():
    """DeepSpeed's own config model accepts the block and reads it as meant (the engine's timer takes this config)."""
    pytest.importorskip("deepspeed")
    from deepspeed.utils.config import get_timers_config

    config = {}
    deepspeed_timers.unsynchronized(config)
    throughput = get_timers_config(config)  # the throughput timer's own
    assert throughput.enabled is True and throughput.synchronized is False
    assert get_timers_config({}).synchronized is True  # DeepSpeed's default, which this changes
