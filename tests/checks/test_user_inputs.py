"""Bad input a user can hand the recipes and the trainer is an error naming what was found and what is needed,
raised before any step (hf_grpo.checks.inputs); the quickstarts train a checkpoint they are given; GRPOConfig works
on a CPU-only machine without device flags."""

import pytest
import torch
from datasets import Dataset
from tests.project_files import load_recipe
from tests.test_trainer import TOKENIZER, count_a_reward, make_trainer, prompt_dataset

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.recipe_support.launch import load_model_and_tokenizer, parse_recipe_args
from hf_grpo.recipe_support.tiny import build_tiny_model, save_tiny_checkpoint


def trainer_with(tmp_path, dataset=None, model=None, reward=count_a_reward, **config):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
                      save_strategy="no", disable_tqdm=True, **config)
    return GRPOTrainer(model=model if model is not None else build_tiny_model(TOKENIZER, seed=0),
                       reward_funcs=reward, args=args,
                       train_dataset=prompt_dataset() if dataset is None else dataset, processing_class=TOKENIZER)


# ---- the training set ---------------------------------------------------------------------------

def test_an_empty_training_set_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="train_dataset has 0 rows") as err:
        trainer_with(tmp_path, dataset=Dataset.from_dict({"prompt": []}))
    assert "save the untouched model" in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing written as if trained


def test_a_training_set_smaller_than_one_rollout_is_refused_and_exactly_one_rollout_trains(tmp_path):
    """TRL's sampler draws generation_batch_size / num_generations rows at a time and drops a partial draw: 8
    completions per device x 2 micro-batches per rollout / 4 generations = 4 prompts. 3 rows would train 0 steps
    and save the untouched model; 4 rows train."""
    with pytest.raises(ValueError) as err:
        trainer_with(tmp_path, dataset=prompt_dataset(3), gradient_accumulation_steps=2)
    assert str(err.value).startswith(
        "train_dataset has 3 rows, fewer than one rollout takes: 4 prompts (the rollout's 16 completions = "
        "per_device_train_batch_size 8 x steps_per_generation 2 x 1 processes, / num_generations 4)")
    assert "Give at least 4 rows (the recipes' --num_train_samples)" in str(err.value)
    assert not (tmp_path / "out").exists()

    trainer = trainer_with(tmp_path, dataset=prompt_dataset(4), gradient_accumulation_steps=2)
    trainer.args.max_steps = 2
    trainer.train()
    assert trainer.state.global_step == 2  # the one rollout's rows, drawn again for the second step


def test_on_two_processes_one_rollout_takes_twice_the_prompts(tmp_path, monkeypatch):
    """The config built as each process of a 2-process launch builds it: 8 x 1 x 2 / 4 = 4 prompts a rollout."""
    import transformers

    import hf_grpo.config

    monkeypatch.setattr(hf_grpo.config, "current_world_size", lambda: 2)
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"^train_dataset has 3 rows, fewer than one rollout takes: 4 prompts \(the "
                                         r"rollout's 16 completions = per_device_train_batch_size 8 x "
                                         r"steps_per_generation 1 x 2 processes, / num_generations 4\)"):
        trainer_with(tmp_path, dataset=prompt_dataset(3))


def test_a_training_set_without_a_prompt_column_is_refused_naming_its_columns(tmp_path):
    with pytest.raises(ValueError) as err:
        trainer_with(tmp_path, dataset=Dataset.from_dict({"question": ["ab>"], "answer": ["a"]}))
    message = str(err.value)
    assert "no 'prompt' column" in message and "['question', 'answer']" in message
    assert "rename_column('question', 'prompt')" in message


# ---- the model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["./no-such-checkpoint", "models/org/no-such-checkpoint"])
def test_a_missing_local_model_directory_is_named_not_sent_to_the_hub(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is a local path, but no such directory exists") as err:
        trainer_with(tmp_path, model=name)
    assert repr(name) in str(err.value) and "Repo id" not in str(err.value)


def test_the_recipes_name_a_missing_model_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quickstart = load_recipe("quickstart")
    training_args, recipe_args, model_args = parse_recipe_args(
        quickstart.DEFAULTS, ["--model_name_or_path", "./my-checkpoint", "--output_dir", str(tmp_path / "o")])
    with pytest.raises(ValueError, match=r"model_name_or_path='\./my-checkpoint' is a local path, but no such"):
        load_model_and_tokenizer(model_args, recipe_args, training_args)


def test_a_model_directory_without_config_json_is_named(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "weights.bin").write_text("")
    with pytest.raises(ValueError, match=r"is a directory without config.json \(found \['weights.bin'\]\)"):
        trainer_with(tmp_path, model=str(tmp_path / "ckpt"))


# ---- the quickstarts and a checkpoint ------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("quickstart_checkpoint") / "ckpt")


@pytest.mark.parametrize("recipe", ["quickstart", "diffu_quickstart"])
def test_the_quickstarts_use_a_given_checkpoint_instead_of_their_tiny_default(tmp_path, saved_checkpoint, recipe):
    module = load_recipe(recipe)
    config_cls = GRPOConfig
    if recipe.startswith("diffu"):
        from hf_grpo.diffusion import DiffuGRPOConfig as config_cls
    _, recipe_args, model_args = parse_recipe_args(
        module.DEFAULTS, ["--model_name_or_path", saved_checkpoint, "--output_dir", str(tmp_path)], config_cls)
    assert recipe_args.tiny is False and model_args.model_name_or_path == saved_checkpoint


def test_the_quickstart_trains_the_given_checkpoint(tmp_path, saved_checkpoint):
    trainer = load_recipe("quickstart").main([
        "--model_name_or_path", saved_checkpoint, "--output_dir", str(tmp_path), "--max_steps", "1",
        "--per_device_train_batch_size", "8", "--logging_steps", "1", "--disable_tqdm", "true", "--plot", "false"])
    assert trainer.model.config._name_or_path == saved_checkpoint


def test_tiny_and_a_checkpoint_both_on_the_command_line_are_refused(tmp_path, saved_checkpoint):
    quickstart = load_recipe("quickstart")
    with pytest.raises(ValueError, match="contradict each other") as err:
        parse_recipe_args(quickstart.DEFAULTS, ["--tiny", "true", "--model_name_or_path", saved_checkpoint,
                                                "--output_dir", str(tmp_path)])
    assert "both set on the command line" in str(err.value)


def test_a_checkpoint_flag_beats_tiny_from_the_shipped_yaml(tmp_path, saved_checkpoint):
    quickstart = load_recipe("quickstart")
    _, recipe_args, _ = parse_recipe_args(quickstart.DEFAULTS, [
        "--config", "recipes/quickstart.yaml", "--model_name_or_path", saved_checkpoint, "--output_dir", str(tmp_path)])
    assert recipe_args.tiny is False


# ---- the reward -----------------------------------------------------------------------------------

def string_reward(completions, **kwargs):
    return ["0.5" for _ in completions]


def test_a_reward_returning_strings_is_named_with_its_value(tmp_path):
    trainer = trainer_with(tmp_path, reward=string_reward)
    assert trainer.reward_func_names == ["string_reward"]
    with pytest.raises(TypeError) as err:
        trainer.train()
    message = str(err.value)
    assert "reward function 'string_reward' returned str '0.5' for completion 0" in message
    assert "numbers (int or float) or None" in message


@pytest.mark.parametrize("kind", ["mixed list", "numpy array", "tensor"])
def test_numeric_rewards_pass_through_unchanged(tmp_path, kind):
    import numpy as np

    calls = []

    def numeric(completions, **kwargs):
        calls.append(1)
        n = len(completions)
        if kind == "numpy array":
            return np.linspace(0, 1, n)
        if kind == "tensor":
            return torch.linspace(0, 1, n)
        return [1, 0.5, None, torch.tensor(0.25), np.float32(0.5), True, np.int64(0), np.bool_(False)][:n]

    trainer = trainer_with(tmp_path, reward=numeric)
    trainer.train()
    assert calls and trainer.state.global_step == 1


def test_a_reward_returning_one_number_instead_of_a_list_is_named(tmp_path):
    trainer = trainer_with(tmp_path, reward=lambda completions, **kwargs: 1.0)
    with pytest.raises(TypeError, match="returned float 1.0; a reward function returns a list with one float"):
        trainer.train()


# ---- the device and the generation backend --------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback is for machines without CUDA")
def test_the_library_config_trains_on_a_cpu_only_machine_without_device_flags(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=8, num_generations=4)
    assert (config.bf16, config.use_cpu) == (False, True)  # what the recipes get on this machine


def test_the_vllm_backend_without_vllm_names_generation_backend(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    with pytest.raises(ValueError) as err:
        trainer_with(tmp_path, generation_backend="vllm")
    assert "generation_backend='vllm' needs the vllm package" in str(err.value)
    assert "use_vllm" not in str(err.value)


# ---- the diffusion trainer shares the checks ---------------------------------------------------------------

def diffu_trainer(tmp_path, model, dataset):
    from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer
    from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer

    args = DiffuGRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=8,
                           num_generations=4, max_completion_length=8, block_length=4, diffusion_steps=4)
    return DiffuGRPOTrainer(model=model, reward_funcs=count_a_reward, args=args, train_dataset=dataset,
                            processing_class=build_diffusion_tokenizer())


def test_the_diffusion_trainer_names_a_missing_model_directory_before_loading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'\./my-llada' is a local path, but no such directory exists"):
        diffu_trainer(tmp_path, "./my-llada", prompt_dataset())


def test_the_diffusion_trainer_refuses_an_empty_training_set(tmp_path):
    from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

    model = build_tiny_diffusion_model(build_diffusion_tokenizer(), seed=0)
    with pytest.raises(ValueError, match="train_dataset has 0 rows"):
        diffu_trainer(tmp_path, model, Dataset.from_dict({"prompt": []}))


def test_an_empty_gsm8k_file_is_named_not_a_bare_stop_iteration(tmp_path):
    from hf_grpo.recipe_support.tasks import gsm8k_dataset

    (tmp_path / "data.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"GSM8K data file '.*data.jsonl' is empty; it needs one JSON object"):
        gsm8k_dataset(str(tmp_path / "data.jsonl"))
