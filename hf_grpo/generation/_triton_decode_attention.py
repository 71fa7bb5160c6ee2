"""The Triton kernels of ``filled_attention``'s decode attention: the split attention over the admitted span of
each row, and the reduction of its splits. With ``SHARED``, a row reads the positions before ``PROMPT_END`` (its
prompt) from the cache row ``SOURCE`` names: the rows of one prompt then read one copy, which the L2 serves to all
but the first. Imported on first use only (``filled_attention._kernels``), so that
importing ``hf_grpo.generation`` never needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend(
    Q, K, V, VALID, SOURCE, PROMPT_END, OUT, PARTIAL, STATS, scale, length,
    sq_b, sq_h, sq_g, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d, sm_b, sm_l,
    so_b, so_h, so_g, so_d,
    GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
    BLOCK: tl.constexpr, SCAN: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr, SHARED: tl.constexpr,
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
    if SHARED:  # the row holding this row's prompt, and where the prompts end (read at replay time)
        source = tl.load(SOURCE + b)
        prompt_end = tl.load(PROMPT_END)
    for start in range(lo, hi, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ok = tl.load(VALID + b * sm_b + pos * sm_l, mask=pos < hi, other=0) != 0
        if SHARED:
            row = tl.where(pos < prompt_end, source, b)
            k_row = row[None, :] * sk_b
            v_row = row[:, None] * sv_b
        else:
            k_row = b * sk_b
            v_row = b * sv_b
        k = tl.load(K + k_row + h * sk_h + pos[None, :] * sk_l + d[:, None] * sk_d,
                    mask=ok[None, :] & d_ok[:, None], other=0.0)  # [D, BLOCK]
        v = tl.load(V + v_row + h * sv_h + pos[:, None] * sv_l + d[None, :] * sv_d,
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
