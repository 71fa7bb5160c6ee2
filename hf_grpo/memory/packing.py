"""Which rows of a micro-batch go into which token-budget pass, and the loss scale of each pass: pure
arithmetic over the rows' real extents (see ``token_budget`` for why the passes give the micro-batch's
gradient). ``token_budget`` runs the passes; this module only plans and cuts them.

May import: torch (to cut the tensors), nothing of the trainer or of Accelerate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

FIELD = "max_tokens_per_micro_batch"
LOSS_TYPES = ("grpo", "sapo", "luspo", "dr_grpo", "bnpo", "dapo", "cispo", "vespo")
_PER_ROW = ("grpo", "sapo", "luspo", "dr_grpo")  # scale rows(pass) / rows(micro-batch)
TOKEN_MEAN_LOSSES = ("bnpo",)  # scale tokens(pass) / tokens(micro-batch)
_PROMPT_COLUMNS = ("prompt_ids", "prompt_mask")
# Per-completion-token inputs TRL may put in a micro-batch (cut with the completion's right padding).
_COMPLETION_COLUMNS = (
    "completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
    "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask", "advantages",
)


class Extents(NamedTuple):
    """Columns each row really uses: its prompt (a left-padded suffix) and completion (a right-padded prefix)."""

    prompt: list[int]
    completion: list[int]

    def row_tokens(self, row: int) -> int:
        return self.prompt[row] + self.completion[row]


def extents(inputs: Mapping[str, Any]) -> Extents:
    """Per-row prompt and completion extents read from the masks of a TRL micro-batch."""
    prompt_mask, completion_mask = inputs["prompt_mask"].bool(), inputs["completion_mask"].bool()
    width = prompt_mask.shape[1]
    columns = torch.arange(width, device=prompt_mask.device)
    first = torch.where(prompt_mask, columns, width).min(dim=1).values  # first real prompt column
    columns = torch.arange(completion_mask.shape[1], device=completion_mask.device)
    last = torch.where(completion_mask, columns + 1, 0).max(dim=1).values  # one past the last real token
    return Extents((width - first).tolist(), last.tolist())


def pass_tokens(rows: list[int], ext: Extents) -> int:
    """Tokens of the padded tensor a pass of ``rows`` feeds the model."""
    if not rows:
        return 0
    return len(rows) * (max(ext.prompt[r] for r in rows) + max(ext.completion[r] for r in rows))


def _longest_first(ext: Extents) -> list[int]:
    return sorted(range(len(ext.prompt)), key=lambda r: (-ext.row_tokens(r), -ext.completion[r], r))


def _check_rows_fit(ext: Extents, budget: int) -> None:
    for row in range(len(ext.prompt)):
        if ext.row_tokens(row) > budget:
            raise ValueError(
                f"{FIELD}={budget} is smaller than one completion: row {row} of this micro-batch has "
                f"{ext.prompt[row]} prompt + {ext.completion[row]} completion = {ext.row_tokens(row)} tokens; set "
                f"{FIELD} >= your longest prompt + max_completion_length"
            )


def first_fit_decreasing(ext: Extents, budget: int) -> list[list[int]]:
    """Rows packed longest first, each into the first pass it fits; the fewest passes this greedy finds."""
    _check_rows_fit(ext, budget)
    passes: list[list[int]] = []
    for row in _longest_first(ext):
        for rows in passes:
            if pass_tokens(rows + [row], ext) <= budget:
                rows.append(row)
                break
        else:
            passes.append([row])
    return passes


def balanced_passes(ext: Extents, budget: int, count: int) -> list[list[int]] | None:
    """Rows spread over exactly ``count`` passes, each to the fitting pass left cheapest; None if one fits nowhere.

    Passes with no row (fewer rows than ``count``) come last.
    """
    _check_rows_fit(ext, budget)
    passes: list[list[int]] = [[] for _ in range(count)]
    for row in _longest_first(ext):
        costs = [(pass_tokens(rows + [row], ext), i) for i, rows in enumerate(passes)]
        fitting = [(cost, i) for cost, i in costs if cost <= budget]
        if not fitting:
            return None
        passes[min(fitting)[1]].append(row)
    return sorted(passes, key=lambda rows: not rows)


def plan_passes(ext: Extents, budget: int, agree: Callable[[int], int] = lambda count: count) -> list[list[int]]:
    """This rank's passes: as many as the rank that needs most (``agree`` returns the max over ranks)."""
    packed = first_fit_decreasing(ext, budget)
    count = agree(len(packed))
    balanced = balanced_passes(ext, budget, count)
    return balanced if balanced is not None else packed + [[] for _ in range(count - len(packed))]


# ---- the passes' inputs and weights ---------------------------------------------------------------
def select_rows(inputs: Mapping[str, Any], rows: list[int], ext: Extents) -> dict[str, Any]:
    """The micro-batch's ``rows``, with the prompt and completion padding none of them uses cut off."""
    batch = inputs["prompt_ids"].shape[0]
    prompt_width, completion_width = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
    keep_prompt = max(ext.prompt[r] for r in rows)
    keep_completion = max(1, max(ext.completion[r] for r in rows))  # logits_to_keep=0 would mean "all"
    index = torch.tensor(rows, device=inputs["prompt_ids"].device)
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            out[key] = value  # global scalars such as num_items_in_batch
        elif not isinstance(value, torch.Tensor) or value.shape[0] != batch:
            raise ValueError(
                f"{FIELD} cannot split the micro-batch input {key!r} ({type(value).__name__}): token-budget passes "
                f"support text-only GRPO inputs; set {FIELD}=None for this run"
            )
        elif key in _PROMPT_COLUMNS:
            out[key] = value[index, prompt_width - keep_prompt:]
        elif key in _COMPLETION_COLUMNS and value.ndim == 2 and value.shape[1] == completion_width:
            out[key] = value[index, :keep_completion]
        elif key in _COMPLETION_COLUMNS or value.ndim == 1:
            out[key] = value[index]  # per-row values ((B,) advantages, (B, 1) sequence-level ratios)
        else:
            raise ValueError(
                f"{FIELD} does not know how to split the micro-batch input {key!r} of shape {tuple(value.shape)}; "
                f"set {FIELD}=None for this run"
            )
    return out


def empty_pass(inputs: Mapping[str, Any], ext: Extents) -> dict[str, Any]:
    """A one-row pass that trains nothing: the shortest row with its completion mask zeroed."""
    row = min(range(len(ext.prompt)), key=lambda r: (ext.row_tokens(r), r))
    one = Extents(ext.prompt, [1] * len(ext.completion))
    out = select_rows(inputs, [row], one)
    out["completion_mask"] = torch.zeros_like(out["completion_mask"])
    return out


def _loss_tokens(inputs: Mapping[str, Any]) -> int:
    """The tokens TRL's loss averages over: completion mask times tool mask."""
    mask = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        mask = mask * inputs["tool_mask"]
    return int(mask.sum())


def pass_scale(loss_type: str, part: Mapping[str, Any], whole: Mapping[str, Any]) -> float:
    """The factor that turns TRL's loss over the pass ``part`` into its share of the loss over ``whole``."""
    if loss_type in _PER_ROW:
        return part["prompt_ids"].shape[0] / whole["prompt_ids"].shape[0]
    if loss_type in TOKEN_MEAN_LOSSES:
        return max(_loss_tokens(part), 1) / max(_loss_tokens(whole), 1)
    if loss_type in LOSS_TYPES:
        return 1.0  # normalised by the rollout's global token count already
    raise ValueError(f"{FIELD} supports loss_type in {LOSS_TYPES}, got {loss_type!r}")


class Pass(NamedTuple):
    inputs: dict[str, Any]
    scale: float
    rows: list[int]


def build_passes(inputs: Mapping[str, Any], budget: int, loss_type: str, agree: Callable[[int], int]) -> list[Pass]:
    """The micro-batch as token-budget passes with their loss scales (zero for padding passes)."""
    ext = extents(inputs)
    passes = []
    for rows in plan_passes(ext, budget, agree):
        if rows:
            part = select_rows(inputs, rows, ext)
            passes.append(Pass(part, pass_scale(loss_type, part, inputs), rows))
        else:
            passes.append(Pass(empty_pass(inputs, ext), 0.0, rows))
    return passes
