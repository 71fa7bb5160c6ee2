"""A prompt's completions trained in the same micro-batches, where that leaves the step's gradient as it is.

Packed rows that repeat a prompt run its tokens once (``padding_free.pack_rows``), but only within a micro-batch,
and TRL shuffles the rows of a generation batch before it splits them into micro-batches: with 8 completions a
prompt and micro-batches of 8 rows, a micro-batch holds some 3.7 prompts instead of one. Where that split cannot
change the step, the rows are ordered by prompt before the split:

* every micro-batch of a generation batch goes into one optimizer step (``steps_per_generation`` equal to
  ``gradient_accumulation_steps``), so the step's gradient is the sum over all of them;
* the loss normalizes each micro-batch by what does not depend on which rows it holds (its row count, or the
  generation batch's tokens: ``ORDER_FREE_LOSSES``; not ``bnpo``'s per-micro-batch tokens), and nothing else is
  computed per micro-batch (the entropy mask's quantile, the entropy bonus's mean, the MoE auxiliary loss).

Then the summed gradient is the same up to the order of its additions. A prompt's rows keep TRL's shuffled order
among themselves, and prompts come in the order of their first row in it.
"""

from __future__ import annotations

import torch

from ..run_state import RunDecisions, RunFacts, RunSizes
from ..ops.equal_rows import first_equal_prompt
from . import padding_free

# TRL 1.16's loss types whose micro-batch normalizer is its row count or the generation batch's token count
ORDER_FREE_LOSSES = ("grpo", "sapo", "dr_grpo", "dapo", "cispo", "luspo")
# A switch for benchmarks (bench/grpo_realistic.py --group_prompts off)
GROUP_PROMPTS = True


def unavailable_reason(packed: bool, sizes: RunSizes, facts: RunFacts) -> str | None:
    """Why this run's micro-batches keep TRL's shuffled rows; None when a prompt's rows may go together.
    ``packed``: the micro-batches are scored packed (by the training graphs where they replay, else eager)."""
    if not GROUP_PROMPTS:
        return "grouping turned off (hf_grpo.training.prompt_groups.GROUP_PROMPTS)"
    if not packed:
        return "rows are scored padded, where they share nothing"
    if sizes.steps_per_generation != sizes.gradient_accumulation_steps:
        return (f"steps_per_generation={sizes.steps_per_generation} differs from gradient_accumulation_steps="
                f"{sizes.gradient_accumulation_steps}: the micro-batches go into several optimizer steps")
    if facts.loss_type not in ORDER_FREE_LOSSES:
        why = ("normalizes by the micro-batch's own tokens" if facts.loss_type == "bnpo"
               else f"is not one known to sum the same over any split ({', '.join(ORDER_FREE_LOSSES)})")
        return f"loss_type={facts.loss_type!r} {why}"
    if facts.entropy_per_micro_batch:
        return "the entropy mask or bonus is computed per micro-batch"
    if facts.off_policy_mask or facts.router_aux_loss_coef:
        return "the off-policy mask or the MoE auxiliary loss is computed per micro-batch"
    return None


def packed_rows(decisions: RunDecisions, padding_free_setting: bool | None, model: torch.nn.Module) -> bool:
    """Whether the run's micro-batches are scored packed: as the training graphs replay them, else as the eager
    layout chosen at train begin (the user's ``padding_free``, else ``eager_packing``'s rule)."""
    if decisions.graphs_replay:
        return decisions.train_graphs.packed
    if decisions.eager_rows is not None:
        return decisions.eager_rows.packed
    return padding_free_setting is True and padding_free.unsupported_reason(model) is None


def regroup(micro_batches: list[dict]) -> list[dict] | None:
    """``micro_batches`` (TRL's split of one generation batch) with the rows ordered by prompt, split again into as
    many micro-batches of the same size; None where they hold what cannot be reordered by row (images)."""
    merged: dict = {}
    rows = micro_batches[0]["prompt_ids"].shape[0] * len(micro_batches)
    for key, first in micro_batches[0].items():
        values = [batch[key] for batch in micro_batches]
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            merged[key] = first  # (num_items_in_batch: the generation batch's, in every micro-batch)
            continue
        if isinstance(first, torch.Tensor):
            merged[key] = torch.cat(values)
        elif isinstance(first, list):
            merged[key] = [item for value in values for item in value]
        else:
            return None
        if len(merged[key]) != rows:  # not one entry a row (images by grid): leave TRL's split as it is
            return None
    first_row = first_equal_prompt(merged["prompt_ids"], merged["prompt_mask"])
    order = torch.argsort(first_row * rows + torch.arange(rows, device=first_row.device))
    size = rows // len(micro_batches)
    regrouped = []
    for start in range(0, rows, size):
        chosen = order[start:start + size]
        regrouped.append({
            key: value if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0)
            else value[chosen.to(value.device)] if isinstance(value, torch.Tensor)
            else [value[i] for i in chosen.tolist()]
            for key, value in merged.items()})
    return regrouped
