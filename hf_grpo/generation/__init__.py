"""Generation backends: one module each, behind the interface in ``base.py``.

``resolve_backend`` picks one by name; ``"auto"`` prefers the CUDA-graph decoder on CUDA
and falls back to ``"hf"`` with the reason, never an error, when a model is not supported.
"""

from __future__ import annotations

import logging

import torch

from .base import (Completions, GenerationBackend, backend_counts, cut_after_eos, iter_chunks, left_pad, model_device,
                   padded_length)
from . import decode_compile
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


def open_backend(setting: str, model: torch.nn.Module, reserve: int | None, main: bool,
                 decode: tuple[bool | None, str] | None = None) -> GenerationBackend:
    """The run's backend for ``generation_backend=setting`` serving ``model`` (``resolve_backend``), its cache
    reserved for ``reserve`` tokens where it keeps one (one cache and one compile for the whole run), its decode step
    compiled or not as ``decode`` says (``decode_compile.apply``); the choice logged on
    ``main``, a warning where a backend asked for by name falls back."""
    backend, reason = resolve_backend(setting, model)
    said = decode_compile.apply(backend, decode)
    if hasattr(backend, "reserve") and reserve is not None:
        backend.reserve(reserve)
    log = logging.getLogger("hf_grpo")
    if main and reason is None:
        log.info("generation backend: %s%s", backend.name, f"; {said}" if said else "")
    elif main and setting == "auto":
        log.info("generation backend: hf (%s)", reason)
    elif main:
        log.warning("generation_backend=%r falls back to 'hf': %s", setting, reason)
    return backend


__all__ = [
    "BACKEND_NAMES",
    "Completions",
    "GenerationBackend",
    "backend_counts",
    "HFGenerateBackend",
    "cut_after_eos",
    "iter_chunks",
    "left_pad",
    "model_device",
    "open_backend",
    "padded_length",
    "resolve_backend",
]
