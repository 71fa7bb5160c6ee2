"""Every backend records, beside each sampled token, its log-prob under the law it was drawn from: equal to a no-grad
forward of the whole sequence whose logits go through the same filters (temperature, top-k, top-p, min-p)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_grpo.generation import HFGenerateBackend
from hf_grpo.generation.cuda_graph import CudaGraphBackend
from hf_grpo.generation.sampling import SamplingSettings, effective_generation_config, process_logits_
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model
from tests.tolerances import FP32_EPS

TOKENIZER = build_char_tokenizer()
PROMPTS = [TOKENIZER(text)["input_ids"] for text in ("ab>", "c>", "defg>", "h>", "ij>", "klmno>")]
SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=0.9, top_k=5),
    "top_p": dict(top_p=0.8),
    "min_p": dict(temperature=1.3, min_p=0.1),
}
BACKENDS = {"hf": HFGenerateBackend, "cuda_graph_eager": lambda: CudaGraphBackend(use_cuda_graph=False, compile=False)}


def no_grad_logprobs(model, prompt, completion, settings: SamplingSettings) -> torch.Tensor:
    """The completion's log-probs from one forward of prompt + completion, filtered as the sampler filters."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    scores = torch.stack([process_logits_(row[None].clone(), settings)[0] for row in logits])
    return scores.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def sample(backend, model, gc, seed=0):
    torch.manual_seed(seed)
    return backend.sample(model, PROMPTS, generation_config=gc, chunk_size=4, pad_token_id=TOKENIZER.pad_token_id,
                          eos_token_ids=[TOKENIZER.eos_token_id])


def law(model, gc) -> SamplingSettings:
    """The settings ``model.generate`` samples with: the call's, completed by the model's and transformers' defaults
    (top_k=50 where the call leaves it unset)."""
    gc = effective_generation_config(model, gc)
    return SamplingSettings.from_config(gc, [TOKENIZER.eos_token_id], TOKENIZER.pad_token_id)


# bf16 with the temperature alone: a filter's cut (the k-th score, the top-p mass, min-p's threshold) moves with the
# rounding of bf16 logits, which the cached decode and the whole-sequence forward round at different places, so a
# token kept by one can be cut by the other; the law without a cut is continuous in the logits.
@pytest.mark.parametrize("setting,dtype", [(name, torch.float32) for name in sorted(SETTINGS)]
                         + [("temperature", torch.bfloat16)], ids=[*sorted(SETTINGS), "temperature-bf16"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sampled_logprobs_equal_a_no_grad_forward_of_the_filtered_law(backend, setting, dtype):
    model = build_tiny_model(TOKENIZER, seed=1, dtype=dtype).eval()
    gc = GenerationConfig(max_new_tokens=12, do_sample=True, pad_token_id=TOKENIZER.pad_token_id,
                          eos_token_id=TOKENIZER.eos_token_id, **{"top_k": 0, **SETTINGS[setting]})
    settings = law(model, gc)
    got = sample(BACKENDS[backend](), model, gc)
    assert got.logprobs is not None and [len(lp) for lp in got.logprobs] == [len(ids) for ids in got.ids]
    config = model.config
    # fp32: the cached decode and the whole-sequence forward sum the same terms in other orders; a log-prob is a
    # difference of logits (|logit| <= max) after sums over the hidden and MLP widths of each layer and the vocabulary
    terms = config.vocab_size + config.num_hidden_layers * (config.hidden_size + config.intermediate_size)
    for prompt, ids, logprobs in zip(PROMPTS, got.ids, got.logprobs):
        expected = no_grad_logprobs(model, prompt, ids, settings)
        actual = torch.tensor(logprobs)
        assert torch.isfinite(actual).all() and (actual <= 0).all()
        if dtype == torch.float32:
            atol = terms * FP32_EPS * max(1.0, float(expected.abs().max()))
        else:
            # bf16: each logit is rounded to 8 bits of mantissa in both paths, and the two paths round their
            # intermediate sums at different places; a few bf16 ulps of the largest log-prob
            atol = 4 * 2**-8 * max(1.0, float(expected.abs().max()))
        torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol)


def test_both_backends_record_the_same_logprobs_for_the_same_tokens():
    model = build_tiny_model(TOKENIZER, seed=1).eval()
    gc = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=6, top_p=0.9,
                          pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id)
    hf, graph = sample(HFGenerateBackend(), model, gc), sample(BACKENDS["cuda_graph_eager"](), model, gc)
    for ids_a, ids_b, lp_a, lp_b in zip(hf.ids, graph.ids, hf.logprobs, graph.logprobs):
        if ids_a == ids_b:  # the same draws (they can differ where a uniform falls on a rounding edge)
            torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=0.0, atol=1e-4)


def test_greedy_records_the_log_softmax_of_the_chosen_token():
    model = build_tiny_model(TOKENIZER, seed=1).eval()
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=TOKENIZER.pad_token_id,
                          eos_token_id=TOKENIZER.eos_token_id)
    settings = law(model, gc)
    for backend in BACKENDS.values():
        got = sample(backend(), model, gc)
        for prompt, ids, logprobs in zip(PROMPTS, got.ids, got.logprobs):
            torch.testing.assert_close(torch.tensor(logprobs), no_grad_logprobs(model, prompt, ids, settings),
                                       rtol=0.0, atol=1e-4)


def test_a_subclass_that_chooses_its_own_completions_gives_no_logprobs():
    class Fixed(HFGenerateBackend):
        def generate(self, model, prompt_ids, **kwargs):
            return [[5, 6]] * len(prompt_ids)

    got = Fixed().sample(build_tiny_model(TOKENIZER), PROMPTS, generation_config=GenerationConfig(max_new_tokens=2),
                         chunk_size=2, pad_token_id=0, eos_token_ids=[1])
    assert got.ids == [[5, 6]] * len(PROMPTS) and got.logprobs is None
