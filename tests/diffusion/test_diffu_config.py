"""DiffuGRPOConfig: diffusion fields validated with field, value and valid values; the guide's optimization view."""

import pytest

from hf_grpo.diffusion import DiffuGRPOConfig, create_memory_optimized_config, create_speed_optimized_config


def make(**overrides):
    values = dict(output_dir="unused", report_to=[], use_cpu=True)
    values.update(overrides)
    return DiffuGRPOConfig(**values)


def test_defaults_are_the_published_sampler_settings():
    config = make()
    assert (config.max_completion_length, config.block_length, config.diffusion_steps) == (256, 32, 128)
    assert (config.remasking, config.cfg_scale, config.p_mask_prompt) == ("low_confidence", 0.0, 0.15)
    assert config.logits_shift == "auto" and config.mask_token_id is None
    assert config.logprob_estimator == "mean_field"
    assert config.bf16 is False  # no bf16 GPU here: TRL's default (True) would refuse to build on a CPU


@pytest.mark.parametrize("overrides, message", [
    (dict(block_length=30), r"max_completion_length \(256\) must be a multiple of block_length \(30\).*\[8, 16, 32\]"),
    (dict(diffusion_steps=100), r"diffusion_steps \(100\) must be a multiple of the number of blocks.*= 8.*96 or 104"),
    (dict(diffusion_steps=512), r"diffusion_steps \(512\) gives 64 steps per block of 32 tokens.*<= 256"),
    (dict(block_length=0), r"block_length must be an integer >= 1.*got 0"),
    (dict(max_completion_length=None), r"max_completion_length must be an integer >= 1.*got None"),
    (dict(remasking="lowest"), r"remasking must be one of \('low_confidence', 'random'\), got 'lowest'"),
    (dict(cfg_scale=-0.5), r"cfg_scale must be a finite number >= 0.*got -0.5"),
    (dict(p_mask_prompt=1.0), r"p_mask_prompt must be in \[0, 1\).*got 1.0"),
    (dict(p_mask_prompt=-0.1), r"p_mask_prompt must be in \[0, 1\).*got -0.1"),
    (dict(mask_token_id=-3), r"mask_token_id must be a token id >= 0 or None.*got -3"),
    (dict(logits_shift="sometimes"), r"logits_shift must be 'auto', True .* or False .*got 'sometimes'"),
    (dict(logprob_estimator="two_step"), r"logprob_estimator must be one of \('mean_field', 'coupled'\)"),
    (dict(generation_backend="cuda_graph"), r"generation_backend='cuda_graph'.*diffusion sampler"),
    (dict(block_cache="exact"), r"block_cache must be None \(exact, the default\) or one of \('prefix', 'dual'\).*'exact'"),
])
def test_invalid_diffusion_fields_are_named_with_value_and_valid_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


@pytest.mark.parametrize("raw, parsed", [("auto", "auto"), ("true", True), ("False", False), (True, True)])
def test_logits_shift_accepts_strings_from_the_command_line_and_bools(raw, parsed):
    assert make(logits_shift=raw).logits_shift == parsed


def test_optimization_view_reads_and_writes_the_flat_fields():
    config = make(per_device_train_batch_size=8, num_generations=4)
    view = config.optimization
    view.per_device_train_batch_size = 4
    view.generation_batch_size = 2  # the guide's per-device chunk, not TRL's global rollout
    view.tensor_batch_size = 512
    view.enable_gradient_checkpointing = False
    view.enable_profiling = True
    assert (config.per_device_train_batch_size, config.per_device_generation_batch_size) == (4, 2)
    assert config.tensor_batch_size == 512 and config.enable_profiling
    assert config.activation_checkpointing is False and config.gradient_checkpointing is False  # TRL reads the alias
    assert (view.per_device_train_batch_size, view.generation_batch_size, view.tensor_batch_size) == (4, 2, 512)
    view.enable_mixed_precision = True  # no bf16 GPU here: stays fp32 (and says so)
    assert view.enable_mixed_precision is False and config.bf16 is False
    assert config.generation_batch_size == 8  # TRL's global rollout: stale until the trainer revalidates
    config.revalidate(world_size=1)
    assert config.generation_batch_size == 4 and config.batch_plan().generation_chunks == 2


def test_optimization_view_rejects_typos_and_bad_values_at_once():
    config = make()
    with pytest.raises(AttributeError, match="no field 'generation_batch'.*generation_batch_size"):
        config.optimization.generation_batch = 4
    with pytest.raises(ValueError, match=r"generation_batch_size \(per_device_generation_batch_size\) must be a "
                                         r"positive integer, got 0"):
        config.optimization.generation_batch_size = 0
    with pytest.raises(ValueError, match="must be True or False"):
        config.optimization.enable_profiling = "yes"
    config.optimization.tensor_batch_size = None  # None: no chunking
    assert config.tensor_batch_size is None


def test_revalidate_names_a_combination_that_breaks_the_contract():
    config = make(per_device_train_batch_size=8, num_generations=8)
    config.optimization.per_device_train_batch_size = 2  # 2 completions per rollout: not a whole group of 8
    with pytest.raises(ValueError, match="num_generations"):
        config.revalidate(world_size=1)


def test_presets_build_diffusion_configs_and_explicit_values_win():
    config = create_memory_optimized_config(output_dir="unused", report_to=[], use_cpu=True,
                                            per_device_train_batch_size=8, num_generations=4, block_length=64)
    assert isinstance(config, DiffuGRPOConfig) and config.block_length == 64
    assert (config.per_device_generation_batch_size, config.tensor_batch_size) == (2, 512)
    speed = create_speed_optimized_config(output_dir="unused", report_to=[], use_cpu=True, tensor_batch_size=100)
    assert speed.tensor_batch_size == 100 and speed.per_device_generation_batch_size == 8


def test_env_override_applies_to_the_diffusion_config(monkeypatch):
    monkeypatch.setenv("DIFFU_BATCH_SIZE", "2")
    assert make(per_device_train_batch_size=8, num_generations=4).optimization.generation_batch_size == 2


def test_diffusion_plan_shows_blocks_steps_and_seeds():
    config = make(per_device_train_batch_size=8, num_generations=4, num_iterations=3, beta=0.04,
                  per_device_generation_batch_size=4, max_completion_length=64, block_length=16, diffusion_steps=32)
    text = config.diffusion_plan(world_size=1)
    assert "64 tokens in 4 blocks of 16, 32 steps (8 per block, 2 tokens per step)" in text
    assert "64 forwards per rollout per device (32 per chunk x 2 chunks" in text
    assert "full forwards over the whole chunk" in text  # the exact sampler's forwards stay whole
    cached = make(per_device_train_batch_size=8, num_generations=4, block_cache="dual", tensor_batch_size=512)
    assert "a block's full forward <= 512 token rows (at least one row)" in cached.diffusion_plan(world_size=1)
    assert "(3, num_iterations)" in text and "old log-probs for 3 seeds and reference log-probs for 3 seeds: 48" in text


def test_recipe_parser_reads_diffusion_flags(tmp_path):
    from hf_grpo.recipe_support.diffusion_launch import parse_diffu_recipe_args

    training_args, recipe_args, model_args = parse_diffu_recipe_args(
        {"output_dir": str(tmp_path), "per_device_train_batch_size": 8, "num_generations": 4},
        ["--block_length", "64", "--logits_shift", "true", "--p_mask_prompt", "0.3", "--tiny", "true",
         "--logprob_estimator", "coupled", "--report_to", "none"])
    assert isinstance(training_args, DiffuGRPOConfig) and recipe_args.tiny
    assert (training_args.block_length, training_args.logits_shift, training_args.p_mask_prompt) == (64, True, 0.3)
    assert training_args.logprob_estimator == "coupled"
