"""The decode step's logits processing equals transformers' own processors, and its draw samples softmax.

The reference is the ``LogitsProcessorList`` that ``model.generate`` builds for the same
``GenerationConfig`` (``_get_logits_processor``), applied to the same float32 scores, so any
drift in order or semantics between transformers and ``hf_grpo.generation.sampling`` fails here.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_grpo.generation.sampling import (
    SamplingSettings,
    PICK_BLOCK,
    inverse_cdf_pick,
    process_logits_,
    row_uniforms,
    select_tokens,
    select_tokens_from_copies,
    unsupported_generation_setting,
)
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

EOS, PAD = 1, 0
VOCAB = 97
PROMPT_LEN = 5

SETTINGS = {
    "greedy": dict(do_sample=False),
    "greedy_penalty_min_new": dict(do_sample=False, repetition_penalty=1.3, min_new_tokens=4),
    "temperature": dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0),
    "top_k": dict(do_sample=True, temperature=1.0, top_k=5, top_p=1.0),
    "top_p": dict(do_sample=True, temperature=1.0, top_k=0, top_p=0.8),
    "min_p": dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
    "everything": dict(do_sample=True, temperature=0.6, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                       min_new_tokens=3, min_length=PROMPT_LEN + 6),
}


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(build_char_tokenizer()).eval()


def _reference(model, gc: GenerationConfig, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    model._prepare_special_tokens(gc, device=scores.device)  # as generate() does: the EOS processors need it
    processors = model._get_logits_processor(generation_config=gc, input_ids_seq_length=PROMPT_LEN,
                                             device=str(scores.device))
    return processors(input_ids, scores.clone())


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("generated", [0, 2, 8])
def test_process_logits_equals_transformers_processors(model, name, generated):
    gc = GenerationConfig(pad_token_id=PAD, eos_token_id=EOS, **SETTINGS[name])
    settings = SamplingSettings.from_config(gc, [EOS], PAD)
    torch.manual_seed(generated)
    batch = 4
    scores = torch.randn(batch, VOCAB) * 3
    scores[:, EOS] = scores.max() + 1  # EOS is the favourite, so the min-tokens block matters
    input_ids = torch.randint(2, VOCAB, (batch, PROMPT_LEN + generated))
    seen = torch.zeros(batch, VOCAB + 1, dtype=torch.bool)
    seen.scatter_(1, input_ids, True)
    # What the static decoder feeds: EOS blocked while fewer than max(min_new, min_length - prompt) tokens exist.
    min_steps = max(settings.min_new_tokens, settings.min_length - PROMPT_LEN, 0)
    eos_mask = torch.zeros(VOCAB, dtype=torch.bool)
    eos_mask[EOS] = True
    eos_blocked = eos_mask & (torch.tensor([generated]) < min_steps) if settings.blocks_early_eos else None

    got = process_logits_(scores.clone(), settings, seen=seen, eos_blocked=eos_blocked)
    want = _reference(model, gc, input_ids, scores)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # the same tokens are cut


def _pick_only(do_sample: bool) -> SamplingSettings:
    """Settings under which select_tokens applies no filter and only picks."""
    gc = GenerationConfig(do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0)
    return SamplingSettings.from_config(gc, [], PAD)


def test_select_tokens_samples_softmax_of_the_filtered_scores():
    torch.manual_seed(0)
    scores = torch.tensor([[0.0, 1.0, 2.0, float("-inf")]]).expand(20_000, 4).contiguous()
    tokens = select_tokens(scores.clone(), _pick_only(True), noise=row_uniforms(scores))
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    expected = torch.softmax(scores[0].double(), dim=0)
    assert freq[3] == 0  # a cut token is never drawn
    # 20k draws: the standard error of each frequency is below 0.0035; 5 sigma
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.018)
    assert torch.equal(select_tokens(scores.clone(), _pick_only(False), noise=None), torch.full((20_000,), 2))


def _spread_scores() -> torch.Tensor:
    """A row over three blocks and a bit (the last block padded), with whole blocks and single tokens cut, the mass
    spread over every kept block, all scores far below zero (no block's exponentials may underflow to nothing)."""
    vocab = 3 * PICK_BLOCK + 37
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(vocab, generator=g) * 2 - 300.0
    scores[PICK_BLOCK : 2 * PICK_BLOCK] = float("-inf")  # a block cut whole
    scores[::7] = float("-inf")
    scores[5] = scores[3 * PICK_BLOCK + 30] = -294.0  # two favourites, in the first and the padded last block
    return scores


@pytest.mark.slow  # 15-40 s on a 2-core CPU
def test_the_inverse_cdf_pick_samples_softmax_across_blocks():
    scores = _spread_scores()
    draws, chunk = 200_000, 25_000
    torch.manual_seed(0)
    tokens = torch.cat([inverse_cdf_pick(scores.expand(chunk, -1), torch.rand(chunk)) for _ in range(draws // chunk)])
    expected = torch.softmax(scores.double(), dim=0)
    freq = torch.bincount(tokens, minlength=scores.numel()).double() / draws
    assert freq[torch.isinf(scores)].sum() == 0  # a cut token, or a cut block, is never drawn
    # Each frequency within 5 standard errors of its probability (+1e-5 for the rarest tokens).
    assert bool(((freq - expected).abs() <= 5 * (expected * (1 - expected) / draws).sqrt() + 1e-5).all())
    # Block by block too, where the errors of the tokens add up.
    by_block = [(freq[i : i + PICK_BLOCK].sum(), expected[i : i + PICK_BLOCK].sum())
                for i in range(0, scores.numel(), PICK_BLOCK)]
    assert all(abs(f - e) <= 5 * (e * (1 - e) / draws) ** 0.5 + 1e-5 for f, e in by_block)


def test_the_inverse_cdf_pick_at_the_ends_of_the_unit_interval():
    """u = 0 picks the first token with mass, u at 1 (where rounding ``u x total`` can land) the last one: never a
    cut token, a cut block or an index past the vocabulary."""
    scores = _spread_scores()
    late = scores.roll(-PICK_BLOCK)  # its first block is cut whole
    rows = torch.stack([scores, late, scores, late, scores])
    ends = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0 - 2**-24])
    picks = inverse_cdf_pick(rows, ends).tolist()

    def kept(row):
        return torch.nonzero(~torch.isinf(row)).flatten().tolist()

    assert picks == [kept(scores)[0], kept(late)[0], kept(scores)[-1], kept(late)[-1], kept(scores)[-1]]


def test_repetition_penalty_without_seen_mask_is_a_clear_error():
    settings = SamplingSettings.from_config(GenerationConfig(repetition_penalty=1.5), [EOS], PAD)
    with pytest.raises(ValueError, match="repetition_penalty"):
        process_logits_(torch.zeros(1, 4), settings)


def test_unsupported_settings_are_named():
    assert unsupported_generation_setting(GenerationConfig(num_beams=2)) == "generation setting num_beams=2"
    assert unsupported_generation_setting(GenerationConfig(do_sample=True, top_k=3)) is None
    with pytest.raises(ValueError, match="temperature must be positive"):
        SamplingSettings.from_config(GenerationConfig(do_sample=True, temperature=0.0), [EOS], PAD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_selection_picks_the_eager_tokens_and_leaves_its_inputs(dtype):
    """The decode step compiles ``select_tokens_from_copies``; traced whole (one graph), it picks what the eager
    in-place ``select_tokens`` picks from the same uniforms, and writes neither the logits nor the uniforms."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    settings = SamplingSettings.from_config(
        GenerationConfig(**SETTINGS["everything"], pad_token_id=PAD, eos_token_id=EOS), [EOS], PAD)
    torch.manual_seed(3)
    logits = (3 * torch.randn(16, VOCAB)).to(dtype)
    seen = torch.rand(16, VOCAB + 1) < 0.1
    eos_blocked = torch.zeros(VOCAB, dtype=torch.bool)
    eos_blocked[EOS] = True
    noise = row_uniforms(logits)
    inputs = logits.clone(), noise.clone()

    got = torch.compile(select_tokens_from_copies, backend=counting, dynamic=False)(
        logits, settings, noise, seen, eos_blocked)

    want = select_tokens(logits.float(), settings, noise=noise.clone(), seen=seen, eos_blocked=eos_blocked)
    assert torch.equal(got, want)
    assert torch.equal(logits, inputs[0]) and torch.equal(noise, inputs[1])
    assert len(graphs) == 1
    assert len(set(got.tolist())) > 1  # sampled, not one token for every row
