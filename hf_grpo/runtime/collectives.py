"""Collectives over every rank of a run, for the small decisions all ranks must take alike (a chunk size after an
out-of-memory, a checkpoint every rank can read, a shape every rank captures). One all-reduce of a few integers;
the value itself where the run has one process, or torch.distributed is not initialised.

May import: torch only. Every rank must call each function, in the same order (a rank that skips one leaves its
peers waiting in it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether this process is one of several ranks of an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    return dist.get_rank() if is_distributed() else 0


def _collective_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo (CPU runs) reduces CPU tensors.
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all ranks (``value`` itself when not distributed). Every rank must call it."""
    return maxima_over_ranks([value])[0]


def maxima_over_ranks(values: list[int]) -> list[int]:
    """Each of ``values``' largest over all ranks, in one all-reduce (``values`` when not distributed). Every rank
    must call it, with as many values."""
    if not is_distributed():
        return [int(value) for value in values]
    tensor = torch.tensor([int(value) for value in values], dtype=torch.long, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` over all ranks. Every rank must call it."""
    return -max_over_ranks(-int(value))
