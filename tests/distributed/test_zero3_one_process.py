"""ZeRO-3 with one process makes every parameter persistent (``distributed.zero3_one_process``): DeepSpeed's persistence
threshold raised above the largest parameter, where that costs no memory and the user left it to DeepSpeed."""

from __future__ import annotations

import pytest
import torch

from hf_grpo.distributed import zero3_one_process
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


def _config(**zero):
    return {"zero_optimization": {"stage": 3, **zero}}


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
