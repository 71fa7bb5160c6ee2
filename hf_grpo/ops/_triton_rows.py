"""Triton kernels for the per-row reductions of ``chunked_logprobs`` on CUDA.

The torch path makes several passes over each ``(chunk_rows, V_tile)`` fp32 logits tile (max, shift,
exp, sums, and in backward softmax, scale, cast); at V = 152k these passes, not the GEMMs, set the
time. Here the forward is one read of the tile (online log-sum-exp, the softmax mean behind the
entropy, the target logit when the tile holds it) and the backward one read of the tile that
writes the logits gradient straight in the GEMM's dtype. One program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _tile_stats_kernel(Z, B, T, LSE, MEAN, TZ, stride_z, V, inv_t,
                       HAS_BIAS: tl.constexpr, WANT_MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)  # running max per lane
    s_vec = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m) per lane
    t_vec = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m) * z per lane (softmax mean, for the entropy)
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
        if WANT_MEAN:
            t_vec = t_vec * scale + tl.where(mask, e * z, 0.0)
        m_vec = new_m
    m = tl.max(m_vec, 0)
    lane_scale = tl.where(m_vec == float("-inf"), 0.0, tl.exp(m_vec - m))
    s = tl.sum(s_vec * lane_scale, 0)
    tl.store(LSE + row, m + tl.log(s))
    if WANT_MEAN:
        tl.store(MEAN + row, tl.sum(t_vec * lane_scale, 0) / s)
    # the target's scaled logit when this tile holds it, else 0
    target = tl.load(T + row)
    inside = (target >= 0) & (target < V)
    safe = tl.where(inside, target, 0)
    z_t = tl.load(z_row + safe).to(tl.float32)
    if HAS_BIAS:
        z_t += tl.load(B + safe).to(tl.float32)
    tl.store(TZ + row, tl.where(inside, z_t * inv_t, 0.0))


@triton.jit
def _tile_grad_kernel(Z, B, G, T, LSE, GL, COEF, GH, stride_z, stride_g, V, inv_t,
                      HAS_BIAS: tl.constexpr, HAS_GL: tl.constexpr, HAS_GH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    g_row = G + row * stride_g
    lse = tl.load(LSE + row)
    coef = tl.load(COEF + row).to(tl.float32)  # gl + gh * H, H the whole row's entropy
    if HAS_GL:
        gl = tl.load(GL + row).to(tl.float32)
    else:
        gl = 0.0
    if HAS_GH:
        gh = tl.load(GH + row).to(tl.float32)
    target = tl.load(T + row)  # local to this tile; outside [0, V) when another tile holds it
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


def tile_stats(z, bias, targets, inv_t, want_mean):
    """Per row of a logits tile ``z`` [n, V_tile] (fp32, bias not added): the log-sum-exp of the scaled logits,
    their softmax mean (None unless ``want_mean``) and the scaled target logit (0 where ``targets`` [n], local to
    the tile, falls outside it)."""
    n, width = z.shape
    lse = torch.empty(n, device=z.device, dtype=torch.float32)
    mean = torch.empty_like(lse) if want_mean else None
    target_z = torch.empty_like(lse)
    if n:
        _tile_stats_kernel[(n,)](
            z, bias if bias is not None else z, targets, lse, mean if want_mean else lse, target_z,
            z.stride(0), width, inv_t,
            HAS_BIAS=bias is not None, WANT_MEAN=want_mean, BLOCK=_BLOCK, num_warps=8,
        )
    return lse, mean, target_z


def tile_grad(z, bias, targets, lse, grad_logp, coef, grad_entropy, inv_t, out_dtype) -> torch.Tensor:
    """dL/d(raw logits) of a tile [n, V_tile] in ``out_dtype``; ``lse`` and ``coef`` (= gl + gh H) are the whole
    rows', ``targets`` local to the tile."""
    n, width = z.shape
    grad = torch.empty((n, width), device=z.device, dtype=out_dtype)
    if n == 0:
        return grad
    _tile_grad_kernel[(n,)](
        z, bias if bias is not None else z, grad, targets, lse,
        grad_logp if grad_logp is not None else lse, coef, grad_entropy if grad_entropy is not None else lse,
        z.stride(0), grad.stride(0), width, inv_t,
        HAS_BIAS=bias is not None, HAS_GL=grad_logp is not None, HAS_GH=grad_entropy is not None,
        BLOCK=_BLOCK, num_warps=8,
    )
    return grad
