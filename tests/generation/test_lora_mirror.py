"""LoRA rollouts from a merged copy (``lora_generation_mirror``): a LoRA policy outside ZeRO-3 decodes from a plain
copy of the weights with the adapters merged, refreshed each rollout, instead of running the adapters inside
every decode step. What a user relies on: the choice ("auto" needs CUDA and memory, "on" forces it, models
without LoRA are left alone), and that a GRPO run from a saved checkpoint with LoRA generates from the copy,
whose logits equal the live PEFT policy's at every rollout, after optimizer steps have moved the adapters.
The GPU test checks greedy LoRA rollouts of the cuda_graph backend from the copy against the unmerged model.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_grpo
from hf_grpo.generation import dense_mirror
from hf_grpo.generation.hf import HFGenerateBackend
from hf_grpo.plan import BatchPlan
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model, save_tiny_checkpoint

CPU = torch.device("cpu")


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def test_choose_lora_leaves_models_without_lora_alone():
    model = build_tiny_model(build_char_tokenizer())
    assert dense_mirror.choose_lora("on", model, "auto", CPU, lambda v: v) is None


def test_choose_lora_off_auto_and_on():
    policy = _lora(build_tiny_model(build_char_tokenizer()))
    off = dense_mirror.choose_lora("off", policy, "auto", CPU, lambda v: v)
    assert off.mirror is None and off.reason == "lora_generation_mirror='off'" and off.kind == "LoRA"
    auto = dense_mirror.choose_lora("auto", policy, "auto", CPU, lambda v: v)  # the decoder it serves needs CUDA
    assert auto.mirror is None and "CUDA" in auto.reason
    on = dense_mirror.choose_lora("on", policy, "hf", CPU, lambda v: v)
    assert on.mirror is not None and not any("lora" in n for n, _ in on.mirror.module.named_parameters())
    assert "adapters merged" in str(on)
    plan = BatchPlan(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=1,
                     num_generations=4, num_iterations=1, per_device_generation_batch_size=4,
                     tensor_batch_size=64, world_size=1, **on.plan_fields())
    assert "LoRA: decoded from a copy with the adapters merged" in str(plan)


def test_config_rejects_an_unknown_lora_mirror_setting(make_config):
    with pytest.raises(ValueError, match=r"lora_generation_mirror must be one of .*got 'yes'"):
        make_config(lora_generation_mirror="yes")


def test_lora_run_from_a_checkpoint_generates_from_the_merged_copy(tmp_path, monkeypatch):
    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    config = hf_grpo.GRPOConfig(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=3, seed=0,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4, max_completion_length=4,
        learning_rate=0.05, logging_steps=1, save_strategy="no", disable_tqdm=True, generation_backend="hf",
        lora_generation_mirror="on", beta=0.04,  # with LoRA the reference is the policy with adapters disabled
    )
    trainer = hf_grpo.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(checkpoint), processing_class=tokenizer, args=config,
        reward_funcs=lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": ["ab>", "c>", "defgh>", "ij>"] * 4}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    rollouts = []  # per rollout: the largest |logit| gap between the copy and the live policy, and the LoRA size
    generate = HFGenerateBackend.generate

    def checked_generate(self, model, prompt_ids, **kwargs):
        mirror = trainer._mirror_choice.mirror
        assert model is mirror.module, "the rollout did not decode from the merged copy"
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            gap = (model(ids).logits - trainer.model(input_ids=ids).logits).abs().max().item()
        lora_b = max(p.abs().max().item() for n, p in trainer.model.named_parameters() if "lora_B" in n)
        rollouts.append((gap, lora_b))
        return generate(self, model, prompt_ids, **kwargs)

    monkeypatch.setattr(HFGenerateBackend, "generate", checked_generate)
    trainer.train()
    assert len(rollouts) == 3
    assert rollouts[0][1] == 0 and rollouts[-1][1] > 0, "the adapters never moved: the test would prove nothing"
    assert all(gap < 1e-5 for gap, _ in rollouts), rollouts
    assert trainer.batch_plan().generation_mirror_kind == "LoRA"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_lora_rollout_from_the_merged_copy_equals_the_unmerged_model():
    from hf_grpo.generation.cuda_graph import CudaGraphBackend

    tokenizer = build_char_tokenizer()
    policy = _lora(build_tiny_model(tokenizer, dtype=torch.float32).cuda())
    torch.manual_seed(1)
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # B starts at zero; a non-zero delta makes the merge matter
            torch.nn.init.normal_(param, std=0.1)
    choice = dense_mirror.choose_lora("on", policy, "cuda_graph", torch.device("cuda"), lambda v: v)
    merged = choice.mirror.refresh(policy)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    greedy = dict(generation_config=merged.generation_config.__class__(do_sample=False, max_new_tokens=12),
                  chunk_size=len(prompts), pad_token_id=0, eos_token_ids=[1])
    from_copy = CudaGraphBackend().generate(merged, prompts, **greedy)
    from_adapters = HFGenerateBackend().generate(policy, prompts, **greedy)
    assert from_copy == from_adapters
