"""``zero3_leaf_modules``: under ZeRO-3 the decoder layers become DeepSpeed leaf modules (one parameter gather per
layer, no hooks on its children), for the policy and for TRL's reference model; outside ZeRO-3 nothing changes.

Unit tests on tiny Qwen2 models, then real two-process CPU ZeRO-3 runs (``accelerate launch``, the shipped
zero3.yaml) with ``auto`` against ``off``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

import pytest
import torch
from datasets import Dataset
from deepspeed.utils import get_z3_leaf_modules
from tests.launching import accelerate_command, run_launch
from tests.side_by_side import free_port

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.distributed import zero3_leaves
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER = build_char_tokenizer()


def _model():
    return build_tiny_model(TOKENIZER, seed=0)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def _layers(model) -> list[torch.nn.Module]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.model.layers)


def _ids(modules) -> set[int]:
    return {id(module) for module in modules}


# ---- marking ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "lora"])
def test_auto_marks_exactly_the_decoder_layers(wrap):
    model = _lora(_model()) if wrap else _model()
    marking = zero3_leaves.mark(model, "auto", zero3=True)
    assert marking == zero3_leaves.LeafMarking(("Qwen2DecoderLayer",), 2)
    assert _ids(get_z3_leaf_modules(model)) == _ids(_layers(model))  # the layers, and nothing else
    assert "2 ZeRO-3 leaf modules (Qwen2DecoderLayer)" in str(marking)


def test_under_lora_the_leaves_inputs_need_a_gradient():
    """Else DeepSpeed's gradient hook on a leaf fires before the leaf's backward (``_make_leaf_inputs_need_grad``)."""
    ids = torch.tensor([TOKENIZER.encode("ab>")])
    model = _lora(_model())
    assert not model.get_input_embeddings()(ids).requires_grad  # frozen embeddings
    zero3_leaves.mark(model, "auto", zero3=True)
    assert model.get_input_embeddings()(ids).requires_grad
    full = _model()  # trainable embeddings: nothing to do
    zero3_leaves.mark(full, "auto", zero3=True)
    assert not hasattr(full, "_require_grads_hooks")


def test_a_named_class_list_marks_those_classes():
    model = _model()
    marking = zero3_leaves.mark(model, "Qwen2MLP, Qwen2Attention", zero3=True)
    assert marking == zero3_leaves.LeafMarking(("Qwen2Attention", "Qwen2MLP"), 4)
    expected = [module for layer in _layers(model) for module in (layer.self_attn, layer.mlp)]
    assert _ids(get_z3_leaf_modules(model)) == _ids(expected)


def test_off_marks_nothing():
    model = _model()
    assert zero3_leaves.mark(model, "off", zero3=True) == zero3_leaves.LeafMarking((), 0)
    assert get_z3_leaf_modules(model) == []
    assert str(zero3_leaves.LeafMarking((), 0)) == "no ZeRO-3 leaf modules (zero3_leaf_modules)"


def test_outside_zero3_nothing_is_marked():
    model = _model()
    assert zero3_leaves.mark(model, "auto", zero3=False) == zero3_leaves.LeafMarking((), 0)
    assert zero3_leaves.mark(model, "Qwen2MLP", zero3=False).count == 0
    assert get_z3_leaf_modules(model) == []


def test_a_class_the_model_lacks_raises_naming_the_field_the_value_and_the_layers():
    model = _model()
    with pytest.raises(ValueError) as error:
        zero3_leaves.mark(model, "Qwen2DecoderLayer,LlamaDecoderLayer", zero3=True)
    message = str(error.value)
    assert "zero3_leaf_modules='Qwen2DecoderLayer,LlamaDecoderLayer'" in message
    assert "no module of class LlamaDecoderLayer" in message
    assert "its decoder layers are Qwen2DecoderLayer" in message and "Qwen2MLP" in message  # what does occur
    assert get_z3_leaf_modules(model) == []  # nothing half-marked


@pytest.mark.parametrize("value", ["", "Qwen2DecoderLayer;Qwen2MLP", "Qwen2DecoderLayer,", "a.B", None, 3])
def test_config_rejects_a_malformed_setting(make_config, value):
    with pytest.raises(ValueError, match=r"zero3_leaf_modules must be 'auto', 'off' or comma-separated module class "
                                         r"names such as 'Qwen2DecoderLayer', got "):
        make_config(zero3_leaf_modules=value)


def test_config_rejects_on_naming_what_to_use(make_config):
    with pytest.raises(ValueError, match=r"zero3_leaf_modules='on' is not a setting: use 'auto' \(the decoder layers\)"):
        make_config(zero3_leaf_modules="on")


def test_config_default_and_a_class_list():
    assert GRPOConfig(output_dir="unused", use_cpu=True).zero3_leaf_modules == "auto"
    assert zero3_leaves.validate_setting("Qwen2DecoderLayer, Qwen2MLP") is None


def test_the_deepspeed_config_gets_the_classes_next_to_deepspeeds_defaults():
    """Every engine DeepSpeed builds from the config (TRL's reference model too) flags them; its MoE defaults stay."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    config = {"zero_optimization": {"stage": 3}}
    assert zero3_leaves.is_zero3_config(config) and not zero3_leaves.is_zero3_config({"zero_optimization": {"stage": 2}})
    assert not zero3_leaves.is_zero3_config(None)
    zero3_leaves.add_to_deepspeed_config(config, ("Qwen2DecoderLayer",))
    zero3_leaves.add_to_deepspeed_config(config, ("Qwen2DecoderLayer",))  # a second trainer: no duplicate
    parsed = DeepSpeedZeroConfig(**config["zero_optimization"]).leaf_module
    assert parsed.classes == [*DEFAULT_LEAF_MODULE_CLASSES, "Qwen2DecoderLayer"]
    own = {"zero_optimization": {"stage": 3, "leaf_module": {"classes": "MyBlock"}}}
    zero3_leaves.add_to_deepspeed_config(own, ("Qwen2DecoderLayer",))
    assert own["zero_optimization"]["leaf_module"]["classes"] == ["MyBlock", "Qwen2DecoderLayer"]
    zero3_leaves.add_to_deepspeed_config(own, ())
    assert own["zero_optimization"]["leaf_module"]["classes"] == ["MyBlock", "Qwen2DecoderLayer"]


def test_a_trainer_without_deepspeed_marks_nothing(make_config):
    model = _model()
    args = make_config(per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1,
                       zero3_leaf_modules="auto")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["ab>"] * 8}), processing_class=TOKENIZER)
    assert trainer.zero3_leaf_marking == zero3_leaves.LeafMarking((), 0)
    assert get_z3_leaf_modules(model) == []


PLAN_LINE = "│   ├── ZeRO-3: 2 leaf modules (Qwen2DecoderLayer), one parameter gather each (zero3_leaf_modules)"


def test_the_batch_plan_names_the_leaf_modules_only_when_there_are_some(make_config):
    plan = make_config(per_device_train_batch_size=4, num_generations=4).batch_plan(world_size=2)
    assert "leaf modules" not in str(plan) and plan.to_dict()["leaf_module_count"] == 0
    marked = dataclasses.replace(plan, leaf_module_classes=("Qwen2DecoderLayer",), leaf_module_count=2)
    lines = str(marked).splitlines()
    assert lines[lines.index(PLAN_LINE) + 1].startswith("│   └── optimizer step every")  # under "training"
    assert marked.to_dict()["leaf_module_classes"] == ("Qwen2DecoderLayer",)


# ---- real ZeRO-3 runs (two CPU processes) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A hub-like tiny Qwen2 directory: TRL loads the policy from it (under zero.Init) and builds the reference."""
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("zero3_leaves") / "checkpoint")


VARIANTS = ["full", "lora", "lora-no-gc"]


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory, checkpoint):
    """Every variant with leaves ("auto") and without ("off"), trained in turn in one two-process launch (one
    start-up, ~10 s of imports per process, for the six runs). Each run's (result.json, trained weights) are read
    by ``_train``."""
    out_dir = tmp_path_factory.mktemp("zero3_runs")
    scenarios = [f"{setting}:{variant}" for variant in VARIANTS for setting in ("auto", "off")]
    command = accelerate_command("--main_process_port", free_port(),
                                 "--config_file", ROOT / "accelerate_configs" / "zero3.yaml", "--mixed_precision", "no",
                                 ROOT / "tests" / "scripts" / "zero3_leaves_train.py", out_dir, checkpoint, *scenarios,
                                 processes=2)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "ACCELERATE_"))}
    result = run_launch(command, processes=2, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return out_dir


def _train(runs: pathlib.Path, setting: str, variant: str) -> tuple[dict, dict]:
    run = runs / f"{setting}-{variant}"
    return json.loads((run / "result.json").read_text()), torch.load(run / "trained.pt")


# Logged figures computed before the first optimizer step touches the weights (the first rollout and its loss),
# and the rollouts themselves: the same bits with leaves or without.
FORWARD_ONLY = ("loss", "kl", "entropy")
ROLLOUT = ("reward", "reward_std", "num_tokens", "completions/mean_length", "frac_reward_zero_std")


@pytest.mark.slow
@pytest.mark.launch
@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_run_with_leaf_decoder_layers_trains_as_without(zero3_runs, checkpoint, variant):
    """``full`` has a reference model (beta > 0) that TRL prepares inside its ``__init__``; ``lora`` has none;
    ``lora-no-gc`` (no gradient checkpointing) is where no decoder layer's input needs a gradient of its own."""
    leaves, leaf_weights = _train(zero3_runs, "auto", variant)
    plain, plain_weights = _train(zero3_runs, "off", variant)

    # DeepSpeed hooked each decoder layer as one leaf: its parameters tied to it, its children not registered
    assert leaves["marking"] == {"classes": ["Qwen2DecoderLayer"], "count": 2}
    assert PLAN_LINE in leaves["plan"] and "leaf modules" not in plain["plan"]
    one_gather_per_layer = {"layers": 2, "flagged": 2, "params_tied_to_leaf": 2, "children_hooked": 0,
                            "layers_hooked": 2}
    hook_per_submodule = {"layers": 2, "flagged": 0, "params_tied_to_leaf": 0, "children_hooked": 2,
                          "layers_hooked": 2}
    assert leaves["policy"] == one_gather_per_layer and plain["policy"] == hook_per_submodule
    if variant == "full":
        assert leaves["reference"] == one_gather_per_layer and plain["reference"] == hook_per_submodule
    else:
        assert leaves["reference"] is None and plain["reference"] is None  # PEFT: the adapter-free policy is it

    assert [row["step"] for row in leaves["logged"]] == [row["step"] for row in plain["logged"]] == [1, 2]
    first, first_plain = leaves["logged"][0], plain["logged"][0]
    with_kl = variant == "full"  # logged only with a reference model (beta > 0)
    for key in FORWARD_ONLY if with_kl else ("loss", "entropy"):
        assert first[key] == first_plain[key], key
    for row, row_plain in zip(leaves["logged"], plain["logged"]):
        for key in ROLLOUT:
            assert row[key] == row_plain[key], (row["step"], key)
    # Gradients agree to float32 rounding, not bit for bit: without leaves DeepSpeed puts an identity autograd
    # function on every submodule's input, so the residual stream's gradient (3 consumers: the residual add and
    # the RMSNorm's pow and mul) is summed in another order. That reaches every gradient upstream of the last
    # layer's attention (seen on CPU: 5e-9 relative in the first grad_norm, weights within 4e-9 after 2 steps,
    # the second step's kl within 7e-6 relative); a missing or doubled gradient would be off by orders of
    # magnitude more.
    assert math.isclose(first["grad_norm"], first_plain["grad_norm"], rel_tol=1e-6)
    second, second_plain = leaves["logged"][1], plain["logged"][1]  # after one step from slightly other gradients
    for key in ("grad_norm", "loss", *(["kl"] if with_kl else [])):
        assert math.isclose(second[key], second_plain[key], rel_tol=1e-4, abs_tol=1e-9), key

    assert leaf_weights.keys() == plain_weights.keys() and leaf_weights
    for name, weight in leaf_weights.items():
        torch.testing.assert_close(weight, plain_weights[name], rtol=0, atol=1e-7, msg=name)
    if variant == "full":  # the steps moved the weights far more than the tolerance
        from safetensors.torch import load_file

        start = load_file(os.path.join(checkpoint, "model.safetensors"))
        moved = max((weight - start[name]).abs().max().item() for name, weight in leaf_weights.items())
    else:  # LoRA's B matrices start at zero
        moved = max(weight.abs().max().item() for name, weight in leaf_weights.items() if "lora_B" in name)
    assert moved > 1e-4, moved
