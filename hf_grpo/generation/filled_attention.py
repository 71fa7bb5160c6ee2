"""Decode attention that reads only the cache positions a row may attend to.

A captured decode step attends over a static cache of ``cache_len`` positions, of which a rollout has
filled, on average, the prompt plus half the completion. Two batched matmuls over the whole cache (the
``matmul`` decode attention) read every position's keys and values at every step: a third of the step at
1.5B x 128 rows (``bench/results/decode_profile_fused_h100.jsonl``). A graph cannot change the shapes it
replays, but a kernel can read its bounds from memory at run time: this one walks the cache in blocks
from the row's first position the attention mask admits to its last one, so the left padding's blocks
and everything past the current token stay unread (and inside that span, no excluded position is read).

``filled_decode_attention(query, key, value, valid, scale)`` is a ``torch.library`` custom op, so a
compiled step calls it as one opaque kernel:

* query ``[B, KV heads, G, D]``: the G query heads that share a KV head, for the one decode token
  (``attention_routing._gqa_decode`` packs them);
* key, value ``[B, KV heads, L, D]``: the static cache;
* valid ``[B, L]`` bool: the positions each row attends to;
* source ``[B]`` int32 and prompt_end ``[1]`` int32, optional: each row reads its positions before
  ``prompt_end`` from row ``source[b]`` of the cache. GRPO decodes every prompt ``num_generations`` times, and the
  shared prefill writes the same prompt keys and values into each of those rows; read from one of them, the
  prompt comes from memory once and from the L2 for the others (7B, 32 rows of 4 prompts, 2048-token
  completions: 30% of the cache's reads at the rollout's mean fill, the attention 15% faster on an H100,
  ``bench/results/decode_shared_prompts_h100_7b.jsonl``);
* result ``[B, KV heads, G, D]`` in the query's dtype.

On CUDA with Triton it runs the block-skipping kernel (an online softmax in float32, as flash attention
computes it), one program per (row, KV head) and, over a long cache, per share of its filled span
(``splits``: flash-decoding), the shares' partial sums then reduced by a second kernel; elsewhere the same
math as the ``matmul`` decode attention, in torch. A decoder takes this attention only where the kernel has
at least one program per SM (``serves``): with fewer, over a short cache, the matmul attention was as fast
(32 rows of Qwen2-0.5B at 768 positions, H100, ``bench/results/decode_attention_sweep_h100.jsonl``) and needs
no Triton compile at a run's start. Over a long cache those 32 rows are split until the programs fill the
SMs: the matmul attention reads the whole static cache at every step, the kernel only what is filled.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch


@dataclasses.dataclass
class KernelConfig:
    """Launch settings of the kernel (``bench/decode_attention.py`` sweeps them)."""

    block: int = 128  # cache positions per step of the kernel's loop (64 was 10-25% slower, H100 sweep)
    num_warps: int = 4
    num_stages: int = 2
    min_programs: int | None = None  # fewest programs the kernel serves; None: the GPU's SMs
    # A long cache is split over several programs per (row, KV head), each walking its share of the filled
    # span, then one reduction (flash-decoding): with one program per (row, KV head), 32 rows x 2 KV heads
    # leave most SMs idle however long the cache grows.
    programs_per_sm: int = 2  # splits are added until the programs reach this many per SM ...
    max_splits: int = 16  # ... but no more than this many per (row, KV head) ...
    min_blocks_per_split: int = 4  # ... and none shorter than this many blocks of the whole cache


CONFIG = KernelConfig()


# Whether Triton can be imported, without importing it (it is, lazily, by the kernel's first call).
TRITON = importlib.util.find_spec("triton") is not None


def splits(rows: int, kv_heads: int, cache_len: int, sms: int, config: KernelConfig | None = None) -> int:
    """Programs each (row, KV head) is split over: enough to fill ``programs_per_sm`` per SM where the cache is
    long enough to give each at least ``min_blocks_per_split`` blocks; 1 where the rows alone fill the GPU."""
    config = CONFIG if config is None else config
    programs = rows * kv_heads
    wanted = -(-config.programs_per_sm * sms // programs)
    by_length = cache_len // (config.block * config.min_blocks_per_split)
    return max(1, min(config.max_splits, wanted, by_length))


def worth_the_kernel(programs: int, sms: int, min_programs: int | None = None) -> bool:
    """The kernel pays where its programs are at least the SMs (or ``min_programs``)."""
    return programs >= (sms if min_programs is None else min_programs)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def serves(rows: int, kv_heads: int, device: torch.device, cache_len: int = 0) -> bool:
    """True where a decoder of ``rows`` rows and a ``cache_len`` cache should attend with the kernel (decided once,
    outside any trace): its programs, the cache's splits counted, fill the GPU's SMs."""
    if device.type != "cuda" or not TRITON:
        return False
    sms = _sms(device.index if device.index is not None else torch.cuda.current_device())
    programs = rows * kv_heads * splits(rows, kv_heads, cache_len, sms)
    return worth_the_kernel(programs, sms, CONFIG.min_programs)


def usable(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """True where the kernel can take this call's tensors (else the caller keeps its own attention)."""
    return (
        query.is_cuda
        and TRITON
        and mask is not None
        and mask.dtype == torch.bool
        and query.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and key.dtype == query.dtype
        and query.size(-1) <= 256
    )


def matmul_decode_attention(query, key, value, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention over the whole cache with torch ops: scores, a float32 softmax, the weighted values.

    ``mask`` broadcasts to the scores ``[B, KV heads, G, L]``: bool (True: attend), additive float, or None.
    The decode step's "matmul" attention, and this op's reference.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [B, KV heads, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value)


def prompts_from_source(cache: torch.Tensor, source: torch.Tensor, prompt_end: torch.Tensor) -> torch.Tensor:
    """``cache`` [B, KV heads, L, D] with each row's positions before ``prompt_end`` taken from row ``source[b]``."""
    in_prompt = torch.arange(cache.size(2), device=cache.device) < prompt_end  # [L]
    return torch.where(in_prompt[None, None, :, None], cache.index_select(0, source.long()), cache)


def reference_decode_attention(query, key, value, valid, scale: float, source=None, prompt_end=None) -> torch.Tensor:
    """The op's result with torch ops, for ``valid`` [B, L]."""
    if source is not None:
        key, value = prompts_from_source(key, source, prompt_end), prompts_from_source(value, source, prompt_end)
    return matmul_decode_attention(query, key, value, valid[:, None, None, :], scale)


@torch.library.custom_op("hf_grpo::filled_decode_attention", mutates_args=())
def filled_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scale: float,
    source: torch.Tensor | None = None, prompt_end: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_prompt_source(source, prompt_end)
    return reference_decode_attention(query, key, value, valid, scale, source, prompt_end)


def _check_prompt_source(source, prompt_end) -> None:
    if (source is None) != (prompt_end is None):
        raise ValueError("filled_decode_attention: source and prompt_end are given together or not at all "
                         f"(got source={source is not None}, prompt_end={prompt_end is not None})")


@filled_decode_attention.register_fake
def _(query, key, value, valid, scale, source=None, prompt_end=None):
    return torch.empty_like(query)


@filled_decode_attention.register_kernel("cuda")
def _(query, key, value, valid, scale, source=None, prompt_end=None):
    _check_prompt_source(source, prompt_end)
    if not TRITON:
        return reference_decode_attention(query, key, value, valid, scale, source, prompt_end)
    return _triton_decode_attention(query, key, value, valid, scale, source, prompt_end)


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _triton_decode_attention(query, key, value, valid, scale, source=None, prompt_end=None):
    batch, kv_heads, groups, dim = query.shape
    length = key.size(2)
    config = CONFIG
    split = splits(batch, kv_heads, length, _sms(query.device.index), config)
    valid_bytes = valid.view(torch.uint8)  # same strides; Triton reads uint8 where bool pointers vary by version
    out = torch.empty_like(query)
    if split > 1:  # each split's unnormalised sum and its softmax's max and denominator, reduced below
        partial = query.new_empty((batch, kv_heads, split, groups, dim), dtype=torch.float32)
        stats = query.new_empty((2, batch, kv_heads, split, groups), dtype=torch.float32)
    else:
        partial = stats = out  # unused: the one split writes the result itself
    shape = dict(GROUPS=groups, GROUPS_P=_pow2_at_least_16(groups), DIM=dim, DIM_P=_pow2_at_least_16(dim))
    shared = source is not None
    _kernels()[0][(batch, kv_heads, split)](
        query, key, value, valid_bytes, source if shared else out, prompt_end if shared else out,
        out, partial, stats, scale, length,
        *query.stride(), *key.stride(), *value.stride(), *valid_bytes.stride(), *out.stride(),
        **shape, BLOCK=config.block, SCAN=min(1024, _pow2_at_least_16(length)), SPLITS=split,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SHARED=shared,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        _kernels()[1][(batch, kv_heads)](partial, stats, out, *out.stride(), **shape, SPLITS=split)
    return out


@functools.cache
def _kernels():
    """The attention kernel and the reduction of its splits (``_triton_decode_attention``), compiled on first use:
    imported here so that importing this module never needs Triton."""
    from . import _triton_decode_attention as kernels

    return kernels.attend, kernels.reduce_splits
