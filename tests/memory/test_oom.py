"""OOM back-off (hf_grpo.memory.oom): an injected out-of-memory halves the chunk on every rank, and the run equals
one that used the smaller size from the start."""

import json
import types

import pytest
import torch
import torch.multiprocessing as mp
from tests.launching import gloo_group, join_ranks, spawn_ranks
from tests.side_by_side import free_port
from tests.test_trainer import TOKENIZER, make_trainer, train_one_step
from transformers import GenerationConfig

import hf_grpo.logprob_head
from hf_grpo.generation import HFGenerateBackend
from hf_grpo.memory.oom import SizeKnob, generate_with_backoff, is_oom
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

PROMPTS = [TOKENIZER(text)["input_ids"] for text in ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]]
SAMPLING = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=5, pad_token_id=0, eos_token_id=1)


def oom(size):
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a chunk of {size} (injected)")


def test_is_oom_tells_allocation_failures_from_other_errors():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))  # only runtime errors come from the allocator


def test_knob_halves_until_the_attempt_fits_and_keeps_the_size():
    owner = types.SimpleNamespace(tensor_batch_size=16)
    seen, backoffs = [], []
    knob = SizeKnob(owner, "tensor_batch_size", lambda field, old, new: backoffs.append((field, old, new)))

    def attempt(size):
        seen.append(size)
        if size > 3:
            raise oom(size)
        return f"done at {size}"

    assert knob.run(attempt) == "done at 2"
    assert seen == [16, 8, 4, 2]
    assert owner.tensor_batch_size == 2 and knob.backoffs == 3
    assert backoffs == [("tensor_batch_size", 16, 8), ("tensor_batch_size", 8, 4), ("tensor_batch_size", 4, 2)]
    seen.clear()
    assert knob.run(attempt) == "done at 2" and seen == [2]  # the smaller size stays


def test_knob_none_halves_from_the_row_count_and_gives_up_below_one_row():
    owner = types.SimpleNamespace(tensor_batch_size=None)
    knob = SizeKnob(owner, "tensor_batch_size")
    seen = []

    def attempt(size):
        seen.append(size)
        if size is None or size > 5:
            raise oom(size)
        return size

    assert knob.run(attempt, full=lambda: 24) == 3
    assert seen == [None, 12, 6, 3]

    def never_fits(size):
        raise oom(size)

    with pytest.raises(torch.OutOfMemoryError, match=r"tensor_batch_size=1, the smallest chunk"):
        knob.run(never_fits)


def test_other_errors_pass_through_without_a_retry():
    knob = SizeKnob(types.SimpleNamespace(size=8), "size")
    with pytest.raises(ValueError, match="bad input"):
        knob.run(lambda size: (_ for _ in ()).throw(ValueError("bad input")))
    assert knob.value == 8


def oom_after_sampling(model, limit, calls):
    """model.generate that samples (using the RNG) and then fails when the chunk is larger than ``limit``."""
    real = model.generate

    def generate(*args, **kwargs):
        output = real(*args, **kwargs)
        calls.append(output.size(0))
        if output.size(0) > limit:
            raise oom(output.size(0))
        return output

    return generate


def test_generation_retry_equals_sampling_at_the_smaller_chunk_from_the_start():
    model = build_tiny_model(TOKENIZER, seed=0)
    kwargs = dict(generation_config=SAMPLING, pad_token_id=0, eos_token_ids=[1])
    torch.manual_seed(7)
    expected = HFGenerateBackend().generate(model, PROMPTS, chunk_size=2, **kwargs)

    calls = []
    model.generate = oom_after_sampling(model, 2, calls)
    owner = types.SimpleNamespace(per_device_generation_batch_size=8)
    torch.manual_seed(7)
    got = generate_with_backoff(HFGenerateBackend(), model, PROMPTS, SizeKnob(owner, "per_device_generation_batch_size"),
                                torch.device("cpu"), **kwargs)
    assert got.ids == expected
    assert owner.per_device_generation_batch_size == 2
    assert calls == [8, 4, 2, 2, 2, 2]  # each failed attempt drew from the RNG before failing: it was restored


def test_train_step_with_a_generation_oom_equals_the_smaller_chunk_from_the_start(tmp_path):
    sizes = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
    reference = make_trainer(tmp_path / "ref", fixed=False, per_device_generation_batch_size=2, **sizes)
    expected = train_one_step(reference)

    trainer = make_trainer(tmp_path / "oom", fixed=False, per_device_generation_batch_size=8, **sizes)
    calls = []
    trainer.model.generate = oom_after_sampling(trainer.model, 2, calls)
    loss, update = train_one_step(trainer)
    assert trainer.sizes.per_device_generation_batch_size == 2
    assert calls[:3] == [8, 4, 2]
    assert loss == expected[0]
    assert all(torch.equal(update[name], expected[1][name]) for name in update)
    logged = trainer.state.log_history[0]
    assert logged["perf/oom_backoffs"] == 2 and logged["perf/per_device_generation_batch_size"] == 2


def test_train_step_with_a_logprob_oom_equals_the_smaller_chunk_from_the_start(tmp_path, monkeypatch):
    reference = make_trainer(tmp_path / "ref", tensor_batch_size=8, max_steps=2)
    expected = train_one_step(reference)

    real = hf_grpo.logprob_head.chunked_logprobs
    seen = []

    def failing(hidden, *args, chunk_rows, **kwargs):
        seen.append(chunk_rows)
        if chunk_rows is None or chunk_rows > 8:
            raise oom(chunk_rows)
        return real(hidden, *args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(hf_grpo.logprob_head, "chunked_logprobs", failing)
    trainer = make_trainer(tmp_path / "oom", tensor_batch_size=32, max_steps=2)
    loss, update = train_one_step(trainer)
    assert trainer.sizes.tensor_batch_size == 8
    assert seen == [32, 16, 8, 8]  # one training forward per step; the second step starts at the kept size
    assert loss == expected[0]
    assert all(torch.equal(update[name], expected[1][name]) for name in update)
    assert trainer.state.log_history[0]["perf/tensor_batch_size"] == 8


# ---- two processes over gloo: only rank 1 runs out of memory, and neither hangs -------------------
def _two_rank_worker(rank, port, results):
    with gloo_group(rank, port, world_size=2):
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, seed=0)
        kwargs = dict(generation_config=SAMPLING, pad_token_id=0, eos_token_ids=[1])
        torch.manual_seed(11 + rank)
        expected = HFGenerateBackend().generate(model, PROMPTS, chunk_size=2, **kwargs)

        calls = []
        if rank == 1:  # only this rank is short of memory
            model.generate = oom_after_sampling(model, 2, calls)
        owner = types.SimpleNamespace(per_device_generation_batch_size=8)
        torch.manual_seed(11 + rank)
        got = generate_with_backoff(HFGenerateBackend(), model, PROMPTS,
                                    SizeKnob(owner, "per_device_generation_batch_size"), torch.device("cpu"), **kwargs)

        # Past the smallest size both ranks raise, neither waits for the other.
        def rank1_never_fits(size):
            if rank == 1:
                raise oom(size)
            return size

        try:
            SizeKnob(types.SimpleNamespace(t=4), "t").run(rank1_never_fits)
            gave_up = False
        except torch.OutOfMemoryError:
            gave_up = True
        results[rank] = dict(same=got.ids == expected, size=owner.per_device_generation_batch_size, gave_up=gave_up)


@pytest.mark.slow
@pytest.mark.launch
def test_two_ranks_agree_when_only_one_runs_out_of_memory():
    results = mp.Manager().dict()
    hung = join_ranks(spawn_ranks(_two_rank_worker, (free_port(), results), processes=2), timeout=90)
    assert not hung, "a rank hung waiting for the other"
    assert dict(results) == {0: dict(same=True, size=2, gave_up=True), 1: dict(same=True, size=2, gave_up=True)}


@pytest.mark.slow
@pytest.mark.launch
def test_ddp_run_where_only_rank_1_runs_out_of_memory_equals_the_smaller_sizes_from_the_start(tmp_path):
    """Two processes under DDP (accelerate launch, gloo): rank 1 alone fails in generation and in the head; both
    ranks back off together, and the trained weights equal a run that used the smaller sizes from the start."""
    from tests.distributed.test_launch import launch

    script = "tests/scripts/oom_two_ranks_train.py"
    # one launch: the smaller sizes from the start, then the injected run (its patches stay in the process)
    launch("multi_gpu", script, tmp_path / "small", 2, 8, 0, tmp_path / "oom", 8, 32, 1)
    for rank in (0, 1):
        got = json.loads((tmp_path / "oom" / f"rank{rank}.json").read_text())
        assert got == {"per_device_generation_batch_size": 2, "tensor_batch_size": 8, "oom_backoffs": 4, "steps": 2}
        assert json.loads((tmp_path / "small" / f"rank{rank}.json").read_text())["oom_backoffs"] == 0
    oom_params, small_params = torch.load(tmp_path / "oom" / "params.pt"), torch.load(tmp_path / "small" / "params.pt")
    assert all(torch.equal(oom_params[name], small_params[name]) for name in small_params)
    initial = dict(build_tiny_model(build_char_tokenizer(), seed=0).named_parameters())
    assert any(not torch.equal(initial[name], small_params[name]) for name in small_params), "no step was taken"
