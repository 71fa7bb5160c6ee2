"""The prefill of a chunk whose rows repeat prompts: each distinct prompt run once, its keys and values copied to
every row that holds it.

Why: GRPO decodes ``num_generations`` completions of every prompt, so a chunk of 32 rows holds 4 prompts 8 times
each. Run as 32 rows, the prefill computes every prompt 8 times over: at 7B, 32 rows of 544 tokens took 0.48-0.51 s
on an H100 (``bench/decode_profile.py --rollout-timeline``), where the 4 prompts alone take a few hundredths.

Here the distinct rows run through the model against a small ``DynamicCache`` of their own, then each layer of the
decoder's static cache is written, through its own ``update``, with every row's prompt keys and values gathered
from its prompt's row; the last position's logits likewise, so each row then samples its own tokens from the same
state. Rows are equal when their token ids and padding are (padded positions compared as -1, so the pad id does
not matter), and equal rows give equal keys, values and logits: the decode sees what a prefill of every row would
have given, up to the matmuls' order over a smaller batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.equal_rows import first_equal_prompt


@dataclass(frozen=True)
class SharedRows:
    """Which rows of a chunk run (``leaders``, ``[U]``) and, for every row, its prompt's place among them."""

    leaders: torch.Tensor
    place: torch.Tensor

    @property
    def count(self) -> int:
        return self.leaders.numel()


def shared_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SharedRows | None:
    """The distinct prompts of a left-padded chunk, or None where every row is its own (nothing to share)."""
    if input_ids.size(0) < 2:
        return None
    first = first_equal_prompt(input_ids, attention_mask)
    is_leader = first == torch.arange(first.numel(), device=first.device)
    leaders = is_leader.nonzero().squeeze(1)  # one host read a chunk
    if leaders.numel() == first.numel():
        return None
    place = (is_leader.cumsum(0) - 1)[first]  # each row's leader's rank among the leaders
    return SharedRows(leaders, place)


def cache_shareable(cache) -> bool:
    """Whether every layer of ``cache`` is a plain static layer, which a prompt's keys and values written once
    fill (a sliding window that rolls over, or a recurrent state, is prefilled row by row as before)."""
    from transformers.cache_utils import StaticLayer

    return all(type(layer) is StaticLayer for layer in cache.layers)


def fill(static_cache, prompts_cache, rows: SharedRows) -> None:
    """Write ``static_cache`` (reset) with each row's prompt keys and values, gathered from ``prompts_cache``."""
    if len(prompts_cache.layers) != len(static_cache.layers):
        raise RuntimeError(f"the shared prefill filled {len(prompts_cache.layers)} cache layers where the decoder's "
                           f"cache has {len(static_cache.layers)}")
    for source, target in zip(prompts_cache.layers, static_cache.layers):
        target.update(source.keys.index_select(0, rows.place), source.values.index_select(0, rows.place))
