"""Triton kernels for the per-row reductions of ``chunked_logprobs`` on CUDA.

The torch path makes several passes over each ``(chunk_rows, V)`` fp32 logits chunk (max, shift,
exp, sums, and in backward softmax, scale, cast); at V = 152k these passes, not the GEMMs, set the
time. Here the forward is one read of the chunk (online log-sum-exp, target logit and the sum
behind the entropy) and the backward one read of the chunk that writes the logits gradient
straight in the GEMM's dtype (two reads when the entropy has a gradient). One program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _row_stats_kernel(Z, B, T, LSE, LOGP, ENT, stride_z, V, inv_t,
                      HAS_BIAS: tl.constexpr, WANT_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)  # running max per lane
    s_vec = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m) per lane
    t_vec = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m) * z per lane (entropy)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, z * inv_t, float("-inf"))
        new_m = tl.maximum(m_vec, z)
        # lanes that have seen only masked columns keep m = -inf: avoid exp(-inf - -inf)
        scale = tl.where(new_m == float("-inf"), 1.0, tl.exp(m_vec - new_m))
        e = tl.where(mask, tl.exp(z - new_m), 0.0)
        s_vec = s_vec * scale + e
        if WANT_ENT:
            t_vec = t_vec * scale + tl.where(mask, e * z, 0.0)
        m_vec = new_m
    m = tl.max(m_vec, 0)
    lane_scale = tl.where(m_vec == float("-inf"), 0.0, tl.exp(m_vec - m))
    s = tl.sum(s_vec * lane_scale, 0)
    lse = m + tl.log(s)
    target = tl.load(T + row)
    z_t = tl.load(z_row + target).to(tl.float32)
    if HAS_BIAS:
        z_t += tl.load(B + target).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(LOGP + row, z_t * inv_t - lse)
    if WANT_ENT:
        # H = -sum p log p = lse - E_p[z]
        tl.store(ENT + row, lse - tl.sum(t_vec * lane_scale, 0) / s)


@triton.jit
def _row_grad_kernel(Z, B, G, T, LSE, GL, GH, stride_z, stride_g, V, inv_t,
                     HAS_BIAS: tl.constexpr, HAS_GL: tl.constexpr, HAS_GH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    g_row = G + row * stride_g
    lse = tl.load(LSE + row)
    if HAS_GL:
        gl = tl.load(GL + row).to(tl.float32)
    else:
        gl = 0.0
    # dL/dz_j = gl * 1[j = t] - p_j * (gl + gh * (log p_j + H)); the entropy term needs H first.
    coef = gl
    if HAS_GH:
        gh = tl.load(GH + row).to(tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                z += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            logp = z * inv_t - lse
            acc += tl.where(mask, tl.exp(logp) * logp, 0.0)
        coef = gl - gh * tl.sum(acc, 0)  # gl + gh * H, with H = -sum p log p
    target = tl.load(T + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        logp = z * inv_t - lse
        p = tl.exp(logp)
        if HAS_GH:
            g = -p * (coef + gh * logp)
        else:
            g = -p * coef
        g = tl.where(cols == target, g + gl, g) * inv_t  # w.r.t. the logits before the temperature
        tl.store(g_row + cols, g.to(G.dtype.element_ty), mask=mask)


def row_stats(z, bias, targets, inv_t, lse, logp, entropy):
    """Fill ``lse``, ``logp`` (and ``entropy`` unless None) for raw logits ``z`` [n, V] (fp32, bias not added)."""
    n, vocab = z.shape
    if n == 0:
        return
    _row_stats_kernel[(n,)](
        z, bias if bias is not None else z, targets, lse, logp, entropy if entropy is not None else lse,
        z.stride(0), vocab, inv_t,
        HAS_BIAS=bias is not None, WANT_ENT=entropy is not None, BLOCK=_BLOCK, num_warps=8,
    )


def row_grad(z, bias, targets, lse, grad_logp, grad_entropy, inv_t, out_dtype) -> torch.Tensor:
    """dL/d(raw logits) [n, V] in ``out_dtype``, from raw logits ``z`` and the upstream gradients."""
    n, vocab = z.shape
    grad = torch.empty((n, vocab), device=z.device, dtype=out_dtype)
    if n == 0:
        return grad
    _row_grad_kernel[(n,)](
        z, bias if bias is not None else z, grad, targets, lse,
        grad_logp if grad_logp is not None else lse, grad_entropy if grad_entropy is not None else lse,
        z.stride(0), grad.stride(0), vocab, inv_t,
        HAS_BIAS=bias is not None, HAS_GL=grad_logp is not None, HAS_GH=grad_entropy is not None,
        BLOCK=_BLOCK, num_warps=8,
    )
    return grad
