"""Generation backends: one module each, behind the interface in ``base.py``.

``resolve_backend`` picks one by name; ``"auto"`` prefers the CUDA-graph decoder on CUDA
and falls back to ``"hf"`` with the reason, never an error, when a model is not supported.
"""

from __future__ import annotations

import logging

import torch

from .base import GenerationBackend, backend_counts, cut_after_eos, iter_chunks, left_pad, model_device, padded_length
from .hf import HFGenerateBackend

BACKEND_NAMES = ("auto", "hf", "cuda_graph", "vllm")


def resolve_backend(name: str, model: torch.nn.Module) -> tuple[GenerationBackend, str | None]:
    """The backend for ``name`` and ``model``, plus a reason when it fell back to ``"hf"``.

    ``"vllm"`` is not resolved here: the trainer hands it to TRL's own vLLM path.
    """
    if name not in ("auto", "hf", "cuda_graph"):
        raise ValueError(f"generation_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "hf":
        return HFGenerateBackend(), None
    try:
        from .cuda_graph import CudaGraphBackend
    except ImportError as err:
        return HFGenerateBackend(), f"the cuda_graph backend is unavailable ({err})"
    backend = CudaGraphBackend()
    reason = backend.unsupported_reason(model)
    if reason is not None:
        return HFGenerateBackend(), reason
    return backend, None


def open_backend(setting: str, model: torch.nn.Module, reserve: int | None, main: bool) -> GenerationBackend:
    """The run's backend for ``generation_backend=setting`` serving ``model`` (``resolve_backend``), its cache
    reserved for ``reserve`` tokens where it keeps one (one cache and one compile for the whole run); the choice
    logged on ``main``, a warning where a backend asked for by name falls back."""
    backend, reason = resolve_backend(setting, model)
    if hasattr(backend, "reserve") and reserve is not None:
        backend.reserve(reserve)
    log = logging.getLogger("hf_grpo")
    if main and reason is None:
        log.info("generation backend: %s", backend.name)
    elif main and setting == "auto":
        log.info("generation backend: hf (%s)", reason)
    elif main:
        log.warning("generation_backend=%r falls back to 'hf': %s", setting, reason)
    return backend


def dense_mirror_choice(settings, model: torch.nn.Module, zero3_configured: bool, device: torch.device,
                        agree, main: bool) -> tuple[bool, object]:
    """``(decided, MirrorChoice or None)``: the dense copy of the weights generation reads, under ZeRO-3
    (``zero3_generation_mirror``) and for a LoRA policy otherwise (``lora_generation_mirror``: the adapters merged);
    ``settings`` is the run's config, ``agree`` the minimum over the ranks. Not decided while ZeRO-3 is configured
    and ``model`` is not partitioned yet (built in code, before DeepSpeed wraps it); logged on ``main``."""
    from . import dense_mirror

    zero3 = dense_mirror.is_zero3_partitioned(model)
    if not zero3 and zero3_configured:
        return False, None
    choose, setting = ((dense_mirror.choose, settings.zero3_generation_mirror) if zero3 else
                       (dense_mirror.choose_lora, settings.lora_generation_mirror))
    choice = choose(setting, model, settings.generation_backend, device, agree)
    if choice is not None and main:
        logging.getLogger("hf_grpo").info("%s generation mirror: %s", choice.kind, choice)
    return True, choice


__all__ = [
    "BACKEND_NAMES",
    "GenerationBackend",
    "backend_counts",
    "HFGenerateBackend",
    "cut_after_eos",
    "dense_mirror_choice",
    "iter_chunks",
    "left_pad",
    "model_device",
    "open_backend",
    "padded_length",
    "resolve_backend",
]
