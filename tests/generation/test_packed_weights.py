"""A LoRA policy's frozen q/k/v and gate/up weights laid side by side (``packed_weights``), so the decode step fuses
them as views with no copy. What a user relies on: the model computes exactly what it did, its parameters stay the
same objects (PEFT, the optimizer, ``save_pretrained`` see no difference), trained weights are never moved, the
fused decode step on packed weights gives the unfused step's tokens and follows the weights in place (the LoRA merge
and its restore), and a checkpoint saved after packing loads back to the same weights.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_grpo.generation.fused_projections import FusedProjections, projection_groups
from hf_grpo.generation.lora_merge import InPlaceLoraMerge
from hf_grpo.generation.packed_weights import adjacent, pack
from tests.generation.test_fused_projections import _model
from tests.generation.test_regional_compile import _batch, _decode, _decoder


@pytest.fixture(scope="module")
def tokenizer():
    from hf_grpo.recipe_support.tiny import build_char_tokenizer

    return build_char_tokenizer()


def _frozen(model):
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def test_adjacent_gives_the_concatenation_as_a_view_only_for_consecutive_slices():
    buffer = torch.arange(24.0).view(6, 4)
    a, b, c = buffer[:1], buffer[1:4], buffer[4:]
    view = adjacent([a, b, c])
    assert view is not None and torch.equal(view, torch.cat([a, b, c])) and view.data_ptr() == buffer.data_ptr()
    view[2, 0] = -1.0  # a view, not a copy
    assert b[1, 0] == -1.0
    assert adjacent([a, c]) is None  # a gap
    assert adjacent([b, a]) is None  # out of order
    assert adjacent([a, torch.zeros(3, 4)]) is None  # another storage
    assert adjacent([buffer[:, :2], buffer[:, 2:]]) is None  # not contiguous
    bias = torch.arange(6.0)
    assert torch.equal(adjacent([bias[:2], bias[2:]]), bias)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_pack_keeps_the_parameters_and_the_output_and_lays_each_group_side_by_side(tokenizer, family):
    model = _frozen(_model(tokenizer, family))
    ids, _ = _batch(tokenizer)
    before = model(input_ids=ids).logits
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    groups = projection_groups(model)
    per_layer = 3 if family == "qwen2" else 2  # Qwen2's q/k/v carry biases: one group more
    assert len(groups) == per_layer * len(model.model.layers)
    assert all(adjacent(group) is None for group in groups)  # separate allocations to begin with

    assert pack(groups) == len(groups)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert all(torch.equal(p, values[name]) for name, p in model.named_parameters())
    assert all(adjacent(group) is not None for group in projection_groups(model))
    assert torch.equal(model(input_ids=ids).logits, before)
    assert pack(projection_groups(model)) == 0  # packed already: nothing moves again


def test_pack_leaves_trained_weights_where_they_are(tokenizer):
    model = _model(tokenizer, "qwen2")
    for param in model.parameters():
        param.requires_grad_(False)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)  # one trained member keeps its group apart
    up = model.model.layers[0].mlp.up_proj.weight
    address = up.data_ptr()
    groups = projection_groups(model)
    assert pack(groups) == len(groups) - 1
    assert up.data_ptr() == address
    assert adjacent([model.model.layers[0].mlp.gate_proj.weight, up]) is None


def test_fused_decode_on_packed_weights_has_no_copy_and_gives_the_unfused_tokens(tokenizer):
    model = _frozen(_model(tokenizer, "qwen2", seed=3))
    ids, mask = _batch(tokenizer)
    ref = _decoder(model)
    _decode(model, ref, ids, mask, steps=6, routed=False)

    pack(projection_groups(model))
    only_qkv = FusedProjections(model, ("qkv",))  # gate/up are fused too: packed, they cost nothing
    assert only_qkv.parts() == {"qkv": "packed", "gate_up": "packed"} and only_qkv.nbytes() == 0
    fused = _decoder(model, fuse_projections=("qkv",))
    _decode(model, fused, ids, mask, steps=6, routed=True)
    assert fused.fused.parts() == {"qkv": "packed", "gate_up": "packed"}
    assert torch.equal(fused.out, ref.out)


def test_unpacked_gate_up_is_not_copied_unless_asked(tokenizer):
    model = _model(tokenizer, "qwen2")  # trained weights: nothing packed
    assert FusedProjections(model, ("qkv",)).parts() == {"qkv": "copy"}
    assert FusedProjections(model, ("qkv", "gate_up")).parts() == {"qkv": "copy", "gate_up": "copy"}


def _lora_policy(tokenizer, seed=5):
    model = _model(tokenizer, "qwen2", seed=seed)
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(seed)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return policy


def test_the_lora_merge_packs_the_frozen_base_and_the_fused_step_follows_merge_and_restore(tokenizer):
    policy = _lora_policy(tokenizer)
    ids, mask = _batch(tokenizer, seed=2)
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    merged_model = _frozen(_lora_policy(tokenizer).merge_and_unload())  # the same seed: the same merged weights

    view = InPlaceLoraMerge(policy)
    assert view.packed_groups == 3 * len(merged_model.model.layers)
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if "lora_" not in n)
    fused = FusedProjections(view.module, ("qkv",))
    assert fused.parts() == {"qkv": "packed", "gate_up": "packed"}

    module = view.refresh(policy)  # merged in place: the packed views see the merged values with no refresh
    want = _decoder(merged_model)
    _decode(merged_model, want, ids, mask, steps=5, routed=False)
    got = _decoder(module, fuse_projections=("qkv",))
    _decode(module, got, ids, mask, steps=5, routed=True)
    assert torch.equal(got.out, want.out)
    view.restore()
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if "lora_" not in n)


def test_a_model_saved_after_packing_loads_back_the_same_weights(tokenizer, tmp_path):
    policy = _lora_policy(tokenizer, seed=7)
    InPlaceLoraMerge(policy)  # packs the base weights, as a run's first rollout does
    merged = policy.merge_and_unload()  # what a user saves at the end of a LoRA run
    merged.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved = dict(merged.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, saved[name]), name
