"""``true_on_policy=True`` (hf_grpo.training.true_on_policy): the sampler's log-prob of every token equals the
trainer's bit for bit, so the old-policy pass it replaces changes nothing; settings that would break that are turned
off or refused by name."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from hf_grpo.recipe_support.tiny import build_tiny_model
from hf_grpo.training import true_on_policy
from tests.test_trainer import GRPOConfig, TOKENIZER, make_trainer

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def saved_model(tmp_path, dtype) -> str:
    """A checkpoint directory, as a hub download leaves one: the run loads it by path."""
    path = tmp_path / f"tiny-{str(dtype).split('.')[-1]}"
    build_tiny_model(TOKENIZER, seed=0, dtype=dtype).save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return str(path)


def mismatches(tmp_path, name, device="cpu", dtype=torch.bfloat16, **fields):
    values = dict(max_steps=2, num_iterations=1, beta=0.0, learning_rate=0.05, temperature=0.9, seed=5,
                  model_init_kwargs={"dtype": dtype})
    if device == "cuda":
        values.update(use_cpu=False, bf16=dtype == torch.bfloat16)
    values.update(fields)
    trainer = make_trainer(tmp_path / name, model=saved_model(tmp_path, dtype), fixed=False, **values)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "rollout_logprobs/abs_diff_max" in entry]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_logprobs_are_the_trainers_bit_for_bit(tmp_path, device, dtype):
    """Measured on the training forward of every step (TRL's defaults: no old-policy pass), prompts of varied length,
    sampled at temperature 0.9: not one token differs."""
    logged = mismatches(tmp_path, "bitwise", device, dtype, true_on_policy=True)
    assert len(logged) == 2
    for entry in logged:
        assert entry["rollout_logprobs/abs_diff_max"] == 0.0, entry
        assert entry["sampling/sampling_logp_difference/max"] == 0.0


def test_without_it_the_two_differ_by_rounding(tmp_path):
    """The check above can fail: the default kernels differ in bf16."""
    logged = mismatches(tmp_path, "default", true_on_policy=False)
    assert max(entry["rollout_logprobs/abs_diff_max"] for entry in logged) > 0


def _peft_run(tmp_path, name, **fields):
    from peft import LoraConfig

    from hf_grpo import GRPOTrainer
    from tests.test_trainer import count_a_reward, prompt_dataset

    values = dict(output_dir=str(tmp_path / name), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=8,
                  num_generations=4, max_completion_length=6, optim="sgd", lr_scheduler_type="constant",
                  logging_steps=1, save_strategy="no", disable_tqdm=True, activation_checkpointing=True, max_steps=4,
                  num_iterations=2, beta=0.04, learning_rate=0.05, temperature=0.9, seed=5, true_on_policy=True,
                  model_init_kwargs={"dtype": torch.bfloat16})
    values.update(fields)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = GRPOTrainer(model=saved_model(tmp_path, torch.bfloat16), reward_funcs=count_a_reward,
                          args=GRPOConfig(**values), train_dataset=prompt_dataset(), processing_class=TOKENIZER,
                          peft_config=lora)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, torch.cat([p.detach().flatten().float() for p in trainer.model.parameters()])


def test_the_sampler_logprobs_replace_the_old_policy_pass_without_changing_a_bit(tmp_path, caplog):
    """num_iterations 2 (TRL runs its old-policy pass), 4 steps, a reference (adapters off), LoRA, activation
    checkpointing, bf16: the run on the sampler's log-probs and the run on TRL's recompute are the same run."""
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        sampled = _peft_run(tmp_path, "sampler", old_logprobs_source="auto")
    assert "old-policy log-probs: the sampler (true_on_policy" in caplog.text
    recomputed = _peft_run(tmp_path, "recompute", old_logprobs_source="recompute")
    assert len(sampled[0]) == 4
    assert sampled[0] == recomputed[0]
    assert torch.equal(sampled[1], recomputed[1])


def test_defaults_that_would_change_a_tokens_arithmetic_are_turned_off_and_said(caplog):
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        config = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], true_on_policy=True)
    assert (config.padding_free, config.compile_training, config.training_cuda_graphs) == (False, "off", "off")
    assert (config.lora_fused_forward, config.compile_generation, config.lora_generation_mirror) == (False, "off",
                                                                                                     "off")
    assert "true_on_policy: padding_free=False" in caplog.text
    untouched = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[])
    assert untouched.lora_fused_forward is True and untouched.compile_training == "auto"


@pytest.mark.parametrize("fields,message", [
    (dict(top_p=0.9), "top_p must be 1.0 (no sampling filter), got 0.9"),
    (dict(top_k=20), "top_k must be 0 (no sampling filter), got 20"),
    (dict(repetition_penalty=1.1), "repetition_penalty must be 1.0"),
    (dict(padding_free=True), "needs padding_free=False (it packs the rows into one sequence"),
    (dict(compile_training="on"), "needs compile_training='off'"),
    (dict(lora_fused_forward=True), "needs lora_fused_forward=False"),
    (dict(cast_lm_head_to_fp32=True), "needs cast_lm_head_to_fp32=False (it runs the trainer's LM head in fp32"),
    (dict(true_on_policy="yes"), "true_on_policy must be True or False, got 'yes'"),
    (dict(use_transformers_continuous_batching=True), "cannot be combined with use_transformers_continuous_batching"),
])
def test_settings_that_cannot_hold_bitwise_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], **{"true_on_policy": True, **fields})


def test_runs_whose_decoder_reads_another_copy_of_the_weights_are_refused():
    model = build_tiny_model(TOKENIZER)
    args = types.SimpleNamespace(true_on_policy=True)
    with pytest.raises(ValueError, match="not supported under DeepSpeed ZeRO-3"):
        true_on_policy.install(model, args, types.SimpleNamespace(sharding=None, zero3=True))
    assert not true_on_policy.installed(model)


def test_model_families_without_routed_kernels_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"supports the model types \('llama', 'mistral', 'qwen2', 'qwen3'\), got "
                                         r"'gpt2'"):
        true_on_policy.install(model, types.SimpleNamespace(true_on_policy=True),
                               types.SimpleNamespace(sharding=None, zero3=False))


def test_a_diffusion_config_refuses_it():
    from hf_grpo.diffusion import DiffuGRPOConfig

    with pytest.raises(ValueError, match="true_on_policy=True matches an autoregressive decoder's log-probs"):
        DiffuGRPOConfig(output_dir="unused", use_cpu=True, report_to=[], true_on_policy=True)


def test_dropout_is_refused_with_the_module_that_drops():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_model(TOKENIZER), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.05))
    with pytest.raises(ValueError, match=r"lora_dropout\.default drops out with p=0\.05"):
        true_on_policy.install(model, types.SimpleNamespace(true_on_policy=True),
                               types.SimpleNamespace(sharding=None, zero3=False))
    assert not any("forward" in vars(module) for module in model.modules())  # refused before anything was routed
