"""hf_grpo.GRPOTrainer on a tiny model: chunking is exact, accumulation is exact, stats, PEFT, bad input."""

import copy
import inspect
import math

import pytest
import torch
import trl
from datasets import Dataset
from transformers import TrainerCallback

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.generation import HFGenerateBackend
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()
PROMPTS = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]


def prompt_dataset(n=16):
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def count_a_reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def fixed_completions(prompt_ids):
    """Completions that differ within a group and depend only on the prompt and its row."""
    letters = TOKENIZER.convert_tokens_to_ids(list("abcab"))
    return [[letters[(len(p) + row) % 5]] * (1 + row % 4) + [TOKENIZER.eos_token_id] for row, p in enumerate(prompt_ids)]


class FixedBackend(HFGenerateBackend):
    """Deterministic completions, so training steps can be compared across chunk sizes."""

    def generate(self, model, prompt_ids, **kwargs):
        return fixed_completions(prompt_ids)


def make_trainer(tmp_path, cls=GRPOTrainer, config_cls=GRPOConfig, model=None, fixed=True, reward_funcs=count_a_reward,
                 **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=1,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=6, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no", seed=3,
        disable_tqdm=True, activation_checkpointing=False,
    )
    values.update(overrides)
    args = config_cls(**values)
    trainer = cls(
        model=model if model is not None else build_tiny_model(TOKENIZER, seed=0),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=TOKENIZER,
    )
    if fixed and cls is GRPOTrainer:
        trainer.decisions.backend = FixedBackend()
    elif fixed:  # plain TRL trainer: replace its generation method on the instance
        trainer._generate_single_turn = lambda prompt_ids, *a, **k: (fixed_completions(prompt_ids), None)
    return trainer


def train_one_step(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    loss = trainer.state.log_history[0]["loss"]
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    return loss, update


def assert_same_update(a, b, rtol=1e-5):
    loss_a, update_a = a
    loss_b, update_b = b
    assert loss_a == pytest.approx(loss_b, rel=rtol, abs=1e-7)
    flat_a = torch.cat([u.flatten() for u in update_a.values()])
    flat_b = torch.cat([u.flatten() for u in update_b.values()])
    assert flat_a.norm() > 0, "the step changed no parameter: the comparison would be empty"
    assert ((flat_a - flat_b).norm() / flat_a.norm()).item() < rtol


@pytest.mark.parametrize("tensor_batch_size", [3, 1, None])
@pytest.mark.parametrize("chunk", [1, 8])
def test_chunked_step_equals_unchunked_step(tmp_path, tensor_batch_size, chunk):
    reference = train_one_step(make_trainer(tmp_path / "ref", tensor_batch_size=None, per_device_generation_batch_size=8))
    chunked = train_one_step(
        make_trainer(tmp_path / "c", tensor_batch_size=tensor_batch_size, per_device_generation_batch_size=chunk)
    )
    assert_same_update(reference, chunked)


def test_step_equals_trls_own_trainer(tmp_path):
    # The same completions through TRL's fused head: our chunked head computes the same loss and update.
    ours = train_one_step(make_trainer(tmp_path / "ours", tensor_batch_size=5))
    theirs = train_one_step(make_trainer(tmp_path / "trl", cls=trl.GRPOTrainer, config_cls=trl.GRPOConfig))
    assert_same_update(ours, theirs)


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    # P=2, A=4 (four micro-batches of one rollout of 8) against P=8, A=1: one optimizer step each.
    accumulated = train_one_step(make_trainer(tmp_path / "a", per_device_train_batch_size=2,
                                              gradient_accumulation_steps=4))
    big = train_one_step(make_trainer(tmp_path / "b", per_device_train_batch_size=8, gradient_accumulation_steps=1))
    _, update_a = accumulated
    _, update_b = big
    flat_a = torch.cat([u.flatten() for u in update_a.values()])
    flat_b = torch.cat([u.flatten() for u in update_b.values()])
    assert flat_b.norm() > 0
    assert ((flat_a - flat_b).norm() / flat_b.norm()).item() < 1e-5


def test_greedy_generation_is_identical_for_any_chunk_size(tmp_path):
    outputs = []
    for chunk in (1, 3, 8):
        trainer = make_trainer(tmp_path / str(chunk), fixed=False, per_device_generation_batch_size=chunk,
                               generation_kwargs={"do_sample": False}, max_completion_length=10)
        prompt_ids = [TOKENIZER(p)["input_ids"] for p in PROMPTS]
        completions, _ = trainer._generate_single_turn(prompt_ids, None, {}, 4)
        outputs.append(completions)
    assert outputs[0] == outputs[1] == outputs[2]
    reference = build_tiny_model(TOKENIZER, seed=0)
    for prompt, completion in zip(PROMPTS, outputs[0]):
        ids = torch.tensor([TOKENIZER(prompt)["input_ids"]])
        alone = reference.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.size(1):].tolist()
        cut = alone[: alone.index(1) + 1] if 1 in alone else alone
        assert completion == cut  # unpadded, one prompt at a time, EOS kept as TRL keeps it


def test_generation_runs_in_chunks_of_the_configured_size(tmp_path):
    trainer = make_trainer(tmp_path, fixed=False, per_device_generation_batch_size=3)
    sizes = []
    model = trainer.model
    original = model.generate

    def spy(*args, **kwargs):
        sizes.append(kwargs["input_ids"].size(0))
        return original(*args, **kwargs)

    model.generate = spy
    trainer.train()
    assert sizes == [3, 3, 2]  # rollout of 8 per device in chunks of 3


def test_performance_stats_after_a_step(tmp_path):
    trainer = make_trainer(tmp_path, fixed=False, per_device_generation_batch_size=4)
    trainer.train()
    stats = trainer.get_performance_stats()
    for key in ("step_s", "generation_s_per_step", "reward_s_per_step", "logprob_s_per_step", "optimizer_s_per_step",
                "rollout_tokens_per_s", "train_tokens_per_s", "peak_memory_gib"):
        assert stats[key] > 0, key
    assert stats["batch_plan"]["generation_chunks"] == 2
    # the phases happen inside the step
    phases = sum(stats[f"{p}_s_per_step"] for p in ("generation", "reward", "logprob", "optimizer"))
    assert phases < stats["step_s"]
    logged = trainer.state.log_history[0]
    assert logged["perf/rollout_tokens_per_s"] > 0 and logged["perf/peak_memory_gib"] > 0


def test_lora_step_changes_only_adapter_weights(tmp_path):
    from peft import LoraConfig

    model = build_tiny_model(TOKENIZER, seed=0)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=count_a_reward,
        args=GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                        per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                        learning_rate=0.5, optim="sgd", save_strategy="no", disable_tqdm=True,
                        activation_checkpointing=False, tensor_batch_size=4),
        train_dataset=prompt_dataset(),
        processing_class=TOKENIZER,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    trainer.decisions.backend = FixedBackend()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "no parameter changed"
    assert all("lora_" in n for n in changed), sorted(changed)
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)


def test_reward_function_with_wrong_count_is_named(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.reward_funcs = [lambda completions, **kw: [0.0]]
    trainer.reward_func_names = ["short_reward"]
    with pytest.raises(ValueError, match="'short_reward' returned 1 rewards, but 8 were expected"):
        trainer.train()


def test_reward_none_for_a_whole_group_scores_zero_advantage_not_nan(tmp_path):
    # TRL's documented handling: None means "no opinion"; rows where every function abstains get advantage 0
    # (a rollout where every row is unscored is an error: tests/checks/test_unscored_rewards.py).
    def first_group_unscored(completions, **kw):
        return [None if i < 4 else text.count("a") / 4 for i, text in enumerate(completions)]

    trainer = make_trainer(tmp_path, reward_funcs=first_group_unscored)
    loss, update = train_one_step(trainer)
    assert math.isfinite(loss)
    assert trainer.state.log_history[0]["rewards/unscored"] == 4
    assert all(torch.isfinite(u).all() for u in update.values())


def test_tokenizer_without_pad_token_gets_eos_as_pad(tmp_path):
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer.pad_token = None
    trainer = GRPOTrainer(
        model=build_tiny_model(TOKENIZER, seed=0), reward_funcs=count_a_reward,
        args=GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                        per_device_train_batch_size=8, num_generations=4),
        train_dataset=prompt_dataset(), processing_class=tokenizer,
    )
    assert trainer.processing_class.pad_token == trainer.processing_class.eos_token


def test_trl_config_is_rejected_with_a_pointer(tmp_path):
    with pytest.raises(TypeError, match="needs args=hf_grpo.GRPOConfig"):
        GRPOTrainer(model=build_tiny_model(TOKENIZER), reward_funcs=count_a_reward,
                    args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                        per_device_train_batch_size=8, num_generations=4),
                    train_dataset=prompt_dataset(), processing_class=TOKENIZER)


def test_args_none_is_rejected_with_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"args=None.*hf_grpo.GRPOConfig\(output_dir="):
        GRPOTrainer(model=build_tiny_model(TOKENIZER), reward_funcs=count_a_reward, args=None,
                    train_dataset=prompt_dataset(), processing_class=TOKENIZER)


def test_generate_on_the_patched_model_still_receives_logits_to_keep(tmp_path):
    """The chunked head keeps forward's signature, so the prefill projects only the last position."""
    trainer = make_trainer(tmp_path, fixed=False)
    model = trainer.model
    seen = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[1]))
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    prompt = TOKENIZER(["abcdefgh>"], return_tensors="pt")
    model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert seen[0] == 1, f"the prefill projected {seen[0]} positions through the LM head, not 1"


def test_decoder_compiles_and_captures_are_counted_per_window(tmp_path):
    class CountingBackend(FixedBackend):
        num_compiles = num_captures = 0

        def generate(self, model, prompt_ids, **kwargs):
            self.num_compiles += 1  # as a decoder that meets a new shape every rollout would
            self.num_captures += 2
            return super().generate(model, prompt_ids, **kwargs)

    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.decisions.backend = CountingBackend()
    trainer.train()
    stats = trainer.get_performance_stats()
    assert (stats["decode_compiles"], stats["graph_captures"]) == (3, 6)
    assert [row["perf/decode_compiles"] for row in trainer.state.log_history if "loss" in row] == [1, 1, 1]
    assert stats["generation_cache_gib"] == 0  # this backend keeps nothing between rollouts


@pytest.mark.parametrize("release", [True, False])
def test_generation_memory_is_released_after_each_rollout_unless_kept(tmp_path, release):
    class RecordingBackend(FixedBackend):
        releases = 0

        def release(self, empty_cache=True):
            self.releases += 1

    trainer = make_trainer(tmp_path, max_steps=3, release_generation_memory=release)
    trainer.decisions.backend = RecordingBackend()
    trainer.train()
    assert trainer.decisions.backend.releases == (3 if release else 0)  # one rollout per step here


def test_the_decoder_cache_is_reserved_for_the_longest_training_prompt(tmp_path, monkeypatch):
    class ReservingBackend(FixedBackend):
        reserved = None

        def reserve(self, positions):
            self.reserved = positions

    trainer = make_trainer(tmp_path, fixed=False)
    backend = ReservingBackend()
    monkeypatch.setattr("hf_grpo.generation.resolve_backend", lambda name, model: (backend, None))
    assert trainer._generation_backend(trainer.model) is backend
    longest = max(len(TOKENIZER(p)["input_ids"]) for p in PROMPTS)  # "klmno>": 6 tokens
    assert backend.reserved == longest + 6  # + max_completion_length


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_the_scan_for_the_longest_prompt_shows_progress_on_large_sets(tmp_path, monkeypatch, capsys, disable_tqdm):
    """Tokenizing every prompt once (to size the generation cache) takes a while on a large set: say so."""
    from hf_grpo.memory import prompt_lengths

    monkeypatch.setattr(prompt_lengths, "PROGRESS_FROM", 8)  # the 16-prompt test set counts as large
    trainer = make_trainer(tmp_path, disable_tqdm=disable_tqdm)
    capsys.readouterr()
    assert trainer._longest_prompt() > 0
    shown = "hf-grpo: longest prompt" in capsys.readouterr().err
    assert shown != disable_tqdm
    monkeypatch.setattr(prompt_lengths, "PROGRESS_FROM", 17)  # below it: no bar
    assert make_trainer(tmp_path / "small", disable_tqdm=False)._longest_prompt() > 0
    assert "hf-grpo: longest prompt" not in capsys.readouterr().err


class _RecordCudnnAttention(TrainerCallback):
    """cuDNN's SDPA switch as each optimizer step begins."""

    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(torch.backends.cuda.cudnn_sdp_enabled())


@pytest.mark.parametrize("allowed", [False, True])
def test_cudnn_attention_is_left_out_of_training_unless_asked_and_put_back_after(tmp_path, allowed):
    """cuDNN's SDPA kernel builds a kernel per new sequence shape (seconds per run of varied prompts on an H100):
    train() switches it off unless cudnn_attention=True, also inside the backward, and restores the switch."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    trainer = make_trainer(tmp_path, cudnn_attention=allowed, max_steps=2)
    recorder = _RecordCudnnAttention()
    trainer.add_callback(recorder)
    in_backward = []
    hook = trainer.model.model.layers[0].mlp.down_proj.weight.register_hook(
        lambda grad: in_backward.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        trainer.train()
    finally:
        hook.remove()
    assert recorder.seen == [allowed, allowed]
    assert in_backward and set(in_backward) == {allowed}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


class CounterEnvironment:
    """An environment as TRL's environment_factory takes it: reset() and one tool method."""

    def reset(self, **kwargs):
        self.total = 0
        return "start"

    def add(self, amount: int) -> int:
        """Add an amount to the total.

        Args:
            amount: what to add
        """
        self.total += amount
        return self.total


def environment_trainer(tmp_path, fixed=True, **overrides):
    """A trainer with environment_factory: conversational prompts, a tool-calling chat template (TRL's Qwen3);
    ``fixed``: completions without a tool call (one turn)."""
    from pathlib import Path

    from hf_grpo.recipe_support.tiny import build_byte_level_tokenizer

    tokenizer = build_byte_level_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    letters, eos = tokenizer.convert_tokens_to_ids(list("abc")), tokenizer.eos_token_id

    class Completions(HFGenerateBackend):
        def generate(self, model, prompt_ids, **kwargs):
            return [[letters[row % 3]] * (1 + row % 4) + [eos] for row in range(len(prompt_ids))]

    values = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=6, logging_steps=1,
                  save_strategy="no", disable_tqdm=True, activation_checkpointing=False)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 2]})
    trainer = GRPOTrainer(model=build_tiny_model(tokenizer, seed=0), reward_funcs=count_a_reward,
                          args=GRPOConfig(**values, **overrides), train_dataset=dataset, processing_class=tokenizer,
                          environment_factory=CounterEnvironment)
    if fixed:
        trainer.decisions.backend = Completions()
    return trainer


def test_environments_train_with_a_token_budget(tmp_path):
    """The budget's train-start check scans the longest prompt; with environments TRL cannot tokenize the dataset
    outside a batch (and reset() lengthens each prompt), so the scan stands aside and the budget is checked per step."""
    trainer = environment_trainer(tmp_path, max_tokens_per_micro_batch=2048)
    assert trainer._longest_prompt() is None
    trainer.train()
    assert trainer.state.global_step == 1 and "loss" in trainer.state.log_history[0]


def test_environments_leave_the_decoder_cache_unreserved(tmp_path, monkeypatch):
    class ReservingBackend(FixedBackend):
        reserved = None

        def reserve(self, positions):
            self.reserved = positions

    trainer = environment_trainer(tmp_path, fixed=False)
    backend = ReservingBackend()
    monkeypatch.setattr("hf_grpo.generation.resolve_backend", lambda name, model: (backend, None))
    trainer._batch_environments = [None] * 8  # as after a batch of 8: TRL's tokenizer zips prompts against it
    assert trainer._generation_backend(trainer.model) is backend
    assert backend.reserved is None  # the cache then grows along its ladder, as for a set it cannot scan


def test_fields_written_through_optimization_are_rechecked_by_the_trainer(tmp_path):
    """The seed guide sets sizes one at a time on a built config (config.optimization.<field> = ...): the trainer
    re-derives TRL's global rollout from them, and refuses a combination the batch contract forbids."""
    values = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, num_generations=4,
                  per_device_train_batch_size=8, per_device_generation_batch_size=4)
    config = GRPOConfig(**values)
    config.optimization.per_device_train_batch_size = 4
    trainer = GRPOTrainer(model=build_tiny_model(TOKENIZER), reward_funcs=count_a_reward, args=config,
                          train_dataset=prompt_dataset(), processing_class=TOKENIZER)
    assert (trainer.args.per_device_train_batch_size, trainer.args.generation_batch_size) == (4, 4)
    config = GRPOConfig(**values)
    config.optimization.per_device_train_batch_size = 3
    with pytest.raises(ValueError, match=r"num_generations"):
        GRPOTrainer(model=build_tiny_model(TOKENIZER), reward_funcs=count_a_reward, args=config,
                    train_dataset=prompt_dataset(), processing_class=TOKENIZER)
