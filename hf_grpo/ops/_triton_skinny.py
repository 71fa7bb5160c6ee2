"""The Triton kernels of ``skinny_linear``: a GEMM for a few dozen rows that streams the weight once, split over K
where its column blocks alone leave SMs idle, and the ordered sum of the splits. Imported on first use only
(``skinny_linear._kernels``), so that importing ``hf_grpo.ops`` never needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def skinny_gemm(
    X, W, BIAS, OUT, PARTIAL, M, N, K, sx_m, sw_n, so_m, SPLITS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """``OUT[m, n] = X[m, :] @ W[n, :] (+ BIAS[n])`` for one block of BLOCK_N columns and one of SPLITS shares of K
    (each share a whole number of BLOCK_K; K a multiple of BLOCK_K). A split writes its float32 sum to
    ``PARTIAL[split, m, n]`` for ``reduce_splits``; one split writes the result itself."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    per_split = tl.cdiv(K // BLOCK_K, SPLITS) * BLOCK_K
    k_lo = split * per_split
    k_hi = tl.minimum(K, k_lo + per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + m[:, None] * sx_m + k[None, :], mask=m_ok[:, None], other=0.0)
        if EVEN_N:
            w = tl.load(W + n[:, None] * sw_n + k[None, :])
        else:
            w = tl.load(W + n[:, None] * sw_n + k[None, :], mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + m[:, None] * so_m + n[None, :], acc.to(OUT.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(PARTIAL + (split * M + m[:, None]) * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def reduce_splits(
    PARTIAL, BIAS, OUT, M, N, so_m, SPLITS,
    BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """``OUT = sum over splits of PARTIAL (+ BIAS)``, the splits added in order (the same bits every call)."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < N
    total = tl.zeros((BLOCK,), tl.float32)
    for split in range(SPLITS):
        total += tl.load(PARTIAL + (split * M + row) * N + n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * so_m + n, total.to(OUT.dtype.element_ty), mask=n_ok)
