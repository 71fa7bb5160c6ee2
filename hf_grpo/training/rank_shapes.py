"""One static shape for a micro-batch on every rank, so that the ranks capture the same graphs at the same call.

Under DDP (and ZeRO-1/2) each rank replays its micro-batches from graphs of its own (``graphs``) and meets the
others at every micro-batch (TRL's metric all-reduces, the gradient reduction). Left to itself a rank's shapes
follow its own rollout, so it captures a new shape at a call of its own while every other rank waits for it there.
Measured on four H200s (1.5B LoRA, DDP, prompts of 64-1024 tokens, 8 steps): the ranks captured 5-10 shapes each,
a capture costs about 0.45 s, and the training half of a step took 1.20 s against 0.77 s on one GPU, the
difference spent waiting. Here a micro-batch's shape is the largest over the ranks (one all-reduce of six integers
and its host copy; TRL's metrics copy to the host at every micro-batch already): every rank then captures and
replays the same shapes at the same calls, and the shape reuse (``shape_reuse``) decides alike everywhere.

Every rank must call ``static_batch`` (or ``join_without_a_batch``) the same number of times: once for every
micro-batch and every scoring chunk the graphs see, also on a rank whose capture failed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime.collectives import maxima_over_ranks
from . import graph_inputs


def static_batch(model: torch.nn.Module, input_ids, attention_mask, completion_width: int, pad_token_id: int, *,
                 packed: bool, over_ranks: bool,
                 fit: Callable[[int, int, int], tuple[int, int, int]] | None = None) -> graph_inputs.StaticBatch:
    """The micro-batch in the run's static layout (``graph_inputs``): packed where every rank's rows pack (at the
    largest packed shape over the ranks, or the larger captured one ``fit`` gives), else padded (to the widest
    prompt and completion over the ranks). ``over_ranks``: agree with the other ranks (a collective)."""
    plan = graph_inputs.plan_packed(model, input_ids, attention_mask, completion_width) if packed else None
    widths = (input_ids.shape[1] - completion_width, completion_width)
    shape = None if plan is None else plan.shape
    if over_ranks:
        most = maxima_over_ranks([*widths, int(packed and plan is None), *(shape or (0, 0, 0))])
        # one rank's rows that cannot be packed send every rank's padded
        widths, shape = (most[0], most[1]), (None if plan is None or most[2] else tuple(most[3:]))
    if shape is not None:
        return graph_inputs.build_packed(plan, input_ids.shape[0], completion_width, pad_token_id,
                                         shape if fit is None else fit(*shape))
    return graph_inputs.padded(input_ids, attention_mask, completion_width, pad_token_id, at_least=widths)


def join_without_a_batch() -> None:
    """The agreement of one micro-batch, joined by a rank that builds none (its capture failed: it runs eagerly)."""
    maxima_over_ranks([0] * 6)
