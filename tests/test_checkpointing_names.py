"""transformers 5.23 renamed ``gradient_checkpointing*`` to ``activation_checkpointing*``: hf_grpo uses the new names
(building and stepping a trainer calls no deprecated one), still accepts the old field, and TRL 1.16, which reads
the old field, sees the same value."""

import os
import pathlib
import warnings

import pytest
import yaml
from datasets import Dataset
from tests.deprecations import PACKAGE, future_warnings_from_hf_grpo
from tests.test_trainer import TOKENIZER, make_trainer, train_one_step

from hf_grpo import GRPOConfig, create_memory_optimized_config
from hf_grpo.checkpointing import paused
from hf_grpo.recipe_support.tiny import build_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPRECATED_FIELDS = ("gradient_checkpointing", "gradient_checkpointing_kwargs")


def cpu_config(tmp_path, **fields):
    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **fields)


def test_the_detector_tells_hf_grpos_calls_from_others():
    """A deprecated name called from a line under hf_grpo/ counts; the same call from elsewhere does not."""
    model = build_tiny_model(TOKENIZER, seed=0)
    call = "model.gradient_checkpointing_enable(); model.gradient_checkpointing_disable()"
    with future_warnings_from_hf_grpo() as ours:
        exec(compile(call, os.path.join(PACKAGE, "somewhere.py"), "exec"), {"model": model})
    assert len(ours) == 2 and all(line.startswith(os.path.join(PACKAGE, "somewhere.py:1:")) for line in ours)
    with future_warnings_from_hf_grpo() as ours:
        exec(compile(call, __file__, "exec"), {"model": model})
    assert ours == []


def test_a_default_config_warns_about_no_deprecated_name(tmp_path):
    """TRL 1.16 turns checkpointing on through the deprecated field; hf_grpo's config does it under the new one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = cpu_config(tmp_path)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert config.activation_checkpointing is True and config.gradient_checkpointing is True  # TRL reads the alias


@pytest.mark.parametrize("value", [True, False])
def test_the_deprecated_field_is_still_taken(tmp_path, value):
    """transformers takes the old name when the new one is unset, and tells the user (its FutureWarning)."""
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        config = cpu_config(tmp_path, gradient_checkpointing=value)
    assert config.activation_checkpointing is value and config.gradient_checkpointing is value


def test_a_preset_leaves_the_deprecated_field_alone(tmp_path):
    """The memory preset turns checkpointing on unless the user set it, under either name."""
    with pytest.warns(FutureWarning):
        config = create_memory_optimized_config(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=False)
    assert config.activation_checkpointing is False and config.gradient_checkpointing is False
    config = create_memory_optimized_config(output_dir=str(tmp_path), use_cpu=True, activation_checkpointing=False)
    assert config.activation_checkpointing is False and config.gradient_checkpointing is False
    assert create_memory_optimized_config(output_dir=str(tmp_path), use_cpu=True).activation_checkpointing is True


@pytest.mark.parametrize("checkpointing", [True, False])
def test_building_and_stepping_the_trainer_calls_no_deprecated_name(tmp_path, checkpointing):
    """The issue's check (``-W error::FutureWarning``, scoped to this package's own calls): TRL's and transformers'
    own uses of the old names are theirs."""
    with future_warnings_from_hf_grpo() as ours:
        trainer = make_trainer(tmp_path, activation_checkpointing=checkpointing)
        train_one_step(trainer)
    assert trainer.model.is_activation_checkpointing is checkpointing
    assert ours == []


def test_stepping_the_diffusion_trainer_calls_no_deprecated_name(tmp_path):
    """Checkpointing on, old and reference log-probs scored with it paused (num_iterations 2, beta > 0)."""
    from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer
    from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

    tokenizer = build_diffusion_tokenizer()
    with future_warnings_from_hf_grpo() as ours:
        args = DiffuGRPOConfig(
            output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, per_device_train_batch_size=8,
            num_generations=4, max_completion_length=8, block_length=4, diffusion_steps=2, learning_rate=0.1,
            optim="sgd", save_strategy="no", disable_tqdm=True, activation_checkpointing=True, num_iterations=2,
            beta=0.04)
        trainer = DiffuGRPOTrainer(
            model=build_tiny_diffusion_model(tokenizer, seed=0), args=args, processing_class=tokenizer,
            reward_funcs=lambda completions, **kwargs: [text.count("a") / 4 for text in completions],
            train_dataset=Dataset.from_dict({"prompt": ["ab>", "c>", "defg>", "h>"] * 4}))
        trainer.train()
    assert trainer.model.is_activation_checkpointing  # back on after the rollout's scoring
    assert ours == []


def test_paused_restores_checkpointing_as_the_trainer_enabled_it():
    """Off inside the block; back on after it with the same layers checkpointed (``every_n_layers`` is an argument
    of ``activation_checkpointing_enable``, not a kwarg of ``torch.utils.checkpoint``)."""
    model = build_tiny_model(TOKENIZER, seed=0)
    kwargs = {"use_reentrant": False, "every_n_layers": 2}
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    before = [layer.gradient_checkpointing for layer in model.model.layers]
    assert before == [True, False]  # every second layer of two
    with paused(model, kwargs):
        assert not model.is_activation_checkpointing
    assert [layer.gradient_checkpointing for layer in model.model.layers] == before
    assert model.is_activation_checkpointing


def test_recipes_use_the_current_names():
    """The shipped recipe YAMLs are what users copy: no deprecated field in them."""
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text()) or {})
        assert not keys & set(DEPRECATED_FIELDS), f"{path.name} uses {sorted(keys & set(DEPRECATED_FIELDS))}"
