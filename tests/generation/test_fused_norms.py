"""The uncompiled decode step's RMSNorms as one kernel each (hf_grpo.generation.fused_norms): the same values as
transformers' norm, only while the step is captured, and nothing changed where no kernel serves (CPU)."""

from __future__ import annotations

import pytest
import torch

from hf_grpo.generation import fused_norms
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()


def norm_outputs(model, x):
    return [module(x) for module in model.modules() if type(module).__name__ == "Qwen2RMSNorm"]


def test_on_cpu_nothing_is_routed():
    model = build_tiny_model(TOKENIZER)
    with fused_norms.routed(model, torch.device("cpu")) as routed:
        assert routed == 0
        assert not any("forward" in vars(module) for module in model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_every_norm_runs_the_kernel_with_transformers_values_and_is_put_back():
    model = build_tiny_model(TOKENIZER, dtype=torch.bfloat16).cuda()
    x = torch.randn(32, 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    expected = norm_outputs(model, x)
    with fused_norms.routed(model, torch.device("cuda")) as routed:
        assert routed == 2 * model.config.num_hidden_layers + 1  # two a layer and the final norm
        fused = norm_outputs(model, x)
    for ours, theirs in zip(fused, expected):
        torch.testing.assert_close(ours, theirs, rtol=2 ** -7, atol=2 ** -7 * float(theirs.abs().max()))
    assert not any("forward" in vars(module) for module in model.modules())
