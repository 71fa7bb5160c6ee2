"""Tests for hf_grpo.ops.chunked_logprobs against a full-logits reference."""

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_grpo.ops import chunked_logprobs

N, V, H = 23, 37, 11
CHUNKS = [1, 7, N, N + 5, None]


def _inputs(dtype, bias=True, seed=0, w_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (w_scale * torch.randn(V, H, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    g_lp = torch.randn(N, generator=g, dtype=torch.float64)
    g_ent = torch.randn(N, generator=g, dtype=torch.float64)
    return hidden, weight, b, targets, g_lp, g_ent


def _reference(hidden, weight, bias, targets, temperature):
    """Full-logits float64 log-probs and entropy (the definition being matched)."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    logp_all = torch.log_softmax(z / temperature, -1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _params(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None]


def _grads(outs, g_lp, g_ent, params):
    logp, entropy = outs
    loss = (logp * g_lp.to(logp.dtype)).sum() + (entropy * g_ent.to(entropy.dtype)).sum()
    return torch.autograd.grad(loss, params)


def _assert_close(actual, expected, rel, what):
    """max |actual - expected| <= rel * max(1, max |expected|): relative to the tensor's scale, so entries that are
    near zero are not held to an impossible elementwise relative bound."""
    actual, expected = actual.double(), expected.double()
    scale = max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= rel * scale, f"{what}: max abs err {err:.3e} > {rel:.1e} * {scale:.3g}"


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_rows", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_full_logits(dtype, rel, chunk_rows, temperature, with_bias):
    hidden, weight, bias, targets, g_lp, g_ent = _inputs(dtype, bias=with_bias)
    params = _params(hidden, weight, bias)

    outs = chunked_logprobs(
        hidden, weight, targets, chunk_rows=chunk_rows, temperature=temperature, bias=bias, return_entropy=True
    )
    assert outs[0].shape == outs[1].shape == (N,)
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert outs[0].dtype == outs[1].dtype == expected_dtype
    grads = _grads(outs, g_lp, g_ent, params)

    # Reference gradients from float64 copies of the same inputs
    ref_params = [p.detach().double().requires_grad_() for p in params]
    ref_h, ref_w = ref_params[0], ref_params[1]
    ref_b = ref_params[2] if with_bias else None
    ref_outs = _reference(ref_h, ref_w, ref_b, targets, temperature)
    ref_grads = _grads(ref_outs, g_lp, g_ent, ref_params)

    _assert_close(outs[0], ref_outs[0], rel, "logp")
    _assert_close(outs[1], ref_outs[1], rel, "entropy")
    for name, g, rg, p in zip(("hidden", "weight", "bias"), grads, ref_grads, params):
        assert g.dtype == p.dtype, name
        _assert_close(g, rg, rel, f"grad_{name}")


@pytest.mark.parametrize("chunk_rows", [7, None])
def test_single_output_gradients(chunk_rows):
    """Entropy returned but unused (its grad arrives as None), entropy-only loss, and return_entropy=False."""
    hidden, weight, bias, targets, g_lp, g_ent = _inputs(torch.float64)
    params = _params(hidden, weight, bias)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref_logp, ref_ent = _reference(*ref_params, targets, 0.7)
    kw = dict(chunk_rows=chunk_rows, temperature=0.7, bias=bias)

    logp, ent = chunked_logprobs(hidden, weight, targets, return_entropy=True, **kw)
    for got, want in zip(
        torch.autograd.grad((logp * g_lp).sum(), params, retain_graph=True),
        torch.autograd.grad((ref_logp * g_lp).sum(), ref_params, retain_graph=True),
    ):
        _assert_close(got, want, 1e-10, "logp-only grad")
    for got, want in zip(
        torch.autograd.grad((ent * g_ent).sum(), params),
        torch.autograd.grad((ref_ent * g_ent).sum(), ref_params, retain_graph=True),
    ):
        _assert_close(got, want, 1e-10, "entropy-only grad")

    logp_only = chunked_logprobs(hidden, weight, targets, **kw)
    assert isinstance(logp_only, torch.Tensor)
    _assert_close(logp_only, ref_logp, 1e-10, "logp")
    for got, want in zip(
        torch.autograd.grad((logp_only * g_lp).sum(), params),
        torch.autograd.grad((ref_logp * g_lp).sum(), ref_params),
    ):
        _assert_close(got, want, 1e-10, "return_entropy=False grad")


@pytest.mark.parametrize("col_block", [1, 8])
def test_column_blocked_reductions(monkeypatch, col_block):
    """The op walks the vocabulary in tiles (32768 columns by default, wider than V here); shrink them so the
    multi-tile path (online log-sum-exp, targets in another tile, the entropy gradient) meets the reference too."""
    import hf_grpo.ops.logprobs as mod

    monkeypatch.setattr(mod, "_VOCAB_BLOCK", col_block)
    hidden, weight, bias, targets, g_lp, g_ent = _inputs(torch.float64)
    params = _params(hidden, weight, bias)
    outs = chunked_logprobs(hidden, weight, targets, chunk_rows=7, temperature=0.7, bias=bias, return_entropy=True)
    grads = _grads(outs, g_lp, g_ent, params)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref_outs = _reference(*ref_params, targets, 0.7)
    ref_grads = _grads(ref_outs, g_lp, g_ent, ref_params)
    for got, want in zip((*outs, *grads), (*ref_outs, *ref_grads)):
        _assert_close(got, want, 1e-10, "column-blocked")


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, 3, 3, 1])

    def fn(h, w, b):
        return chunked_logprobs(h, w, targets, chunk_rows=2, temperature=0.7, bias=b, return_entropy=True)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias), eps=1e-6, atol=1e-7)


_CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_bfloat16_within_rounding_bound(device):
    """bf16 inputs: compared with float64 evaluated on the *same* bf16-rounded inputs, so only the op's own rounding
    is measured. Where the GEMM output is bf16 (CPU; CUDA before torch 2.8), each logit carries up to 2^-9 relative
    rounding before the fp32 log-sum-exp, hence

        |d logp| <= |dz_t| + max_j |dz_j| <= 2 * 2^-9 * max|z|,
        |d H|    <= sum_j p_j |log p_j + H| * max|dz| <= 2 H * 2^-9 * max|z|   (first order),

    and the gradients add bf16 rounding of the (fp32) logits gradient and of the returned grads (2^-9 each) on top
    of the softmax error, so a 3% bound relative to each gradient's largest entry is comfortably safe while still
    catching a wrong formula (those errors are O(1)). Logits are kept O(1) as in a trained LM head (w_scale).
    On CUDA (torch >= 2.8) the GEMMs write fp32 directly, so the same bounds hold with room to spare; that run also
    covers the fp32-output GEMM and the multi-chunk fp32 grad_weight accumulation."""
    temperature = 0.7
    hidden, weight, bias, targets, g_lp, g_ent = _inputs(torch.bfloat16, w_scale=0.3)
    hidden, weight, bias = (t.detach().to(device).requires_grad_() for t in (hidden, weight, bias))
    targets, g_lp, g_ent = targets.to(device), g_lp.to(device), g_ent.to(device)
    params = _params(hidden, weight, bias)
    outs = chunked_logprobs(
        hidden, weight, targets, chunk_rows=7, temperature=temperature, bias=bias, return_entropy=True
    )
    assert outs[0].dtype == outs[1].dtype == torch.float32  # reductions in fp32 even for bf16 inputs
    grads = _grads(outs, g_lp, g_ent, params)

    ref_params = [p.detach().double().requires_grad_() for p in params]
    ref_outs = _reference(*ref_params, targets, temperature)
    ref_grads = _grads(ref_outs, g_lp, g_ent, ref_params)

    with torch.no_grad():
        z = (ref_params[0] @ ref_params[1].T + ref_params[2]) / temperature
    zmax = z.abs().max().item()
    u = 2.0**-9
    logp_err = (outs[0].double() - ref_outs[0]).abs().max().item()
    ent_err = (outs[1].double() - ref_outs[1]).abs().max().item()
    assert logp_err <= 1.25 * 2 * u * zmax, logp_err
    assert ent_err <= 1.25 * 2 * u * zmax * ref_outs[1].max().item() + 1e-6, ent_err
    for name, g, rg, p in zip(("hidden", "weight", "bias"), grads, ref_grads, params):
        assert g.dtype == torch.bfloat16, name
        err = (g.double() - rg).abs().max().item()
        assert err <= 3e-2 * rg.abs().max().item(), (name, err)


def test_autocast_and_mixed_dtypes():
    """Under CPU autocast (bf16) with fp32 inputs the GEMMs run in bf16, grads come back fp32."""
    hidden, weight, bias, targets, g_lp, g_ent = _inputs(torch.float32, w_scale=0.3)
    params = _params(hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = chunked_logprobs(hidden, weight, targets, chunk_rows=5, bias=bias, return_entropy=True)
    grads = _grads(outs, g_lp, g_ent, params)
    ref_params = [p.detach().double().requires_grad_() for p in params]
    ref_outs = _reference(*ref_params, targets, 1.0)
    ref_grads = _grads(ref_outs, g_lp, g_ent, ref_params)
    assert outs[0].dtype == torch.float32
    _assert_close(outs[0], ref_outs[0], 5e-2, "logp")
    for g, rg, p in zip(grads, ref_grads, params):
        assert g.dtype == p.dtype == torch.float32
        _assert_close(g, rg, 5e-2, "grad")


def test_no_grad_and_partial_requires_grad():
    hidden, weight, bias, targets, g_lp, _ = _inputs(torch.float64)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    ref_logp, ref_ent = _reference(hidden.detach(), weight.detach(), bias.detach(), targets, 1.0)
    # Inference path: no autograd node, nothing saved, same values
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.no_grad():
        logp, ent = chunked_logprobs(hidden, weight, targets, chunk_rows=4, bias=bias, return_entropy=True)
    assert logp.grad_fn is None and not logp.requires_grad and saved == []
    _assert_close(logp, ref_logp, 1e-10, "no_grad logp")
    _assert_close(ent, ref_ent, 1e-10, "no_grad entropy")
    # Detached inputs outside no_grad take the same path
    out = chunked_logprobs(hidden.detach(), weight.detach(), targets, chunk_rows=4, bias=bias.detach())
    assert out.grad_fn is None

    # Only hidden requires grad: the others get no gradient
    w_frozen, b_frozen = weight.detach(), bias.detach()
    logp = chunked_logprobs(hidden, w_frozen, targets, chunk_rows=4, bias=b_frozen)
    (logp * g_lp).sum().backward()
    ref_h = hidden.detach().clone().requires_grad_()
    (_reference(ref_h, w_frozen, b_frozen, targets, 1.0)[0] * g_lp).sum().backward()
    _assert_close(hidden.grad, ref_h.grad, 1e-10, "grad_hidden")
    assert w_frozen.grad is None and b_frozen.grad is None


def test_int32_targets_and_empty_input():
    hidden, weight, bias, targets, _, _ = _inputs(torch.float64)
    a = chunked_logprobs(hidden, weight, targets.int(), chunk_rows=3, bias=bias)
    b = chunked_logprobs(hidden, weight, targets, chunk_rows=3, bias=bias)
    assert torch.equal(a, b)

    h0 = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
    logp, ent = chunked_logprobs(
        h0, weight, torch.zeros(0, dtype=torch.long), chunk_rows=None, bias=bias, return_entropy=True
    )
    assert logp.shape == ent.shape == (0,)
    gh, gw, gb = torch.autograd.grad(logp.sum() + ent.sum(), (h0, weight, bias))
    assert gh.shape == (0, H) and not gw.any() and not gb.any()


def _bad(**overrides):
    hidden, weight, bias, targets, _, _ = _inputs(torch.float32)
    kw = dict(hidden=hidden, weight=weight, targets=targets, chunk_rows=4, temperature=1.0, bias=bias)
    kw.update(overrides)
    return kw


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (dict(hidden=torch.zeros(2, 3, H)), r"hidden.*\(2, 3, 11\)"),
        (dict(hidden=torch.zeros(N)), rf"hidden.*\({N},\)"),
        (dict(weight=torch.zeros(V, H + 1)), r"weight"),
        (dict(bias=torch.zeros(V + 1)), r"bias"),
        (dict(targets=torch.zeros(N + 1, dtype=torch.long)), r"targets"),
        (dict(targets=torch.zeros(N)), r"targets.*dtype"),
        (dict(targets=torch.full((N,), -1)), r"targets.*-1"),
        (dict(targets=torch.full((N,), V)), rf"targets.*\b{V}\b"),
        (dict(chunk_rows=0), r"chunk_rows.*positive int.*got 0"),
        (dict(chunk_rows=-3), r"chunk_rows.*-3"),
        (dict(chunk_rows=2.5), r"chunk_rows.*2\.5"),
        (dict(chunk_rows=True), r"chunk_rows.*True"),
        (dict(temperature=0.0), r"temperature.*> 0.*0\.0"),
        (dict(temperature=-1.0), r"temperature.*-1\.0"),
        (dict(temperature=math.nan), r"temperature.*nan"),
    ],
)
def test_bad_inputs_raise(overrides, pattern):
    kw = _bad(**overrides)
    hidden, weight, targets = kw.pop("hidden"), kw.pop("weight"), kw.pop("targets")
    with pytest.raises(ValueError, match=pattern):
        chunked_logprobs(hidden, weight, targets, **kw)


class _AllocTracker(TorchDispatchMode):
    """Records the largest tensor any aten op produces and how many fresh tensors of at least `big` elements are
    alive at once (in-place results and views share an input's storage and are not counted as new)."""

    def __init__(self, big):
        super().__init__()
        self.big = big
        self.max_numel = 0
        self.max_alive = 0
        self._alive = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_ptrs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
                if t.numel() >= self.big and t.untyped_storage().data_ptr() not in in_ptrs:
                    self._alive.append(weakref.ref(t))
        self._alive = [r for r in self._alive if r() is not None]
        self.max_alive = max(self.max_alive, len(self._alive))
        return out


@pytest.mark.parametrize("return_entropy", [False, True])
def test_memory_bound(return_entropy):
    # Sizes chosen so that N*V is far above chunk_rows*V, and N*H, V*H (inputs, grads) are below it.
    n, v, h, chunk = 64, 97, 4, 8
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)

    saved = []

    def pack(t):
        saved.append(t)
        return t

    tracker = _AllocTracker(big=chunk * v)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = chunked_logprobs(
                hidden, weight, targets, chunk_rows=chunk, bias=bias, return_entropy=return_entropy
            )
        logp = outs[0] if return_entropy else outs
        loss = logp.sum() + (outs[1].sum() if return_entropy else 0)
        loss.backward()

    # Saved for backward: exactly the inputs plus size-N vectors (the log-sum-exp, and the entropy when it is an
    # output: its gradient needs it), no logits
    assert all(t.numel() != n * v for t in saved)
    inputs = {(t.data_ptr(), tuple(t.shape)) for t in (hidden, weight, bias, targets)}
    extra = [t for t in saved if (t.data_ptr(), tuple(t.shape)) not in inputs]
    vectors = 2 if return_entropy else 1
    assert len(saved) == 4 + vectors and len(extra) == vectors, [tuple(t.shape) for t in saved]
    assert all(t.shape == (n,) for t in extra)
    # and no tensor hidden on the autograd node itself
    assert not any(isinstance(x, torch.Tensor) for x in vars(logp.grad_fn).values())

    # Never an (N, V) tensor; at most one chunk of logits plus one same-size buffer alive at any time
    assert tracker.max_numel <= chunk * v, tracker.max_numel
    assert tracker.max_alive <= 2, tracker.max_alive
    assert tracker.max_alive >= 1  # the tracker did see the logits chunks


def test_param_context_is_entered_by_the_backward():
    # ZeRO-3 re-partitions the head after the forward; the backward must gather it again through this hook.
    import contextlib

    entered = []

    @contextlib.contextmanager
    def gather():
        entered.append(True)
        yield

    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(7, 4, requires_grad=True)
    targets = torch.randint(0, 7, (5,))
    logp = chunked_logprobs(hidden, weight, targets, chunk_rows=2, param_context=gather)
    assert entered == []
    logp.sum().backward()
    assert entered == [True]
