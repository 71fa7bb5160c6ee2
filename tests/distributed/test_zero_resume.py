"""A ZeRO checkpoint resumed in another launch shape is refused, naming the optimizer state it would lose
(hf_grpo.distributed.zero_resume), instead of exiting 0 with a fresh optimizer."""

import json
import sys

import pytest
from tests.launching import accelerate_command, run_launch
from tests.distributed.test_launch import QUICK, ROOT
from tests.test_trainer import make_trainer

from hf_grpo.distributed.plain_to_zero import check_stage
from hf_grpo.distributed.zero_resume import check_resume_shape, saved_partitions


def fake_zero_checkpoint(directory, ranks, step=2, prefix=""):
    state = directory / f"checkpoint-{step}" / f"global_step{step}"
    state.mkdir(parents=True)
    (state.parent / "latest").write_text(f"global_step{step}")
    for rank in range(ranks):
        (state / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (state / "mp_rank_00_model_states.pt").write_bytes(b"")
    (state.parent / "trainer_state.json").write_text(f'{{"global_step": {step}}}')  # a complete save's last file
    return str(state.parent)


@pytest.mark.parametrize("prefix", ["", "bf16_"])
def test_the_saved_partitions_are_counted(tmp_path, prefix):
    assert saved_partitions(fake_zero_checkpoint(tmp_path, 2, prefix=prefix)) == 2
    plain = tmp_path / "plain" / "checkpoint-1"
    plain.mkdir(parents=True)
    (plain / "optimizer.pt").write_bytes(b"")
    assert saved_partitions(str(plain)) == 0  # a checkpoint without ZeRO resumes in any shape


def test_the_same_shape_resumes_and_another_is_refused_naming_the_loss(tmp_path):
    checkpoint = fake_zero_checkpoint(tmp_path, 2)
    check_resume_shape(checkpoint, 2, uses_deepspeed=True)
    with pytest.raises(ValueError) as err:
        check_resume_shape(checkpoint, 1, uses_deepspeed=True)
    message = str(err.value)
    assert "optimizer state (Adam's moments and the fp32 master weights) of a DeepSpeed ZeRO run of 2 processes" \
        in message and "global_step2/" in message
    assert "this run has 1 process," in message and "accelerate launch --num_processes 2" in message


def test_a_one_process_run_without_deepspeed_refuses_before_any_step(tmp_path):
    checkpoint = fake_zero_checkpoint(tmp_path / "out", 2)
    trainer = make_trainer(tmp_path, max_steps=3)
    with pytest.raises(ValueError, match="this run does not use DeepSpeed, so it would resume with a fresh optimizer"):
        trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 0


@pytest.mark.slow
@pytest.mark.launch
def test_a_two_process_zero2_checkpoint_is_refused_by_a_one_process_resume(tmp_path, zero2_quickstart_run):
    """As a user does it: save under 2-process ZeRO-2 (CPU, gloo; conftest's zero2_quickstart_run), resume with plain
    python and with the ZeRO-2 config on 1 process; both stop with the reason instead of training on with a fresh
    optimizer."""
    out = tmp_path / "out"
    common = [*QUICK, "--output_dir", out, "--save_steps", 2]
    checkpoint = zero2_quickstart_run / "checkpoint-2"
    assert saved_partitions(str(checkpoint)) == 2
    resume = [*map(str, common), "--max_steps", "4", "--resume_from_checkpoint", str(checkpoint)]
    plain = run_launch([sys.executable, str(ROOT / "recipes" / "quickstart.py"), *resume], processes=1, timeout=900,
                       cwd=ROOT)
    one_zero2 = run_launch(accelerate_command("--config_file", ROOT / "accelerate_configs" / "zero2.yaml",
                                              "--mixed_precision", "no", ROOT / "recipes" / "quickstart.py", *resume,
                                              processes=1), processes=1, timeout=900, cwd=ROOT)
    for result, reason in ((plain, "this run does not use DeepSpeed"), (one_zero2, "this run has 1 process,")):
        assert result.returncode != 0
        assert reason in result.stderr and "ZeRO run of 2 processes" in result.stderr, result.stderr[-3000:]
    assert not (out / "checkpoint-4").exists()


def test_a_checkpoint_without_zero_state_is_refused_under_zero3_naming_what_works(tmp_path):
    plain = tmp_path / "checkpoint-2"
    plain.mkdir()
    (plain / "optimizer.pt").write_bytes(b"")
    check_stage(str(plain), uses_deepspeed=True, stage=2)
    check_stage(str(plain), uses_deepspeed=False, stage=None)
    with pytest.raises(ValueError, match="resumes under ZeRO-1 or ZeRO-2 .* or without DeepSpeed, not under ZeRO-3"):
        check_stage(str(plain), uses_deepspeed=True, stage=3)


@pytest.mark.slow
@pytest.mark.launch
def test_a_one_process_checkpoint_resumes_under_two_process_zero2_with_its_weights_and_adam_moments(tmp_path):
    """Saved by one process (model.safetensors, optimizer.pt), resumed under the shipped zero2.yaml on 2 processes:
    before the first step each rank's ZeRO partition holds exactly the saved weights and Adam moments."""
    from tests.distributed.test_launch import launch, python

    script = "tests/scripts/plain_checkpoint_under_zero.py"
    python(script, tmp_path, "save")
    result = launch("zero2", script, tmp_path, "resume")
    assert "(saved without ZeRO) under DeepSpeed ZeRO: its weights and optimizer.pt" in result.stderr
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert loaded.pop("global_step") == 2 and loaded.pop("adam_steps") == [2.0]
    assert len(loaded) > 10 and all(d["exp_avg_norm"] > 0 for d in loaded.values())
    assert {name: (d["weight"], d["exp_avg"], d["exp_avg_sq"]) for name, d in loaded.items()} == {
        name: (0.0, 0.0, 0.0) for name in loaded}  # copied, not recomputed: exactly equal
    assert (tmp_path / "checkpoint-3" / "trainer_state.json").exists()  # and it trains on, saving under ZeRO
    assert saved_partitions(str(tmp_path / "checkpoint-3")) == 2


@pytest.mark.slow
@pytest.mark.launch
def test_the_quickstart_saved_by_one_process_resumes_with_true_under_zero2(tmp_path):
    common = [*QUICK, "--output_dir", tmp_path, "--save_steps", 2]
    from tests.distributed.test_launch import launch, python

    python("recipes/quickstart.py", *common, "--per_device_train_batch_size", 16, "--max_steps", 2)
    result = launch("zero2", "recipes/quickstart.py", *common, "--max_steps", 4, "--resume_from_checkpoint", "true")
    assert f"resuming {tmp_path / 'checkpoint-2'} (saved without ZeRO) under DeepSpeed ZeRO" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["run"], r["step"]) for r in rows] == [(1, 1), (1, 2), (2, 3), (2, 4)]
