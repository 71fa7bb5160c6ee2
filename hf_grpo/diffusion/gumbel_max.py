"""Gumbel-max sampling over the vocabulary in one CUDA kernel: no float64 tensor of noise in memory.

The diffusion sampler draws ``argmax(logits / T + g)`` with standard Gumbel noise ``g`` in float64 and
ranks its commits by ``log softmax(logits)[token]``. In torch that is a float64 copy of the logits, a
float64 noise tensor and their temporaries per vocabulary slice, about twenty small ops each: the
sampler's memory peak once, and after slicing its host time (about 6 ms a step at 8 rows x 32
positions of LLaDA's 126,464-word vocabulary, H100, where the captured model step takes about 20 ms).

This kernel takes one program per position and walks the vocabulary in blocks: it reads the logits
once, makes each word's noise from two 32-bit Philox draws (a 53-bit uniform u in (0, 1), then
``-log(-log u)``, all in float64), keeps a running maximum of ``logits / T + g`` per lane (ties to the
lower word id, as ``argmax``) and an online log-sum-exp of the untempered logits. The Philox seed is
drawn from the caller's torch generator on the device, so nothing syncs with the host and a seeded
generator gives the same tokens again. The noise is not the torch ``exponential_`` stream: tokens
differ from the torch path's draw by draw, not in distribution (``tests/diffusion/test_diffu_gumbel_max.py``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

TRITON = importlib.util.find_spec("triton") is not None
BLOCK = 2048  # vocabulary words per step of a program's loop
_SEED_RANGE = 2**62


def usable(logits: torch.Tensor) -> bool:
    """Whether ``gumbel_max`` serves these logits ``[N, V]``: CUDA, Triton present, float dtypes, unit stride."""
    return (logits.is_cuda and TRITON and logits.dim() == 2 and logits.stride(-1) == 1
            and logits.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64))


def gumbel_max(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None):
    """``(tokens [N] long, log_confidence [N] float32)`` for ``logits`` ``[N, V]`` on CUDA (see the module doc).

    ``temperature`` 0 takes the argmax and draws nothing.
    """
    if not usable(logits):
        raise ValueError(f"gumbel_max needs CUDA logits [N, V] of a float dtype with unit stride on the last "
                         f"dimension and Triton; got {tuple(logits.shape)} {logits.dtype} on {logits.device} "
                         f"(Triton {'present' if TRITON else 'absent'})")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    confidence = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sample = temperature > 0
    # Philox counters are 32-bit (row x vocab + word): a launch covers fewer than 2**31 words
    per_launch = max(1, (2**31 - 1) // max(vocab, 1))
    scale = torch.full((1,), temperature if sample else 1.0, dtype=torch.float64, device=logits.device)
    seed = torch.zeros(1, dtype=torch.long, device=logits.device)  # read only when sampling
    for begin in range(0, rows, per_launch):
        end = min(rows, begin + per_launch)
        if sample:  # a fresh seed per launch, drawn on the device from the caller's generator
            seed = torch.randint(_SEED_RANGE, (1,), device=logits.device, generator=generator)
        _kernel()[(end - begin,)](
            logits[begin:end], logits.stride(0), vocab, seed, scale, tokens[begin:end], confidence[begin:end],
            SAMPLE=sample, BLOCK=BLOCK, num_warps=8,
        )
    return tokens, confidence


@functools.cache
def _kernel():
    """Compile-on-first-use Triton kernel (defined here so that importing this module never needs Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gumbel_max_kernel(LOGITS, stride_row, vocab, SEED, TEMPERATURE, TOKENS, CONFIDENCE,
                          SAMPLE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = LOGITS + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        best = tl.full((BLOCK,), float("-inf"), tl.float64)
        best_id = tl.full((BLOCK,), 0, tl.int64)
        top = tl.full((BLOCK,), float("-inf"), tl.float64)  # per lane: running max of the logits
        total = tl.zeros((BLOCK,), tl.float64)  # per lane: sum of exp(logit - top)
        if SAMPLE:
            seed = tl.load(SEED)
            temperature = tl.load(TEMPERATURE)  # float64, as the torch path divides
        for start in range(0, vocab, BLOCK):
            words = start + lanes
            inside = words < vocab
            x = tl.load(base + words, mask=inside, other=float("-inf")).to(tl.float64)
            new_top = tl.maximum(top, x)
            finite = new_top > float("-inf")  # exp(-inf - -inf) would be NaN
            total = tl.where(finite, total * tl.exp(top - new_top) + tl.exp(x - new_top), total)
            top = new_top
            if SAMPLE:
                offsets = row * vocab + words  # int32: the wrapper keeps it below 2**31
                high, low, _, _ = tl.randint4x(seed, offsets)
                uniform = ((high >> 5).to(tl.float64) * 67108864.0 + (low >> 6).to(tl.float64) + 0.5) \
                    * 1.1102230246251565e-16  # (53-bit integer + 1/2) / 2**53: never 0, never 1
                value = x / temperature - tl.log(-tl.log(uniform))
            else:
                value = x
            better = value > best  # a lane sees its words in increasing order: ties keep the lower id
            best = tl.where(better, value, best)
            best_id = tl.where(better, words.to(tl.int64), best_id)
        winner = tl.max(best, axis=0)
        token = tl.min(tl.where(best == winner, best_id, vocab), axis=0)  # ties across lanes: the lower id
        overall = tl.max(top, axis=0)
        norm = overall + tl.log(tl.sum(tl.where(top > float("-inf"), total * tl.exp(top - overall), 0.0), axis=0))
        chosen = tl.load(base + token).to(tl.float64)
        tl.store(TOKENS + row, token)
        tl.store(CONFIDENCE + row, (chosen - norm).to(tl.float32))

    return gumbel_max_kernel
