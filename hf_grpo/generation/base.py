"""The interface every generation backend implements, and the padding/EOS helpers they share.

A backend turns a list of tokenized prompts into completions, ``chunk_size`` prompts at a
time, so that peak memory follows ``per_device_generation_batch_size`` and not the rollout.
The trainer calls it inside TRL's ``unwrap_model_for_generation`` context, so under
DeepSpeed ZeRO-3 the parameters are gathered once for all chunks of a rollout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from transformers import GenerationConfig


class Completions(NamedTuple):
    """A rollout's completions and, beside each token, its log-prob under the law it was drawn from (after
    temperature, top-k, top-p and min-p): what TRL takes as ``sampling_per_token_logps``. ``logprobs`` is None
    where the backend did not record them."""

    ids: list[list[int]]
    logprobs: list[list[float]] | None = None


class GenerationBackend(ABC):
    """Generates completions for prompts given as token-id lists."""

    name: str = "base"

    def unsupported_reason(self, model: torch.nn.Module) -> str | None:
        """Why this backend cannot serve ``model`` (the trainer then falls back to ``"hf"``), or None."""
        return None

    @abstractmethod
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
        """Return one completion per prompt, cut after its first EOS token (the EOS is kept).

        Completions are at most ``generation_config.max_new_tokens`` long. The model is the
        unwrapped policy; the caller has already entered ``torch.no_grad()``.
        """

    def sample(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], **kwargs) -> Completions:
        """``generate``'s completions with their sampled log-probs (``Completions``); the same keyword arguments.

        A backend that records log-probs implements ``_sample`` and a ``generate`` made by ``ids_of_sample``
        (``hf``, ``cuda_graph``); where ``generate`` is another (a subclass's own completions, a patched method),
        its completions come without log-probs.
        """
        if getattr(self.generate, "ids_of_sample", False):
            return self._sample(model, prompt_ids, **kwargs)
        return Completions(self.generate(model, prompt_ids, **kwargs))

    def release(self, empty_cache: bool = True) -> None:
        """Free what the backend keeps between calls (caches, captured graphs); nothing by default."""

    def for_memory_probe(self) -> GenerationBackend:
        """The backend ``memory.autosize`` measures a generation chunk's memory with: this one, unless it would
        spend minutes on work that takes no memory (the cuda_graph backend's compiles)."""
        return self


def ids_of_sample(cls_name: str):
    """A backend's ``generate``: its ``_sample``'s completions (``GenerationBackend.sample`` calls ``_sample``)."""

    def generate(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], **kwargs) -> list[list[int]]:
        return self._sample(model, prompt_ids, **kwargs).ids

    generate.ids_of_sample = True
    generate.__doc__ = (f"{cls_name}'s completions, one per prompt, each cut after its first EOS token (kept); "
                        "``sample`` gives their log-probs too.")
    return generate


def iter_chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    """Consecutive slices of ``size`` items; the last one may be shorter."""
    if size < 1:
        raise ValueError(f"chunk size must be a positive integer, got {size}")
    for start in range(0, len(items), size):
        yield items[start : start + size]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters live (the CPU for a model without any)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def is_zero3_param(param: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 manages this parameter (it carries a ``ds_id``)."""
    return hasattr(param, "ds_id")


def is_zero3_partitioned(model: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 manages the model's parameters."""
    return any(is_zero3_param(p) for p in model.parameters())


def fsdp_sharding(model: torch.nn.Module) -> str | None:
    """How FSDP shards the model's parameters ("FSDP (version 1)": flattened into flat parameters, "FSDP (version
    2)": each a DTensor), or None where FSDP does not manage them."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support: no FSDP either
        return None
    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        return "FSDP (version 1) flattens and shards the parameters"
    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        return "FSDP (version 2) shards the parameters as DTensors"
    return None


def padded_length(prompt_ids: Sequence[Sequence[int]], pad_to_multiple_of: int | None = None) -> int:
    """Length of the longest prompt, rounded up to ``pad_to_multiple_of`` when given."""
    length = max(len(p) for p in prompt_ids)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    return length


def left_pad(
    prompt_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    device: torch.device | str,
    pad_to_multiple_of: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into ``input_ids`` and ``attention_mask`` of shape [B, L]."""
    length = padded_length(prompt_ids, pad_to_multiple_of)
    input_ids = torch.full((len(prompt_ids), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), length), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        if len(ids):
            input_ids[row, length - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, length - len(ids) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def cut_after_eos(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """Rows of ``completion_ids`` [B, T] as lists, each ending at its first EOS (kept), as TRL does.

    The EOS search runs where the ids are (the GPU, after a rollout), and the host only turns two tensors into
    lists: torch's CPU ops on the copied ids took 4 to 53 ms of host time per rollout on an H100 machine's CPU
    (``bench/results/decode_profile_h100_host_after_rollout.jsonl``), while the GPU waited.
    """
    ids = completion_ids
    is_eos = torch.isin(ids, torch.as_tensor(list(eos_token_ids), dtype=ids.dtype, device=ids.device))
    # Position of the first EOS per row, or T when the row has none.
    first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(ids[:, 0], ids.size(1)))
    return [row[: end + 1] for row, end in zip(ids.tolist(), first_eos.tolist())]


def cut_like(values: torch.Tensor, completions: Sequence[Sequence[int]]) -> list[list[float]]:
    """Rows of ``values`` [B, T] cut to the lengths of ``completions`` (``cut_after_eos``'s rows): one host copy."""
    return [row[: len(ids)] for row, ids in zip(values.tolist(), completions)]


def backend_counts(backend: GenerationBackend) -> dict[str, float]:
    """The cuda_graph backend's compile and capture counters and its decode loops' device seconds (zeros for
    backends without them)."""
    return {"decode_compiles": getattr(backend, "num_compiles", 0),
            "graph_captures": getattr(backend, "num_captures", 0),
            "decode_s": getattr(backend, "decode_seconds", 0.0)}
