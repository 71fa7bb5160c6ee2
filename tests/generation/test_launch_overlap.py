"""The decode step's programmatic dependent launch (``launch_overlap``): where it is on, and that every kernel
inductor generates under it waits before it touches memory."""

from __future__ import annotations

import re

import pytest
import torch

from hf_grpo.generation import launch_overlap


def test_off_on_the_cpu_with_the_reason():
    assert "NVIDIA" in launch_overlap.unavailable_reason(torch.device("cpu"))
    assert launch_overlap.compile_options("inductor", torch.device("cpu")) is None


def test_the_environment_turns_it_off_before_anything_is_asked_of_the_gpu(monkeypatch):
    monkeypatch.setenv("HF_GRPO_DECODE_PDL", "0")
    assert launch_overlap.unavailable_reason(torch.device("cuda")) == "HF_GRPO_DECODE_PDL=0"
    assert launch_overlap.compile_options("inductor", torch.device("cuda")) is None


def test_options_turn_pdl_on_and_put_the_waiting_rule_in_the_cache_key(monkeypatch):
    monkeypatch.setattr(launch_overlap, "unavailable_reason", lambda device: None)
    options = launch_overlap.compile_options("inductor", torch.device("cuda"))
    assert options["triton.enable_pdl"] is True
    salt = options["post_grad_custom_pre_pass"]
    from torch._inductor.custom_graph_pass import CustomGraphPass

    assert isinstance(salt, CustomGraphPass) and salt.uuid() == launch_overlap.RULE
    # a counting backend of the tests compiles no kernels: no options for it
    assert launch_overlap.compile_options(lambda gm, inputs: gm, torch.device("cuda")) is None


class _Scheduler:
    previous_node = "the node before"


class _Graph:
    scheduler = _Scheduler()


def test_inside_every_kernel_is_generated_as_if_first_and_the_scheduler_is_left_as_it_was(monkeypatch):
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.virtualized import V

    seen = []
    monkeypatch.setattr(TritonKernel, "_handle_pdl_before_access",
                        lambda self, *args, **kwargs: seen.append(V.graph.scheduler.previous_node))
    recorder = TritonKernel._handle_pdl_before_access
    graph = _Graph()
    with V.set_graph_handler(graph):
        with launch_overlap.codegen_waits_first():
            TritonKernel._handle_pdl_before_access(None, "buffer")
            assert graph.scheduler.previous_node == "the node before"
        TritonKernel._handle_pdl_before_access(None, "buffer")
    assert seen == [None, "the node before"]  # inductor waits where it sees no previous node
    assert TritonKernel._handle_pdl_before_access is recorder


def test_the_original_is_back_after_an_error():
    from torch._inductor.codegen.triton import TritonKernel

    original = TritonKernel._handle_pdl_before_access
    with pytest.raises(RuntimeError, match="compile failed"):
        with launch_overlap.codegen_waits_first():
            raise RuntimeError("compile failed")
    assert TritonKernel._handle_pdl_before_access is original


def _pdl_kernels(sources: list[str]) -> list[str]:
    """The Triton kernels launched with PDL in inductor's generated ``sources``, each its decorator and body."""
    kernels = []
    for source in sources:
        for piece in re.split(r"(?=@triton_heuristics\.)", source)[1:]:
            if "'launch_pdl': True" in piece:
                kernels.append(piece)
    return kernels


def _first(piece: str, *needles: str) -> int:
    found = [piece.find(needle) for needle in needles if piece.find(needle) >= 0]
    return min(found) if found else -1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_hopper_gpu_every_pdl_kernel_waits_before_its_first_load_or_store():
    device = torch.device("cuda")
    if launch_overlap.unavailable_reason(device) is not None:
        pytest.skip(launch_overlap.unavailable_reason(device))
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    def step(x, residual, weight, gain):
        # what a decode layer's glue does around a GEMM: add, RMSNorm, an activation, a fresh buffer
        h = residual + x @ weight
        normed = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype) * gain
        return torch.nn.functional.silu(normed), torch.zeros_like(h), h.sum(0)

    args = [torch.randn(32, 256, device=device, dtype=torch.bfloat16),
            torch.randn(32, 256, device=device, dtype=torch.bfloat16),
            torch.randn(256, 256, device=device, dtype=torch.bfloat16) * 0.05,
            torch.randn(256, device=device, dtype=torch.bfloat16)]
    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False, options=launch_overlap.compile_options("inductor", device))
    with config.patch(fx_graph_cache=False), launch_overlap.codegen_waits_first():
        got, sources = run_and_get_code(compiled, *args)
    kernels = _pdl_kernels(sources)
    assert kernels, "no kernel was generated with PDL"
    for kernel in kernels:
        body = kernel[kernel.find("def triton_"):]
        wait, access = body.find("gdc_wait"), _first(body, "tl.load(", "tl.store(")
        assert wait >= 0 and (access < 0 or wait < access), f"a kernel touches memory before it waits:\n{body}"
    for value, expected in zip(got, step(*args)):
        torch.testing.assert_close(value, expected, rtol=2e-2, atol=2e-2)
