"""A checkpoint save that fails, as on a full disk, is named with the checkpoint, the free space and the checkpoint
it left intact (hf_grpo.checks.checkpoint_save), not only torch's "[enforce fail at inline_container.cc:672]"; a
resume then goes on from that checkpoint."""

import shutil

import pytest
import torch
from tests.test_trainer import make_trainer

from hf_grpo.checks.checkpoints import complete_checkpoints

# what torch.save raises when the disk fills while it writes optimizer.pt
DISK_FULL = ("[enforce fail at inline_container.cc:672] . unexpected pos 1024 vs 960\n"
             "frame #0: c10::ThrowEnforceNotMet(char const*, int, char const*, std::string const&, void const*)")


def disk_full_from_step(monkeypatch, step, error=None):
    """torch.save raises as on a full disk while checkpoint-``step`` (and later) is written."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if f"checkpoint-{step}" in str(f):
            raise error or RuntimeError(DISK_FULL)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("error", [None, OSError(28, "No space left on device")], ids=["torch", "oserror"])
def test_a_save_that_fails_names_the_checkpoint_the_free_space_and_the_one_kept(tmp_path, monkeypatch, error):
    out = tmp_path / "out"
    disk_full_from_step(monkeypatch, 2, error)
    trainer = make_trainer(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1)
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    message = str(err.value)
    assert message.startswith(f"saving {out / 'checkpoint-2'} failed: ")
    assert ("unexpected pos 1024 vs 960" if error is None else "No space left on device") in message
    free = shutil.disk_usage(out).free / 2**30
    assert f" GiB free on its disk (a full disk is the usual cause)" in message
    assert abs(float(message.split(" GiB free")[0].rsplit(" ", 1)[1]) - free) < 1  # the disk's, as it stands
    assert (f"The newest complete checkpoint, {out / 'checkpoint-1'}, is intact" in message
            and "--resume_from_checkpoint true" in message)
    assert complete_checkpoints(str(out)) == ["checkpoint-1"]  # rotation never ran: checkpoint-1 is kept

    monkeypatch.undo()  # space freed: the resume takes checkpoint-1 and trains on
    resumed = make_trainer(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert complete_checkpoints(str(out)) == ["checkpoint-3"]


def test_a_failed_first_save_says_no_checkpoint_was_kept(tmp_path, monkeypatch):
    disk_full_from_step(monkeypatch, 1)
    with pytest.raises(RuntimeError, match=r"No complete checkpoint was saved before it: free space and start the "
                                           r"run again with --overwrite_output_dir true"):
        make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1).train()
    monkeypatch.undo()  # as the message says
    make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, overwrite_output_dir=True).train()
    assert complete_checkpoints(str(tmp_path / "out")) == ["checkpoint-1", "checkpoint-2"]
