"""A micro-batch as the static-shape inputs a CUDA graph replays (``hf_grpo.training.graphs``).

A graph replays fixed shapes, so a micro-batch is brought to one of few bucketed shapes:

* **padded**: the prompt part padded on the left and the completion part on the right, each to ``bucket(width)``;
  ``position_ids`` keep every real token at the position it has unpadded (transformers counts positions from the
  first column), so a bucket's log-probs are the unpadded ones. Every position of the completion window is scored.
* **packed** (``padding_free``): the real tokens of every row in one sequence (``hf_grpo.training.padding_free``),
  padded at its end to a bucket of ``tokens + 1`` (four an octave) by one more row of padding tokens, so about a
  tenth of the tokens the layers run over are padding where the padded form may have half. The row bounds live in
  a device tensor the graph reads at replay. Only the completion tokens TRL scores reach the LM head: their states
  are gathered from their packed places by an index of ``scored_width`` (a power of two), so the shape does not
  follow the rollout's longest completion, which changes every rollout, and the head does no work on padding.

Both give a ``StaticBatch``: the shape key of the graphs that replay it, the tensors the graphs read (a bucket
copies a later micro-batch of the same key into its own), the width of the scored positions, and ``spread``,
which puts the graph's log-probs (or entropies) back in TRL's ``[rows, completion width]`` layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import padding_free


class StaticBatch(NamedTuple):
    key: tuple  # the layout's shape key (with the rows and the window, the key of the graphs that replay it)
    inputs: dict[str, torch.Tensor]  # what the graphs read
    window: int  # the scored positions' width: the graph's log-probs are [n, window]
    spread: Callable[[torch.Tensor], torch.Tensor]  # [n, window] -> [rows, completion width], zeros where unscored


# A packed micro-batch's length in four buckets an octave (less than 25% padding), not eight as a padded width: its
# length is the sum of its rows', which varies more than a rollout's longest row. Simulated over the benchmark's
# rollouts at prompts of 64-1024 tokens (bench/graph_shapes.py), eight an octave met half again as many shapes
# (47 against 31 in 20 steps) for 5% fewer tokens through the layers.
PACKED_BUCKETS_PER_OCTAVE = 4


def bucket(width: int, per_octave: int = 8) -> int:
    """``width`` rounded up to a multiple of 64, or above ``64 * per_octave`` of a ``per_octave``-th of the power of
    two below it (``per_octave`` buckets an octave: less than 12.5% padding at eight)."""
    if width < 1:
        raise ValueError(f"a width to bucket must be at least 1, got {width}")
    step = max(64, (1 << (width.bit_length() - 1)) // per_octave)
    return -(-width // step) * step


def pad_to_bucket(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, pad_token_id: int,
                  at_least: tuple[int, int] = (0, 0)):
    """``(input_ids, attention_mask, position_ids)`` with the prompt part padded on the left and the last
    ``completion_width`` columns on the right, each to its ``bucket`` (of at least ``at_least``'s prompt and
    completion widths: the widest over the ranks); every real token keeps the position it has unpadded, so its
    log-prob is the unpadded one."""
    prompt_width = input_ids.shape[1] - completion_width
    wanted = max(prompt_width, at_least[0])
    left = (bucket(wanted) if wanted else 0) - prompt_width
    right = bucket(max(completion_width, at_least[1])) - completion_width
    ids = torch.nn.functional.pad(input_ids, (left, right), value=pad_token_id)
    mask = torch.nn.functional.pad(attention_mask, (left, right), value=0)
    positions = (torch.arange(ids.shape[1], device=ids.device) - left).clamp(min=0).expand(ids.shape[0], -1)
    return ids, mask, positions


def padded(input_ids, attention_mask, completion_width: int, pad_token_id: int,
           at_least: tuple[int, int] = (0, 0)) -> StaticBatch:
    """The micro-batch padded to its bucket (``pad_to_bucket``)."""
    ids, mask, positions = pad_to_bucket(input_ids, attention_mask, completion_width, pad_token_id, at_least)
    window = bucket(max(completion_width, at_least[1]))
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    return StaticBatch(("padded", ids.shape[1] - window, 0), inputs, window, lambda values: values[:, :completion_width])


def scored_width(scored: int) -> int:
    """The static width of a packed micro-batch's ``scored`` tokens: the power of two at or above, at least 64."""
    return max(64, 1 << max(scored - 1, 0).bit_length())


class PackedPlan(NamedTuple):
    """A micro-batch's rows packed (``plan_packed``), before its static tensors are built at a shape."""

    rows: padding_free.PackedRows
    keys: int  # the places the rows' keys take (the tokens, or more where rows share a prompt's)
    before: torch.Tensor  # the packed column of the state that predicts each completion column
    labels: torch.Tensor  # [rows, completion width], -100 where unscored
    row_of: torch.Tensor  # the scored labels' rows and columns
    column_of: torch.Tensor
    shape: tuple[int, int, int]  # its own (length, shared, window)


def packed(model: torch.nn.Module, input_ids, attention_mask, completion_width: int, pad_token_id: int,
           fit: Callable[[int, int, int], tuple[int, int, int]] | None = None) -> StaticBatch | None:
    """The micro-batch's rows packed into one sequence of a bucketed length; None where the rows cannot be packed
    for ``model`` (a row's tokens not one run, an empty row, a row longer than the model's attention window:
    ``padding_free.packable``), which then go padded. Rows of one prompt share its tokens
    (``padding_free.shares_prompts``): their keys are gathered into a sequence ``shared`` places longer (a bucket
    of the tokens sharing saved), whose end, after every row's keys, is the padding row's. Two device-to-host
    copies: the row lengths, the number of scored tokens. ``fit(length, shared, window)`` may give a larger shape
    to build instead (a captured graph's: ``hf_grpo.training.shape_reuse``)."""
    plan = plan_packed(model, input_ids, attention_mask, completion_width)
    if plan is None:
        return None
    return build_packed(plan, input_ids.shape[0], completion_width, pad_token_id,
                        plan.shape if fit is None else fit(*plan.shape))


def plan_packed(model: torch.nn.Module, input_ids, attention_mask, completion_width: int) -> PackedPlan | None:
    """The packing of ``packed`` and its own shape; None where the rows cannot be packed."""
    first = input_ids.shape[1] - completion_width
    rows = padding_free.pack_rows(input_ids, attention_mask, first if padding_free.shares_prompts(model) else 0)
    if rows is None or not padding_free.packable(model, rows):
        return None
    tokens = rows.tokens
    keys = tokens if rows.key_index is None else rows.key_index.numel()
    length = bucket(tokens + 1, PACKED_BUCKETS_PER_OCTAVE)  # at least one padding token: a padding row, never empty
    shared = bucket(keys - tokens, PACKED_BUCKETS_PER_OCTAVE) if keys > tokens else 0
    before = torch.arange(first - 1, first - 1 + completion_width, device=input_ids.device)
    # Label column j of the completion is predicted by the state of the token before it.
    labels = input_ids[:, first:].masked_fill(attention_mask[:, first:] == 0, -100)
    if first == 0:  # no prompt columns: the first completion token has no state before it
        before, labels[:, 0] = before.clamp(min=0), -100
    else:  # nor where the token before is padding (a row without a prompt token)
        labels = labels.masked_fill(attention_mask[:, before] == 0, -100)
    row_of, column_of = (labels != -100).nonzero(as_tuple=True)
    return PackedPlan(rows, keys, before, labels, row_of, column_of, (length, shared, scored_width(row_of.numel())))


def build_packed(plan: PackedPlan, row_count: int, completion_width: int, pad_token_id: int,
                 shape: tuple[int, int, int]) -> StaticBatch:
    """``plan``'s static tensors at ``shape`` (length, shared places, scored width), each at least its own."""
    if any(built < own for built, own in zip(shape, plan.shape)):
        raise ValueError(f"a packed micro-batch of length {plan.shape[0]}, {plan.shape[1]} shared places and scored "
                         f"width {plan.shape[2]} cannot be built as {tuple(shape)}: each must be at least its own")
    length, shared, window = shape
    rows, keys, before, labels, row_of, column_of = plan[:6]
    tokens, scored = rows.tokens, row_of.numel()
    ids = torch.nn.functional.pad(rows.input_ids, (0, length - tokens), value=pad_token_id)
    positions = torch.cat([rows.position_ids[0], torch.arange(length - tokens, device=ids.device)]).unsqueeze(0)
    ends = torch.tensor([length], dtype=torch.int32)
    # (the slots past the scored tokens read packed position 0 and are not scored: label -100)
    places = torch.nn.functional.pad(rows.index[row_of, before[column_of]], (0, window - scored))
    inputs = {
        "input_ids": ids,
        "position_ids": positions,
        "cu_seq_lens": torch.cat([rows.cu_seq_lens, ends.to(ids.device)]),
        "cu_seq_lens_host": torch.cat([rows.cu_seq_lens_host, ends]),
        "window_index": places.unsqueeze(0),
        "labels": torch.nn.functional.pad(labels[row_of, column_of], (0, window - scored), value=-100).unsqueeze(0),
    }
    if shared:
        # The padding row's keys: its own tokens, then its last token again up to the bucket, so that it has at
        # least as many keys as queries (each of its queries sees one key at least; it is never scored).
        key_index = torch.arange(tokens, device=ids.device) if rows.key_index is None else rows.key_index
        cu_key_lens_host = rows.cu_seq_lens_host if rows.cu_key_lens_host is None else rows.cu_key_lens_host
        key_ends = torch.tensor([length + shared], dtype=torch.int32)
        inputs["key_index"] = torch.cat([key_index, torch.arange(tokens, length, device=ids.device),
                                         key_index.new_full((length + shared - keys - (length - tokens),),
                                                            length - 1)])
        inputs["cu_key_lens_host"] = torch.cat([cu_key_lens_host, key_ends])
        inputs["cu_key_lens"] = inputs["cu_key_lens_host"].to(ids.device)

    def spread(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(row_count, completion_width).index_put((row_of, column_of), values[0, :scored])

    return StaticBatch(("packed", length, shared), inputs, window, spread)


def model_kwargs(inputs: dict[str, torch.Tensor], window: int) -> dict:
    """The keyword arguments of the model's fused-head forward (``hf_grpo.logprob_head``) for ``inputs``: TRL's
    labels, of which only the completion window is scored, with static shapes."""
    if "cu_seq_lens" in inputs:
        ids = inputs["input_ids"]
        rows = padding_free.PackedRows(ids, inputs["position_ids"], None, (), inputs["cu_seq_lens"],
                                       inputs["cu_seq_lens_host"], ids.shape[1], inputs.get("key_index"),
                                       inputs.get("cu_key_lens"), inputs.get("cu_key_lens_host"))
        return {"input_ids": ids, "labels": inputs["labels"], "packed_rows": rows,
                "window_index": inputs["window_index"], "fused_lm_head": True, "scored_window": window}
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-window] = -100
    return {"input_ids": ids, "attention_mask": mask, "position_ids": inputs["position_ids"], "labels": labels,
            "fused_lm_head": True, "scored_window": window}
