"""A checkpoint whose save was interrupted is never resumed from, recommended, or kept by rotation in place of a
complete one (hf_grpo.checks.checkpoints). The kill itself, during a 2-process ZeRO-2 save, is in
tests/checks/test_fault_resume.py; here the directory it leaves (checkpoint-N without trainer_state.json) is made by
hand next to checkpoints a run saved."""

import logging
import shutil

import pytest
from tests.test_trainer import make_trainer

from hf_grpo.checks.checkpoints import complete_checkpoints, what_is_missing


def train(tmp_path, resume=None, **overrides):
    values = dict(max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=None)
    values.update(overrides)
    trainer = make_trainer(tmp_path, **values)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def interrupted_save(out, step, like=None):
    """What a kill during the save of ``step`` leaves: the directory, some files, no trainer_state.json."""
    path = out / f"checkpoint-{step}"
    if like is None:
        path.mkdir()
    else:
        shutil.copytree(out / like, path)
        (path / "trainer_state.json").unlink()
    return path


def test_resume_true_takes_the_newest_complete_checkpoint_and_says_what_it_skipped(tmp_path, caplog):
    train(tmp_path)
    out = tmp_path / "out"
    interrupted_save(out, 3)  # the run was killed as checkpoint-3 appeared
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        trainer = train(tmp_path, resume=True, max_steps=4)
    assert trainer.state.global_step == 4
    assert f"resume_from_checkpoint=true skips {out / 'checkpoint-3'}: it has no trainer_state.json" in caplog.text
    assert f"resuming from {out / 'checkpoint-2'}, the newest complete checkpoint" in caplog.text
    # the resumed run saved step 3 anew into an empty directory; the broken one is kept aside, not deleted
    assert complete_checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert (out / "_interrupted-checkpoint-3").is_dir()


def test_a_checkpoint_killed_while_writing_trainer_state_is_skipped(tmp_path, caplog):
    train(tmp_path)
    out = tmp_path / "out"
    state = (out / "checkpoint-2" / "trainer_state.json").read_text()
    (out / "checkpoint-2" / "trainer_state.json").write_text(state[: len(state) // 2])  # killed while writing it
    assert "trainer_state.json is cut short or unreadable" in what_is_missing(str(out / "checkpoint-2"))
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        trainer = train(tmp_path, resume=True, max_steps=3)
    assert f"resuming from {out / 'checkpoint-1'}, the newest complete checkpoint" in caplog.text
    assert trainer.state.global_step == 3
    assert complete_checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_the_fresh_run_refusal_recommends_only_a_complete_checkpoint(tmp_path):
    train(tmp_path)
    out = tmp_path / "out"
    interrupted_save(out, 3)
    with pytest.raises(ValueError) as err:
        train(tmp_path, max_steps=1)
    message = str(err.value)
    assert "checkpoint-3 (incomplete: its save was interrupted)" in message
    assert f"--resume_from_checkpoint {out / 'checkpoint-2'} (or true for the newest complete" in message


def test_a_resume_by_name_from_an_incomplete_checkpoint_says_what_is_missing_and_what_to_use(tmp_path):
    train(tmp_path)
    out = tmp_path / "out"
    partial = interrupted_save(out, 3, like="checkpoint-2")  # weights and optimizer written, then the kill
    trainer = make_trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=1)
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(partial))
    message = str(err.value)
    assert f"resume_from_checkpoint={str(partial)!r} is not a complete checkpoint" in message
    assert "it has no trainer_state.json, the file a save writes last" in message and "model.safetensors" in message
    assert f"resume from {out / 'checkpoint-2'}, the newest complete checkpoint there" in message
    assert trainer.state.global_step == 0 and partial.is_dir()


def test_rotation_never_keeps_an_incomplete_checkpoint_in_place_of_the_last_complete_one(tmp_path):
    train(tmp_path, save_total_limit=1)
    out = tmp_path / "out"
    interrupted_save(out, 9)  # a later save (of a longer earlier run) was interrupted
    train(tmp_path, resume=str(out / "checkpoint-2"), max_steps=3, save_total_limit=1)
    # transformers' rotation orders by step where mtimes are within a second: checkpoint-9 would have been kept
    # as "the newest" and checkpoint-3, the only complete one, deleted
    assert complete_checkpoints(str(out)) == ["checkpoint-3"]
    assert not (out / "checkpoint-9").exists() and (out / "_interrupted-checkpoint-9").is_dir()


def test_resume_true_with_no_complete_checkpoint_is_refused_clearly(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    interrupted_save(out, 5)
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.raises(ValueError, match=r"holds no complete checkpoint \(checkpoint-5: it has no trainer_state"):
        trainer.train(resume_from_checkpoint=True)
