"""Triton kernels whose result for one row never depends on the other rows of the call (``batch_invariant``).

Each kernel has ONE configuration, whatever the shapes: cuBLAS and torch's reductions pick their tiling, split-K and
reduction trees by the shape of the call, so a token's numbers move with how many tokens share the call. Here:

* ``matmul``: tiles chosen by the weight's shape alone (``config_for``), fixed-width K steps accumulated in fp32 in K
  order, no split-K. An output element is the same dot product, in the same order, for a one-token decode step
  (M = rows of the batch) and for the trainer's forward (M = all the tokens).
* ``rms_norm``, ``logsumexp``: one program per row, one block width.
* ``attention``: one query's keys are visited in 64-key blocks counted from the row's first attended key (the left
  padding differs between the decoder's batch and the trainer's); keys past the query's last are masked to an exact
  zero weight, so blocks past it change nothing (m stays, exp(-inf) = 0, acc * 1 + 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MM_GROUP_M = 8
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), chosen by the weight's shape only, never by the call's rows (the
# decoder and the trainer run the same weight with the same tiles). Measured on an H100 at 1.5B and 7B, in CUDA graphs
# (bench/results/batch_invariant_matmul_h100.jsonl): wide weights (MLP up, LM head) take large tiles, 1.7-1.9x faster
# on the trainer's 16k rows and as fast on a decode step's 32; narrower ones keep small tiles, whose decode step has
# enough programs to read the weight at speed (large tiles cost a 1.5B decode step's q/o projection 2x).
WIDE_CONFIG, NARROW_CONFIG, WIDE_N = (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), 8192


def config_for(n: int) -> tuple[int, int, int, int, int]:
    """The tiles for a weight of ``n`` outputs."""
    return WIDE_CONFIG if n >= WIDE_N else NARROW_CONFIG
ATTN_BLOCK_M, ATTN_BLOCK_N = 64, 64
LSE_BLOCK = 4096


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(A, W, BIAS, C, M, N, K, stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n  # grouped order: neighbouring programs share W tiles in L2
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config=None) -> torch.Tensor:
    """``x2d @ weight.T + bias`` [M, N] in ``x2d``'s dtype, fp32 accumulation; ``config``: ``config_for``'s form
    (a benchmark's; the default is the weight's)."""
    M, K = x2d.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    if M == 0:
        return out
    block_m, block_n, block_k, warps, stages = config or config_for(N)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _matmul_kernel[grid](x2d, weight, bias if bias is not None else weight, out, M, N, K,
                         x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                         HAS_BIAS=bias is not None, IEEE=x2d.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, GROUP_M=MM_GROUP_M, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    normed = (x * tl.math.rsqrt(variance + eps)).to(X.dtype.element_ty)  # back to the input's dtype, then scaled
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x2d: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    rows, hidden = x2d.shape
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x2d.device)
    if rows:
        _rms_norm_kernel[(rows,)](x2d, weight, out, x2d.stride(0), out.stride(0), hidden, eps,
                                  BLOCK=triton.next_power_of_2(hidden), num_warps=8)
    return out


@triton.jit
def _logsumexp_kernel(Z, OUT, stride_z, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(Z + row * stride_z + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m_vec, z)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s_vec = s_vec * tl.exp(m_vec - safe) + tl.exp(z - safe)
        m_vec = new_m
    m = tl.max(m_vec, axis=0)
    safe_m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(s_vec * tl.exp(m_vec - safe_m), axis=0)
    tl.store(OUT + row, tl.log(total) + safe_m)


def logsumexp(z2d: torch.Tensor) -> torch.Tensor:
    rows, vocab = z2d.shape
    out = torch.empty((rows,), dtype=torch.float32, device=z2d.device)
    if rows:
        _logsumexp_kernel[(rows,)](z2d, out, z2d.stride(0), vocab, BLOCK=LSE_BLOCK, num_warps=8)
    return out


@triton.jit
def _attention_kernel(Q, K, V, START, END, O, Sq, Sk, heads, groups, scale,
                      sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, sos, soh, seb,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // heads, pid_bh % heads
    kv = h // groups
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=rows[:, None] < Sq, other=0.0)
    start = tl.load(START + b)
    ends = tl.load(END + b * seb + rows, mask=rows < Sq, other=0)
    stop = tl.max(ends, axis=0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        inside = keys < Sk
        k = tl.load(K + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(V + b * svb + kv * svh + keys[:, None] * svs + dims[None, :], mask=inside[:, None], other=0.0)
        if IEEE:  # fp32 inputs: full-precision products, not tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(keys[None, :] < ends[:, None], s, float("-inf"))
        new_m = tl.maximum(m, tl.max(s, axis=1))
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        alpha = tl.exp(m - safe)
        p = tl.exp(s - safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = new_m
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(O + b * sob + rows[:, None] * sos + h * soh + dims[None, :], out.to(O.dtype.element_ty),
             mask=rows[:, None] < Sq)


def attention(query, key, value, start, end, scale: float) -> torch.Tensor:
    """query [B, H, Sq, D], key/value [B, Hkv, Sk, D] (last dim contiguous), start [B], end [B, Sq] int32 ->
    [B, Sq, H, D]."""
    batch, heads, sq, dim = query.shape
    if dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"true_on_policy attention: head_dim {dim} is not one of 16, 32, 64, 128, 256")
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    end = end.contiguous()
    out = torch.empty((batch, sq, heads, dim), dtype=query.dtype, device=query.device)
    grid = (triton.cdiv(sq, ATTN_BLOCK_M), batch * heads)
    _attention_kernel[grid](query, key, value, start, end, out, sq, key.shape[2], heads, heads // key.shape[1], scale,
                            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1),
                            key.stride(2), value.stride(0), value.stride(1), value.stride(2), out.stride(0),
                            out.stride(1), out.stride(2), end.stride(0), D=dim, BLOCK_M=ATTN_BLOCK_M,
                            BLOCK_N=ATTN_BLOCK_N, IEEE=query.dtype == torch.float32, num_warps=4, num_stages=2)
    return out
