"""Start torch's compile workers while the trainer is being set up, not at the first rollout.

inductor builds its Triton kernels in a pool of worker processes, which it starts at the first compile; each worker
imports torch and Triton before it takes a kernel. The first rollout's decode-step compile waited for them: on an
H200 (0.5B shape, cold compile cache) the first rollout's compile took 8.5 s with the pool started then, 6.3 s with
it started 6 s earlier (``bench/results/cold_start_h200.jsonl``). Started when the trainer is constructed, the
workers boot while the reference model, the accelerator and the data are prepared.

torch's own switches still decide: ``TORCH_WARM_POOL=0`` or ``TORCHINDUCTOR_COMPILE_THREADS=1`` start nothing.
"""

from __future__ import annotations

import logging

import torch

from . import decode_compile

logger = logging.getLogger(__name__)


def will_compile(config, model: torch.nn.Module | str | None = None) -> bool:
    """Whether a run with ``config`` (a ``GRPOConfig``) compiles a decode step: the cuda_graph backend ("auto" picks
    it on CUDA) compiling its step (``compile_generation``), on a machine with a CUDA device, for a model of a family
    it serves (a model given by its path is assumed to be one: its config is not read before TRL loads it)."""
    if config.use_vllm or config.use_cpu or config.generation_backend not in ("auto", "cuda_graph"):
        return False
    if not torch.cuda.is_available() or not decode_compile.expected_at_start(config):
        return False
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is not None:
        from .cuda_graph import SUPPORTED_MODEL_TYPES

        return model_type in SUPPORTED_MODEL_TYPES  # others decode through "hf": idle workers would cost memory
    return True


def start_early(config, model: torch.nn.Module | str | None = None) -> bool:
    """Start inductor's compile workers now if the run will compile; True if they were asked to start."""
    if not will_compile(config, model):
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError as err:  # a torch without inductor: the decode step runs uncompiled anyway
        logger.debug("compile workers not started early: %s", err)
        return False
    maybe_warm_pool()
    return True
