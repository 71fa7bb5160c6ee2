"""Per-row log-probabilities (and entropies) through an LM head without materialising all ``(N, V)`` logits.

The op projects ``chunk_rows`` rows at a time against ``_VOCAB_BLOCK`` vocabulary columns at a time, reduces each
tile to running per-row statistics (an online log-sum-exp), and throws the logits away. The backward recomputes each
tile from the saved inputs (one extra GEMM per tile) instead of keeping it, walking the vocabulary in the outer loop
so that the weight gradient of one column block is finished (in fp32) before the next starts: scratch memory is one
``(chunk_rows, _VOCAB_BLOCK)`` tile and one ``(_VOCAB_BLOCK, H)`` fp32 accumulator, never ``V`` wide.

Targets are taken as given: row ``i`` is scored against ``targets[i]``, with no causal shift, so the same op serves
next-token (shift done by the caller) and masked-diffusion objectives.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.autograd.function import once_differentiable

__all__ = ["chunked_logprobs"]

# Vocabulary columns per logits tile. Each (rows, columns) tile of logits is made, reduced and dropped, forward and
# backward, so the op's scratch memory is one (chunk_rows, _VOCAB_BLOCK) fp32 tile plus its gradient, whatever V is
# (at V = 152k, a whole (1024, V) fp32 chunk would be 0.58 GiB; a tile is 0.125 GiB).
_VOCAB_BLOCK = 32768

_HALF_DTYPES = (torch.float16, torch.bfloat16)

# On CUDA the row reductions run as fused Triton kernels (hf_grpo/ops/_triton_rows.py); tests switch
# this off to compare against the torch path.
USE_TRITON = True


def _triton_rows(z: torch.Tensor):
    """The Triton row kernels when they apply to this fp32 CUDA chunk, else None (torch path)."""
    if not (USE_TRITON and z.is_cuda and z.dtype == torch.float32):
        return None
    try:
        from . import _triton_rows
    except ImportError:  # no triton installed
        return None
    return _triton_rows
# Whether `torch.mm/addmm(..., out_dtype=torch.float32)` works for half inputs (CUDA, torch >= 2.8). Probed on first
# use on a CUDA device; None means not probed yet.
_OUT_DTYPE_OK: bool | None = None


def _use_out_dtype(t: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    return (
        t.device.type == "cuda"
        and t.dtype in _HALF_DTYPES
        and acc_dtype == torch.float32
        and _OUT_DTYPE_OK is not False
    )


def _mm_acc(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in ``acc_dtype``; half inputs go through cuBLAS with an fp32 output when possible, so the
    logits are never rounded to bf16 before the log-sum-exp (and no extra half-size copy is made)."""
    global _OUT_DTYPE_OK
    if a.dtype == acc_dtype:
        return torch.mm(a, b)
    if _use_out_dtype(a, acc_dtype):
        try:
            out = torch.mm(a, b, out_dtype=acc_dtype)
            _OUT_DTYPE_OK = True
            return out
        except torch.cuda.OutOfMemoryError:
            raise  # a real OOM, not a missing kernel: the fallback would need even more memory
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_OK = False
    # Fallback (CPU, old torch): the GEMM output is rounded to the input dtype, then upcast for the log-sum-exp.
    return torch.mm(a, b).to(acc_dtype)


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_acc: torch.Tensor | None) -> None:
    """``acc += a @ b`` with ``acc`` in fp32/fp64; ``a_acc`` is ``a`` in ``acc.dtype`` if at hand (for the fallback).

    Rounding each chunk's product to bf16 before summing over chunks would bias ``grad_weight``; either cuBLAS adds
    the fp32 product in place, or the GEMM runs in ``acc.dtype``.
    """
    global _OUT_DTYPE_OK
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if _use_out_dtype(a, acc.dtype):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _OUT_DTYPE_OK = True
            return
        except torch.cuda.OutOfMemoryError:
            raise  # a real OOM, not a missing kernel: the fallback would need even more memory
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_OK = False
    acc.addmm_(a.to(acc.dtype) if a_acc is None else a_acc, b.to(acc.dtype))


def _vocab_blocks(v: int):
    for start in range(0, v, _VOCAB_BLOCK):
        yield start, min(start + _VOCAB_BLOCK, v)


def _dtypes(hidden: torch.Tensor, weight: torch.Tensor):
    # The GEMMs run in the autocast dtype when autocast is on (as nn.Linear would), else in the promoted input dtype.
    # Reductions run in fp32, or fp64 when the GEMMs already are fp64.
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        compute = torch.get_autocast_dtype(dev)
    else:
        compute = torch.promote_types(hidden.dtype, weight.dtype)
    return compute, torch.promote_types(compute, torch.float32)


def _tile_stats_torch(z, inv_t, want_entropy):
    """Per-row log-sum-exp of a tile of scaled logits and E[z] under the tile's own softmax (torch path)."""
    z.mul_(inv_t)
    m = z.amax(dim=-1, keepdim=True)
    e = (z - m).exp_()  # one tile-sized temporary besides z
    sum_exp = e.sum(-1)
    lse = m.squeeze(1) + sum_exp.log()
    mean_z = (e.mul_(z).sum(-1) / sum_exp) if want_entropy else None
    return lse, mean_z


def _merge(lse_a, mean_a, lse_b, mean_b):
    """Combine two column blocks' (log-sum-exp, softmax mean of z) into those of their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    if mean_a is None:
        return lse, None
    return lse, torch.exp(lse_a - lse) * mean_a + torch.exp(lse_b - lse) * mean_b


def _forward(hidden, weight, targets, bias, chunk_rows: int, temperature: float, want_entropy: bool, dtypes):
    """Returns (logp (N,), lse (N,), entropy (N,) or None), all in the accumulation dtype.

    Each row's log-sum-exp (and the softmax mean of its logits, for the entropy H = lse - E_p[z]) is built block
    by block; the target logit is picked from the block that holds it.
    """
    compute, acc = dtypes
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    w_c = weight.to(compute)  # (V, H); a view unless a cast is needed
    bias_acc = None if bias is None else bias.to(acc)
    logp = torch.empty(n_rows, device=hidden.device, dtype=acc)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if want_entropy else None

    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h_c = hidden[start:end].to(compute)
        rows_t = targets[start:end]
        run_lse = run_mean = None
        target_z = torch.zeros(end - start, device=hidden.device, dtype=acc)
        for c0, c1 in _vocab_blocks(vocab):
            z = _mm_acc(h_c, w_c[c0:c1].t(), acc)  # (n, block) raw logits
            b_blk = None if bias_acc is None else bias_acc[c0:c1]
            local = rows_t - c0
            inside = (local >= 0) & (local < c1 - c0)
            kernels = _triton_rows(z)
            if kernels is not None:  # one fused pass: bias, temperature, log-sum-exp, softmax mean, target logit
                blk_lse, blk_mean, blk_target = kernels.tile_stats(z, b_blk, local, inv_t, want_entropy)
            else:
                if b_blk is not None:
                    z.add_(b_blk)
                blk_target = z.gather(1, local.clamp(0, c1 - c0 - 1)[:, None]).squeeze(1) * inv_t
                blk_lse, blk_mean = _tile_stats_torch(z, inv_t, want_entropy)
            del z
            target_z += torch.where(inside, blk_target, torch.zeros_like(blk_target))
            if run_lse is None:
                run_lse, run_mean = blk_lse, blk_mean
            else:
                run_lse, run_mean = _merge(run_lse, run_mean, blk_lse, blk_mean)
        lse[start:end] = run_lse
        logp[start:end] = target_z - run_lse
        if want_entropy:
            entropy[start:end] = run_lse - run_mean
    return logp, lse, entropy


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows, temperature, want_entropy, param_context):
        # Gradients of unused outputs (typically the entropy, logged only) arrive as None instead of zeros, so the
        # backward can skip their term.
        ctx.set_materialize_grads(False)
        ctx.dtypes = _dtypes(hidden, weight)
        # Dtypes are fixed above (autocast included); the body casts explicitly, so autocast must not recast it.
        with torch.autocast(hidden.device.type, enabled=False):
            logp, lse, entropy = _forward(
                hidden, weight, targets, bias, chunk_rows, temperature, want_entropy, ctx.dtypes
            )
        # Only the inputs (references, no copies) and per-row statistics are kept; logits are recomputed.
        # The entropy is kept too (N floats): its gradient needs H, which the backward then need not recompute.
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk_rows = chunk_rows
        ctx.device_type = hidden.device.type
        ctx.temperature = temperature
        ctx.param_context = param_context or nullcontext
        if want_entropy:
            return logp, entropy
        return logp

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy=None):
        # The backward recomputes logits from the saved weight; under ZeRO-3 it must be gathered again.
        with ctx.param_context(), torch.autocast(ctx.device_type, enabled=False):
            return (*_backward(ctx, grad_logp, grad_entropy), None)


def _tile_grad_torch(z, bias_blk, inv_t, lse, local, inside, gl, coef, gh):
    """dL/d(raw logits) for one tile, in place in ``z`` (fp32): the torch path of the backward.

    With p = softmax over the whole row (``lse``), H its entropy and gl, gh the upstream gradients of log p_target
    and of H: dL/dz_j = inv_t * (gl 1[j = target] - p_j (coef + gh log p_j)), where coef = gl + gh H.
    gl, coef, gh: (n, 1) or None.
    """
    if bias_blk is not None:
        z.add_(bias_blk)
    z.mul_(inv_t).sub_(lse[:, None])  # log p
    if gh is None:
        z.exp_().mul_(-coef * inv_t)
    else:
        p = torch.exp(z)
        z.mul_(gh).add_(coef).mul_(p).mul_(-inv_t)
        del p
    if gl is not None:
        # rows whose target lies in another block add 0 at a clamped (valid) index: no host sync to find them
        width = z.shape[1]
        z.scatter_add_(1, local.clamp(0, width - 1)[:, None], gl * inv_t * inside[:, None])
    return z


def _backward(ctx, grad_logp, grad_entropy):
    hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    if (grad_logp is None and grad_entropy is None) or not (need_h or need_w or need_b):
        return None, None, None, None, None, None, None
    compute, acc = ctx.dtypes
    chunk_rows, temperature = ctx.chunk_rows, ctx.temperature
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    single_chunk = n_rows <= chunk_rows

    w_c = weight.to(compute)  # (V, H)
    bias_acc = None if bias is None else bias.to(acc)
    g_lp = None if grad_logp is None else grad_logp.to(acc)
    g_h = None if grad_entropy is None else grad_entropy.to(acc)
    # coef = gl + gh H per row (see _tile_grad_torch), with H saved by the forward
    if g_h is None:
        coef = g_lp
    else:
        coef = g_h * entropy.to(acc) if g_lp is None else g_lp + g_h * entropy.to(acc)

    # grad_hidden sums over vocabulary blocks in fp32 ((N, H): small); grad_weight is finished block by block.
    grad_h_acc = torch.zeros(hidden.shape, device=hidden.device, dtype=acc) if need_h else None
    grad_weight = torch.empty_like(weight) if need_w else None
    grad_b_acc = torch.zeros(vocab, device=weight.device, dtype=acc) if need_b else None
    if need_w and n_rows == 0:
        grad_weight.zero_()

    for c0, c1 in _vocab_blocks(vocab):
        w_blk = w_c[c0:c1]  # (block, H)
        b_blk = None if bias_acc is None else bias_acc[c0:c1]
        # one rounding of the block's weight gradient, after every row chunk is summed in fp32
        w_acc = torch.zeros((c1 - c0, weight.shape[1]), device=weight.device, dtype=acc) \
            if need_w and not single_chunk else None
        for start in range(0, n_rows, chunk_rows):
            end = min(start + chunk_rows, n_rows)
            h_c = hidden[start:end].to(compute)
            local = targets[start:end] - c0
            inside = (local >= 0) & (local < c1 - c0)
            z = _mm_acc(h_c, w_blk.t(), acc)  # (n, block) raw logits, recomputed
            gl_c = None if g_lp is None else g_lp[start:end].contiguous()
            gh_c = None if g_h is None else g_h[start:end].contiguous()
            kernels = _triton_rows(z)
            if kernels is not None:  # one fused pass writes dL/dz straight in the GEMM dtype
                g_c = kernels.tile_grad(z, b_blk, local, lse[start:end], gl_c, coef[start:end].contiguous(), gh_c,
                                        inv_t, compute)
                g = None  # the fp32 gradient is never materialised
            else:
                g = _tile_grad_torch(z, b_blk, inv_t, lse[start:end], local, inside,
                                     None if gl_c is None else gl_c[:, None], coef[start:end, None],
                                     None if gh_c is None else gh_c[:, None])
                g_c = g.to(compute)  # no copy unless the GEMMs run in half precision
            del z
            if need_b:
                grad_b_acc[c0:c1] += g.sum(0) if g is not None else g_c.sum(0, dtype=acc)
            if need_h:
                _addmm_acc(grad_h_acc[start:end], g_c, w_blk, g)  # (n, block) @ (block, H)
            if need_w:
                if single_chunk:
                    grad_weight[c0:c1] = torch.mm(g_c.t(), h_c).to(weight.dtype)  # (block, n) @ (n, H)
                else:
                    _addmm_acc(w_acc, g_c.t(), h_c, None if g is None else g.t())
            del g, g_c
        if w_acc is not None:
            grad_weight[c0:c1] = w_acc.to(weight.dtype)
            del w_acc

    grad_hidden = None if grad_h_acc is None else grad_h_acc.to(hidden.dtype)
    grad_bias = None if grad_b_acc is None else grad_b_acc.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _validate(hidden, weight, targets, bias, chunk_rows, temperature) -> int:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be 2-D (N, H); flatten leading dims first. Got shape {shape}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype}")
    n_rows, h = hidden.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != h:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must have shape (V, {h}) to match hidden {tuple(hidden.shape)}, got {shape}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")
    vocab = weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab,)):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must have shape ({vocab},) or be None, got {shape}")
    if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != (n_rows,):
        shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets must have shape ({n_rows},) (one per hidden row), got {shape}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor (int64), got dtype {targets.dtype}")
    try:
        rows = None if chunk_rows is None or isinstance(chunk_rows, bool) else operator.index(chunk_rows)
    except TypeError:
        rows = None
    if chunk_rows is not None and (rows is None or rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None (all rows in one chunk), got {chunk_rows!r}")
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.item()
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if n_rows and not (targets.is_cuda and torch.cuda.is_current_stream_capturing()):
        # One small reduction and one host sync: an out-of-range index would otherwise be a silent CUDA gather error.
        # (Not inside a CUDA graph's capture, which cannot wait on the host: hf_grpo.training.graphs clamps them.)
        lo, hi = torch.aminmax(targets)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"targets must lie in [0, {vocab}) (vocab size V={vocab}), got target value {bad}")
    return vocab


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_rows: int | None,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    param_context: Callable[[], AbstractContextManager] | None = None,
):
    """Log-probability of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``, row by row.

    Args:
        hidden: (N, H) floating point. Exactly 2-D; flatten (B, T, H) to (B*T, H) first.
        weight: (V, H) LM head weight.
        targets: (N,) integer in [0, V), aligned with the rows (no causal shift is applied here).
        chunk_rows: rows projected at a time (positive int), or None for all rows in one chunk. Peak extra memory
            is about one (chunk_rows, 32768) fp32 logits tile and its gradient (the vocabulary is walked in tiles of
            ``_VOCAB_BLOCK`` columns), plus, in the backward, one (32768, H) fp32 weight-gradient block.
        temperature: > 0; logits are divided by it.
        bias: optional (V,) LM head bias.
        return_entropy: also return the entropy of each row's distribution (needs finite logits: a -inf logit,
            e.g. from a masking bias, makes that row's entropy NaN).
        param_context: a zero-argument callable returning a context manager that the backward enters before it
            reads ``weight``/``bias`` again (DeepSpeed ZeRO-3 re-partitions them after the forward).

    Returns:
        logp (N,), or (logp (N,), entropy (N,)) when ``return_entropy``. float32 (float64 if the GEMMs run in
        float64). Differentiable w.r.t. hidden, weight and bias; gradients come back in each input's dtype.
    """
    _validate(hidden, weight, targets, bias, chunk_rows, temperature)
    temperature = float(temperature.item() if isinstance(temperature, torch.Tensor) else temperature)
    if targets.dtype != torch.long:
        targets = targets.long()  # gather/scatter need int64 indices
    n_rows = hidden.shape[0]
    rows = max(n_rows, 1) if chunk_rows is None else operator.index(chunk_rows)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if not needs_grad:
        # Inference (old-policy / reference log-probs): skip autograd bookkeeping entirely.
        dtypes = _dtypes(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, _, entropy = _forward(hidden, weight, targets, bias, rows, temperature, return_entropy, dtypes)
        return (logp, entropy) if return_entropy else logp
    return _ChunkedLogprobs.apply(
        hidden, weight, bias, targets, rows, temperature, bool(return_entropy), param_context
    )
