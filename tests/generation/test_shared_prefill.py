"""The prefill of rows that repeat prompts (GRPO's completions of one prompt): each prompt runs once, and the
decode that follows is the one a prefill of every row gives."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig

from hf_grpo.generation import HFGenerateBackend, shared_prefill
from hf_grpo.generation.cuda_graph import CudaGraphBackend
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model
from tests.generation.test_cuda_graph import EOS, PAD, _bias_eos, _llama

NUM_GENERATIONS = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _grpo_prompts(tokenizer, distinct: int, seed: int = 0) -> list[list[int]]:
    """``distinct`` prompts of varied lengths (3-24 tokens), each repeated as GRPO's rollout holds them."""
    rng = random.Random(seed)
    prompts = [tokenizer("".join(rng.choice("abcdefgh 123+=") for _ in range(rng.randint(3, 24))))["input_ids"]
               for _ in range(distinct)]
    return [p for p in prompts for _ in range(NUM_GENERATIONS)]


def _generate(backend, model, prompts, chunk: int, **settings):
    gc = GenerationConfig(max_new_tokens=30, pad_token_id=PAD, eos_token_id=EOS, **settings)
    with torch.no_grad():
        return backend.generate(model, prompts, generation_config=gc, chunk_size=chunk, pad_token_id=PAD,
                                eos_token_ids=[EOS])


def _prefill_rows(monkeypatch) -> list[int]:
    """The row counts of the prefill forwards that follow (the shared prefill's and the row-by-row one's)."""
    from hf_grpo.generation import static_decoder

    rows: list[int] = []
    original = static_decoder.last_logits

    def counted(model, input_ids, *args, **kwargs):
        if input_ids.size(1) > 1:  # a prompt piece, not a decode step
            rows.append(input_ids.size(0))
        return original(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(static_decoder, "last_logits", counted)
    return rows


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_repeated_prompts_prefill_once_and_decode_the_tokens_of_generate(tokenizer, family, monkeypatch):
    model = (build_tiny_model(tokenizer) if family == "qwen2" else _llama(tokenizer)).eval()
    prompts = _grpo_prompts(tokenizer, 5)  # 20 rows: chunks of 8 hold 2 prompts, the last 1 (padded with copies)
    _bias_eos(model, prompts, 30, "cpu")
    rows = _prefill_rows(monkeypatch)
    expected = _generate(HFGenerateBackend(), model, prompts, 8, do_sample=False)
    got = _generate(CudaGraphBackend(use_cuda_graph=False), model, prompts, 8, do_sample=False)
    assert got == expected
    lengths = [len(c) for c in expected]
    assert min(lengths) < 30 and max(lengths) == 30, lengths  # EOS mid-way in some rows
    assert rows and max(rows) <= 2, rows  # every chunk's prefill ran its distinct prompts only


def test_the_shared_state_equals_a_prefill_of_every_row(tokenizer, monkeypatch):
    """The static cache and the first logits after the shared prefill are those of every row run through the model
    (float64, so the smaller batch's matmul order cannot hide a difference)."""
    from hf_grpo.generation import static_decoder

    model = build_tiny_model(tokenizer).double().eval()
    prompts = _grpo_prompts(tokenizer, 3, seed=1)
    states = {}
    for share in (True, False):
        if not share:
            monkeypatch.setattr(shared_prefill, "shared_rows", lambda *args: None)
        captured = {}

        def keep(self, logits, compiled=None, captured=captured):
            captured["logits"] = logits.clone()
            captured["cache"] = [(layer.keys.clone(), layer.values.clone()) for layer in self.cache.layers]
            raise _Stop

        monkeypatch.setattr(static_decoder.StaticDecoder, "_advance", keep)
        with pytest.raises(_Stop):
            _generate(CudaGraphBackend(use_cuda_graph=False), model, prompts, len(prompts), do_sample=False)
        states[share] = captured
    torch.testing.assert_close(states[True]["logits"], states[False]["logits"], rtol=1e-12, atol=1e-12)
    for (keys, values), (keys_all, values_all) in zip(states[True]["cache"], states[False]["cache"]):
        torch.testing.assert_close(keys, keys_all, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(values, values_all, rtol=1e-12, atol=1e-12)


class _Stop(Exception):
    pass


def test_rows_of_one_prompt_still_sample_their_own_tokens(tokenizer):
    model = build_tiny_model(tokenizer).eval()
    prompts = _grpo_prompts(tokenizer, 2, seed=2)
    torch.manual_seed(0)
    out = _generate(CudaGraphBackend(use_cuda_graph=False), model, prompts, len(prompts), do_sample=True,
                    temperature=1.5)
    for start in range(0, len(out), NUM_GENERATIONS):
        group = [tuple(row) for row in out[start:start + NUM_GENERATIONS]]
        assert len(set(group)) > 1, group  # one prompt, several completions


def test_which_rows_are_shared():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [3, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1]])
    rows = shared_prefill.shared_rows(ids, mask)
    assert rows.leaders.tolist() == [0, 1]  # row 3 is row 0 with another pad id: the same prompt
    assert rows.place.tolist() == [0, 1, 0, 0, 1]
    assert shared_prefill.shared_rows(ids[:2], mask[:2]) is None  # nothing repeats
    other_padding = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1]])
    assert shared_prefill.shared_rows(ids, other_padding).leaders.tolist() == [0, 1, 2]  # row 0 now 3 tokens long
