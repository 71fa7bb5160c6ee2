"""Ops whose result for one token is the same bits however many tokens share the call (``true_on_policy``).

The decoder computes a token in a one-token step over a batch of rows; the trainer computes the same token inside a
forward over whole sequences. Library kernels choose their tiling and reduction order by the shape of the call, so the
two disagree in the last bits (bf16 p99 0.01-0.08 nats a token). These ops do not:

* on CUDA, ``_triton_invariant``'s kernels, one configuration for every shape;
* on CPU, a reference written so that a token's arithmetic sees only its own row (one row, one query at a time, on a
  fresh contiguous copy): slow, for tests and tiny models.

Only the forward must be invariant: the sampler's numbers are compared with the trainer's forward, not its gradients.
Each op's backward is the ordinary torch formula (cuBLAS, SDPA).

Autocast does not reach inside: each op computes in its inputs' dtype (a linear layer in its input's, the weight cast
to it), whether or not the caller runs under autocast. The decoder runs outside autocast and the trainer's forward
inside it; an op that autocast re-typed on one side only would differ between them.
"""

from __future__ import annotations

import torch

__all__ = [
    "RMS_NORM_CLASSES", "attention", "attention_bounds", "linear", "logsumexp", "rms_norm", "rms_norm_forward",
]

# transformers' RMSNorm classes whose forward is ``rms_norm``'s formula: weight * (x / rms(x)).to(dtype), the rms in
# fp32, the epsilon as ``variance_epsilon`` (Gemma's 1 + weight is not)
RMS_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _triton():
    from . import _triton_invariant

    return _triton_invariant


# ---------------------------------------------------------------------------------------------------- linear
def _linear_reference(x2d, weight, bias):
    w = weight.float().t()
    b = None if bias is None else bias.float()
    rows = []
    for i in range(x2d.shape[0]):
        row = x2d[i:i + 1].float().clone() @ w
        rows.append((row if b is None else row + b).to(x2d.dtype))
    return torch.cat(rows) if rows else x2d.new_empty((0, weight.shape[0]))


def _no_autocast(function, *args):
    """``function(*args)`` with autocast off on the first argument's device (see the module doc)."""
    with torch.autocast(args[0].device.type, enabled=False):
        return function(*args)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        x2d = x.reshape(-1, x.shape[-1])
        out = _triton().matmul(x2d, weight, bias) if x.is_cuda else _linear_reference(x2d, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in ``x``'s dtype (``weight`` cast to it, as autocast would)."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return _no_autocast(_Linear.apply, x, weight, bias)


# ---------------------------------------------------------------------------------------------------- rms norm
def _rms_norm_torch(x, weight, eps):
    """The formula of transformers' Llama/Qwen2 RMSNorm (the backward's, and the CPU reference's per row)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        x2d = x.reshape(-1, x.shape[-1])
        out_dtype = torch.result_type(weight, x)
        if x.is_cuda:
            out = _triton().rms_norm(x2d, weight, eps, out_dtype)
        else:
            rows = [_rms_norm_torch(x2d[i:i + 1].clone(), weight, eps) for i in range(x2d.shape[0])]
            out = torch.cat(rows) if rows else x2d.new_empty(x2d.shape, dtype=out_dtype)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(ctx.needs_input_grad[0]), weight.detach().requires_grad_(
                ctx.needs_input_grad[1])
            out = _rms_norm_torch(x_, w_, ctx.eps)
            wanted = [t for t in (x_, w_) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (next(grads) if x_.requires_grad else None, next(grads) if w_.requires_grad else None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen2 RMSNorm: ``weight * (x / rms(x)).to(x.dtype)``, the rms in fp32."""
    return _no_autocast(_RMSNorm.apply, x, weight, eps)


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``forward`` for a module of ``RMS_NORM_CLASSES`` (bound to it), through ``rms_norm``."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


# ---------------------------------------------------------------------------------------------------- logsumexp
class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        z2d = z.reshape(-1, z.shape[-1])
        if z.is_cuda:
            out = _triton().logsumexp(z2d)
        else:
            out = torch.stack([torch.logsumexp(z2d[i].clone(), dim=0) for i in range(z2d.shape[0])]) if len(z2d) \
                else z2d.new_empty((0,), dtype=torch.float32)
        out = out.view(z.shape[:-1])
        ctx.save_for_backward(z, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        z, out = ctx.saved_tensors
        return grad.unsqueeze(-1) * torch.exp(z.float() - out.unsqueeze(-1)).to(z.dtype)


def logsumexp(z: torch.Tensor) -> torch.Tensor:
    """fp32 log-sum-exp of each row of the fp32 scores ``z`` [..., V]."""
    return _no_autocast(_LogSumExp.apply, z)


# ---------------------------------------------------------------------------------------------------- attention
def attention_bounds(allowed: torch.Tensor | None, batch: int, sq: int, sk: int, device):
    """(start [B], end [B, Sq]) int32 from a boolean mask [B, 1 or H, Sq, Sk] (True: attend): each row's first
    attended key, and one past each query's last. Each query must attend to one contiguous run of keys (left padding,
    then causal), as both the decoder's and TRL's layouts do. ``None``: causal, no padding, queries at the end."""
    if allowed is None:
        start = torch.zeros((batch,), dtype=torch.int32, device=device)
        end = torch.arange(sk - sq + 1, sk + 1, dtype=torch.int32, device=device).expand(batch, sq)
        return start, end
    allowed = allowed[:, 0].expand(batch, sq, sk)
    attends = allowed.any(-1)  # [B, Sq]
    end = torch.where(attends, sk - allowed.flip(-1).int().argmax(-1), 0).to(torch.int32)
    start = allowed.any(1).int().argmax(-1).to(torch.int32)  # [B]
    return start, end


def _attention_reference(query, key, value, start, end, scale):
    batch, heads, sq, dim = query.shape
    groups = heads // key.shape[1]
    out = query.new_zeros((batch, sq, heads, dim))
    for b in range(batch):
        s = int(start[b])
        for i in range(sq):
            e = int(end[b, i])
            if e <= s:
                continue
            k = key[b, :, s:e].repeat_interleave(groups, 0).float().clone()  # [H, n, D]
            v = value[b, :, s:e].repeat_interleave(groups, 0).float().clone()
            q = query[b, :, i].float().clone()  # [H, D]
            weights = torch.softmax((k @ q.unsqueeze(-1)).squeeze(-1) * scale, dim=-1)  # [H, n]
            out[b, i] = (weights.to(query.dtype).float().unsqueeze(1) @ v).squeeze(1).to(query.dtype)
    return out


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, start, end, scale):
        ctx.save_for_backward(query, key, value, start, end)
        ctx.scale = scale
        if query.is_cuda:
            return _triton().attention(query, key, value, start, end, scale)
        return _attention_reference(query, key, value, start, end, scale)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, start, end = ctx.saved_tensors
        groups = query.shape[1] // key.shape[1]
        keys = torch.arange(key.shape[2], device=key.device)
        mask = (keys >= start.view(-1, 1, 1)) & (keys < end.unsqueeze(-1))  # [B, Sq, Sk]
        mask[..., 0] |= ~mask.any(-1)  # a query that attends to nothing (padding): any key; its gradient is zero
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask.unsqueeze(1),
                scale=ctx.scale)
            grads = torch.autograd.grad(out.transpose(1, 2), (q, k, v), grad)
        return (*grads, None, None, None)


def attention(query, key, value, allowed: torch.Tensor | None, scale: float, bounds=None) -> torch.Tensor:
    """Softmax attention, query [B, H, Sq, D] over key/value [B, Hkv, Sk, D] (grouped heads) -> [B, Sq, H, D].

    ``allowed``: boolean [B, 1, Sq, Sk] (True: attend) or None (causal); ``bounds``: its ``attention_bounds`` where
    the caller keeps them (one mask serves every layer of a forward)."""
    start, end = bounds if bounds is not None else attention_bounds(allowed, query.shape[0], query.shape[2],
                                                                     key.shape[2], query.device)
    return _no_autocast(_Attention.apply, query, key, value, start, end, scale)
