"""A finished run resumed (``--resume_from_checkpoint true``, as a preemptible job passes on every start) trains no
step, saves and rotates no checkpoint, and leaves the model with its last checkpoint's weights, which the recipe
writes as the final model (hf_grpo.checks.resume.finished). Without it, transformers trained one step past
max_steps and its save rotated the run's final checkpoint away.

One process here, in this process; 2-process ZeRO-2 (CPU, gloo) below, marked ``launch``."""

import json
import shutil

import pytest
import torch
from tests.in_process import run_recipe
from safetensors.torch import load_file
from tests.distributed.test_launch import QUICK, launch

RUN = [*QUICK, "--max_steps", 2, "--save_steps", 2, "--save_total_limit", 1]


def files_of(directory):
    """Every file under ``directory`` (relative path: bytes), to tell that nothing in it was rewritten."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_finished_resume(out, log, checkpoint_files, rows, final_weights, step):
    checkpoint = out / f"checkpoint-{step}"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [checkpoint.name]  # none saved, none rotated away
    assert files_of(checkpoint) == checkpoint_files
    assert (out / "metrics.jsonl").read_text().splitlines() == rows  # no step trained, none logged
    written = load_file(out / "model.safetensors")
    assert written.keys() == final_weights.keys()
    for name, tensor in final_weights.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0)
    assert f"resume_from_checkpoint: {checkpoint} is at step {step}, the run's max_steps={step}" in log, log[-3000:]


def test_a_finished_run_resumed_trains_nothing_and_keeps_its_final_checkpoint_and_model(tmp_path):
    out = tmp_path / "out"
    common = [*RUN, "--output_dir", out]
    first = run_recipe("quickstart", common)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint_files, rows = files_of(out / "checkpoint-2"), (out / "metrics.jsonl").read_text().splitlines()
    final = load_file(out / "model.safetensors")
    performance = (out / "performance.json").read_text()

    resumed = run_recipe("quickstart", [*common, "--resume_from_checkpoint", "true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_finished_resume(out, resumed.stderr, checkpoint_files, rows, final, 2)
    assert (out / "performance.json").read_text() == performance  # the figures of the run that trained

    # killed between the last save and the final model: the resume writes it from checkpoint-2, training nothing
    for name in ("model.safetensors", "config.json", "performance.json"):
        (out / name).unlink()
    resumed = run_recipe("quickstart", [*common, "--resume_from_checkpoint", "true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_finished_resume(out, resumed.stderr, checkpoint_files, rows, final, 2)
    assert json.loads((out / "performance.json").read_text())["per_rank"][0]["step_s"] == 0  # written: it was gone


def test_a_library_resume_past_max_steps_trains_nothing_and_holds_the_checkpoints_weights(tmp_path, caplog):
    from tests.test_trainer import make_trainer

    make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = load_file(checkpoint / "model.safetensors")
    trainer = make_trainer(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)  # below the checkpoint's step
    with caplog.at_level("WARNING", logger="hf_grpo"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 2 and sorted(p.name for p in checkpoint.parent.glob("checkpoint-*")) == [
        "checkpoint-2"]
    held = trainer.model.state_dict()  # what the script's save_model() then writes
    assert saved.keys() <= held.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(held[name], tensor, rtol=0, atol=0)
    assert f"resume_from_checkpoint: {checkpoint} is at step 2, past the run's max_steps=1" in caplog.text


@pytest.mark.slow
@pytest.mark.launch
def test_a_finished_zero2_run_resumed_on_two_processes_trains_nothing(tmp_path, zero2_quickstart_run):
    """conftest's zero2_quickstart_run (6 steps, checkpoints 2, 4, 6), its final model removed as by a kill after the
    last save: resumed with true (and save_total_limit 1, which a save would apply) it writes the final model from
    checkpoint-6's ZeRO state, saves no checkpoint-7 and removes none."""
    from tests.distributed.test_launch import ZERO2_QUICKSTART, ZERO2_QUICKSTART_STEPS as STEPS

    out = tmp_path / "out"
    shutil.copytree(zero2_quickstart_run, out)
    final = load_file(out / "model.safetensors")
    kept = {name: files_of(out / name) for name in ("checkpoint-2", "checkpoint-4", f"checkpoint-{STEPS}")}
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "model.safetensors").unlink()

    result = launch("zero2", "recipes/quickstart.py", *ZERO2_QUICKSTART, "--output_dir", out,
                    "--resume_from_checkpoint", "true", "--save_total_limit", 1)
    assert {p.name: files_of(p) for p in out.glob("checkpoint-*")} == kept  # no global_step tag added either
    assert (out / "metrics.jsonl").read_text().splitlines() == rows
    written = load_file(out / "model.safetensors")
    for name, tensor in final.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0)
    checkpoint = out / f"checkpoint-{STEPS}"
    assert f"resume_from_checkpoint: {checkpoint} is at step {STEPS}, the run's max_steps={STEPS}" in result.stderr
