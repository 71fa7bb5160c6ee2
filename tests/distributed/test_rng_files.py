"""Every rank's random state, and the run's sizes, are in a checkpoint before rank 0 marks it complete
(hf_grpo.distributed.rng_files), and a resume from a checkpoint without its rank's random state says so."""

import json
import logging

import pytest

from hf_grpo.distributed.rng_files import warn_if_missing
from hf_grpo.memory.autosize import SIZES_FILE


@pytest.mark.slow
@pytest.mark.launch
def test_rank_zero_marks_a_checkpoint_complete_only_after_every_rank_saved_its_random_state(tmp_path):
    # Rank 1 takes 3 s to write its random state, as a rank being stopped might: transformers alone writes rank 0's
    # trainer_state.json meanwhile, and a kill in that gap leaves a checkpoint that looks whole without it. The run's
    # sizes (hf_grpo.memory.autosize) are in it by then too, not written after the old checkpoints' rotation.
    from tests.distributed.test_launch import launch

    launch("multi_gpu", "tests/scripts/slow_rank_checkpoint.py", tmp_path)
    seen = json.loads((tmp_path / "marked_complete.json").read_text())
    files = sorted(["rng_state_0.pth", "rng_state_1.pth", SIZES_FILE])
    assert seen == {f"checkpoint-{step}": files for step in (1, 2)}


def test_a_resume_without_the_ranks_random_state_says_what_it_loses(tmp_path, caplog):
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "rng_state_0.pth").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        assert warn_if_missing(str(checkpoint), world_size=2, rank=1)
    assert "not rank 1's (rng_state_1.pth)" in caplog.text and "rng_state_0.pth" in caplog.text
    assert "rollouts will differ" in caplog.text
    caplog.clear()
    (checkpoint / "rng_state_1.pth").write_bytes(b"")
    assert not warn_if_missing(str(checkpoint), world_size=2, rank=1)
    # one process, no checkpoint, or a checkpoint saved without random states: nothing to say here
    assert not warn_if_missing(str(checkpoint), world_size=1, rank=0)
    assert not warn_if_missing(None, world_size=2, rank=1)
    bare = tmp_path / "checkpoint-2"
    bare.mkdir()
    assert not warn_if_missing(str(bare), world_size=2, rank=1)
    assert not caplog.text
