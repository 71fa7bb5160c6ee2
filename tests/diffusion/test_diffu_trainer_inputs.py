"""DiffuGRPOTrainer's state comes with its inputs: the chunk sizes from the run's sizes as they stand at each call
(halved mid-run after an out-of-memory), the mask seeds with the loss pass they belong to, and the user's config
left as given."""

import math

import torch
from transformers import TrainerCallback

from hf_grpo.diffusion import logprobs as logprobs_module

from test_diffu_trainer import halve_tensor_batch_size, make_trainer, train


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
    chunks = []
    original = logprobs_module.chunked_logprobs

    def spy(*args, chunk_rows, **kwargs):
        chunks.append(chunk_rows)
        return original(*args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(logprobs_module, "chunked_logprobs", spy)
    trainer = make_trainer(tmp_path, tensor_batch_size=6, num_iterations=2, beta=0.04, max_steps=2)
    trainer.add_callback(_HalveAfterFirstStep(trainer, chunks))
    losses, _ = train(trainer)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    halved = chunks.index("halved")
    assert set(chunks[:halved]) == {6} and set(chunks[halved + 1:]) == {3}
    assert trainer.sizes.tensor_batch_size == 3
