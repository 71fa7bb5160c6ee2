"""DiffuGRPOTrainer's state comes with its inputs: the chunk sizes from the run's sizes as they stand at each call
(halved mid-run after an out-of-memory), the mask seeds with the loss pass they belong to, and the user's config
left as given."""

import dataclasses
import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer
from hf_grpo.recipe_support.diffusion_tiny import build_tiny_diffusion_model

from tests.diffusion.test_diffu_trainer import (
    PROMPTS, TOKENIZER, FixedBackend, count_a_reward, halve_tensor_batch_size, make_trainer, record_estimator_chunks,
    train, trainer_values,
)


class _HalveAfterFirstStep(TrainerCallback):
    """An out-of-memory in a log-prob chunk after the first optimizer step: long after train start, where the run's
    sizes were handed to TRL and transformers (``RunSizes.published``)."""

    def __init__(self, trainer, chunks):
        self.trainer, self.chunks = trainer, chunks

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            halve_tensor_batch_size(self.trainer)
            self.chunks.append("halved")


def test_estimator_chunk_follows_a_halving_during_training(tmp_path, monkeypatch):
    """The estimator reads tensor_batch_size from the run's sizes at every call: after a mid-run halving, every
    later chunk (old, reference and loss log-probs) is the halved size; the config's copy is not consulted."""
    chunks = record_estimator_chunks(monkeypatch)
    trainer = make_trainer(tmp_path, tensor_batch_size=6, num_iterations=2, beta=0.04, max_steps=2)
    trainer.add_callback(_HalveAfterFirstStep(trainer, chunks))
    losses, _ = train(trainer)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    halved = chunks.index("halved")
    assert set(chunks[:halved]) == {6} and set(chunks[halved + 1:]) == {3}
    assert trainer.sizes.tensor_batch_size == 3


def test_trl_loss_hands_its_model_argument_only_to_the_scoring_call():
    """The mask seeds of a loss pass travel with its model (``SeededModel``) through TRL's ``_compute_loss``: sound
    only while TRL's loss reads that argument nowhere but as the model of ``_get_per_token_logps_and_entropies``."""
    import ast
    import inspect
    import textwrap

    import trl

    tree = ast.parse(textwrap.dedent(inspect.getsource(trl.GRPOTrainer._compute_loss)))
    scoring = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", None) == "_get_per_token_logps_and_entropies"]
    handed = {id(call.args[0]) for call in scoring if call.args}
    reads = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "model"]
    assert len(scoring) == 1 and reads and all(id(node) in handed for node in reads)


def test_scoring_without_seeds_is_a_placeholder_in_the_rollout_and_refused_elsewhere(tmp_path):
    """Without a loss pass's seeds, TRL's no-grad old/reference passes (chunked by batch_size) get zeros, as the
    rollout estimates those log-probs for every seed afterwards; a scoring call with gradients is refused."""
    trainer = make_trainer(tmp_path)
    ids = torch.randint(3, 20, (2, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4, batch_size=2)
    assert logps.shape == (2, 4) and not logps.any() and entropies is None
    with pytest.raises(RuntimeError, match=r"mask seed per row.*called outside _compute_loss"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4, compute_entropy=True)


def config_fields(config) -> dict:
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}


class WatchedConfig(DiffuGRPOConfig):
    """A config that records every field written on it (not on a copy of it) once ``watch`` is set."""

    def __setattr__(self, name, value):
        if self.__dict__.get("watch") is self:
            self.__dict__["writes"].append(name)
        super().__setattr__(name, value)


def test_the_users_config_is_left_as_given(tmp_path, monkeypatch):
    """An in-code policy with beta > 0 gets its reference built here (TRL would load one from its empty path), and
    a model without activation checkpointing trains without it: both are the trainer's own settings, the config the
    user built is not written (before, after construction, after a step)."""
    import hf_grpo.diffusion.trainer as diffusion_trainer

    monkeypatch.setattr(diffusion_trainer, "_supports_checkpointing", lambda model: False)  # as LLaDA's remote code
    config = WatchedConfig(**{**trainer_values(tmp_path), "beta": 0.04, "activation_checkpointing": True})
    before = config_fields(config)
    vars(config).update(watch=config, writes=[])  # a field set for the time of a call and put back shows here
    trainer = DiffuGRPOTrainer(
        model=build_tiny_diffusion_model(TOKENIZER, seed=0), reward_funcs=count_a_reward, args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=TOKENIZER)
    assert config_fields(config) == before and config.writes == []
    assert trainer.ref_model is not None and trainer.beta == trainer.args.beta == 0.04
    assert trainer.args.activation_checkpointing is False and trainer.args.gradient_checkpointing is False
    trainer.decisions.backend = FixedBackend()
    losses, _ = train(trainer)
    assert losses and "kl" in trainer.state.log_history[0] and not trainer.model.is_activation_checkpointing
    assert config_fields(config) == before and config.writes == []


def test_the_autosize_probes_score_with_mask_seeds(tmp_path):
    """tensor_batch_size="auto" (or an "auto" micro-batch) on a GPU probes sizes with the trainer's own training
    forward (hf_grpo.memory.autosize): called as the probes call it, with gradients and no loss pass around it, the
    diffusion trainer's scorer estimates and backpropagates instead of refusing a call without mask seeds."""
    trainer = make_trainer(tmp_path)
    score = trainer._probe_score()
    C = trainer.args.max_completion_length
    input_ids = torch.randint(0, len(TOKENIZER), (3, 6 + C))
    trainer.model.train()
    logps, entropies, _ = score(input_ids, torch.ones_like(input_ids), C)
    assert logps.shape == (3, C) and entropies.shape == (3, C) and torch.isfinite(logps).all()
    (logps.sum() + entropies.sum()).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())
