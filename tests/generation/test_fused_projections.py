"""Fused q/k/v and gate/up projections in the decode step: the same tokens, one compiled graph, weights followed.

Run on CPU through the decoder's compile-and-capture context (``StaticDecoder._compiled_step``) with a
graph-counting backend that runs the traced graph as it is, against the same decoder stepping unfused.
The families' tiny models also carry the last two tests: a sliding-window model (Mistral's default
window) compiles its decode layer once, and a cache past the window goes to ``model.generate``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_grpo.generation.cuda_graph import CudaGraphBackend
from hf_grpo.generation.fused_projections import FusedProjections
from hf_grpo.runtime.regional_compile import CompiledLayers
from hf_grpo.generation.sampling import SamplingSettings
from hf_grpo.generation.static_decoder import StaticDecoder
from hf_grpo.recipe_support.tiny import build_char_tokenizer
from tests.generation.test_regional_compile import (  # the same prompts, decoders and graph counter
    CountingBackend,
    _batch,
    _decode,
    _decoder,
    _routed_and_reference,
)

PAD, EOS = 0, 1
FAMILIES = ["qwen2", "llama", "qwen3", "mistral"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test counts the graphs of its own compile
    yield


def _model(tokenizer, family, seed=0):
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _settings(**gen):
    gc = GenerationConfig(max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS, **gen)
    return SamplingSettings.from_config(gc, [EOS], PAD)


def _count_projection_calls(model):
    calls = []
    handles = [module.register_forward_hook(lambda *_: calls.append(1))
               for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS]
    return calls, handles


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_step_gives_the_tokens_and_cache_of_the_unfused_one(tokenizer, family):
    model = _model(tokenizer, family)
    ids, mask = _batch(tokenizer)
    counting = CountingBackend()
    fused = _decoder(model, compiled_layers=CompiledLayers(backend=counting), fuse_projections=("qkv", "gate_up"))
    ref = _decoder(model)
    attention_forward = type(model.model.layers[0].self_attn).forward

    with torch.no_grad():
        fused._prefill(model, ids, mask)  # the prefill runs the model's own forward
    calls, handles = _count_projection_calls(model)
    with torch.no_grad():
        for _ in range(6):
            with fused._compiled_step(model):
                fused._decode_step(model)
    for handle in handles:
        handle.remove()
    _decode(model, ref, ids, mask, steps=6, routed=False)

    assert calls == [], "a q/k/v or gate/up projection ran on its own inside the fused step"
    assert len(counting.graphs) == 1, f"{len(counting.graphs)} graphs for 3 layers"
    assert {cls.__name__ for cls in fused.fused.forwards} == {
        type(model.model.layers[0].self_attn).__name__, type(model.model.layers[0].mlp).__name__}
    assert torch.equal(fused.out, ref.out)
    for got, want in zip(fused.cache.layers, ref.cache.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-6)
    # Outside the step the model is its own: the class forward is back, no fused weight is attached.
    assert type(model.model.layers[0].self_attn).forward is attention_forward
    assert not any(name.startswith("hf_grpo_") for m in model.modules() for name in vars(m))


def test_fused_weights_follow_in_place_updates_between_chunks(tokenizer, monkeypatch):
    """The captured graph reads the fused copies, so each chunk copies the parameters into them first:
    after an in-place update (what an optimizer step is) the fused step decodes with the new weights."""
    model = _model(tokenizer, "qwen2")
    ids, mask = _batch(tokenizer, seed=4)

    class RoutedCapture(StaticDecoder):
        """Stands in for a captured graph on CPU: each replay is one step in the capture context."""

        def _capture(self, model):
            self.graph = self

        def replay(self):
            with self._compiled_step(self.model_ref()):
                self._decode_step(self.model_ref())

    def run(decoder, use_graph):
        with torch.no_grad():
            return decoder.run(model, ids, mask, 8, use_graph=use_graph, check_every=4)

    fused = RoutedCapture(model, batch=3, cache_len=32, sampling=_settings(do_sample=False),
                          decode_attention="matmul", fuse_projections=("qkv", "gate_up"))
    before = run(fused, True)
    assert torch.equal(before, run(_decoder(model), False))
    with torch.no_grad():
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if any(p in name for p in PROJECTIONS):
                param.mul_(1 + torch.randn_like(param))
    expected = run(_decoder(model), False)
    assert not torch.equal(expected, before), "the update must change the greedy tokens for this test to mean anything"
    assert torch.equal(run(fused, True), expected)


def test_lora_wrapped_attention_keeps_its_forward_and_the_plain_mlp_is_fused(tokenizer):
    peft = pytest.importorskip("peft")
    model = _model(tokenizer, "qwen2", seed=2)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False)).eval()
    base = model.get_base_model()
    assert {cls.__name__ for cls in FusedProjections(base).forwards} == {"Qwen2MLP"}

    ids, mask = _batch(tokenizer, seed=5)
    fused, ref, _ = _routed_and_reference(model, ids, mask, steps=5, fuse_projections=("qkv", "gate_up"))
    assert torch.equal(fused.out, ref.out)


def test_fuse_projections_names_are_validated():
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['mlp'\]; valid parts are \['qkv', 'gate_up'\]"):
        CudaGraphBackend(fuse_projections=("qkv", "mlp"))


def test_a_sliding_window_the_cache_fits_in_decodes_with_one_graph(tokenizer):
    """Mistral's default window (4096) gives every layer a sliding cache layer, whose Python-side length made
    dynamo compile the decode layer anew at every step. A cache that fits the window never rolls over, so the
    decoder holds plain static layers: one graph, and the tokens and cache of the unrouted step."""
    from transformers.cache_utils import StaticLayer

    model = _model(tokenizer, "mistral")
    assert model.config.sliding_window is not None and model.config.sliding_window >= 32
    ids, mask = _batch(tokenizer, seed=6)
    got, ref, counting = _routed_and_reference(model, ids, mask, steps=6)
    assert all(type(layer) is StaticLayer for layer in got.cache.layers)
    assert len(counting.graphs) == 1
    assert torch.equal(got.out, ref.out)
    with torch.no_grad():  # and the plain layers decode what model.generate decodes with its own cache
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False,
                                  pad_token_id=PAD, eos_token_id=EOS)[:, ids.size(1):]
    assert torch.equal(ref.out[:, : expected.size(1)], expected)


def test_a_cache_longer_than_a_sliding_window_goes_to_generate(tokenizer):
    """Past its window a sliding cache layer rolls over with Python-side state a graph cannot replay. Mistral
    sets no layer_types, so the window is read from the cache layers transformers would build."""
    model = _model(tokenizer, "mistral")
    model.config.sliding_window = 16
    backend = CudaGraphBackend()
    gc = GenerationConfig(max_new_tokens=8, do_sample=False)
    assert backend._call_reason(model, gc, 32) == "cache length 32 exceeds the sliding window 16"
    assert backend._call_reason(model, gc, 16) is None
