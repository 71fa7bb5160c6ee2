"""Under FSDP the CUDA-graph decoder is not chosen: its fused projections read whole weights, which FSDP version 1
keeps flattened and sharded and version 2 as DTensors (on two H200s the first rollout failed either way: "got mixed
torch.Tensor and DTensor", "b must be 2D"). "auto" generates with the "hf" backend and says why."""

import pytest
import torch
from tests.launching import gloo_group
from tests.side_by_side import free_port

from hf_grpo.generation import HFGenerateBackend, resolve_backend
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone, as FSDP needs one."""
    with gloo_group(0, free_port(), world_size=1):
        yield


def test_fsdp_sharded_models_generate_with_the_hf_backend_and_say_why(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    tokenizer = build_char_tokenizer()
    plain = build_tiny_model(tokenizer, seed=0)
    backend, reason = resolve_backend("auto", plain)
    assert reason == "the model is on cpu, and the cuda_graph backend needs a CUDA device"  # (the CPU's own reason)

    version_2 = build_tiny_model(tokenizer, seed=0)
    mesh = init_device_mesh("cpu", (1,))
    for layer in version_2.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(version_2, mesh=mesh)
    backend, reason = resolve_backend("cuda_graph", version_2)
    assert isinstance(backend, HFGenerateBackend)
    assert reason.startswith("FSDP (version 2) shards the parameters as DTensors"), reason

    version_1 = FullyShardedDataParallel(build_tiny_model(tokenizer, seed=0), device_id=torch.device("cpu"),
                                         use_orig_params=True)
    backend, reason = resolve_backend("auto", version_1)
    assert isinstance(backend, HFGenerateBackend)
    assert reason.startswith("FSDP (version 1) flattens and shards the parameters"), reason
