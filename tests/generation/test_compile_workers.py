"""inductor's compile workers start while the trainer is built, only for runs that will compile a decode step."""

import pytest
import torch
from datasets import Dataset
from torch._inductor import async_compile

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.generation import compile_workers
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture
def started(monkeypatch):
    """Calls of inductor's pool warm-up, recorded instead of starting processes."""
    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append("warm"))
    return calls


@pytest.mark.parametrize("backend", ["auto", "cuda_graph"])
def test_a_run_that_will_compile_on_a_gpu_starts_the_workers_once(monkeypatch, started, backend):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compile_workers.start_early(backend, use_vllm=False, use_cpu=False)
    assert started == ["warm"]


@pytest.mark.parametrize(
    "backend, use_vllm, use_cpu, cuda",
    [("hf", False, False, True), ("auto", True, False, True), ("vllm", True, False, True),
     ("auto", False, True, True), ("auto", False, False, False), ("cuda_graph", False, False, False)],
)
def test_a_run_that_will_not_compile_starts_no_process(monkeypatch, started, backend, use_vllm, use_cpu, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert not compile_workers.start_early(backend, use_vllm=use_vllm, use_cpu=use_cpu)
    assert started == []


def test_the_trainer_asks_for_them_with_its_own_settings_before_trl_sets_up(monkeypatch, tmp_path):
    asked = []

    def record(*settings):
        asked.append(settings)
        return False

    monkeypatch.setattr(compile_workers, "start_early", record)
    tokenizer = build_char_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=4, generation_backend="cuda_graph")
    GRPOTrainer(model=build_tiny_model(tokenizer, seed=0), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                args=args, train_dataset=Dataset.from_dict({"prompt": ["ab>"] * 8}), processing_class=tokenizer)
    assert asked == [("cuda_graph", False, True)]
