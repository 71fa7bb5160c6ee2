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


def reference_decode_attention(query, key, value, valid, scale: float) -> torch.Tensor:
    """The op's result with torch ops, for ``valid`` [B, L]."""
    return matmul_decode_attention(query, key, value, valid[:, None, None, :], scale)


@torch.library.custom_op("hf_grpo::filled_decode_attention", mutates_args=())
def filled_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    return reference_decode_attention(query, key, value, valid, scale)


@filled_decode_attention.register_fake
def _(query, key, value, valid, scale):
    return torch.empty_like(query)


@filled_decode_attention.register_kernel("cuda")
def _(query, key, value, valid, scale):
    if not TRITON:
        return reference_decode_attention(query, key, value, valid, scale)
    return _triton_decode_attention(query, key, value, valid, scale)


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _triton_decode_attention(query, key, value, valid, scale):
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
    _kernels()[0][(batch, kv_heads, split)](
        query, key, value, valid_bytes, out, partial, stats, scale, length,
        *query.stride(), *key.stride(), *value.stride(), *valid_bytes.stride(), *out.stride(),
        **shape, BLOCK=config.block, SCAN=min(1024, _pow2_at_least_16(length)), SPLITS=split,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        _kernels()[1][(batch, kv_heads)](partial, stats, out, *out.stride(), **shape, SPLITS=split)
    return out


@functools.cache
def _kernels():
    """The attention kernel and the reduction of its splits, compiled on first use (defined here so that importing
    this module never needs Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(
        Q, K, V, VALID, OUT, PARTIAL, STATS, scale, length,
        sq_b, sq_h, sq_g, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d, sm_b, sm_l,
        so_b, so_h, so_g, so_d,
        GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
        BLOCK: tl.constexpr, SCAN: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, GROUPS_P)  # tl.dot needs 16 rows at least: the padded groups are masked
        d = tl.arange(0, DIM_P)
        g_ok = g < GROUPS
        d_ok = d < DIM
        # The row's first and last admitted positions, read at replay time (a captured graph serves every step).
        first = length
        end = 0
        for scan in range(0, length, SCAN):
            span = scan + tl.arange(0, SCAN)
            admitted = tl.load(VALID + b * sm_b + span * sm_l, mask=span < length, other=0) != 0
            first = tl.minimum(first, tl.min(tl.where(admitted, span, length), axis=0))
            end = tl.maximum(end, tl.max(tl.where(admitted, span + 1, 0), axis=0))  # none admitted: 0
        # This split's share of the blocks from the first admitted one to the last. The loop has no branch
        # inside, so Triton can pipeline the loads (a per-block skip left each block's loads waiting on the
        # last). Positions the mask excludes inside that span are still masked out of every load.
        start0 = first // BLOCK * BLOCK
        per_split = tl.cdiv(tl.cdiv(tl.maximum(end - start0, 0), BLOCK), SPLITS) * BLOCK
        lo = start0 + split * per_split
        hi = tl.minimum(end, lo + per_split)
        q = tl.load(Q + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :] * sq_d,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full((GROUPS_P,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUPS_P,), tl.float32)
        acc = tl.zeros((GROUPS_P, DIM_P), tl.float32)
        for start in range(lo, hi, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            ok = tl.load(VALID + b * sm_b + pos * sm_l, mask=pos < hi, other=0) != 0
            k = tl.load(K + b * sk_b + h * sk_h + pos[None, :] * sk_l + d[:, None] * sk_d,
                        mask=ok[None, :] & d_ok[:, None], other=0.0)  # [D, BLOCK]
            v = tl.load(V + b * sv_b + h * sv_h + pos[:, None] * sv_l + d[None, :] * sv_d,
                        mask=ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK, D]
            scores = tl.dot(q, k, input_precision=PRECISION) * scale  # [G, BLOCK] float32
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # a block with nothing admitted yet keeps m at -inf: exp(-inf - -inf) would be NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if SPLITS == 1:
            result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that attends nowhere gives zeros
            tl.store(OUT + b * so_b + h * so_h + g[:, None] * so_g + d[None, :] * so_d,
                     result.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:  # contiguous [B, H, SPLITS, GROUPS, DIM] and [2, B, H, SPLITS, GROUPS]
            heads = tl.num_programs(1)
            row = (b * heads + h) * SPLITS + split
            tl.store(PARTIAL + (row * GROUPS + g[:, None]) * DIM + d[None, :], acc,
                     mask=g_ok[:, None] & d_ok[None, :])
            tl.store(STATS + row * GROUPS + g, m_i, mask=g_ok)
            tl.store(STATS + (tl.num_programs(0) * heads * SPLITS + row) * GROUPS + g, l_i, mask=g_ok)

    @triton.jit
    def reduce_splits(
        PARTIAL, STATS, OUT, so_b, so_h, so_g, so_d,
        GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr, SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        second = tl.num_programs(0) * heads * SPLITS * GROUPS  # where the denominators start in STATS
        g = tl.arange(0, GROUPS_P)
        d = tl.arange(0, DIM_P)
        g_ok = g < GROUPS
        d_ok = d < DIM
        base = (b * heads + h) * SPLITS
        m_max = tl.full((GROUPS_P,), float("-inf"), tl.float32)
        for split in range(SPLITS):
            m_max = tl.maximum(m_max, tl.load(STATS + (base + split) * GROUPS + g, mask=g_ok, other=float("-inf")))
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        total = tl.zeros((GROUPS_P,), tl.float32)
        acc = tl.zeros((GROUPS_P, DIM_P), tl.float32)
        for split in range(SPLITS):
            row = base + split
            weight = tl.exp(tl.load(STATS + row * GROUPS + g, mask=g_ok, other=float("-inf")) - m_safe)
            total += weight * tl.load(STATS + second + row * GROUPS + g, mask=g_ok, other=0.0)
            part = tl.load(PARTIAL + (row * GROUPS + g[:, None]) * DIM + d[None, :],
                           mask=g_ok[:, None] & d_ok[None, :], other=0.0)
            acc += weight[:, None] * part
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(OUT + b * so_b + h * so_h + g[:, None] * so_g + d[None, :] * so_d,
                 result.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    return attend, reduce_splits
