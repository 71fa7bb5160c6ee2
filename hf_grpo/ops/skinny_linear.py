"""A linear layer for a few dozen rows that reads its weight near the GPU's copy bandwidth.

A decode step multiplies 32 rows by each weight: the GEMM is bound by the weight's bytes, and a library kernel tiled
for large products leaves part of the bandwidth unused on the smaller ones. At Qwen2.5-7B x 32 rows on an H100,
cuBLAS read the q/k/v and o weights at 72-73% of the copy bandwidth, against 89-95% for the MLP's larger ones
(``bench/results/decode_profile_h100_7b_32rows_full_length.jsonl``): a few column blocks per SM leave the SMs waiting
at the start and the end of the product. This kernel gives every SM several blocks of columns, splitting the inner
dimension where the columns alone are too few, and sums the splits in a second small kernel, in order (the same bits
every call, as a CUDA graph replays it).

``skinny_linear(x, weight, bias)`` is a ``torch.library`` custom op, so a compiled decode step calls it as one opaque
kernel. On CUDA with Triton, for at most ``MAX_ROWS`` rows of bf16 or fp16 and a contiguous weight whose inner
dimension is a multiple of the block, it runs the kernel with ``choose``'s launch settings; otherwise ``F.linear``.
The result matches ``F.linear`` to the rounding of a float32 sum in another order.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch
from torch.nn import functional as F

MAX_ROWS = 64  # above this the product is no longer bound by the weight's bytes alone: cuBLAS's tiles serve
TRITON = importlib.util.find_spec("triton") is not None


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Launch settings of the kernel (``bench/skinny_linear.py`` sweeps them)."""

    block_n: int = 64  # output columns a program computes
    block_k: int = 128  # inner-dimension elements a step of its loop reads
    splits: int = 1  # shares of the inner dimension, each a program, summed by the reduction
    num_warps: int = 4
    num_stages: int = 4


def choose(rows: int, out_features: int, in_features: int, sms: int) -> SkinnyConfig:
    """The settings for a product of ``rows`` x ``in_features`` by ``out_features`` x ``in_features`` on ``sms``
    SMs: blocks of 64 columns, split over the inner dimension until there are about ``4 x sms`` programs, each split
    at least 4 steps of 128 long."""
    del rows
    config = SkinnyConfig()
    blocks = -(-out_features // config.block_n)
    steps = in_features // config.block_k
    splits = 1
    while blocks * splits < 4 * sms and steps // (splits + 1) >= 4:
        splits += 1
    return dataclasses.replace(config, splits=splits)


def usable(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> bool:
    """True where the kernel takes this call (else ``F.linear``)."""
    block_k = (config or SkinnyConfig()).block_k
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    return (
        TRITON
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and 0 < rows <= MAX_ROWS
        and weight.size(1) % block_k == 0
    )


@torch.library.custom_op("hf_grpo::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@skinny_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.size(0)))


@skinny_linear.register_kernel("cuda")
def _(x, weight, bias):
    if not usable(x, weight):
        return F.linear(x, weight, bias)
    return run(x, weight, bias)


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        config: SkinnyConfig | None = None) -> torch.Tensor:
    """The kernel on ``x`` ([..., K], at most ``MAX_ROWS`` rows) and ``weight`` ([N, K], contiguous), with
    ``config`` or ``choose``'s settings (``usable`` must hold)."""
    x2d = x.reshape(-1, x.size(-1))
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    rows, (n, k) = x2d.size(0), weight.shape
    if config is None:
        config = choose(rows, n, k, _sms(x.device.index if x.device.index is not None else 0))
    out = x2d.new_empty((rows, n))
    gemm, reduce = _kernels()
    partial = out if config.splits == 1 else x2d.new_empty((config.splits, rows, n), dtype=torch.float32)
    has_bias = bias is not None
    gemm[(-(-n // config.block_n), config.splits)](
        x2d, weight, bias if has_bias else out, out, partial, rows, n, k,
        x2d.stride(0), weight.stride(0), out.stride(0), config.splits,
        BLOCK_M=_pow2_at_least_16(rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        HAS_BIAS=has_bias, EVEN_N=n % config.block_n == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if config.splits > 1:
        block = 1024
        reduce[(rows, -(-n // block))](partial, bias if has_bias else out, out, rows, n, out.stride(0), config.splits,
                                       BLOCK=block, HAS_BIAS=has_bias, num_warps=4)
    return out.view(*x.shape[:-1], n)


@functools.cache
def _kernels():
    """The GEMM and the reduction of its splits, compiled on first use: imported here so that importing this module
    never needs Triton."""
    from . import _triton_skinny as kernels

    return kernels.skinny_gemm, kernels.reduce_splits
