"""A micro-batch as the static-shape inputs a CUDA graph replays (``hf_grpo.training.graphs``).

A graph replays fixed shapes, so a micro-batch is brought to one of few bucketed shapes:

* **padded**: the prompt part padded on the left and the completion part on the right, each to ``bucket(width)``;
  ``position_ids`` keep every real token at the position it has unpadded (transformers counts positions from the
  first column), so a bucket's log-probs are the unpadded ones.
* **packed** (``padding_free``): the real tokens of every row in one sequence (``hf_grpo.training.padding_free``), padded at
  its end to ``bucket(tokens + 1)`` by one more row of padding tokens, so only a few percent of the tokens the
  layers run over are padding where the padded form may have half. The row bounds live in a device tensor the
  graph reads at replay, the completion window's states are gathered from their packed places by an index of
  static shape (``[rows, bucket(completion width)]``), and the log-probs come back in the padded window's layout.

Both give ``(key, inputs, window)``: the shape key of the graphs that replay them, the tensors the graphs read (a
bucket copies a later micro-batch of the same key into its own), and the completion window scored.
"""

from __future__ import annotations

import torch

from . import padding_free


def bucket(width: int) -> int:
    """``width`` rounded up to a multiple of 64, or above 512 of an eighth of the power of two below it (less than
    12.5% padding, eight buckets an octave)."""
    if width < 1:
        raise ValueError(f"a width to bucket must be at least 1, got {width}")
    step = max(64, (1 << (width.bit_length() - 1)) // 8)
    return -(-width // step) * step


def pad_to_bucket(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, pad_token_id: int):
    """``(input_ids, attention_mask, position_ids)`` with the prompt part padded on the left and the last
    ``completion_width`` columns on the right, each to its ``bucket``; every real token keeps the position it has
    unpadded, so its log-prob is the unpadded one."""
    prompt_width = input_ids.shape[1] - completion_width
    left = (bucket(prompt_width) if prompt_width else 0) - prompt_width
    right = bucket(completion_width) - completion_width
    ids = torch.nn.functional.pad(input_ids, (left, right), value=pad_token_id)
    mask = torch.nn.functional.pad(attention_mask, (left, right), value=0)
    positions = (torch.arange(ids.shape[1], device=ids.device) - left).clamp(min=0).expand(ids.shape[0], -1)
    return ids, mask, positions


def padded(input_ids, attention_mask, completion_width: int, pad_token_id: int):
    """The micro-batch padded to its bucket: ``(key, inputs, window)``."""
    ids, mask, positions = pad_to_bucket(input_ids, attention_mask, completion_width, pad_token_id)
    window = bucket(completion_width)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    return ("padded", ids.shape[1] - window), inputs, window


def packed(model: torch.nn.Module, input_ids, attention_mask, completion_width: int, pad_token_id: int):
    """The micro-batch's rows packed into one sequence of a bucketed length: ``(key, inputs, window)``; None where
    the rows cannot be packed for ``model`` (a row's tokens not one run, an empty row, a row longer than the model's
    attention window: ``padding_free.packable``), which then go padded. One device-to-host copy (the row lengths)."""
    rows = padding_free.pack_rows(input_ids, attention_mask)
    if rows is None or not padding_free.packable(model, rows):
        return None
    tokens, window = rows.tokens, bucket(completion_width)
    length = bucket(tokens + 1)  # at least one padding token: the padding row is never empty
    ids = torch.nn.functional.pad(rows.input_ids, (0, length - tokens), value=pad_token_id)
    positions = torch.cat([rows.position_ids[0], torch.arange(length - tokens, device=ids.device)]).unsqueeze(0)
    ends = torch.tensor([length], dtype=torch.int32)
    # Label column j of the completion is predicted by the state of the token before it.
    first = input_ids.shape[1] - completion_width
    before = torch.arange(first - 1, first - 1 + completion_width, device=ids.device)
    labels = input_ids[:, first:].masked_fill(attention_mask[:, first:] == 0, -100)
    if first == 0:  # no prompt columns: the first completion token has no state before it
        before, labels[:, 0] = before.clamp(min=0), -100
    else:  # nor where the token before is padding (a row without a prompt token)
        labels = labels.masked_fill(attention_mask[:, before] == 0, -100)
    index = rows.index[:, before].clamp(min=0)
    inputs = {
        "input_ids": ids,
        "position_ids": positions,
        "cu_seq_lens": torch.cat([rows.cu_seq_lens, ends.to(ids.device)]),
        "cu_seq_lens_host": torch.cat([rows.cu_seq_lens_host, ends]),
        "window_index": torch.nn.functional.pad(index, (0, window - completion_width)),
        "labels": torch.nn.functional.pad(labels, (0, window - completion_width), value=-100),
    }
    return ("packed", length), inputs, window


def model_kwargs(inputs: dict[str, torch.Tensor], window: int) -> dict:
    """The keyword arguments of the model's fused-head forward (``hf_grpo.logprob_head``) for ``inputs``: TRL's
    labels, of which only the completion window is scored, with static shapes."""
    if "cu_seq_lens" in inputs:
        ids = inputs["input_ids"]
        rows = padding_free.PackedRows(ids, inputs["position_ids"], None, (), inputs["cu_seq_lens"],
                                       inputs["cu_seq_lens_host"], ids.shape[1])
        return {"input_ids": ids, "labels": inputs["labels"], "packed_rows": rows,
                "window_index": inputs["window_index"], "fused_lm_head": True, "scored_window": window}
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-window] = -100
    return {"input_ids": ids, "attention_mask": mask, "position_ids": inputs["position_ids"], "labels": labels,
            "fused_lm_head": True, "scored_window": window}
