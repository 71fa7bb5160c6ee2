"""Frozen projection weights laid side by side in memory, so the decode step fuses them with no copy.

Why: at a few dozen rows the decode step reads every weight once a token, and one GEMM over q/k/v (or gate/up)
reads them faster than three (two) GEMMs: 7B at 32 rows took 7.00 ms a step with gate/up fused against 7.21 ms
without (``bench/results/decode_profile_h100_7b_32rows_full_length.jsonl``). A fused *copy* of gate/up costs two
thirds of the MLP weights' memory for as long as the decoder lives (7.1 GiB at 7B, which put the run's peak above
TRL's), so it is off by default. A LoRA policy's base weights are frozen: nothing but the in-place merge and its
restore writes them, so they can be moved into one buffer per layer group (q, k, v; gate, up), each parameter a row
slice of it. The decoder's fused weight is then a view of that buffer (``adjacent``): no memory, and nothing to
refresh.

Only frozen parameters are moved: a trained weight belongs to the optimizer and to DeepSpeed, which may flatten it
into buffers of their own. Each parameter keeps its identity, shape and contiguity (``param.data`` is re-pointed),
so PEFT, the training forward and ``save_pretrained`` see the same tensors as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import is_zero3_param


def adjacent(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor that ``tensors`` are consecutive row slices of (each contiguous, the same storage, dtype and
    trailing shape, each starting where the last ended), concatenated along dim 0 as a view; else None."""
    first = tensors[0]
    for before, after in zip(tensors, tensors[1:]):
        if (after.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or after.dtype != first.dtype or after.shape[1:] != first.shape[1:]
                or after.storage_offset() != before.storage_offset() + before.numel()):
            return None
    if not all(t.is_contiguous() for t in tensors):
        return None
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]),
                                   first.stride())


def _packable(params: Sequence[torch.nn.Parameter]) -> bool:
    first = params[0]
    return all(
        not p.requires_grad and not is_zero3_param(p) and p.device == first.device and p.dtype == first.dtype
        and p.shape[1:] == first.shape[1:] and p.device.type != "meta"
        for p in params
    )


@torch.no_grad()
def pack(groups: Sequence[Sequence[torch.nn.Parameter]]) -> int:
    """Move each group of frozen parameters into one new buffer, in order; return how many groups were moved.

    A group is left as it is where it already lies side by side, or where any member is trained, partitioned by
    ZeRO-3 or of another device, dtype or trailing shape. One group's buffer is allocated at a time (the old
    storage is freed as the next one is made), so the peak grows by one group's size at most.
    """
    moved = 0
    for params in groups:
        if len(params) < 2 or not _packable(params) or adjacent(params) is not None:
            continue
        buffer = torch.cat([p.detach() for p in params])
        start = 0
        for param in params:
            param.data = buffer[start:start + param.shape[0]]
            start += param.shape[0]
        moved += 1
    return moved
