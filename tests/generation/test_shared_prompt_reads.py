"""Rows of one prompt read its keys and values from one row of the cache (``StaticDecoder.prompt_source``).

GRPO decodes each prompt ``num_generations`` times; the shared prefill writes the prompt's keys and values into
every row that holds it, and the decode step's "filled" attention reads them from the first such row. On the CPU the
op is its torch reference, which follows the same source, so the decoder's part is checked here end to end: the
followers' prompt copies are poisoned after the prefill, and the tokens must not change.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_grpo.generation import filled_attention, shared_prefill
from hf_grpo.generation.attention_routing import decode_attention
from hf_grpo.generation.sampling import SamplingSettings
from hf_grpo.generation.static_cache import last_logits
from hf_grpo.generation.static_decoder import StaticDecoder
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

PROMPTS = ["12+34=", "7*8=", "12+34=", "12+34="]  # rows 0, 2 and 3 share a prompt; its source is row 0


def _batch(tokenizer):
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return input_ids, mask


def _poison_followers(monkeypatch):
    """After each shared prefill, every row but its prompt's first holds garbage where its prompt is."""
    fill = shared_prefill.fill

    def poisoned_fill(static_cache, prompts_cache, rows):
        fill(static_cache, prompts_cache, rows)
        followers = rows.leaders.index_select(0, rows.place) != torch.arange(rows.place.numel())
        prompt = prompts_cache.layers[0].keys.shape[2]
        for layer in static_cache.layers:
            layer.keys[followers, :, :prompt] = float("nan")
            layer.values[followers, :, :prompt] = 1e4

    monkeypatch.setattr(shared_prefill, "fill", poisoned_fill)


def _decode(model, tokenizer, steps: int = 10):
    sampling = SamplingSettings.from_config(GenerationConfig(do_sample=False), eos_token_ids=[1], pad_token_id=0)
    # last_logits as the "compiled" forward: the decode step is routed as a compiled one, without compiling
    decoder = StaticDecoder(model, batch=len(PROMPTS), cache_len=32, sampling=sampling, compiled_forward=last_logits,
                            decode_attention="filled")
    input_ids, mask = _batch(tokenizer)
    with torch.no_grad(), decode_attention(model, decoder.decode_attention):
        tokens = decoder.run(model, input_ids, mask, steps, use_graph=False, check_every=steps)
    return decoder, tokens


@pytest.fixture
def served(monkeypatch):
    """The "filled" attention on the CPU: the decoder takes it and the op runs its torch reference."""
    monkeypatch.setattr(filled_attention, "serves", lambda *args, **kwargs: True)
    monkeypatch.setattr(filled_attention, "usable", lambda *args, **kwargs: True)


# The cuda_graph backend's families whose attention the decode step routes (sdpa; Gemma2 has only eager attention)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "olmo2", "granite"]


def _family_model(model_type: str, tokenizer):
    """A tiny model of ``model_type`` from transformers' own modelling code, so the keywords travel as each
    family's released forward hands them down."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_decode_step_reads_a_shared_prompt_from_its_first_row(served, monkeypatch, model_type):
    tokenizer = build_char_tokenizer()
    model = _family_model(model_type, tokenizer)
    decoder, expected = _decode(model, tokenizer)
    assert decoder.decode_attention == "filled"
    assert decoder.prompt_source.tolist() == [0, 1, 0, 0]
    assert decoder.prompt_end.tolist() == [_batch(tokenizer)[0].size(1)]
    _poison_followers(monkeypatch)
    decoder, got = _decode(model, tokenizer)
    assert torch.isfinite(decoder.last_logps).all()
    assert torch.equal(got, expected)


def test_without_the_filled_attention_each_row_reads_its_own_copy(monkeypatch):
    """The matmul attention (a CPU decoder's) reads every row's own cache: poisoned copies show, which is what makes
    the test above able to fail."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=3).eval()
    _poison_followers(monkeypatch)
    decoder, _ = _decode(model, tokenizer)
    assert decoder.decode_attention == "matmul"
    logps = decoder.last_logps
    assert torch.isfinite(logps[[0, 1]]).all()  # the source row and the row of the other prompt
    assert not torch.isfinite(logps[[2, 3], 1:]).any()  # the followers, from their first decode step on
