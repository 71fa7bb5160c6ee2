"""The ``"hf"`` backend: ``model.generate`` on one chunk of prompts at a time.

Each chunk is padded on its own, so a chunk of short prompts carries less padding than
one batch of the whole rollout would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from .base import GenerationBackend, cut_after_eos, iter_chunks, left_pad, model_device


class HFGenerateBackend(GenerationBackend):
    name = "hf"

    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        *,
        generation_config: GenerationConfig,
        chunk_size: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        pad_to_multiple_of: int | None = None,
    ) -> list[list[int]]:
        device = model_device(model)
        completions: list[list[int]] = []
        for chunk in iter_chunks(prompt_ids, chunk_size):
            input_ids, attention_mask = left_pad(chunk, pad_token_id, device, pad_to_multiple_of)
            output = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
            )
            completions.extend(cut_after_eos(output[:, input_ids.size(1) :], eos_token_ids))
        return completions
