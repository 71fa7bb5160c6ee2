"""ZeRO-3 with one process: the decoder reads the parameters' partitions in place, with no dense mirror.

One process holds every partition whole (``ds_tensor`` is the parameter, flattened), so a second copy of the model
for the CUDA-graph decoder would only add memory (1.5B: 2.9 GiB, which put the run's peak above TRL's). What a user
relies on: the choice (in place where every partition is whole on the device, a dense mirror otherwise); logits equal
to the policy's, LoRA merged as PEFT merges it; the partitions back bit for bit after each rollout; the optimizer's
in-place steps read without a copy; a partition DeepSpeed moved is an error, never a stale read. Partitions are laid
out here as DeepSpeed lays them out for one process; the real run is the one-process launch in
``tests/generation/test_dense_mirror.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_grpo.generation import dense_mirror
from hf_grpo.generation.dense_mirror import DenseMirror
from hf_grpo.generation.lora_merge import InPlaceLoraMerge, partitions_whole
from hf_grpo.plan import BatchPlan
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

CPU = torch.device("cpu")


def _policy(lora: bool) -> torch.nn.Module:
    model = build_tiny_model(build_char_tokenizer(), dtype=torch.float64, seed=0).eval()
    if not lora:
        return model
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(1)
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # B starts at zero: a non-zero delta makes the merge matter
            torch.nn.init.normal_(param, std=0.1)
    return policy.eval()


def _partitioned(model: torch.nn.Module, processes: int = 1) -> torch.nn.Module:
    """The base parameters partitioned as ZeRO-3 leaves them between uses: ``ds_tensor`` holds this rank's share of
    the flattened value (all of it for one process) in one flat buffer, and the parameter itself is empty. (The
    adapters' weights stay whole here: gathering them needs DeepSpeed, which the launch test runs.)"""
    params = [p for n, p in model.named_parameters() if "lora_" not in n]
    shares = [-(-p.numel() // processes) for p in params]
    flat = torch.zeros(sum(shares), dtype=params[0].dtype)
    offset = 0
    for index, (param, share) in enumerate(zip(params, shares)):
        part = flat.narrow(0, offset, share)
        part[: min(share, param.numel())] = param.detach().flatten()[:share]
        param.ds_id, param.ds_shape, param.ds_numel, param.ds_tensor = index, param.shape, param.numel(), part
        param.data = torch.empty(0, dtype=param.dtype)
        offset += share
    return model


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(2, 30, (3, 9), generator=torch.Generator().manual_seed(0))
    return model(ids).logits


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_process_decodes_from_its_partitions_in_place(lora):
    policy = _policy(lora)
    expected = _logits(copy.deepcopy(policy).merge_and_unload() if lora else policy)
    policy = _partitioned(policy)
    partitions = {n: p.ds_tensor.clone() for n, p in policy.named_parameters() if hasattr(p, "ds_tensor")}

    choice = dense_mirror.choose("on", policy, "hf", CPU, lambda v: v)
    assert isinstance(choice.mirror, InPlaceLoraMerge) and choice.nbytes == 0
    assert "reads them in place" in str(choice) and ("host copy" in str(choice)) == lora
    plan = BatchPlan(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=1,
                     num_generations=4, num_iterations=1, per_device_generation_batch_size=4, tensor_batch_size=None,
                     **choice.plan_fields())
    assert "decoded from the partitions in place" in str(plan)

    module = choice.mirror.refresh(policy)
    storage = {p.ds_tensor.untyped_storage().data_ptr() for p in policy.parameters() if hasattr(p, "ds_tensor")}
    assert {p.untyped_storage().data_ptr() for p in module.parameters()} == storage  # views, no copy
    assert not any(hasattr(p, "ds_id") for p in module.parameters())
    assert torch.equal(_logits(module), expected)
    choice.mirror.restore()
    for name, param in policy.named_parameters():
        if name in partitions:
            assert torch.equal(param.ds_tensor, partitions[name]), name  # the frozen base, bit for bit


def test_optimizer_steps_in_the_partitions_show_through_and_a_moved_partition_is_refused():
    policy = _partitioned(_policy(lora=False))
    mirror = dense_mirror.choose("on", policy, "hf", CPU, lambda v: v).mirror
    module = mirror.refresh(policy)
    before = _logits(module)
    head = policy.lm_head.weight
    head.ds_tensor.add_(0.5)  # what DeepSpeed's step does: the new values written into the partition
    assert not torch.equal(_logits(mirror.refresh(policy)), before)
    assert torch.equal(module.lm_head.weight.flatten(), head.ds_tensor)

    head.ds_tensor = head.ds_tensor.clone()  # a partition given new memory: the view would read the old one
    with pytest.raises(RuntimeError, match=r"DeepSpeed moved a ZeRO-3 partition of shape .* build it again"):
        mirror.refresh(policy)


def test_partitions_split_over_processes_or_offloaded_get_a_dense_mirror():
    split = _partitioned(_policy(lora=False), processes=2)
    assert not partitions_whole(split, CPU)
    choice = dense_mirror.choose("on", split, "hf", CPU, lambda v: v)
    assert isinstance(choice.mirror, DenseMirror) and choice.nbytes > 0 and "copy of the model" in str(choice)
    whole = _partitioned(_policy(lora=False))
    assert partitions_whole(whole, CPU) and partitions_whole(whole, torch.device("cpu:0"))  # accelerate's name for it
    assert not partitions_whole(whole, torch.device("meta"))  # the partitions offloaded elsewhere
    # every rank must agree: one rank whose partitions are not whole sends all of them to the dense mirror
    assert isinstance(dense_mirror.choose("on", whole, "hf", CPU, lambda v: 0).mirror, DenseMirror)
