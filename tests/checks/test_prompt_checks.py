"""A tokenizer that cannot end or pad completions, prompts of no token and prompts too long for the model's
positions are refused with errors naming what was found (hf_grpo.checks.prompts), not a TypeError in
``left_pad``, an IndexError inside transformers' ``generate`` or a run that trains past the model's positions."""

import pytest
from datasets import Dataset, IterableDataset
from tests.test_trainer import TOKENIZER, count_a_reward, prompt_dataset

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


def trainer_with(tmp_path, dataset=None, tokenizer=TOKENIZER, model=None, **config):
    values = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=4, save_strategy="no",
                  disable_tqdm=True)
    values.update(config)
    return GRPOTrainer(model=model if model is not None else build_tiny_model(TOKENIZER, seed=0),
                       reward_funcs=count_a_reward, args=GRPOConfig(**values),
                       train_dataset=prompt_dataset() if dataset is None else dataset, processing_class=tokenizer)


# ---- the tokenizer ----------------------------------------------------------------------------------------------

def test_a_tokenizer_without_pad_or_eos_token_is_refused_at_construction(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = None, None
    with pytest.raises(ValueError, match="has neither a pad_token nor an eos_token") as err:
        trainer_with(tmp_path, tokenizer=tokenizer)
    assert "tokenizer.eos_token = " in str(err.value) and "resize_token_embeddings" in str(err.value)


def test_a_tokenizer_with_a_pad_token_but_no_eos_token_is_refused(tmp_path):
    """TRL always stops completions at the tokenizer's eos_token: None there fails the first rollout too."""
    tokenizer = build_char_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match=r"has no eos_token \(its pad_token is '<pad>'\)"):
        trainer_with(tmp_path, tokenizer=tokenizer)


def test_a_tokenizer_with_an_eos_token_only_trains_padding_with_it(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    trainer = trainer_with(tmp_path, tokenizer=tokenizer)
    assert trainer._tokenizer.pad_token_id == trainer._tokenizer.eos_token_id  # TRL's default
    trainer.train()
    assert trainer.state.global_step == 1


# ---- empty prompts --------------------------------------------------------------------------------------------------

def test_empty_prompts_are_refused_at_construction_naming_their_rows(tmp_path):
    prompts = ["ab>", "", "c>", "d>", "", "ef>", "g>", "h>"] * 2
    with pytest.raises(ValueError, match=r"4 prompt\(s\) that tokenize to no token \(rows 1, 4, 9, 12: ''\)") as err:
        trainer_with(tmp_path, dataset=Dataset.from_dict({"prompt": prompts}))
    assert "dataset.filter(" in str(err.value)


def test_a_white_space_prompt_that_has_tokens_is_not_refused(tmp_path):
    trainer_with(tmp_path, dataset=Dataset.from_dict({"prompt": ["ab>", " ", "c>", "d>"] * 4}))


def test_an_empty_prompt_of_a_streamed_set_is_refused_when_its_rollout_is_tokenized(tmp_path):
    """A streamed set cannot be scanned at construction: the rollout's tokenized prompts are checked instead,
    before transformers' generate fails on a prompt of no token."""
    rows = [{"prompt": p} for p in [""] * 16]
    dataset = IterableDataset.from_generator(lambda: iter(rows))
    trainer = trainer_with(tmp_path, dataset=dataset)
    with pytest.raises(ValueError, match=r"8 prompt\(s\) of this rollout tokenize to no token \(the first: ''\)"):
        trainer.train()
    assert trainer.state.global_step == 0


# ---- prompts longer than the model's positions ---------------------------------------------------------------------

def short_model(positions):
    return build_tiny_model(TOKENIZER, seed=0, max_position_embeddings=positions)


def test_a_prompt_past_the_models_positions_is_refused_naming_the_lengths(tmp_path):
    long_prompt = "ab" * 15 + ">"  # 31 tokens; with 4 completion tokens 35 > 32 positions
    dataset = Dataset.from_dict({"prompt": ["ab>"] * 15 + [long_prompt]})
    trainer = trainer_with(tmp_path, dataset=dataset, model=short_model(32), per_device_train_batch_size=16)
    with pytest.raises(ValueError, match=r"a prompt of 31 tokens \('abab.*max_completion_length=4 tokens needs 35 "
                                         r"positions, more than the model's 32 \(max_position_embeddings=32\)") as e:
        trainer.train()
    assert "longer than 28 tokens" in str(e.value) and "max_completion_length <= 1" in str(e.value)
    assert trainer.state.global_step == 0


def test_where_the_training_set_is_scanned_at_train_start_a_long_prompt_anywhere_in_it_is_refused(tmp_path):
    """A token budget scans every prompt for the longest before the first step: the long prompt in the last row is
    refused then, not at the rollout that samples it."""
    dataset = Dataset.from_dict({"prompt": ["ab>"] * 63 + ["ab" * 15 + ">"]})
    trainer = trainer_with(tmp_path, dataset=dataset, model=short_model(32), max_tokens_per_micro_batch=4096)
    with pytest.raises(ValueError, match=r"a prompt of 31 tokens .* needs 35 positions"):
        trainer.train()
    assert trainer.state.global_step == 0 and trainer.decisions.backend is None  # no rollout was generated


def test_prompts_that_fit_with_their_completion_train(tmp_path):
    dataset = Dataset.from_dict({"prompt": ["ab" * 13 + ">"] * 16})  # 27 + 4 completion tokens <= 32
    trainer = trainer_with(tmp_path, dataset=dataset, model=short_model(32), per_device_train_batch_size=16)
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_completion_length_that_leaves_no_room_for_a_prompt_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"max_completion_length=32 leaves no room for a prompt in the model's 32 "
                                         r"positions"):
        trainer_with(tmp_path, model=short_model(32), max_completion_length=32)


def test_rope_scaling_extends_the_positions_a_prompt_may_use():
    from hf_grpo.checks.prompts import check_rollout_prompts, position_limit

    model = build_tiny_model(TOKENIZER, seed=0, max_position_embeddings=32,
                             rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    limit = position_limit(model)
    assert limit[0] == 128 and "RoPE factor 4" in limit[1]
    check_rollout_prompts([[2] * 100], ["x" * 100], 28, limit)  # 128 positions: fits
    with pytest.raises(ValueError, match="needs 129 positions"):
        check_rollout_prompts([[2] * 101], ["x" * 101], 28, limit)
