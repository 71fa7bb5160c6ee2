"""hf_grpo.ops.batch_invariant: a token's result is the same bits whatever else shares the call (the rows around it,
the padding before it, the cache after it), and close to the library op it replaces. On CPU the reference path, on
CUDA (the GPU machine) the Triton kernels; the same assertions."""

from __future__ import annotations

import pytest
import torch

from hf_grpo.ops import batch_invariant
from tests.tolerances import FP32_EPS, reordered

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
DTYPES = [torch.float32, torch.bfloat16]


def _close(actual, expected, terms):
    """fp32: reordered sums; bf16: one bf16 rounding of the result on top of them."""
    if expected.dtype == torch.bfloat16:
        scale = float(expected.float().abs().max())
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=2 ** -7 * scale)
    else:
        torch.testing.assert_close(actual, expected, **reordered(expected, terms))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_other_rows(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(300, 200, device=device, dtype=dtype)
    weight, bias = torch.randn(96, 200, device=device, dtype=dtype), torch.randn(96, device=device, dtype=dtype)
    full = batch_invariant.linear(x, weight, bias)
    for rows in (slice(0, 1), slice(7, 39), slice(250, 300)):  # a decode step's few rows, an odd block, the end
        assert torch.equal(batch_invariant.linear(x[rows].clone(), weight, bias), full[rows])
    _close(full, torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(dtype), 200)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_gradients_are_the_ordinary_ones(device):
    torch.manual_seed(1)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    weight = torch.randn(24, 32, device=device, requires_grad=True)
    bias = torch.randn(24, device=device, requires_grad=True)
    grad = torch.randn(2, 5, 24, device=device)
    ours = torch.autograd.grad(batch_invariant.linear(x, weight, bias), (x, weight, bias), grad)
    theirs = torch.autograd.grad(torch.nn.functional.linear(x, weight, bias), (x, weight, bias), grad)
    for a, b in zip(ours, theirs):
        _close(a, b, 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_are_invariant_and_match_transformers(device, dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(2)
    norm = Qwen2RMSNorm(96, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data.normal_()
    x = torch.randn(64, 96, device=device, dtype=dtype, requires_grad=True)
    full = batch_invariant.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert torch.equal(batch_invariant.rms_norm(x[5:6].detach().clone(), norm.weight, 1e-6), full[5:6].detach())
    _close(full.detach(), norm(x).detach(), 96)
    grad = torch.randn_like(full)
    ours = torch.autograd.grad(full, (x, norm.weight), grad)
    theirs = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    for a, b in zip(ours, theirs):
        _close(a, b, 96 * 64)


@pytest.mark.parametrize("device", DEVICES)
def test_logsumexp_rows_are_invariant_and_exact(device):
    torch.manual_seed(3)
    z = 4 * torch.randn(40, 5000, device=device)  # wider than the kernel's block
    z[3, 100:] = float("-inf")  # a row filtered down to a few tokens
    full = batch_invariant.logsumexp(z)
    assert torch.equal(batch_invariant.logsumexp(z[3:5].clone()), full[3:5])
    # log(sum) is off by the sum's relative error: at most n * eps for n positive terms, whatever their size
    torch.testing.assert_close(full, torch.logsumexp(z.double(), -1).float(), rtol=0, atol=5000 * FP32_EPS)


def _mask(pads, lengths, width, queries=None):
    """sdpa-style boolean masks [B, 1, Sq, Sk]: row b has ``pads[b]`` pads, then its tokens attend causally."""
    keys = torch.arange(width)
    rows = []
    for pad, length in zip(pads, lengths):
        q_pos = torch.arange(width) if queries is None else queries
        rows.append((keys[None, :] >= pad) & (keys[None, :] <= q_pos[:, None]) & (keys[None, :] < pad + length))
    return torch.stack(rows)[:, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_token_is_the_same_in_a_training_forward_and_a_decode_step(device, dtype):
    """One sequence of 70 tokens: a training forward (3 pads before it, other rows beside it) and a decode step for
    its last token (8 pads before it, a 160-position cache of zeros after it) give that token the same bits."""
    torch.manual_seed(4)
    heads, kv_heads, dim, n = 4, 2, 32, 70
    q, k, v = (torch.randn(n, h, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))

    def place(t, pad, width):
        out = torch.zeros(width, t.shape[1], dim, dtype=dtype)
        out[pad:pad + n] = t
        return out.transpose(0, 1)  # [H, width, D]

    width = 73
    other = [torch.randn(h, width, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads)]
    train_q, train_k, train_v = (torch.stack([place(t, 3, width), o]).to(device) for t, o in zip((q, k, v), other))
    train_mask = _mask([3, 0], [n, width], width).to(device)
    train = batch_invariant.attention(train_q, train_k, train_v, train_mask, dim ** -0.5)  # [B, Sq, H, D]

    cache = 160
    dec_k, dec_v = (place(t, 8, cache)[None].to(device) for t in (k, v))
    dec_q = place(q, 8, cache)[None, :, 8 + n - 1:8 + n].to(device)  # the last token's query
    dec_mask = _mask([8], [n], cache, queries=torch.tensor([8 + n - 1])).to(device)
    decoded = batch_invariant.attention(dec_q, dec_k, dec_v, dec_mask, dim ** -0.5)
    assert torch.equal(decoded[0, 0], train[0, 3 + n - 1])

    expected = torch.nn.functional.scaled_dot_product_attention(
        train_q.float(), train_k.float().repeat_interleave(2, 1), train_v.float().repeat_interleave(2, 1),
        attn_mask=train_mask.expand(2, 1, width, width).clone().logical_or_(
            ~train_mask.any(-1, keepdim=True)), scale=dim ** -0.5).transpose(1, 2)
    _close(train[0, 3:], expected[0, 3:].to(dtype), n)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_gradients_match_sdpa(device):
    torch.manual_seed(5)
    q = torch.randn(2, 4, 12, 16, device=device, requires_grad=True)
    k = torch.randn(2, 2, 12, 16, device=device, requires_grad=True)
    v = torch.randn(2, 2, 12, 16, device=device, requires_grad=True)
    mask = _mask([2, 0], [10, 12], 12).to(device)
    grad = torch.randn(2, 12, 4, 16, device=device)
    grad[0, :2] = 0  # padding queries: nothing flows back from them
    ours = torch.autograd.grad(batch_invariant.attention(q, k, v, mask, 0.25), (q, k, v), grad)
    fixed = mask.clone().logical_or_(~mask.any(-1, keepdim=True))
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=fixed, scale=0.25).transpose(1, 2)
    theirs = torch.autograd.grad(out, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        _close(a, b, 12 * 16)
