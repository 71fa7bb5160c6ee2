"""GRPOConfig: the batch contract through the real config class, presets and env overrides."""

import logging
import os

import pytest

from hf_grpo import (
    GRPOConfig,
    create_balanced_config,
    create_memory_optimized_config,
    create_speed_optimized_config,
    prepare_process,
)
from hf_grpo.config import batch_field_defaults


def guide_config(make_config, prompts, samples, mini_batch, micro, gpus):
    """A config from the batch-size guides' terms: prompts x samples per rollout, global mini-batch."""
    accumulation = mini_batch // (micro * gpus)
    steps_per_generation = prompts * samples // (micro * gpus)
    return make_config(
        per_device_train_batch_size=micro,
        num_generations=samples,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
    )


@pytest.mark.parametrize(
    "prompts, samples, mini_batch, micro, gpus, accumulation, steps",
    [
        (1024, 5, 256, 1, 4, 64, 20),
        (1024, 5, 256, 2, 4, 32, 20),
        (512, 8, 256, 1, 8, 32, 16),
    ],
)
def test_valid_cases_from_the_batch_size_guides(
    make_config, prompts, samples, mini_batch, micro, gpus, accumulation, steps
):
    config = guide_config(make_config, prompts, samples, mini_batch, micro, gpus)
    plan = config.batch_plan(world_size=gpus).validate()
    assert plan.global_rollout == prompts * samples  # samples per rollout
    assert plan.prompts_per_rollout == prompts
    assert plan.global_batch_size == mini_batch
    assert plan.gradient_accumulation_steps == accumulation
    assert plan.optimizer_steps_per_rollout == steps == prompts * samples // mini_batch


def test_guide_case_500_samples_not_a_multiple_of_256_is_rejected(make_config):
    # 100 prompts x 5 samples on 4 GPUs: 125 micro-batches per device per rollout, 64 per step
    with pytest.raises(ValueError) as err:
        make_config(per_device_train_batch_size=1, num_generations=5, gradient_accumulation_steps=64,
                    steps_per_generation=125)
    assert "steps_per_generation (125) and gradient_accumulation_steps (64)" in str(err.value)


def test_guide_case_mini_batch_300_does_not_divide_5120(make_config):
    # 1024 prompts x 5 samples on 4 GPUs with a global mini-batch of 300 (micro 1): 75 accumulation steps
    with pytest.raises(ValueError) as err:
        make_config(per_device_train_batch_size=1, num_generations=5, gradient_accumulation_steps=75,
                    steps_per_generation=1280)
    assert "(1280)" in str(err.value) and "(75)" in str(err.value)


def test_defaults_generate_the_whole_rollout_in_one_chunk(make_config):
    config = make_config(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=3)
    assert config.steps_per_generation == 3
    assert config.per_device_generation_batch_size == 12
    assert config.tensor_batch_size == 1024
    # TRL's inherited field keeps TRL's meaning: the global rollout
    assert config.generation_batch_size == 12


def test_trl_generation_batch_size_is_still_accepted_as_the_global_rollout(make_config):
    config = make_config(per_device_train_batch_size=2, num_generations=4, generation_batch_size=8)
    assert config.steps_per_generation == 4
    with pytest.raises(ValueError, match=r"generation_batch_size \(7\) is the global rollout"):
        make_config(per_device_train_batch_size=2, num_generations=4, generation_batch_size=7)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(per_device_train_batch_size=3, num_generations=8),
         "nearest valid per_device_train_batch_size: 8"),
        (dict(num_generations=1), "num_generations must be an integer >= 2, got 1"),
        (dict(steps_per_generation=2, generation_batch_size=16), "set either steps_per_generation (2)"),
        (dict(per_device_train_batch_size=4, num_generations=4, per_device_generation_batch_size=5),
         "per_device_generation_batch_size (5) is larger than the rollout"),
        (dict(tensor_batch_size=0, per_device_train_batch_size=4, num_generations=4),
         "tensor_batch_size must be an integer >= 1"),
        (dict(preset="fast"), "preset must be one of ['balanced', 'memory', 'speed']"),
        (dict(generation_backend="tensorrt"), "generation_backend must be one of"),
    ],
)
def test_invalid_configs_fail_with_this_packages_message(make_config, overrides, fragment):
    with pytest.raises(ValueError) as err:
        make_config(**overrides)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "factory, chunk, rows, checkpointing",
    [
        (create_memory_optimized_config, 2, 512, True),
        (create_balanced_config, 4, 1024, None),
        (create_speed_optimized_config, 8, 2048, False),
    ],
)
def test_presets(tmp_path, factory, chunk, rows, checkpointing):
    config = factory(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True)
    assert config.per_device_generation_batch_size == chunk
    assert config.tensor_batch_size == rows
    assert config.bf16 is False  # no bf16 hardware on a CPU machine
    if checkpointing is not None:
        assert config.activation_checkpointing is checkpointing


@pytest.mark.parametrize("preset", ["memory", "balanced", "speed"])
def test_both_config_families_take_a_preset_from_the_one_table(tmp_path, preset):
    """hf_grpo's and hf_grpo.diffusion's create_*_config build their own class with ``PRESETS[preset]``, and their
    help() names those values."""
    import hf_grpo
    import hf_grpo.diffusion
    from hf_grpo.batch_fields import PRESET_FACTORY_NAMES, PRESETS

    for module, config_cls in ((hf_grpo, hf_grpo.GRPOConfig), (hf_grpo.diffusion, hf_grpo.diffusion.DiffuGRPOConfig)):
        factory = getattr(module, PRESET_FACTORY_NAMES[preset])
        config = factory(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=8,
                         num_generations=4)
        assert type(config) is config_cls and config.preset == preset
        for name, value in PRESETS[preset].items():
            assert getattr(config, name) == value, (module.__name__, name)
            assert f"{name}={value!r}" in factory.__doc__


def test_explicit_values_win_over_the_preset(tmp_path):
    config = create_memory_optimized_config(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True,
        per_device_generation_batch_size=8, tensor_batch_size=64,
    )
    assert (config.per_device_generation_batch_size, config.tensor_batch_size) == (8, 64)
    # the preset field works the same way: it fills only fields left at their defaults
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True,
                        bf16=False, preset="speed", tensor_batch_size=96)
    assert (config.per_device_generation_batch_size, config.tensor_batch_size) == (8, 96)


def test_preset_chunk_is_capped_by_a_smaller_rollout(tmp_path):
    config = create_speed_optimized_config(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                           num_generations=2, use_cpu=True)
    assert config.per_device_generation_batch_size == 2


@pytest.mark.parametrize(
    "variable, field, value",
    [
        ("DIFFU_BATCH_SIZE", "per_device_generation_batch_size", 3),
        ("DIFFU_TRAIN_BATCH_SIZE", "per_device_train_batch_size", 8),
        ("DIFFU_TENSOR_BATCH_SIZE", "tensor_batch_size", 77),
    ],
)
def test_each_env_override_is_applied_and_logged(make_config, monkeypatch, caplog, variable, field, value):
    monkeypatch.setenv(variable, str(value))
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        config = make_config(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2)
    assert getattr(config, field) == value
    assert f"{variable}={value} overrides {field}" in caplog.text


def test_env_beats_explicit_beats_preset(tmp_path, monkeypatch):
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True)
    assert create_memory_optimized_config(**kwargs).per_device_generation_batch_size == 2  # preset
    assert create_memory_optimized_config(**kwargs, per_device_generation_batch_size=4) \
        .per_device_generation_batch_size == 4  # explicit > preset
    monkeypatch.setenv("DIFFU_BATCH_SIZE", "8")
    assert create_memory_optimized_config(**kwargs, per_device_generation_batch_size=4) \
        .per_device_generation_batch_size == 8  # env > explicit


def test_env_override_is_logged_only_on_the_main_process(make_config, monkeypatch, caplog):
    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "64")
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        assert make_config(per_device_train_batch_size=4, num_generations=4).tensor_batch_size == 64
    assert "DIFFU_TENSOR_BATCH_SIZE" not in caplog.text


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "1.5", "4x", " 4x "])
def test_bad_env_values_are_rejected_naming_variable_and_value(make_config, monkeypatch, raw):
    monkeypatch.setenv("DIFFU_BATCH_SIZE", raw)
    with pytest.raises(ValueError) as err:
        make_config(per_device_train_batch_size=4, num_generations=4)
    assert f"DIFFU_BATCH_SIZE={raw!r} is not a positive integer" in str(err.value)


@pytest.mark.parametrize("raw", ["", " ", "\t\n"])
def test_empty_or_whitespace_env_values_mean_unset(make_config, monkeypatch, caplog, raw):
    monkeypatch.setenv("DIFFU_BATCH_SIZE", raw)
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", raw)
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        config = make_config(per_device_train_batch_size=4, num_generations=4)
    assert (config.per_device_train_batch_size, config.per_device_generation_batch_size) == (4, 4)
    assert "DIFFU_" not in caplog.text


def test_env_override_that_breaks_a_rule_is_caught(make_config, monkeypatch):
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "3")
    with pytest.raises(ValueError, match=r"per_device_train_batch_size \(3\)"):
        make_config(per_device_train_batch_size=4, num_generations=4)


def test_vllm_backend_turns_on_trls_vllm_mode(make_config):
    config = make_config(per_device_train_batch_size=4, num_generations=4, generation_backend="vllm")
    assert config.use_vllm is True


@pytest.mark.parametrize("fields, named", [
    (dict(use_vllm=True, generation_backend="hf"), ("use_vllm=True", "generation_backend='hf'")),
    (dict(use_vllm=True, generation_backend="cuda_graph"), ("use_vllm=True", "generation_backend='cuda_graph'")),
    (dict(use_vllm=False, generation_backend="vllm"), ("use_vllm=False", "generation_backend='vllm'")),
    (dict(use_transformers_continuous_batching=True, generation_backend="cuda_graph"),
     ("use_transformers_continuous_batching=True", "generation_backend='cuda_graph'")),
    (dict(use_transformers_continuous_batching=True, generation_backend="hf"),
     ("use_transformers_continuous_batching=True", "generation_backend='hf'")),
    (dict(use_transformers_continuous_batching=True, generation_backend="vllm"),
     ("use_transformers_continuous_batching=True", "generation_backend='vllm'")),
])
def test_contradictory_generation_choices_are_refused_naming_both(make_config, fields, named):
    """TRL's vLLM and continuous-batching paths bypass generation_backend: one of the two choices would be ignored."""
    with pytest.raises(ValueError) as err:
        make_config(per_device_train_batch_size=4, num_generations=4, **fields)
    assert all(name in str(err.value) for name in named), str(err.value)


@pytest.mark.parametrize("fields", [dict(use_vllm=True), dict(use_vllm=True, generation_backend="vllm"),
                                    dict(use_transformers_continuous_batching=True)])
def test_consistent_generation_choices_are_accepted(make_config, fields):
    config = make_config(per_device_train_batch_size=4, num_generations=4, **fields)
    assert config.generation_backend in ("auto", "vllm")


def test_an_explicit_value_equal_to_the_default_still_beats_the_preset(tmp_path):
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True)
    default_rows = batch_field_defaults()["tensor_batch_size"]  # 1024; the memory preset's is 512
    assert create_memory_optimized_config(**kwargs, tensor_batch_size=default_rows).tensor_batch_size == default_rows
    assert GRPOConfig(**kwargs, preset="memory", tensor_batch_size=default_rows).tensor_batch_size == default_rows
    assert GRPOConfig(**kwargs, preset="memory").tensor_batch_size == 512


@pytest.mark.parametrize("given", ["flag", "yaml"])
def test_recipe_flags_and_yaml_beat_the_preset_even_at_the_default(tmp_path, given):
    from hf_grpo.recipe_support.launch import parse_recipe_args

    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--preset", "memory"]
    if given == "flag":
        argv += ["--tensor_batch_size", "1024", "--per_device_generation_batch_size=8"]
    else:
        (tmp_path / "run.yaml").write_text("tensor_batch_size: 1024\nper_device_generation_batch_size: 8\n")
        argv += ["--config", str(tmp_path / "run.yaml")]
    config, _, _ = parse_recipe_args({"report_to": "none"}, argv)
    assert (config.tensor_batch_size, config.per_device_generation_batch_size) == (1024, 8)
    # what was left out still comes from the preset
    assert config.activation_checkpointing is True


def test_recipe_preset_fills_what_the_user_left_out(tmp_path):
    from hf_grpo.recipe_support.launch import parse_recipe_args

    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--preset", "memory"]
    config, _, _ = parse_recipe_args({"report_to": "none", "tensor_batch_size": 4096}, argv)
    assert (config.tensor_batch_size, config.per_device_generation_batch_size) == (512, 2)


GUIDE_EXAMPLE_2 = """
config = hf_grpo.create_memory_optimized_config()
config.optimization.per_device_train_batch_size = 1
config.optimization.generation_batch_size = 2
config.optimization.tensor_batch_size = 512
"""


def test_the_seed_guides_example_2_runs_from_the_top_level_import():
    """The guide's "4 x RTX 4090 with ZeRO-3" example, verbatim, with ``import hf_grpo``: an autoregressive config
    (hf_grpo.GRPOConfig, not the diffusion one) whose .optimization writes the flat per-device fields."""
    import hf_grpo

    scope = {"hf_grpo": hf_grpo}
    exec(GUIDE_EXAMPLE_2, scope)
    config = scope["config"]
    assert type(config) is hf_grpo.GRPOConfig
    assert (config.per_device_train_batch_size, config.per_device_generation_batch_size, config.tensor_batch_size,
            config.activation_checkpointing) == (1, 2, 512, True)
    assert (config.optimization.per_device_train_batch_size, config.optimization.generation_batch_size) == (1, 2)
    # "Effective global batch sizes: Training: 1 x 4 = 4, Generation: 2 x 4 = 8" (its 4 GPUs)
    assert config.optimization.per_device_train_batch_size * 4 == 4
    assert config.optimization.generation_batch_size * 4 == 8


def test_the_optimization_view_is_one_definition_for_both_configs():
    from hf_grpo.diffusion import DiffuGRPOConfig

    assert DiffuGRPOConfig.optimization is GRPOConfig.optimization


def test_optimization_writes_are_checked_and_rederived(make_config):
    config = make_config(per_device_train_batch_size=8, num_generations=4, per_device_generation_batch_size=4)
    with pytest.raises(ValueError, match=r"config.optimization.generation_batch_size .* positive integer, got 0"):
        config.optimization.generation_batch_size = 0
    with pytest.raises(AttributeError, match=r"no field 'enable_profiling'"):  # a DiffuGRPOConfig field only
        config.optimization.enable_profiling = True
    config.optimization.per_device_train_batch_size = 4
    config.revalidate(world_size=1)  # what GRPOTrainer does with such a config
    assert config.generation_batch_size == 4  # TRL's global rollout, re-derived from the new micro-batch
    config.optimization.per_device_train_batch_size = 3
    with pytest.raises(ValueError, match=r"num_generations"):
        config.revalidate(world_size=1)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the launcher's bf16 stays on a GPU")
def test_a_config_on_a_cpu_turns_off_the_launchers_bf16_and_says_so(tmp_path, monkeypatch, caplog):
    """`accelerate launch --config_file accelerate_configs/zero2.yaml` passes its bf16 on; DeepSpeed would then
    disagree with the fp32 CPU run (a library script builds no recipe that could turn it off). transformers reads
    the variable while the config is built: it sees "no" there; the variable itself is written by the trainer's
    first step (prepare_process), not by the config."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        config = GRPOConfig(output_dir=str(tmp_path / "out"), report_to=[])
    assert not config.bf16 and config.mixed_precision == "no"
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert "no CUDA device: training in fp32, not the launch config's mixed_precision=bf16" in caplog.text
    prepare_process(config)
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no"
