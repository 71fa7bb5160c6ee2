"""A checkpoint's files damaged or edited after its save (``hf_grpo_batch_sizes.json``, ``trainer_state.json``'s
``global_step``) are errors naming the file, what is wrong and what to do, not a bare JSONDecodeError or a TypeError
inside transformers (hf_grpo.memory.saved_sizes, hf_grpo.checks.checkpoints)."""

import json
import logging

import pytest
from tests.test_trainer import make_trainer

from hf_grpo.memory.saved_sizes import SIZES_FILE


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run of 2 steps, a checkpoint after each, to copy and damage."""
    tmp = tmp_path_factory.mktemp("damaged_checkpoint_files")
    make_trainer(tmp, max_steps=2, save_strategy="steps", save_steps=1).train()
    return tmp / "out"


@pytest.fixture
def out(saved_run, tmp_path):
    import shutil

    shutil.copytree(saved_run, tmp_path / "out")
    return tmp_path / "out"


def resume(tmp_path, checkpoint, max_steps=3):
    trainer = make_trainer(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=1)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


@pytest.mark.parametrize("content, problem", [
    ('{"per_device_train_batch_size": 8, "grad', r"it is not valid JSON \(Unterminated string"),
    ("[8, 1, 1]", r"it holds a JSON list, not an object of sizes"),
    ('{"per_device_train_batch_size": "eight"}', r'"per_device_train_batch_size" is \'eight\', not a positive'),
    ('{"tensor_batch_size": 64}', r'it has neither "chosen_for" nor "per_device_train_batch_size"'),
])
def test_a_damaged_sizes_file_names_the_file_and_what_to_do(tmp_path, out, content, problem):
    sizes = out / "checkpoint-2" / SIZES_FILE
    sizes.write_text(content)
    with pytest.raises(ValueError, match=rf"^{sizes} cannot be used: {problem}") as err:
        resume(tmp_path, str(out / "checkpoint-2"))
    assert "delete it to resume with this run's own sizes" in str(err.value)
    sizes.unlink()  # as the message says: the resume then goes on with this run's sizes
    assert resume(tmp_path, str(out / "checkpoint-2")).state.global_step == 3


@pytest.mark.parametrize("step", ["abc", -1, 2.5, None])
def test_a_global_step_that_is_not_a_step_number_names_the_file_and_the_checkpoint_to_use(tmp_path, out, step):
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["global_step"] = step
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=rf"is not a complete checkpoint: its trainer_state.json has \"global_step\": "
                                         rf"{json.dumps(step)}, not a step number .*resume from "
                                         rf"{out / 'checkpoint-1'}, the newest complete checkpoint there"):
        resume(tmp_path, str(out / "checkpoint-2"))


def test_resume_true_skips_a_checkpoint_whose_global_step_was_damaged(tmp_path, out, caplog):
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "global_step": "abc"}))
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        trainer = resume(tmp_path, True)
    assert f"skips {out / 'checkpoint-2'}: its trainer_state.json has \"global_step\": \"abc\"" in caplog.text
    assert f"resuming from {out / 'checkpoint-1'}" in caplog.text
    assert trainer.state.global_step == 3
