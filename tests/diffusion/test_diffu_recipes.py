"""Recipes end to end: the diffusion quickstart learns, the countdown recipe runs --tiny and on a trust_remote_code
checkpoint written here (its own modelling file + auto_map), and a 2-process ZeRO-2 launch."""

import json
import math
import os
import pathlib
import shutil
import string

import pytest
import torch
from tests.project_files import load_file, load_recipe
from tests.launching import accelerate_command, run_launch
from transformers import GenerationConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent


def metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


QUICK = ["--disable_tqdm", "true", "--logging_steps", "1", "--report_to", "none", "--plot", "false"]


def write_remote_checkpoint(directory, auto_class: str, **config_overrides):
    """A checkpoint whose model class exists only in its own modeling file, reached through config.auto_map
    under ``auto_class`` (LLaDA registers AutoModelForCausalLM; Dream registers AutoModel only)."""
    from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer

    module = load_file(HERE / "remote_llada.py", "modeling_tiny_llada")
    tokenizer = build_diffusion_tokenizer(string.printable)
    config = module.TinyLLaDAConfig(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                    **config_overrides)
    torch.manual_seed(0)
    module.TinyLLaDAModelLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    shutil.copy(HERE / "remote_llada.py", directory / "modeling_tiny_llada.py")
    saved = json.loads((directory / "config.json").read_text())
    saved["auto_map"] = {"AutoConfig": "modeling_tiny_llada.TinyLLaDAConfig",
                         auto_class: "modeling_tiny_llada.TinyLLaDAModelLM"}
    (directory / "config.json").write_text(json.dumps(saved))
    return directory


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory):
    return write_remote_checkpoint(tmp_path_factory.mktemp("remote_llada"), "AutoModelForCausalLM")


@pytest.fixture(scope="module")
def remote_checkpoint_automodel_only(tmp_path_factory):
    return write_remote_checkpoint(tmp_path_factory.mktemp("remote_dream_style"), "AutoModel")


def test_remote_code_model_loads_only_with_trust_and_samples_padding_invariantly(remote_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_grpo.diffusion.model import padding_style
    from hf_grpo.diffusion.sampler import DiffusionSampler

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(remote_checkpoint, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(remote_checkpoint, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(remote_checkpoint)
    assert padding_style(model) == "bias4d"  # LLaDA family: the padding mask goes in as attention_bias
    prompts = [tokenizer(p)["input_ids"] for p in ["12+3=", "4>", "56*78-9="]]
    config = GenerationConfig(max_new_tokens=8, do_sample=False)

    def greedy(style, chunk):
        sampler = DiffusionSampler(block_length=4, steps=4, mask_token_id=tokenizer.mask_token_id,
                                   padding_style=style)
        return sampler.generate(model, prompts, generation_config=config, chunk_size=chunk, pad_token_id=0,
                                eos_token_ids=[1])

    with torch.no_grad():
        alone = greedy("bias4d", 1)
        assert greedy("bias4d", 3) == alone
        # LLaDA's 2-D attention_mask path turns causal when the batch is padded: the completions change
        assert greedy("mask2d", 3) != alone


@pytest.mark.parametrize("peft", ["true", "false"], ids=["lora_reference_is_base", "full_reference_from_path"])
def test_remote_code_checkpoint_trains_through_the_recipe(tmp_path, remote_checkpoint, peft):
    recipe = load_recipe("diffu_countdown")
    trainer = recipe.main([
        "--model_name_or_path", str(remote_checkpoint), "--trust_remote_code", "true", "--use_peft", peft,
        "--output_dir", str(tmp_path), "--max_steps", "2", "--max_completion_length", "8", "--block_length", "4",
        "--diffusion_steps", "4", "--num_iterations", "2", "--beta", "0.04", "--num_train_samples", "12",
        "--dtype", "float32", "--learning_rate", "1e-3", *QUICK])
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert type(trainer.accelerator.unwrap_model(trainer.model)).__name__ == (
        "PeftModelForCausalLM" if peft == "true" else "TinyLLaDAModelLM")
    assert (trainer.ref_model is None) == (peft == "true")  # LoRA: base model; full: TRL's copy from the path
    assert trainer.mask_token_id == 2 and trainer.logits_shift is False
    stats = json.loads((tmp_path / "performance.json").read_text())["per_rank"][0]
    assert stats["memory_manager_stats"]["peak_memory_gib"] > 0


def test_full_fine_tuning_with_a_reference_from_an_automodel_only_checkpoint(tmp_path,
                                                                             remote_checkpoint_automodel_only):
    """Dream's auto_map has AutoModel only, which TRL's reference loader (AutoModelForCausalLM) cannot open:
    the reference is a frozen copy of the freshly loaded policy instead, and trains with beta > 0."""
    trainer = load_recipe("diffu_countdown").main([
        "--model_name_or_path", str(remote_checkpoint_automodel_only), "--trust_remote_code", "true",
        "--use_peft", "false", "--output_dir", str(tmp_path), "--max_steps", "2", "--max_completion_length", "8",
        "--block_length", "4", "--diffusion_steps", "4", "--beta", "0.04", "--num_train_samples", "12",
        "--dtype", "float32", "--learning_rate", "1e-3", *QUICK])
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    assert type(reference).__name__ == "TinyLLaDAModelLM" and not any(p.requires_grad for p in reference.parameters())
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert all(p.data_ptr() != r.data_ptr() for p, r in zip(policy.parameters(), reference.parameters()))
    assert all(math.isfinite(r["kl"]) for r in rows)  # the KL term ran against that reference


@pytest.mark.slow
@pytest.mark.convergence  # 50 steps, minutes on CPU: `pytest -m convergence` (docs/testing.md)
def test_diffu_quickstart_reward_rises_and_writes_its_plot(tmp_path):
    quickstart = load_recipe("diffu_quickstart")
    quickstart.main(["--output_dir", str(tmp_path), "--max_steps", "50", "--disable_tqdm", "true"])
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(5, 55, 5))
    first = sum(r["reward"] for r in rows[:3]) / 3
    last = sum(r["reward"] for r in rows[-3:]) / 3
    # each logged reward averages 5 steps x 64 completions; seeded runs here go from about 0.05 to about 0.33
    assert last > first + 0.15, (first, last)
    assert (tmp_path / "reward_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diffu_countdown_tiny_with_its_yaml(tmp_path):
    trainer = load_recipe("diffu_countdown").main([
        "--config", str(ROOT / "recipes" / "diffu_countdown.yaml"), "--tiny", "--output_dir", str(tmp_path),
        "--max_steps", "2", "--max_completion_length", "16", "--block_length", "8", "--diffusion_steps", "8",
        "--num_iterations", "2", "--num_train_samples", "32", "--dtype", "float32", *QUICK])
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    args = trainer.args  # the YAML's d1 settings, the command line's sampler sizes
    assert (args.epsilon, args.beta, args.temperature, args.scale_rewards, args.max_grad_norm) == (
        0.5, 0.04, 0.9, "none", 0.2)
    # d1's objective term by term
    assert (args.objective, args.loss_type, args.use_bias_correction_kl, args.score_with_temperature) == (
        "d1", "bnpo", False, False)
    assert trainer.estimator.temperature == 1.0
    assert (args.block_length, args.diffusion_steps, args.p_mask_prompt) == (8, 8, 0.15)
    assert trainer.batch_plan().generation_chunks == 2  # 12 completions per rollout in chunks of 6


@pytest.mark.slow
@pytest.mark.launch
def test_diffu_quickstart_under_zero2_with_two_processes(tmp_path):
    command = accelerate_command("--config_file", ROOT / "accelerate_configs" / "zero2.yaml", "--mixed_precision", "no",
                                 ROOT / "recipes" / "diffu_quickstart.py", "--use_cpu", "true", "--bf16", "false",
                                 "--output_dir", tmp_path, "--max_steps", "2", "--per_device_train_batch_size", "8",
                                 "--gradient_accumulation_steps", "2", "--num_iterations", "2", "--beta", "0.04",
                                 *QUICK, processes=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    result = run_launch(command, processes=2, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "hf-grpo batch plan (world size 2)" in result.stderr
    assert "hf-grpo diffusion plan" in result.stderr
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    per_rank = json.loads((tmp_path / "performance.json").read_text())["per_rank"]
    assert len(per_rank) == 2 and all(rank["memory_manager_stats"]["peak_memory_gib"] > 0 for rank in per_rank)


@pytest.mark.slow
@pytest.mark.launch
def test_released_llada_style_checkpoint_under_zero3_with_two_processes(tmp_path):
    """A checkpoint that attends to padding (as the released LLaDA code) under ZeRO-3, two processes: the ranks
    group their prompts by length into different numbers of forwards, which are collective under ZeRO-3; they
    run as many as the busiest rank, so the run finishes (without that, it hangs at step 3 of this seed: one
    rank scores its rollout in 1 group, the other in 3). LoRA: full fine-tuning of this remote-code model
    under ZeRO-3 fails in its second backward on the CPU with or without the padding handling."""
    checkpoint = write_remote_checkpoint(tmp_path / "released_llada", "AutoModelForCausalLM",
                                         ignores_attention_mask=True)
    command = accelerate_command(
        "--config_file", ROOT / "accelerate_configs" / "zero3.yaml", "--mixed_precision", "no",
        ROOT / "recipes" / "diffu_countdown.py", "--use_cpu", "true", "--bf16", "false",
        "--model_name_or_path", checkpoint, "--trust_remote_code", "true", "--use_peft", "true",
        "--output_dir", tmp_path / "out", "--max_steps", "8", "--max_completion_length", "8",
        "--block_length", "4", "--diffusion_steps", "4", "--num_iterations", "2", "--beta", "0.0",
        "--per_device_train_batch_size", "6", "--per_device_generation_batch_size", "3",
        "--num_generations", "2",  # three prompts per rank: lengths differ, so do the ranks' group counts
        "--num_train_samples", "48", "--dtype", "float32", "--learning_rate", "1e-3", *QUICK, processes=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    result = run_launch(command, processes=2, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "attends to padding whatever mask it is given" in result.stderr
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == list(range(1, 9)) and all(math.isfinite(r["loss"]) for r in rows)


def test_diffu_countdown_runs_no_checkpoint_code_unless_asked(tmp_path, remote_checkpoint):
    """trust_remote_code is opt-in: false with the YAML and without it (the --tiny model needs none); a checkpoint
    that ships code is refused naming the flag, before anything trains; --trust_remote_code true opts in."""
    from hf_grpo.recipe_support.diffusion_launch import parse_diffu_recipe_args

    recipe = load_recipe("diffu_countdown")
    out = ["--output_dir", str(tmp_path / "parsed")]
    for argv in (out, ["--config", str(ROOT / "recipes" / "diffu_countdown.yaml"), *out]):
        assert parse_diffu_recipe_args(recipe.DEFAULTS, argv)[0].trust_remote_code is False
    assert parse_diffu_recipe_args(recipe.DEFAULTS, [*out, "--trust_remote_code", "true"])[0].trust_remote_code

    with pytest.raises(ValueError, match=r"ships its own modelling code .* add --trust_remote_code true"):
        recipe.main(["--model_name_or_path", str(remote_checkpoint), "--output_dir", str(tmp_path / "run"),
                     "--max_steps", "1", "--num_train_samples", "12", *QUICK])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
