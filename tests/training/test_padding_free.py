"""Padding-free scoring (hf_grpo.training.padding_free): rows packed into one sequence score exactly as padded rows.

The chunked head is installed twice on copies of one tiny model, once packed and once padded, and both
score the same left-padded prompts + right-padded completions of varied lengths (fp32 on CPU): log-probs,
entropies and every parameter's gradient must agree to 1e-5, and the packed backbone must really have run
over the real tokens alone.
"""

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_grpo.training import padding_free
from hf_grpo.logprob_head import install_chunked_lm_head
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model
from tests.tolerances import FP32_EPS, backward_terms, reordered

PROMPT_LENGTHS = (3, 7, 5, 2)
COMPLETION_LENGTHS = (4, 1, 6, 3)


def padded_batch(vocab: int, seed: int = 0, prompts=PROMPT_LENGTHS, completions=COMPLETION_LENGTHS):
    """input_ids, attention_mask and TRL's labels (-100 off the completion) for rows padded as TRL pads them."""
    gen = torch.Generator().manual_seed(seed)
    width_p, width_c = max(prompts), max(completions)
    ids = torch.randint(2, vocab, (len(prompts), width_p + width_c), generator=gen)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        mask[row, width_p - p:width_p + c] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :width_p] = -100
    return ids, mask, labels


def tiny_llama(vocab: int):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def build(family: str, attn: str, **overrides):
    tokenizer = build_char_tokenizer()
    if family == "qwen2":
        return build_tiny_model(tokenizer, attn_implementation=attn, **overrides)
    model = tiny_llama(len(tokenizer))
    model.config._attn_implementation = attn
    return model


def score(model, batch):
    ids, mask, labels = batch
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    weights = torch.linspace(0.5, 1.5, out.log_probs.numel(), device=out.log_probs.device).view_as(out.log_probs)
    model.zero_grad()
    ((out.log_probs * weights).sum() + out.entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_packed_scores_as_padded(family: str, checkpointing: bool, make_batch, tokens: int,
                                   grad_norm_rtol: float | None = None, chunk_rows: int = 3, **overrides):
    """``make_batch(vocab)`` scored packed and padded on copies of one tiny model (fp32, CPU): log-probs, entropies,
    the loss equal to 1e-5, every gradient to the rounding of its sums in another order (``tolerances.reordered``;
    with ``grad_norm_rtol``, to that relative norm: sums over many thousand tokens), and the packed backbone ran over
    ``tokens`` tokens."""
    padded = build(family, "sdpa", **overrides)
    if checkpointing:  # the backward recomputes each layer's forward: the packed rows must reach it again
        padded.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        padded.train()
    packed = copy.deepcopy(padded)
    head = dict(temperature=0.7, chunk_rows=chunk_rows, return_entropy=True)
    assert install_chunked_lm_head(padded, padding_free_rows=False, **head)
    assert install_chunked_lm_head(packed, padding_free_rows=True, **head)
    batch = make_batch(padded.config.vocab_size)
    seen = []  # the token shape the embedding saw
    packed.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))

    out_padded, grads_padded = score(padded, batch)
    out_packed, grads_packed = score(packed, batch)

    assert seen == [(1, tokens)], f"the packed backbone ran over {seen}, not {tokens} tokens"
    assert torch.equal(out_packed.label_mask, out_padded.label_mask)
    torch.testing.assert_close(out_packed.log_probs, out_padded.log_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_packed.entropy, out_padded.entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_packed.loss, out_padded.loss, rtol=1e-5, atol=1e-6)
    assert grads_packed.keys() == grads_padded.keys() and len(grads_packed) > 0
    terms = backward_terms(padded.config, tokens)
    for name, grad in grads_padded.items():
        if grad_norm_rtol is None:
            torch.testing.assert_close(grads_packed[name], grad, **reordered(grad, terms), msg=name)
        else:
            assert (grads_packed[name] - grad).norm() <= grad_norm_rtol * grad.norm(), name


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_packed_scoring_equals_padded(family, checkpointing):
    # every real token once, no padding
    assert_packed_scores_as_padded(family, checkpointing, padded_batch,
                                   sum(PROMPT_LENGTHS) + sum(COMPLETION_LENGTHS))


@pytest.mark.slow
def test_reasoning_length_rows_pack_as_padded():
    # Completions of 8k+ tokens (positions far past the short rows' and a prompt of another length): every
    # position's rotary phase and every row's causal span must survive packing.
    prompts, completions = (300, 41), (8700, 8200)

    def long_batch(vocab):
        return padded_batch(vocab, 1, prompts, completions)

    # (gradients: measured at most 2e-5 apart in relative norm, fp32 sums over 17k tokens in another order)
    assert_packed_scores_as_padded("qwen2", True, long_batch, sum(prompts) + sum(completions), grad_norm_rtol=1e-4,
                                   max_position_embeddings=16384)


# The smallest model that has every part of a decoder (1 layer, 2 query heads sharing 1 KV head): the attention over
# a long row costs T^2. Both scorings of a 16k row took 104 s, of a 64k row 24 min, on a 2-core machine shared with
# other work (load 4-6).
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("completion", [3_072, pytest.param(15_360, marks=pytest.mark.long_context),
                                        pytest.param(64_512, marks=pytest.mark.long_context)], ids=["4k", "16k", "64k"])
def test_one_long_row_packed_scores_as_padded(completion):
    # A reasoning-length row (a 1,024-token prompt and its completion), alone in its micro-batch as a long-context
    # run trains it, through the chunked head at the run's 1,024 rows a chunk and activation checkpointing. The
    # row has no padding: a padded row beside it would make the padded path build a T x T mask (4 GiB at 64k).
    prompt = 1024
    tokens = prompt + completion
    vocab = len(build_char_tokenizer())
    # gradients: fp32 sums of about n terms in another order differ in relative norm by about sqrt(n) eps (random
    # signs; tests/tolerances.py); 10x that (measured at 17k tokens: 2e-5 against this bound's 1.6e-4)
    terms = vocab + SMALL["num_hidden_layers"] * (SMALL["hidden_size"] + SMALL["intermediate_size"]) + tokens
    assert_packed_scores_as_padded("qwen2", True, lambda v: padded_batch(v, 2, (prompt,), (completion,)), tokens,
                                   grad_norm_rtol=10 * math.sqrt(terms) * FP32_EPS, chunk_rows=1024,
                                   max_position_embeddings=tokens, **SMALL)


def test_fp32_weights_under_bf16_autocast_pack_as_sdpa_would():
    # fp32 weights leave q and k fp32 after the rotary embedding and v in bf16: autocast casts SDPA's inputs, and
    # the packed attention must too, or its backward (outside autocast) fails on the mixed dtypes.
    padded = build("qwen2", "sdpa")
    packed = copy.deepcopy(padded)
    head = dict(temperature=1.0, chunk_rows=8, return_entropy=True)
    install_chunked_lm_head(padded, padding_free_rows=False, **head)
    install_chunked_lm_head(packed, padding_free_rows=True, **head)
    batch = padded_batch(padded.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_padded, grads_padded = score(padded, batch)
        out_packed, grads_packed = score(packed, batch)
    mask = out_padded.label_mask
    torch.testing.assert_close(out_packed.log_probs[mask], out_padded.log_probs[mask], rtol=2e-2, atol=2e-2)
    assert grads_packed.keys() == grads_padded.keys()
    for name, grad in grads_padded.items():
        relative = ((grads_packed[name] - grad).norm() / grad.norm().clamp(min=1e-12)).item()
        assert relative < 3e-2, f"{name}: gradients differ by {relative:.2e} (relative)"


def test_mask_with_a_hole_is_scored_padded():
    ids, mask, labels = padded_batch(40)
    mask[0, -1] = 1  # row 0's completion resumes after padding: not one contiguous run
    assert padding_free.pack_rows(ids, mask) is None


def test_rows_keep_their_own_positions():
    ids, mask, _ = padded_batch(40)
    rows = padding_free.pack_rows(ids, mask)
    lengths = [p + c for p, c in zip(PROMPT_LENGTHS, COMPLETION_LENGTHS)]
    assert rows.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    assert rows.input_ids[0].tolist() == ids[mask.bool()].tolist()
    assert [end - start for start, end in rows.bounds] == lengths
    assert rows.cu_seq_lens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(attn_logit_softcapping=30.0), "attn_logit_softcapping"),
        (dict(is_causal=False), "causally"),
        (dict(attn_implementation="eager"), "'eager'"),
    ],
)
def test_models_packing_cannot_serve_are_named(overrides, reason):
    model = build_tiny_model(build_char_tokenizer(), **overrides)
    assert reason in padding_free.unsupported_reason(model)


def test_eager_model_is_scored_padded_with_a_warning(caplog):
    model = build("qwen2", "eager")
    reference = copy.deepcopy(model)
    head = dict(temperature=1.0, chunk_rows=4, return_entropy=False)
    with caplog.at_level("WARNING", logger="hf_grpo"):
        install_chunked_lm_head(model, padding_free_rows=True, **head)
    assert "padding_free is not applied: attn_implementation='eager'" in caplog.text
    install_chunked_lm_head(reference, padding_free_rows=False, **head)
    ids, mask, labels = padded_batch(model.config.vocab_size)
    scored = [m(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
              for m in (model, reference)]
    torch.testing.assert_close(scored[0], scored[1], rtol=0, atol=0)


def test_packed_rows_outside_the_routed_attention_fail_loudly():
    # A layer whose attention missed the routing gets the zero-size mask: an error, never attention over padding.
    model = build("qwen2", "sdpa")
    rows = padding_free.pack_rows(*padded_batch(model.config.vocab_size)[:2])
    model.config._attn_implementation = "eager"
    with pytest.raises(RuntimeError):
        padding_free.packed_hidden_states(model, model.model, rows)


def test_sliding_window_longer_than_every_row_packs():
    model = build_tiny_model(build_char_tokenizer(), use_sliding_window=True, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"])
    rows = padding_free.pack_rows(*padded_batch(40)[:2])
    assert rows.longest == 11 and not padding_free.packable(model, rows)
    model.config.sliding_window = 16
    assert padding_free.packable(model, rows)


def assert_packed_scores_as_padded_in_bf16_on_cuda(batch):
    """Packed scoring of ``batch`` (input_ids, attention_mask, labels) against padded, bf16 on CUDA, within bf16's
    rounding: log-probs and every gradient. Returns the packed model, the batch on CUDA and its packed output."""
    assert padding_free.varlen_attn is not None, "torch has no torch.nn.attention.varlen: the per-row path runs"
    with torch.device("cuda"):
        padded = build("qwen2", "sdpa").to(torch.bfloat16)
    packed = copy.deepcopy(padded)
    head = dict(temperature=1.0, chunk_rows=8, return_entropy=True)
    install_chunked_lm_head(padded, padding_free_rows=False, **head)
    install_chunked_lm_head(packed, padding_free_rows=True, **head)
    batch = [t.cuda() for t in batch]
    out_padded, grads_padded = score(padded, batch)
    out_packed, grads_packed = score(packed, batch)
    mask = out_padded.label_mask
    torch.testing.assert_close(out_packed.log_probs[mask], out_padded.log_probs[mask], rtol=2e-2, atol=2e-2)
    for name, grad in grads_padded.items():
        relative = ((grads_packed[name].float() - grad.float()).norm() / grad.float().norm().clamp(min=1e-12)).item()
        assert relative < 2e-2, f"{name}: gradients differ by {relative:.2e} (relative)"
    return packed, batch, out_packed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_scoring_equals_padded_in_bf16_on_cuda():
    # On CUDA the packed rows take the variable-length flash kernel: the same figures within bf16 rounding.
    assert_packed_scores_as_padded_in_bf16_on_cuda(padded_batch(40))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_key_value_heads_attend_as_repeated_ones_on_cuda(monkeypatch):
    # Fewer key/value heads than query heads (Qwen2.5-7B: 4 against 28), as flash attention groups them itself
    # where this torch allows it: the outputs and gradients of the repeated heads, within bf16 rounding.
    from hf_grpo.training import padding_free

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, heads, 300, 64, device="cuda", dtype=torch.bfloat16, generator=g) for heads in (8, 2, 2))
    cu = torch.tensor([0, 37, 190, 300], dtype=torch.int32, device="cuda")

    def attend():
        inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = padding_free._varlen_attention(*inputs, cu, cu, 0.125)
        return (out, *torch.autograd.grad(out.float().square().sum(), inputs))

    grouped = attend()
    monkeypatch.setattr(padding_free, "_VARLEN_KEYWORDS", padding_free._VARLEN_KEYWORDS - {"enable_gqa"})
    monkeypatch.setattr(padding_free, "_grouped_heads_taken", lambda device: False)
    repeated = attend()
    for name, got, want in zip(("out", "dq", "dk", "dv"), grouped, repeated):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=name)



def _varlen_on_cpu(query, key, value, cu_q, cu_k, max_q, max_k, **keywords):
    """varlen_attn's math on CPU, ``[T, H, D]`` in and out: the packed attention's own path of one SDPA call a row."""
    heads_first = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    return padding_free._attend(*heads_first, cu_q, cu_q.tolist(), query.shape[-1] ** -0.5)[0]


@torch.library.custom_op("hf_grpo_test::grouped_heads_taken", mutates_args=())
def _grouped_heads_taken_inside_an_op(x: torch.Tensor) -> torch.Tensor:
    return x.new_full((), float(padding_free._grouped_heads_taken(x.device)))


def test_grouped_heads_probe_differentiates_inside_the_attention_op(monkeypatch):
    # The probe is first asked inside hf_grpo::packed_attention, where the dispatcher turns autograd off. It must
    # still differentiate, or it answers no and every call repeats the key/value heads (7 times at Qwen2.5-7B).
    monkeypatch.setattr(padding_free, "varlen_attn", _varlen_on_cpu)
    monkeypatch.setattr(padding_free, "_GROUPED_HEADS_TAKEN", {})
    assert _grouped_heads_taken_inside_an_op(torch.zeros(1)).item() == 1.0
    assert padding_free._GROUPED_HEADS_TAKEN == {torch.device("cpu"): True}


@pytest.mark.parametrize(
    ("attn_logit_softcapping", "attention", "reason"),
    [(50.0, "eager", "attn_implementation='eager'"), (None, "sdpa", "final_logit_softcapping")],
)
def test_soft_capped_gemma2_is_refused_packing_with_the_warning(caplog, attn_logit_softcapping, attention, reason):
    # Gemma2 soft-caps its logits, so TRL's head scores it; padding_free=True must say packing is not applied,
    # with the attention's reason where it has one, else the head's.
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0,
                          attn_logit_softcapping=attn_logit_softcapping)
    model = Gemma2ForCausalLM(config)
    model.config._attn_implementation = attention
    with caplog.at_level("WARNING", logger="hf_grpo"):
        installed = install_chunked_lm_head(model, temperature=1.0, chunk_rows=4, return_entropy=False,
                                            padding_free_rows=True)
    assert not installed
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("padding_free is not applied")]
    assert len(warned) == 1 and reason in warned[0], caplog.text
