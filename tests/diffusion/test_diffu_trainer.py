"""DiffuGRPOTrainer on a tiny bidirectional model: seeds per rollout pass, old/ref for all of them, every
(num_iterations, beta) combination, reference as frozen copy and as PEFT base, chunking-exact updates."""

import math

import pytest
import torch
from datasets import Dataset

from hf_grpo import GRPOConfig
from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer
from hf_grpo.diffusion.logprobs import masked_logprobs
from hf_grpo.recipe_support.diffusion_tiny import (
    build_diffusion_tokenizer,
    build_tiny_diffusion_model,
    save_tiny_diffusion_checkpoint,
)
from hf_grpo.generation import HFGenerateBackend

TOKENIZER = build_diffusion_tokenizer()
PROMPTS = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]
LETTERS = TOKENIZER.convert_tokens_to_ids(list("abcab"))


def count_a_reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


class FixedBackend(HFGenerateBackend):
    """Deterministic completions of different lengths that differ within a group."""

    def generate(self, model, prompt_ids, **kwargs):
        return [[LETTERS[(len(p) + row) % 5]] * (1 + row % 4) + [TOKENIZER.eos_token_id]
                for row, p in enumerate(prompt_ids)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_diffusion_checkpoint(tmp_path_factory.mktemp("tiny_diffusion"))


def trainer_values(tmp_path, **overrides) -> dict:
    """make_trainer's DiffuGRPOConfig fields, for a test that builds the config itself."""
    values = dict(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=1, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, block_length=4, diffusion_steps=4, learning_rate=0.1,
        optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no", seed=3, disable_tqdm=True,
        activation_checkpointing=False, p_mask_prompt=0.3, beta=0.0,
    )
    values.update(overrides)
    return values


def make_trainer(tmp_path, model=None, fixed=True, peft_config=None, **overrides):
    trainer = DiffuGRPOTrainer(
        model=model if model is not None else build_tiny_diffusion_model(TOKENIZER, seed=0),
        reward_funcs=count_a_reward, args=DiffuGRPOConfig(**trainer_values(tmp_path, **overrides)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=TOKENIZER,
        peft_config=peft_config,
    )
    if fixed:
        trainer.decisions.backend = FixedBackend()
    return trainer


def record_rollouts(trainer):
    """Keep every rollout TRL buffers (the dicts our override returns)."""
    rollouts = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        output = original(inputs)
        rollouts.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in output.items()})
        return output

    trainer._generate_and_score_completions = spy
    return rollouts


def train(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    update = torch.cat([(p.detach() - before[n]).flatten() for n, p in trainer.model.named_parameters()])
    return losses, update


def test_every_iteration_seed_is_used_under_gradient_accumulation(tmp_path):
    # S = 2 micro-batches per rollout, mu = 3 passes, A = 2: one rollout serves 6 micro-batches, 3 optimizer steps
    trainer = make_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           num_iterations=3, max_steps=6, beta=0.04)
    rollouts = record_rollouts(trainer)
    losses, _ = train(trainer)
    assert [k for _, k, _ in trainer.mask_seed_trace] == [0, 0, 1, 1, 2, 2] * 2  # passes, not micro-batches
    assert len(rollouts) == 2 and all(torch.isfinite(torch.tensor(losses)))
    for rollout in rollouts:
        rows, width = rollout["completion_ids"].shape
        assert rollout["mask_seeds"].shape == (rows, 3) and rollout["mask_seeds"].device.type == "cpu"
        assert rollout["diffu_old_logps"].shape == rollout["diffu_ref_logps"].shape == (rows, 3, width)
        assert len(set(rollout["mask_seeds"].flatten().tolist())) == rows * 3  # a seed per row and iteration
    assert not set(rollouts[0]["mask_seeds"].flatten().tolist()) & set(rollouts[1]["mask_seeds"].flatten().tolist())
    # the loss of pass k used the seeds of column k of its rows
    used = [seed for _, _, seed in trainer.mask_seed_trace]
    assert len(set(used)) == 12


@pytest.mark.parametrize("iterations, beta", [(1, 0.0), (1, 0.04), (2, 0.0), (2, 0.04)])
def test_every_combination_of_iterations_and_beta_trains(tmp_path, checkpoint, iterations, beta):
    # loaded from a path, so TRL can build the frozen reference copy from it (d1 failed with mu = 1, beta > 0)
    trainer = make_trainer(tmp_path, model=checkpoint, num_iterations=iterations, beta=beta, max_steps=2)
    rollouts = record_rollouts(trainer)
    losses, update = train(trainer)
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses))) and update.norm() > 0
    rollout = rollouts[0]
    assert ("diffu_old_logps" in rollout) == (iterations > 1)  # mu = 1, S = A: the loss's own forward, detached
    assert ("diffu_ref_logps" in rollout) == (beta > 0)
    if beta:
        assert "kl" in trainer.state.log_history[0] and (trainer.ref_model is not None)


@pytest.mark.parametrize("source", ["path", "in_code"])
def test_reference_is_a_frozen_copy_of_the_initial_policy(tmp_path, checkpoint, source):
    # from a path TRL loads the copy; an in-code policy has no path, so the trainer deep-copies it
    model = checkpoint if source == "path" else build_tiny_diffusion_model(TOKENIZER, seed=0)
    trainer = make_trainer(tmp_path, model=model, beta=0.04, max_steps=2, learning_rate=1.0)
    assert trainer.ref_model is not None
    rollouts = record_rollouts(trainer)
    train(trainer)
    initial = build_tiny_diffusion_model(TOKENIZER, seed=0).eval()  # what the checkpoint holds
    rollout = rollouts[1]  # the second rollout: the policy has moved, the reference has not
    seeds = rollout["mask_seeds"][:, 0]
    expected = masked_logprobs(initial, rollout["prompt_ids"], rollout["prompt_mask"], rollout["completion_ids"],
                               rollout["completion_mask"], seeds, trainer.estimator)
    torch.testing.assert_close(rollout["diffu_ref_logps"][:, 0], expected, rtol=0, atol=1e-5)
    policy = masked_logprobs(trainer.model.eval(), rollout["prompt_ids"], rollout["prompt_mask"],
                             rollout["completion_ids"], rollout["completion_mask"], seeds, trainer.estimator)
    assert (policy - expected).abs().max() > 1e-3


def test_reference_is_the_peft_base_model(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = make_trainer(tmp_path, beta=0.04, peft_config=lora, num_iterations=2, max_steps=2)
    assert trainer.ref_model is None
    rollouts = record_rollouts(trainer)
    losses, _ = train(trainer)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    base = build_tiny_diffusion_model(TOKENIZER, seed=0).eval()  # the weights under the adapters
    rollout = rollouts[0]
    for k in range(2):
        expected = masked_logprobs(base, rollout["prompt_ids"], rollout["prompt_mask"], rollout["completion_ids"],
                                   rollout["completion_mask"], rollout["mask_seeds"][:, k], trainer.estimator)
        torch.testing.assert_close(rollout["diffu_ref_logps"][:, k], expected, rtol=0, atol=1e-5)
    # the adapters (random B) make the policy differ from its reference
    assert (rollout["diffu_old_logps"] - rollout["diffu_ref_logps"]).abs().max() > 1e-4


@pytest.mark.parametrize("micro_batch, accumulation, tokens", [(4, 2, 5), (8, 1, 1), (2, 4, 3)])
def test_update_is_identical_for_any_logprob_chunking(tmp_path, micro_batch, accumulation, tokens):
    """Two optimizer steps on one rollout (mu = 2, beta > 0): the same update for any per_device_train_batch_size
    (rows per forward, at rollout time and in the loss) and tensor_batch_size (token rows per log-softmax)."""
    common = dict(num_iterations=2, beta=0.04, max_steps=2)
    reference = train(make_trainer(tmp_path / "a", per_device_train_batch_size=8, tensor_batch_size=None, **common))
    chunked = train(make_trainer(tmp_path / "b", per_device_train_batch_size=micro_batch,
                                 gradient_accumulation_steps=accumulation, tensor_batch_size=tokens, **common))
    assert reference[1].norm() > 0
    assert ((chunked[1] - reference[1]).norm() / reference[1].norm()).item() < 1e-5


def test_gradient_accumulation_equals_one_big_micro_batch(tmp_path):
    accumulated = train(make_trainer(tmp_path / "a", per_device_train_batch_size=4, gradient_accumulation_steps=2))
    big = train(make_trainer(tmp_path / "b", per_device_train_batch_size=8, gradient_accumulation_steps=1))
    assert big[1].norm() > 0
    assert ((accumulated[1] - big[1]).norm() / big[1].norm()).item() < 1e-5


def test_real_sampler_step_stats_and_memory_figures(tmp_path):
    trainer = make_trainer(tmp_path, fixed=False, per_device_generation_batch_size=3, log_memory_usage=True,
                           logprob_estimator="coupled", cfg_scale=0.5, remasking="random")
    trainer.train()
    stats = trainer.get_performance_stats()
    assert stats["memory_manager_stats"]["peak_memory_gib"] > 0
    assert stats["diffusion"]["sampler_forwards"] == 4 * 3  # 4 steps per chunk, 3 chunks of <= 3 prompts
    assert stats["batch_plan"]["generation_chunks"] == 3 and stats["generation_s_per_step"] > 0
    assert trainer.state.log_history[0]["mem/peak_memory_gib"] > 0


def test_model_given_by_path_and_wrong_config_type(tmp_path, checkpoint):
    trainer = make_trainer(tmp_path, model=checkpoint)
    assert trainer.mask_token_id == TOKENIZER.mask_token_id and trainer.logits_shift is False
    with pytest.raises(TypeError, match=r"needs args=hf_grpo.DiffuGRPOConfig"):
        DiffuGRPOTrainer(model=checkpoint, reward_funcs=count_a_reward,
                         args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False,
                                         per_device_train_batch_size=8, num_generations=4),
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=TOKENIZER)


def test_missing_mask_token_is_a_clear_error_at_init(tmp_path):
    from hf_grpo.recipe_support.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = build_tiny_diffusion_model(tokenizer, seed=0)
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match=r"mask_token_id is None"):
        DiffuGRPOTrainer(model=model, reward_funcs=count_a_reward,
                         args=DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                              per_device_train_batch_size=8, num_generations=4,
                                              max_completion_length=8, block_length=4, diffusion_steps=4),
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)


def test_rollout_scoring_runs_in_chunks_of_the_micro_batch(tmp_path):
    """Old and reference log-probs for all mu seeds: mu x B rows, never more than P rows per forward."""
    trainer = make_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           num_iterations=3, beta=0.04, max_steps=1)
    rows = []
    for module in (trainer.model, trainer.ref_model):
        module.register_forward_hook(lambda m, args, kwargs, out: rows.append(kwargs["input_ids"].size(0)),
                                     with_kwargs=True)
    trainer.train()
    # the padding probe (2 rows, once), then one rollout of 8: 3 seeds x 2 chunks of 4 rows for old, the same for
    # ref, then 2 loss micro-batches of 4
    assert rows == [2] + [4] * 14


def test_block_cache_reaches_the_sampler_and_a_dual_cache_run_trains(tmp_path, monkeypatch):
    """The opt-in approximate cache is a config field: the trainer's sampler uses it, and a step trains.
    tensor_batch_size reaches it too: below one row's length, each full forward runs one row."""
    from hf_grpo.diffusion import sampler as sampler_module

    pieces = []
    original = sampler_module.full_forward

    def spy(model, inputs, kwargs, read_from, piece_rows, cache):
        pieces.append((inputs.size(0), piece_rows))
        return original(model, inputs, kwargs, read_from, piece_rows, cache)

    monkeypatch.setattr(sampler_module, "full_forward", spy)
    trainer = make_trainer(tmp_path, fixed=False, block_cache="dual", tensor_batch_size=2)
    assert trainer._generation_backend(trainer.model).block_cache == "dual"
    assert "APPROXIMATE dual block cache" in trainer.args.diffusion_plan(1)
    losses, _ = train(trainer)
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert trainer.decisions.backend.forwards > 0  # the rollout came from the cached sampler
    assert pieces and all(rows > 1 and piece == 1 for rows, piece in pieces)


def halve_tensor_batch_size(trainer):
    """What an out-of-memory in a log-prob chunk does (memory.oom): the knob halves the run's size."""
    failures = iter([True])

    def attempt(size):
        if next(failures, False):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    trainer._oom_knobs["tensor_batch_size"].run(attempt)


def record_estimator_chunks(monkeypatch) -> list:
    """The token rows of every log-softmax chunk the estimator runs, in order (a list the test may add marks to)."""
    from hf_grpo.diffusion import logprobs as logprobs_module

    chunks = []
    original = logprobs_module.chunked_logprobs

    def spy(*args, chunk_rows, **kwargs):
        chunks.append(chunk_rows)
        return original(*args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(logprobs_module, "chunked_logprobs", spy)
    return chunks


def test_estimator_chunk_follows_the_runs_sizes(tmp_path, monkeypatch):
    """The estimator's token rows per log-softmax come from the run's sizes (halved after an out-of-memory, or
    settled at train start), not from the config's tensor_batch_size."""
    chunks = record_estimator_chunks(monkeypatch)
    trainer = make_trainer(tmp_path, tensor_batch_size=6, num_iterations=2, beta=0.04)
    halve_tensor_batch_size(trainer)
    assert trainer.sizes.tensor_batch_size == 3 and trainer.args.tensor_batch_size == 6
    losses, _ = train(trainer)
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert chunks and set(chunks) == {3}  # old and reference log-probs and the loss's, every one


def test_sampler_chunk_follows_the_runs_sizes(tmp_path, monkeypatch):
    """A block cache's full forwards are bounded by the run's tensor_batch_size as it stands at each rollout."""
    from hf_grpo.diffusion import sampler as sampler_module

    pieces = []
    original = sampler_module.full_forward

    def spy(model, inputs, kwargs, read_from, piece_rows, cache):
        pieces.append(piece_rows)
        return original(model, inputs, kwargs, read_from, piece_rows, cache)

    monkeypatch.setattr(sampler_module, "full_forward", spy)
    # rows are 9 to 15 tokens long (prompt + 8 completion slots): 48 token rows hold 3 to 5 of them, 12 only one
    trainer = make_trainer(tmp_path, fixed=False, block_cache="dual", tensor_batch_size=48)
    trainer._generation_backend(trainer.model)  # made before the size changes, as a probe would
    halve_tensor_batch_size(trainer)
    halve_tensor_batch_size(trainer)
    assert trainer.sizes.tensor_batch_size == 12
    train(trainer)
    assert pieces and set(pieces) == {1}


def test_reference_of_an_automodel_only_checkpoint_under_zero3_is_refused_with_the_ways_out(monkeypatch):
    """A ZeRO-3-partitioned policy cannot be copied into a reference, and TRL cannot reload a Dream-style path."""
    import hf_grpo.diffusion.trainer as diffusion_trainer

    model = build_tiny_diffusion_model(TOKENIZER, seed=0)
    model.config._name_or_path, model.config.auto_map = "/ckpt/dream-like", {"AutoModel": "modeling.DreamModel"}
    args = DiffuGRPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, beta=0.04, max_completion_length=8,
                           block_length=4, diffusion_steps=4, per_device_train_batch_size=8, num_generations=4)
    copied = DiffuGRPOTrainer._in_code_reference(model, args, None)
    assert copied is not None and copied is not model  # without ZeRO-3: a frozen copy
    monkeypatch.setattr(diffusion_trainer, "is_zero3_partitioned", lambda m: True)
    with pytest.raises(ValueError, match=r"beta=0.04 needs a reference model.*--use_peft"):
        DiffuGRPOTrainer._in_code_reference(model, args, None)
    model.config.auto_map = {"AutoModelForCausalLM": "modeling.LLaDAModelLM"}
    assert DiffuGRPOTrainer._in_code_reference(model, args, None) is None  # TRL reloads it from the path
