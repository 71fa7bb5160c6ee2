"""inductor's compile workers start while the trainer is built, only for runs that will compile a decode step."""

import types

import pytest
import torch
from datasets import Dataset
from torch._inductor import async_compile

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.generation import compile_workers
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()


def settings(generation_backend="auto", use_vllm=False, use_cpu=False, compile_generation="auto", max_steps=-1):
    """A config's fields that decide (max_steps -1: a run counted in epochs, taken to be long)."""
    return types.SimpleNamespace(generation_backend=generation_backend, use_vllm=use_vllm, use_cpu=use_cpu,
                                 compile_generation=compile_generation, max_steps=max_steps, max_completion_length=256,
                                 gradient_accumulation_steps=4, steps_per_generation=4, num_iterations=1)


def model_of_type(model_type):
    return types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type))


@pytest.fixture
def started(monkeypatch):
    """Calls of inductor's pool warm-up, recorded instead of starting processes."""
    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append("warm"))
    return calls


@pytest.mark.parametrize("backend", ["auto", "cuda_graph"])
@pytest.mark.parametrize("model", [None, "path/to/a/checkpoint", model_of_type("qwen2")])
def test_a_run_that_will_compile_on_a_gpu_starts_the_workers_once(monkeypatch, started, backend, model):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compile_workers.start_early(settings(backend), model)
    assert started == ["warm"]


# 256-token completions, a rollout every optimizer step: "auto" compiles from 4096 / 256 = 16 rollouts
@pytest.mark.parametrize("compile_generation, max_steps, starts",
                         [("auto", 16, True), ("auto", 15, False), ("on", 1, True), ("off", -1, False)])
def test_the_workers_start_only_where_the_decode_step_will_be_compiled(monkeypatch, started, compile_generation,
                                                                       max_steps, starts):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = settings(compile_generation=compile_generation, max_steps=max_steps)
    assert compile_workers.start_early(config) is starts
    assert started == (["warm"] if starts else [])


@pytest.mark.parametrize(
    "config, cuda, model",
    [(settings("hf"), True, None), (settings(use_vllm=True), True, None), (settings("vllm", use_vllm=True), True, None),
     (settings(use_cpu=True), True, None), (settings(), False, None), (settings("cuda_graph"), False, None),
     (settings(), True, model_of_type("gpt2"))],  # a family the cuda_graph backend does not serve
)
def test_a_run_that_will_not_compile_starts_no_process(monkeypatch, started, config, cuda, model):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert not compile_workers.start_early(config, model)
    assert started == []


def test_the_trainer_asks_with_its_config_and_model_before_trl_sets_up(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(compile_workers, "start_early", lambda config, model: asked.append((config, model)))
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=4, generation_backend="cuda_graph")
    model = build_tiny_model(TOKENIZER, seed=0)
    GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                train_dataset=Dataset.from_dict({"prompt": ["ab>"] * 8}), processing_class=TOKENIZER)
    assert asked == [(args, model)]
