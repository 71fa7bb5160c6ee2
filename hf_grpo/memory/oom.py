"""Out-of-memory back-off that every rank agrees on.

A chunk size (``per_device_generation_batch_size``, ``tensor_batch_size``) is a ``SizeKnob``: it lives
in the run's sizes (``hf_grpo.run_state.RunSizes``), where the trainer, the batch plan and a saved checkpoint
read it. ``SizeKnob.run``
calls a function with the current size; if it runs out of memory on *any* rank, every rank halves
the size and calls it again, and the smaller size is kept for the rest of the run.

Why every rank, not only the one that failed: the ranks must keep taking the same number of
collective steps, and the run must not depend on which rank happened to be short of memory. So the
outcome of each attempt is all-reduced (MAX of a "failed" flag) before anyone moves on, and a rank
whose attempt succeeded throws its result away and redoes it at the smaller size. The caller makes
an attempt repeatable (e.g. restores the RNG), so the result equals what the smaller size would
have given from the start.

The unit passed to ``run`` must not itself issue collectives that a failed rank would skip (a
ZeRO-3 forward all-gathers per layer): a rank failing halfway would leave its peers waiting there.
The trainer therefore wraps only collective-free units: one rollout's generation (parameters are
gathered before it; not so under ZeRO-3 with ``ds3_gather_for_generation=False``, where an OOM inside
``generate`` still leaves the other ranks waiting) and the log-prob head after the backbone's forward.
An OOM in the backbone's forward or in the backward escapes them: in a one-process run
``hf_grpo.memory.train_backoff`` retries the micro-batch in token-budget passes; with several processes it ends
the run, since that backward all-reduces as it goes.

Cost: with several processes, one all-reduce of one integer (and a host sync) per wrapped unit, i.e.
per rollout and per log-prob forward; none with one process.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.collectives import max_over_ranks, rank

logger = logging.getLogger("hf_grpo")

# The sizes an out-of-memory halves (each a SizeKnob of the trainer): kept in the run's sizes for the rest of the
# run, saved in checkpoints and kept by a resume (hf_grpo.memory.autosize).
BACKOFF_FIELDS = ("per_device_generation_batch_size", "tensor_batch_size", "max_tokens_per_micro_batch")

# Error texts of allocation failures raised as a plain RuntimeError (cuBLAS/cuDNN workspaces, older torch).
_OOM_TEXTS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is a device out-of-memory error (``torch.OutOfMemoryError`` or its RuntimeError forms)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err).lower() for text in _OOM_TEXTS)


def free_memory() -> None:
    """Drop unreachable tensors and hand the allocator's cached blocks back, so a retry starts clean."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class SizeKnob:
    """A chunk size stored as ``owner.<field>`` (the run's ``RunSizes``), halved on every rank after an out-of-memory.

    ``on_backoff(field, old, new)`` is called on every rank after each halving (the trainer counts it
    under ``perf/``). ``None`` (no chunking) counts as ``full()`` rows when halved.
    """

    def __init__(self, owner: Any, field: str, on_backoff: Callable[[str, int | None, int], None] | None = None):
        self.owner, self.field, self.on_backoff = owner, field, on_backoff
        self.backoffs = 0
        self.enabled = True  # off while "auto" sizes are probed: there an OOM is an answer, not an accident

    @property
    def value(self) -> int | None:
        return getattr(self.owner, self.field)

    def run(self, attempt: Callable[[int | None], Any], *, full: Callable[[], int] | None = None,
            on_retry: Callable[[], None] | None = None, floor: Callable[[], int] | None = None) -> Any:
        """``attempt(size)`` with the current size, halving it on every rank until no rank runs out of memory.

        ``full()`` gives the rows a ``None`` size stands for (required if the size can be None);
        ``on_retry()`` runs before each retry (free caches, restore the RNG). Raises the out-of-memory
        error's message as ``torch.OutOfMemoryError`` once the size would drop below ``floor()`` (default 1).
        """
        if not self.enabled:
            return attempt(self.value)
        while True:
            size = self.value
            failed, message = False, ""
            try:
                result = attempt(size)
            except Exception as err:
                if not is_oom(err):
                    raise
                # Leaving the except block drops the traceback, whose frames hold the chunk's tensors.
                failed, message, result = True, str(err).splitlines()[0][:300], None
            if not max_over_ranks(int(failed)):
                return result
            result = None  # a rank that succeeded redoes its part at the smaller size, like the others
            self._halve(size, full, failed, message, 1 if floor is None else floor())
            free_memory()
            if on_retry is not None:
                on_retry()

    def _halve(self, size: int | None, full: Callable[[], int] | None, failed_here: bool, message: str,
               floor: int) -> None:
        if size is None:
            if full is None:
                raise ValueError(f"{self.field} is None (no chunking) and no row count was given to halve")
            rows = max_over_ranks(full())  # the same on every rank, so the new size is too
            size = max(rows, 1)
        new = size // 2
        where = f"on rank {rank()}" if failed_here else f"on another rank (rank {rank()} follows)"
        if new < floor:
            smallest = ("1, the smallest chunk" if floor == 1
                        else f"{size}, and half of it is below {floor}, the smallest that works")
            raise torch.OutOfMemoryError(
                f"out of memory {where} with {self.field}={smallest}: lower another size "
                f"(per_device_train_batch_size, max_completion_length) or free device memory. {message}"
            )
        logger.warning(
            "out of memory %s with %s=%s; every rank retries with %s=%d and keeps it for the rest of the run. %s",
            where, self.field, size, self.field, new, message,
        )
        setattr(self.owner, self.field, new)
        self.backoffs += 1
        if self.on_backoff is not None:
            self.on_backoff(self.field, size, new)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The CPU generator's state and, on CUDA, the device generator's (sampling draws from both)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def generate_with_backoff(backend, model: torch.nn.Module, prompt_ids, knob: SizeKnob, device: torch.device,
                          **generate_kwargs):
    """``backend.sample`` (the completions and their sampled log-probs, ``generation.Completions``) in chunks of
    ``knob.value``; on an out-of-memory anywhere, the whole rollout is sampled again at half the chunk, from the RNG
    state it started with, as if that size had been set."""
    start = rng_state(device)

    def attempt(size):
        set_rng_state(start, device)
        return backend.sample(model, prompt_ids, chunk_size=size, **generate_kwargs)

    return knob.run(attempt, full=lambda: len(prompt_ids), on_retry=lambda: backend.release(empty_cache=True))
