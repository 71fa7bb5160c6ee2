"""The sampler's log-probs in training (hf_grpo.training.rollout_logprobs): handed to TRL, measured against the
trainer's, standing in for the old-policy pass, and TRL's importance-sampling correction for hf_grpo's backends."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import trl

from hf_grpo.training import rollout_logprobs
from tests.test_trainer import make_trainer


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def run(tmp_path, name, monkeypatch=None, peft=False, **fields):
    """Train a few steps with the real ``hf`` backend; the losses, final weights, logs and policy scoring passes."""
    values = dict(max_steps=4, num_iterations=2, beta=0.04, learning_rate=0.05, temperature=0.9, seed=5)
    values.update(fields)
    kwargs = {"peft_config": lora()} if peft else {}
    trainer = make_trainer(tmp_path / name, fixed=False, **values) if not peft else _peft_trainer(tmp_path / name,
                                                                                                  values)
    passes = []
    original = trl.GRPOTrainer._get_per_token_logps_and_entropies

    def counted(self, model, *args, **kw):
        if not torch.is_grad_enabled() and model is self.model:
            passes.append(self.state.global_step)
        return original(self, model, *args, **kw)

    patch = pytest.MonkeyPatch()
    patch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", counted)
    try:
        trainer.train()
    finally:
        patch.undo()
    del kwargs
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return losses, weights, trainer.state.log_history, passes


def _peft_trainer(path, values):
    from datasets import Dataset  # noqa: F401 (make_trainer's dataset)
    from hf_grpo import GRPOTrainer
    from tests.test_trainer import GRPOConfig, TOKENIZER, build_tiny_model, count_a_reward, prompt_dataset

    base = dict(output_dir=str(path), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=8,
                num_generations=4, max_completion_length=6, optim="sgd", lr_scheduler_type="constant",
                logging_steps=1, save_strategy="no", disable_tqdm=True, activation_checkpointing=False)
    return GRPOTrainer(model=build_tiny_model(TOKENIZER, seed=0), reward_funcs=count_a_reward,
                       args=GRPOConfig(**{**base, **values}), train_dataset=prompt_dataset(),
                       processing_class=TOKENIZER, peft_config=lora())


def test_the_sampler_logprobs_reach_trl_and_the_mismatch_is_logged_every_step(tmp_path):
    """TRL's defaults (num_iterations 1): no old-policy pass, the mismatch measured on the training forward."""
    _, _, logs, passes = run(tmp_path, "default", num_iterations=1, beta=0.0, max_steps=2)
    assert passes == []  # no old-policy pass added where TRL runs none
    steps = [entry for entry in logs if "loss" in entry]
    for entry in steps:
        for key in ("rollout_logprobs/abs_diff_mean", "rollout_logprobs/abs_diff_p99", "rollout_logprobs/abs_diff_max",
                    "rollout_logprobs/outside_clip_share", "sampling/sampling_logp_difference/mean",
                    "sampling/sampling_logp_difference/max"):
            assert key in entry, (key, sorted(entry))
        # fp32 on one CPU: the decoder's and the trainer's forwards differ by rounding only
        assert 0 <= entry["rollout_logprobs/abs_diff_mean"] <= entry["rollout_logprobs/abs_diff_max"] < 1e-4
        assert entry["rollout_logprobs/abs_diff_p99"] <= entry["rollout_logprobs/abs_diff_max"]
        assert entry["rollout_logprobs/outside_clip_share"] == 0


def test_skipping_the_old_policy_pass_matches_the_recompute_run(tmp_path):
    """num_iterations 2 over 4 steps, a reference (beta > 0) and LoRA: the run whose old-policy log-probs are the
    sampler's matches TRL's recompute. Two recompute runs with the same seed are bitwise equal (measured: the
    bound of TRL's recompute against itself is 0), so the bound here is what the sampler's numbers may move: the
    ratio exp(trainer - sampler) is off by at most the measured mismatch (max 4.8e-7 here, logged), which moves
    each loss and update by about that relative amount (measured: losses 1e-7 relative, weights 3e-5 of the update);
    the bounds below leave one to two orders of magnitude."""
    first = run(tmp_path, "recompute_a", peft=True, old_logprobs_source="recompute")
    second = run(tmp_path, "recompute_b", peft=True, old_logprobs_source="recompute")
    assert first[0] == second[0] and torch.equal(first[1], second[1])  # TRL's recompute against itself
    sampler = run(tmp_path, "sampler", peft=True, old_logprobs_source="sampler")
    # the policy's no-grad passes: recompute scores the old policy and the reference (adapters off) per rollout
    assert first[3] == [0, 0, 2, 2] and sampler[3] == [0, 2]
    assert len(sampler[0]) == len(first[0]) == 4
    for theirs, ours in zip(first[0], sampler[0]):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-8)
    moved = (sampler[1] - first[1]).norm() / (first[1] - run_start_weights(tmp_path)).norm()
    assert moved < 1e-3


def run_start_weights(tmp_path):
    trainer = _peft_trainer(tmp_path / "start", dict(max_steps=1, seed=5))
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_auto_recomputes_until_a_rollout_is_measured_then_uses_the_sampler(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        _, _, logs, passes = run(tmp_path, "auto", max_steps=6, beta=0.0)
    assert passes == [0]  # the first rollout's old pass ran (nothing measured yet); the next two were skipped
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("old-policy log-probs")]
    assert said[0] == "old-policy log-probs: recomputed (no rollout measured yet)"
    assert said[1].startswith("old-policy log-probs: the sampler (measured p99")


def test_auto_recomputes_where_the_sampler_draws_from_a_filtered_law(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        _, _, logs, passes = run(tmp_path, "top_p", max_steps=4, beta=0.0, top_p=0.8)
    assert passes == [0, 2]
    said = {r.getMessage() for r in caplog.records if r.getMessage().startswith("old-policy log-probs")}
    assert said == {"old-policy log-probs: recomputed (the sampler draws from a filtered law (top_p=0.8) that the "
                    "trainer's ratio does not model)"}


@pytest.mark.parametrize("fields,message", [
    (dict(old_logprobs_source="sampled"), "old_logprobs_source must be one of ('auto', 'sampler', 'recompute'), "
                                          "got 'sampled'"),
    (dict(old_logprobs_tolerance=-1.0), "old_logprobs_tolerance must be a number >= 0"),
    (dict(old_logprobs_tolerance="0.1"), "old_logprobs_tolerance must be a number >= 0"),
    (dict(sampler_importance_sampling_correction="yes"), "sampler_importance_sampling_correction must be true or false"),
    (dict(old_logprobs_source="sampler", sampler_importance_sampling_correction=True), "set old_logprobs_source to"),
    (dict(old_logprobs_source="sampler", use_vllm=True), "with use_vllm=True TRL recomputes them"),
])
def test_bad_values_are_refused_with_the_field_and_the_valid_values(make_config, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(**fields)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_ratio_has_trls_semantics(mode):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = rollout_logprobs.importance_ratio(old, sampler, mask, mode, 0.5, 1.5)
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    want = ratio.clamp(0.5, 1.5) if mode.endswith("truncate") else ratio * ((ratio >= 0.5) & (ratio <= 1.5))
    torch.testing.assert_close(got, want)


def test_the_correction_scales_the_advantages_as_trl_scales_the_loss(tmp_path):
    """With the correction on and TRL's aligned defaults, the old-policy pass runs (as under vLLM) and the ratio
    is exp(trainer - sampler), 1 to fp32 rounding here: the step equals the uncorrected one to that rounding."""
    plain = run(tmp_path, "plain", num_iterations=1, beta=0.0, max_steps=2)
    corrected = run(tmp_path, "corrected", num_iterations=1, beta=0.0, max_steps=2,
                    sampler_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate")
    assert plain[3] == [] and corrected[3] == [0, 1]
    for a, b in zip(plain[0], corrected[0]):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)
    ratio = rollout_logprobs.corrected(
        {"advantages": torch.tensor([1.0, -2.0]), "completion_mask": torch.ones(2, 2),
         "sampling_per_token_logps": torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]),
         "old_per_token_logps": torch.tensor([[-1.0, -1.0 + math.log(2.0)], [-1.0, -1.0]])},
        type("Args", (), dict(sampler_importance_sampling_correction=True,
                              vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=None,
                              vllm_importance_sampling_clip_max=3.0))(), "grpo", None)
    torch.testing.assert_close(ratio["advantages"], torch.tensor([[1.0, 2.0], [-2.0, -2.0]]))
