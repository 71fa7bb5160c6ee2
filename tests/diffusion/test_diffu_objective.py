"""objective="d1": d1's diffu-GRPO loss term by term, checked against the formula written out on a fixed batch.

    ratio  = exp(logp - old)                                    logp from the RAW logits (no / temperature)
    policy = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)    A = r - mean of the group (no std scaling)
    kl     = exp(ref - logp) - (ref - logp) - 1                  plain k3 (not multiplied by the ratio)
    loss   = sum((policy + beta * kl) * mask) / sum(mask)        one token mean over the micro-batch
"""

import pytest
import torch
from datasets import Dataset

from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model
from hf_grpo.generation import HFGenerateBackend

TOKENIZER = build_diffusion_tokenizer()
MASK = TOKENIZER.mask_token_id
PROMPTS = ["ab>", "cd>", "ef>", "gh>"]  # equal lengths: the plain forward below needs no padding
SLOTS, EPSILON, BETA, TEMPERATURE = 8, 0.2, 0.04, 0.7
LETTERS = TOKENIZER.convert_tokens_to_ids(list("abcab"))


def count_a_reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


class FixedBackend(HFGenerateBackend):
    def generate(self, model, prompt_ids, **kwargs):
        return [[LETTERS[row % 5]] * (1 + row % 4) + [TOKENIZER.eos_token_id] for row, p in enumerate(prompt_ids)]


def make_trainer(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, per_device_train_batch_size=8,
                  num_generations=4, max_completion_length=SLOTS, block_length=4, diffusion_steps=4, seed=3,
                  save_strategy="no", disable_tqdm=True, activation_checkpointing=False, p_mask_prompt=0.0,
                  beta=BETA, epsilon=EPSILON, temperature=TEMPERATURE, num_iterations=2)
    values.update(overrides)
    trainer = DiffuGRPOTrainer(model=build_tiny_diffusion_model(TOKENIZER, seed=0, dtype=torch.float64),
                               reward_funcs=count_a_reward, args=DiffuGRPOConfig(**values),
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=TOKENIZER)
    trainer.decisions.backend = FixedBackend()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def fixed_batch(trainer):
    """A rollout of 8 rows (2 prompts x 4), with old and reference log-probs moved off the policy's."""
    rollout = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    generator = torch.Generator().manual_seed(0)
    for key in ("diffu_old_logps", "diffu_ref_logps"):
        rollout[key] = rollout[key] + 0.5 * torch.randn(rollout[key].shape, generator=generator, dtype=torch.float64)
    return rollout


def raw_logit_logps(model, batch):
    """Mean-field log-probs written out: one forward of [prompt | SLOTS masks], log_softmax of the raw logits."""
    rows = torch.cat([batch["prompt_ids"], torch.full((len(batch["prompt_ids"]), SLOTS), MASK)], dim=1)
    width = batch["prompt_ids"].size(1)
    logits = model(input_ids=rows).logits[:, width:width + batch["completion_ids"].size(1)]
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def d1_loss(logp, old, ref, advantages, mask):
    ratio = torch.exp(logp - old)
    a = advantages.unsqueeze(1)
    policy = -torch.min(ratio * a, ratio.clamp(1 - EPSILON, 1 + EPSILON) * a)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    return ((policy + BETA * kl) * mask).sum() / mask.sum()


def test_d1_objective_loss_equals_the_formula_on_a_fixed_batch(tmp_path):
    trainer = make_trainer(tmp_path, objective="d1")
    batch = fixed_batch(trainer)
    rewards = torch.tensor(count_a_reward(TOKENIZER.batch_decode(batch["completion_ids"], skip_special_tokens=True)))
    expected_advantages = rewards - rewards.view(-1, 4).mean(1).repeat_interleave(4)
    torch.testing.assert_close(batch["advantages"].double(), expected_advantages.double(), rtol=0, atol=1e-7)
    assert expected_advantages.abs().sum() > 0 and rewards.view(-1, 4).std(1).ne(1).all()  # std scaling would show
    trainer._step = trainer._rollout_start_step  # iteration k = 0
    loss = trainer._compute_loss(trainer.model, batch)
    mask = batch["completion_mask"].double()
    expected = d1_loss(raw_logit_logps(trainer.model, batch), batch["diffu_old_logps"][:, 0],
                       batch["diffu_ref_logps"][:, 0], batch["advantages"].double(), mask)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-9)  # the estimator scores in float32


def test_trl_settings_give_another_loss_on_the_same_batch(tmp_path):
    """Guards the test above: the terms d1 changes matter on this batch (TRL's defaults, bnpo kept)."""
    trainer = make_trainer(tmp_path, loss_type="bnpo")
    batch = fixed_batch(trainer)
    trainer._step = trainer._rollout_start_step
    loss = trainer._compute_loss(trainer.model, batch)
    expected = d1_loss(raw_logit_logps(trainer.model, batch), batch["diffu_old_logps"][:, 0],
                       batch["diffu_ref_logps"][:, 0], batch["advantages"].double(), batch["completion_mask"].double())
    assert abs(loss.item() - expected.item()) > 1e-4


def test_d1_objective_sets_its_terms_and_refuses_contradicting_ones(tmp_path):
    config = DiffuGRPOConfig(output_dir=str(tmp_path), objective="d1", use_cpu=True, report_to=[])
    assert (config.loss_type, config.use_bias_correction_kl, config.scale_rewards, config.score_with_temperature) == (
        "bnpo", False, "none", False)
    assert "objective: d1 (bnpo token mean, plain k3 KL" in config.diffusion_plan(world_size=1)
    assert DiffuGRPOConfig(output_dir=str(tmp_path), objective="none", use_cpu=True, report_to=[]).objective is None
    assert DiffuGRPOConfig(output_dir=str(tmp_path), objective="d1", scale_rewards=False, use_cpu=True,
                           report_to=[]).scale_rewards == "none"
    for bad, message in ((dict(loss_type="grpo"), "needs loss_type='bnpo'; got loss_type='grpo'"),
                         (dict(use_bias_correction_kl=True), "use_bias_correction_kl=False"),
                         (dict(scale_rewards="group"), "scale_rewards='none'"),
                         (dict(top_entropy_quantile=0.5), "no top_entropy_quantile term"),
                         (dict(epsilon_high=0.3), "epsilon_high must be None or equal to epsilon"),
                         (dict(objective="d2"), "objective must be one of")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **{"objective": "d1", **bad})
