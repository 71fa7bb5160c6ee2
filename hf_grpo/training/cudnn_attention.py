"""Which of PyTorch's scaled-dot-product-attention kernels a training run lets the model use.

With a padding mask (any batch of prompts of different lengths) SDPA cannot use flash attention, and on
H100 torch 2.11 then picks cuDNN's attention first. cuDNN builds, and at times compiles, a kernel for each
new sequence shape: on an H100 a new shape cost 0.07 to 1.2 s of host time against ~0.05 ms on the GPU
(``bench/results/profile_cudnn_attention_h100.txt``), and a GRPO run meets new shapes at every micro-batch,
since prompt and completion lengths vary. So ``train()`` leaves cuDNN attention out unless the user asks
for it (``GRPOConfig.cudnn_attention``); SDPA then takes the memory-efficient kernel, which reads the same
masks without a per-shape build. The switch is process-wide (autograd's backward threads read it too) and
is put back as it was when ``train()`` returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def cudnn_attention(enabled: bool) -> Iterator[None]:
    """Allow (``True``) or forbid (``False``) cuDNN's SDPA kernel inside the block; restored afterwards."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
