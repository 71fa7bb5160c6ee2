"""Generation backends: one module each, behind the interface in ``base.py``.

``resolve_backend`` picks one by name; ``"auto"`` prefers the CUDA-graph decoder on CUDA
and falls back to ``"hf"`` with the reason, never an error, when a model is not supported.
"""

from __future__ import annotations

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


__all__ = [
    "BACKEND_NAMES",
    "GenerationBackend",
    "backend_counts",
    "HFGenerateBackend",
    "cut_after_eos",
    "iter_chunks",
    "left_pad",
    "model_device",
    "padded_length",
    "resolve_backend",
]
