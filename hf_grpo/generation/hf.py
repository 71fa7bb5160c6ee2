"""The ``"hf"`` backend: ``model.generate`` on one chunk of prompts at a time.

Each chunk is padded on its own, so a chunk of short prompts carries less padding than
one batch of the whole rollout would.

Each sampled token's log-prob is recorded by a logits processor that runs last (``ChosenLogprobs``), on the scores
the draw reads: transformers appends a caller's processors *before* its sampling warpers (temperature, top-k, top-p,
min-p), so the call hands the same warpers, transformers' own classes in transformers' order, as its own processors
and sets the config's to their neutral values (``warpers_as_processors``). The tokens are those ``model.generate``
draws from the config as given; a setting outside ``sampling.IMPLEMENTED_SETTINGS`` generates without log-probs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..runtime.model_wrappers import base_model
from ..training import true_on_policy
from .base import (Completions, GenerationBackend, cut_after_eos, cut_like, ids_of_sample, iter_chunks, left_pad,
                   model_device)
from .sampling import chosen_logprobs, effective_generation_config, unsupported_generation_setting


class ChosenLogprobs(LogitsProcessor):
    """The last processor: keeps a step's final scores until the next call shows the token drawn from them, then
    keeps only its log-prob ([B] a step; one [B, V] scores tensor alive at a time)."""

    def __init__(self, invariant: bool = False) -> None:
        self.invariant = invariant  # true_on_policy: the trainer's log-sum-exp
        self.steps: list[torch.Tensor] = []
        self._scores: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._settle(input_ids[:, -1])
        self._scores = scores
        return scores

    def _settle(self, tokens: torch.Tensor) -> None:
        if self._scores is not None:
            self.steps.append(chosen_logprobs(self._scores.float(), tokens, self.invariant))
            self._scores = None

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """[B, n] log-probs of ``generated`` [B, n] (generate may drop steps it ran past a stop: cut to n)."""
        if generated.size(1) > len(self.steps):
            self._settle(generated[:, -1])
        self._scores = None
        if not self.steps:
            return torch.zeros(generated.shape, dtype=torch.float32, device=generated.device)
        return torch.stack(self.steps, dim=1)[:, : generated.size(1)]


def warpers_as_processors(gc: GenerationConfig) -> tuple[GenerationConfig, list[LogitsProcessor]]:
    """``gc`` with its sampling warpers set neutral, and those warpers as transformers would build them for one
    sequence a prompt (``min_tokens_to_keep=1``), in its order: temperature, top-k, top-p, min-p."""
    if not gc.do_sample:
        return gc, []
    warpers: list[LogitsProcessor] = []
    if gc.temperature is not None and gc.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(gc.temperature))
    if gc.top_k:
        warpers.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
    if gc.top_p is not None and gc.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
    if gc.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    neutral = copy.deepcopy(gc)
    # explicit neutral values (None would be filled again from the model's own generation config)
    neutral.temperature, neutral.top_k, neutral.top_p = 1.0, 0, 1.0
    if gc.min_p is not None:
        neutral.min_p = 0.0  # a warper that removes nothing, after ours
    return neutral, warpers


class HFGenerateBackend(GenerationBackend):
    name = "hf"

    generate = ids_of_sample("HFGenerateBackend")

    def _sample(
        self,
        model: torch.nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        *,
        generation_config: GenerationConfig,
        chunk_size: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        pad_to_multiple_of: int | None = None,
    ) -> Completions:
        device = model_device(model)
        gc = effective_generation_config(base_model(model), generation_config)
        recorded = unsupported_generation_setting(gc) is None
        neutral, warpers = warpers_as_processors(gc) if recorded else (generation_config, [])
        completions: list[list[int]] = []
        logprobs: list[list[float]] = []
        for chunk in iter_chunks(prompt_ids, chunk_size):
            input_ids, attention_mask = left_pad(chunk, pad_token_id, device, pad_to_multiple_of)
            recorder = ChosenLogprobs(invariant=true_on_policy.installed(model))
            processors = LogitsProcessorList([*warpers, recorder]) if recorded else None
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=neutral,
                                    logits_processor=processors)
            generated = output[:, input_ids.size(1):]
            ids = cut_after_eos(generated, eos_token_ids)
            completions.extend(ids)
            if recorded:
                logprobs.extend(cut_like(recorder.finish(generated), ids))
        return Completions(completions, logprobs if recorded else None)
