"""ZeRO-3 with one process makes every parameter persistent (``distributed.zero3_one_process``): DeepSpeed's persistence
threshold raised above the largest parameter, where that costs no memory and the user left it to DeepSpeed; its
hooks go, and with them TRL's reason for reentrant activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from hf_grpo import GRPOConfig
from hf_grpo.distributed import zero3_one_process
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


def _config(**zero):
    return {"zero_optimization": {"stage": 3, **zero}}


def _args(tmp_path, **fields):
    """A config as TRL 1.16 leaves it for a PEFT model under ZeRO-3: ``use_reentrant`` forced to True."""
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **fields)
    args.gradient_checkpointing_kwargs = args.gradient_checkpointing_kwargs or {}
    args.gradient_checkpointing_kwargs["use_reentrant"] = True
    return args


def _largest(model) -> int:
    return max(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(build_char_tokenizer(), seed=0)


@pytest.mark.parametrize("given", [{}, {"stage3_param_persistence_threshold": "auto"}], ids=["unset", "auto"])
def test_one_process_makes_every_parameter_persistent(model, given):
    config = _config(**given)
    assert zero3_one_process.make_persistent(config, model, num_processes=1) == _largest(model)
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == _largest(model)


def test_the_size_of_a_parameter_built_under_zero_init_is_its_ds_numel(model):
    # zero.Init leaves a partitioned parameter empty: its numel is 0, its ds_numel the real size
    empty = torch.nn.Linear(4, 4)
    empty.weight = torch.nn.Parameter(torch.empty(0))
    empty.weight.ds_numel = 10**7
    assert zero3_one_process.make_persistent(_config(), empty, num_processes=1) == 10**7


@pytest.mark.parametrize("config, processes", [
    (_config(), 2),  # each process holds a share: persisting would gather the whole model on every one
    (_config(offload_param={"device": "cpu"}), 1),  # a persistent parameter would hold a GPU copy of a host one
    (_config(stage3_param_persistence_threshold=1000), 1),  # the user's own number
    ({"zero_optimization": {"stage": 2}}, 1),
    (None, 1),  # no DeepSpeed
], ids=["two-processes", "offloaded", "user-threshold", "zero2", "no-deepspeed"])
def test_left_as_it_is_elsewhere(model, config, processes):
    before = None if config is None else {**config["zero_optimization"]}
    assert zero3_one_process.make_persistent(config, model, num_processes=processes) is None
    if config is not None:
        assert config["zero_optimization"] == before


def test_offload_to_none_is_no_offload(model):
    config = _config(offload_param={"device": "none"})
    assert zero3_one_process.make_persistent(config, model, num_processes=1) == _largest(model)


def test_one_process_removes_the_hooks_of_a_zero3_run():
    assert zero3_one_process.removes_hooks(_config(), num_processes=1, moe=False)
    assert zero3_one_process.removes_hooks(_config(offload_param={"device": "none"}), num_processes=1, moe=False)


@pytest.mark.parametrize("config, processes, moe", [
    (_config(), 2, False),  # each process holds a share: the hooks fetch the rest
    (_config(offload_param={"device": "cpu"}), 1, False),  # a gathered parameter would be a GPU copy of a host one
    (_config(zero_quantized_weights=True), 1, False),  # a gathered parameter would be a dequantized copy
    (_config(), 1, True),  # DeepSpeed reduces its expert blocks' gradients in their module hooks
    ({"zero_optimization": {"stage": 2}}, 1, False),
    (None, 1, False),
], ids=["two-processes", "offloaded", "quantized", "moe", "zero2", "no-deepspeed"])
def test_the_hooks_stay_elsewhere(config, processes, moe):
    assert not zero3_one_process.removes_hooks(config, num_processes=processes, moe=moe)


def test_no_leaf_module_is_marked_where_the_hooks_go(model, tmp_path):
    # a leaf's gradients are reduced in a module hook that a replayed graph would not run
    config = _config()
    removed, marking = zero3_one_process.configure(config, model, 1, _args(tmp_path), main=False)
    assert removed and marking.count == 0
    assert "leaf_module" not in config["zero_optimization"]
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == _largest(model)


def test_checkpointing_is_non_reentrant_again_where_the_hooks_go(model, tmp_path):
    # TRL forces reentrant checkpointing for the hooks' gathers in the recompute; a replayed backward asks
    # autograd.grad for the parameters' gradients, which reaches none inside a reentrant checkpoint
    args = _args(tmp_path)
    zero3_one_process.configure(_config(), model, 1, args, main=False)
    assert args.gradient_checkpointing_kwargs["use_reentrant"] is False


def test_reentrant_checkpointing_stays_where_the_hooks_stay_or_the_user_asked_for_it(model, tmp_path):
    two_processes = _args(tmp_path / "two")
    zero3_one_process.configure(_config(), model, 2, two_processes, main=False)
    assert two_processes.gradient_checkpointing_kwargs["use_reentrant"] is True
    for given in ({"use_reentrant": True}, '{"use_reentrant": true}'):  # the second as a command line gives it
        asked = _args(tmp_path / "asked", gradient_checkpointing_kwargs=given)
        zero3_one_process.configure(_config(), model, 1, asked, main=False)
        assert asked.gradient_checkpointing_kwargs["use_reentrant"] is True
