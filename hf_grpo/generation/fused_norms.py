"""The uncompiled decode step's RMSNorms as one Triton kernel each.

Captured eager (``compile_generation`` "off", or "auto" in a run too short to repay a compile), transformers' RMSNorm
is eight kernels: the cast to fp32, the square, the mean, the epsilon, the rsqrt, the scale, the cast back, the
weight. At a few dozen rows each is a launch gap in the CUDA graph for a few kilobytes of work, and a decoder layer
has two norms: at 0.5B, 49 norms, 392 of a step's kernels, 49 once fused. ``routed`` runs each one as a single kernel
(``ops.batch_invariant``'s, the same formula, the rms in fp32) while the step is captured; the compiled step needs
none of this (inductor fuses the norm), and the model is its own again on exit.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..ops import batch_invariant
from .filled_attention import TRITON


@contextmanager
def routed(model: torch.nn.Module, device: torch.device) -> Iterator[int]:
    """Inside: ``model``'s RMSNorms of ``batch_invariant.RMS_NORM_CLASSES`` run the fused kernel (on CUDA with Triton;
    elsewhere nothing changes). Yields the number routed."""
    serves = device.type == "cuda" and TRITON
    norms = [module for module in model.modules() if serves and type(module).__name__ in
             batch_invariant.RMS_NORM_CLASSES and hasattr(module, "variance_epsilon") and "forward" not in vars(module)]
    for module in norms:
        module.forward = types.MethodType(batch_invariant.rms_norm_forward, module)
    try:
        yield len(norms)
    finally:
        for module in norms:
            del module.forward

