"""Regional compile of the decode step: one compiled decoder layer serves every layer, with each its own cache.

Run on CPU through the decoder's own compile-and-capture context (``StaticDecoder._compiled_step``)
with a graph-counting ``torch.compile`` backend that runs the traced graph as it is, so the test
sees how many graphs dynamo made and whether routing the layers changed any number.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig

from hf_grpo.generation.cuda_graph import CudaGraphBackend
from hf_grpo.runtime.regional_compile import CompiledLayers, decoder_layers
from hf_grpo.generation.sampling import SamplingSettings
from hf_grpo.generation.attention_routing import decode_attention
from hf_grpo.generation.static_decoder import StaticDecoder, take_next_tokens
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

PAD, EOS = 0, 1
LAYERS = 5


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test counts the graphs of its own compile. Dynamo keeps compiled code per function across tests,
    and past its recompile limit it runs the layer eagerly without a word: after the GPU decode tests had
    compiled the same layer class, the counting backend saw no graph at all (H100, torch 2.11)."""
    torch._dynamo.reset()
    yield


class CountingBackend:
    """A torch.compile backend that records each graph dynamo hands it and runs it unchanged."""

    def __init__(self):
        self.graphs = []
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


def _model(tokenizer, seed=0):
    return build_tiny_model(tokenizer, seed=seed, num_hidden_layers=LAYERS, attn_implementation="sdpa").eval()


def _batch(tokenizer, n=3, seed=0):
    rng = random.Random(seed)
    rows = [tokenizer("".join(rng.choice("abcdefgh 123") for _ in range(rng.randint(2, 9))))["input_ids"]
            for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _decoder(model, gc: GenerationConfig | None = None, **kwargs):
    gc = gc or GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    sampling = SamplingSettings.from_config(gc, [EOS], PAD)
    return StaticDecoder(model, batch=3, cache_len=32, sampling=sampling, decode_attention="matmul", **kwargs)


def _decode(model, decoder, ids, mask, steps, routed):
    """Prefill eagerly, then ``steps`` decode steps: in the compile-and-capture context, or eagerly
    with the same packed attention (the reference)."""
    with torch.no_grad():
        decoder._prefill(model, ids, mask)
        for _ in range(steps):
            if routed:
                with decoder._compiled_step(model):
                    decoder._decode_step(model)
            else:
                with decode_attention(model, "matmul"):
                    decoder._decode_step(model)


def _routed_and_reference(model, ids, mask, steps, **decoder_kwargs):
    """Decode ``steps`` tokens of the same prompts twice: routed through a graph-counting compile (the decoder
    also gets ``decoder_kwargs``), and eagerly, the reference. Returns (routed, reference, counting backend)."""
    counting = CountingBackend()
    got = _decoder(model, compiled_layers=CompiledLayers(backend=counting), **decoder_kwargs)
    ref = _decoder(model)
    _decode(model, got, ids, mask, steps, routed=True)
    _decode(model, ref, ids, mask, steps, routed=False)
    return got, ref, counting


def _assert_same_state(got: StaticDecoder, ref: StaticDecoder):
    assert torch.equal(got.out, ref.out)
    for i, (a, b) in enumerate(zip(got.cache.layers, ref.cache.layers)):
        # each layer wrote its own slice: a view routed to the wrong layer would differ here
        assert torch.equal(a.keys, b.keys), f"layer {i} keys"
        assert torch.equal(a.values, b.values), f"layer {i} values"
        assert int(a.cumulative_length) == int(b.cumulative_length), f"layer {i} length"


def test_one_graph_serves_every_layer_and_changes_no_number(tokenizer):
    model = _model(tokenizer)
    ids, mask = _batch(tokenizer)
    got, ref, counting = _routed_and_reference(model, ids, mask, steps=6)

    assert len(counting.graphs) == 1, f"{len(counting.graphs)} graphs for {LAYERS} layers"
    assert counting.calls == LAYERS * 6
    _assert_same_state(got, ref)
    # Outside the block the layers are the model's own again: training and generate never see the route.
    assert all("forward" not in vars(layer) for layer in decoder_layers(model))


def _in_place_ops(graph_module) -> list[str]:
    return [node.target for node in graph_module.graph.nodes
            if node.op == "call_method" and str(node.target).endswith("_")]


def test_the_compiled_layer_writes_its_keys_and_values_and_leaves_the_cache_length_to_one_add(tokenizer):
    """A static layer advances its own length tensor at every update: one more kernel per layer and token. Routed,
    the compiled layer writes only its keys and values; the decoder moves every layer's length once a step."""
    model = _model(tokenizer)
    ids, mask = _batch(tokenizer)
    got, ref, counting = _routed_and_reference(model, ids, mask, steps=3)
    assert _in_place_ops(counting.graphs[0]) == ["index_copy_", "index_copy_"]
    _assert_same_state(got, ref)  # lengths included: each moved by one a step, as the layers' own update moves it
    assert int(got.cache.layers[0].cumulative_length) == ids.size(1) + 3


def test_lora_layers_share_one_graph_too(tokenizer):
    peft = pytest.importorskip("peft")
    model = _model(tokenizer, seed=1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(model, config).eval()
    ids, mask = _batch(tokenizer, seed=2)
    got, ref, counting = _routed_and_reference(model, ids, mask, steps=4)
    assert len(counting.graphs) == 1
    _assert_same_state(got, ref)


def test_a_layer_with_a_replaced_forward_is_compiled_whole(tokenizer):
    model = _model(tokenizer)
    backend = CudaGraphBackend(compile=True)
    step = backend._compiled_step(model, 3, 32, torch.float32)
    assert set(step) == {"compiled_layers", "compiled_select", "pdl_codegen"}
    assert step["pdl_codegen"] is False  # a CPU model: no programmatic dependent launch

    layer = decoder_layers(model)[2]
    layer.forward = lambda *args, **kwargs: type(layer).forward(layer, *args, **kwargs)  # an offloading hook, say
    assert "replaced" in CompiledLayers.unavailable_reason(model)
    fresh = CudaGraphBackend(compile=True)
    assert set(fresh._compiled_step(model, 3, 32, torch.float32)) == {"compiled_forward", "compiled_select",
                                                                       "pdl_codegen"}
    assert fresh.num_compiles == 1


def test_compile_scope_is_validated():
    with pytest.raises(ValueError, match=r"compile_scope must be one of \['layers', 'model'\], got 'layer'"):
        CudaGraphBackend(compile_scope="layer")


def test_the_compiled_token_step_writes_what_the_eager_one_writes(tokenizer):
    """The decode step compiles its tail (selection and buffer updates, ``take_next_tokens``) as one function: with
    the same noise it leaves every buffer as the eager, in-place tail does (sampling with every filter, the EOS
    block and the repetition penalty on)."""
    model = _model(tokenizer)
    ids, mask = _batch(tokenizer)
    gc = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02,
                          repetition_penalty=1.2, min_new_tokens=3, pad_token_id=PAD, eos_token_id=EOS)
    counting = CountingBackend()
    decoders = [
        _decoder(model, gc, **kwargs)
        for kwargs in ({"compiled_select": torch.compile(take_next_tokens, backend=counting, dynamic=False)}, {})
    ]
    for decoder in decoders:
        torch.manual_seed(5)  # the noise is drawn eagerly, outside the compiled tail: the same draws for both
        _decode(model, decoder, ids, mask, steps=6, routed=False)
    got, ref = decoders
    assert len(counting.graphs) == 1 and counting.calls == 6
    for name in ("out", "unfinished", "seen", "step", "pos", "tok"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert len(set(got.out[:, :7].flatten().tolist())) > 2  # sampled tokens, not one token everywhere
