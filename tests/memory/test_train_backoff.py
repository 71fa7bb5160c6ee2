"""An out-of-memory in a training micro-batch's forward or backward (hf_grpo.memory.train_backoff): the micro-batch runs
again in token-budget passes of half its size, and the run equals one that had that budget from the start.

The error is injected from a gradient hook of the first layer, which fires late in the backward: by then
the later layers' gradients are already added, so a retry that kept them would double-count.
"""

import copy
import dataclasses

import pytest
import torch
from accelerate.utils import DistributedType
from tests.project_files import load_bench
from tests.scripts.token_budget_train import float64_rope
from tests.test_trainer import TOKENIZER, make_trainer

from hf_grpo.memory import token_budget, train_backoff
from hf_grpo.recipe_support.tiny import build_tiny_model

SIZES = dict(max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
             loss_type="bnpo", learning_rate=0.1)


def float64_trainer(path, **overrides):
    model = float64_rope(build_tiny_model(TOKENIZER, seed=0, dtype=torch.float64))
    return make_trainer(path, model=model, **{**SIZES, **overrides})


def fail_in_backward(trainer, on_calls):
    """Raise an out-of-memory from inside the backward on the given (1-based) backward passes."""
    calls = []

    def hook(grad):
        calls.append(len(calls) + 1)
        if calls[-1] in on_calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return grad

    trainer.model.model.layers[0].self_attn.q_proj.weight.register_hook(hook)
    return calls


def metric_counts(trainer):
    """Per logging call: how many values each of TRL's training metrics averaged."""
    counts, real = [], trainer.log

    def log(logs, *args, **kwargs):
        if "loss" in logs:
            counts.append({name: len(values) for name, values in trainer._metrics["train"].items()})
        return real(logs, *args, **kwargs)

    trainer.log = log
    return counts


def run(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer.state.log_history, {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}


def test_a_backward_oom_in_the_second_micro_batch_equals_the_halved_budget_from_the_start(tmp_path, monkeypatch):
    passes, real = [], token_budget.build_passes

    def counting(*args, **kwargs):
        built = real(*args, **kwargs)
        passes.append(len(built))
        return built

    monkeypatch.setattr(token_budget, "build_passes", counting)
    trainer = float64_trainer(tmp_path / "oom")
    assert trainer._train_backoff is not None, trainer._train_backoff_unavailable
    calls = fail_in_backward(trainer, on_calls={2})  # step 1, micro-batch 2: micro-batch 1's gradient is in
    counts = metric_counts(trainer)
    logs, update = run(trainer)
    budget = trainer.sizes.max_tokens_per_micro_batch
    assert isinstance(budget, int) and budget > 0, "the halved budget is kept for the rest of the run"
    assert trainer._train_backoff.replays == 1  # micro-batch 1 ran again, after the gradients were dropped
    assert logs[0]["perf/oom_backoffs"] == 1 and logs[0]["perf/max_tokens_per_micro_batch"] == budget
    # micro-batch 1 again, 2, then step 2's two: each split into passes by the halved budget
    assert len(passes) == 4 and all(count > 1 for count in passes), passes
    assert len(calls) == 2 + sum(passes)

    reference = float64_trainer(tmp_path / "ref", max_tokens_per_micro_batch=budget)
    reference_counts = metric_counts(reference)
    reference_logs, expected = run(reference)
    flat = torch.cat([u.flatten() for u in update.values()])
    flat_expected = torch.cat([u.flatten() for u in expected.values()])
    assert flat_expected.norm() > 0
    assert ((flat - flat_expected).norm() / flat_expected.norm()).item() < 1e-10
    for got, want in zip(logs[:2], reference_logs[:2], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-10)
    # Logged once per pass that counted: micro-batch 1 as first run (one pass), not its replay nor the failed
    # attempt. Step 2 is logged as the reference logs it.
    assert counts[0]["entropy"] == 1 + passes[1]
    assert counts[1] == reference_counts[1]
    assert logs[1]["entropy"] == pytest.approx(reference_logs[1]["entropy"], rel=1e-10)


def test_an_oom_that_halving_cannot_cure_ends_the_run_naming_the_budget_and_the_longest_row(tmp_path):
    trainer = float64_trainer(tmp_path)
    fail_in_backward(trainer, on_calls=set(range(1, 10_000)))
    with pytest.raises(torch.OutOfMemoryError, match=r"max_tokens_per_micro_batch=\d+, and half of it is below "
                                                     r"\d+, the smallest that works"):
        trainer.train()
    floor = trainer._longest_row(None)
    assert floor == trainer._longest_prompt() + trainer.max_completion_length
    assert floor <= trainer.sizes.max_tokens_per_micro_batch < 2 * floor  # halved down to the floor, not past it


def test_other_errors_are_not_retried(tmp_path):
    trainer = float64_trainer(tmp_path)

    def hook(grad):
        raise RuntimeError("shape mismatch")

    trainer.model.model.layers[0].self_attn.q_proj.weight.register_hook(hook)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        trainer.train()
    assert trainer.sizes.max_tokens_per_micro_batch is None and trainer._train_backoff.replays == 0


def test_where_a_retry_is_not_safe_the_reason_is_given(tmp_path):
    trainer = make_trainer(tmp_path)
    assert train_backoff.reason_unavailable(trainer.args, trainer.facts) is None

    def launched(processes, kind):
        return dataclasses.replace(trainer.facts, num_processes=processes, distributed_type=kind.value)

    assert "2 processes" in train_backoff.reason_unavailable(trainer.args, launched(2, DistributedType.MULTI_CPU))
    assert "DEEPSPEED manages the gradients" in train_backoff.reason_unavailable(
        trainer.args, launched(1, DistributedType.DEEPSPEED))
    config = copy.copy(trainer.args)
    config.top_entropy_quantile = 0.5  # the passes could not keep the quantile exact
    reason = train_backoff.reason_unavailable(config, trainer.facts)
    assert reason.startswith("its token-budget passes would not be exact: max_tokens_per_micro_batch cannot be "
                             "combined with top_entropy_quantile=0.5"), reason
    assert "set " not in reason  # the user set no budget: no advice about one


def test_a_resume_keeps_the_halved_budget(tmp_path):
    trainer = float64_trainer(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    fail_in_backward(trainer, on_calls={2})
    trainer.train()
    budget = trainer.sizes.max_tokens_per_micro_batch
    assert budget is not None
    resumed = float64_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    assert resumed.sizes.max_tokens_per_micro_batch is None
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 and resumed.sizes.max_tokens_per_micro_batch == budget


def test_the_gpu_benchmark_scenario_survives_its_injected_oom_on_cpu(tmp_path):
    """bench/autotune.py --scenario oom_train, the CPU smoke run: what the GPU run will measure is recorded."""
    import json

    bench = load_bench("autotune")
    out = tmp_path / "autotune.jsonl"
    assert bench.main(["--tiny", "--scenario", "oom_train", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["steps_done"] == 2 and record["oom_backoffs"] == 1
    assert isinstance(record["sizes"]["max_tokens_per_micro_batch"], int)
