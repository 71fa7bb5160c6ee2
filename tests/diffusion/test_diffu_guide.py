"""Every code example of the batch-size guide hf-grpo grew from ("Batch Size Configuration Guide for DeepSpeed
Training") runs as written against hf_grpo.diffusion, with the guide's meaning for each field.

The snippets below are the guide's Python blocks, copied verbatim (its multiplication signs, rendered as
mojibake in the original, are written as x in comments). Two places cannot run as printed, and the test
says so: "Automatic Scaling" is arithmetic written with a multiplication sign (not Python), so its numbers are
checked against BatchPlan instead; the monitoring example's ``ImprovedDiffuGRPOTrainer(...)`` has its ``...``
replaced by real arguments. ``./improved_run.sh dataset speed`` is not shipped: ``--preset speed`` on any
recipe is its equivalent.
"""

import logging
import textwrap

import pytest
from datasets import Dataset

from hf_grpo.diffusion import ImprovedDiffuGRPOConfig, ImprovedDiffuGRPOTrainer, create_memory_optimized_config
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

FIELD_SNIPPETS = {
    "training batch size": ("config.optimization.per_device_train_batch_size = 1  # Per-device",
                            dict(per_device_train_batch_size=1)),
    "generation batch size": ("config.optimization.generation_batch_size = 4  # Per-device",
                              dict(per_device_generation_batch_size=4)),
    "tensor batch size": ("config.optimization.tensor_batch_size = 1024  # Per-device", dict(tensor_batch_size=1024)),
    "zero-1": ("""
        # Can use larger per-device batch sizes
        config.optimization.per_device_train_batch_size = 2
        config.optimization.generation_batch_size = 8
        """, dict(per_device_train_batch_size=2, per_device_generation_batch_size=8)),
    "zero-2": ("""
        # Moderate batch sizes
        config.optimization.per_device_train_batch_size = 1
        config.optimization.generation_batch_size = 4
        """, dict(per_device_train_batch_size=1, per_device_generation_batch_size=4)),
    "zero-3": ("""
        # Conservative batch sizes
        config.optimization.per_device_train_batch_size = 1
        config.optimization.generation_batch_size = 2
        """, dict(per_device_train_batch_size=1, per_device_generation_batch_size=2)),
    "maximum speed": ("""
        # Use larger per-device batch sizes if memory allows
        config.optimization.generation_batch_size = 8
        config.optimization.tensor_batch_size = 2048
        """, dict(per_device_generation_batch_size=8, tensor_batch_size=2048)),
    "memory efficiency": ("""
        # Use smaller per-device batch sizes
        config.optimization.generation_batch_size = 2
        config.optimization.tensor_batch_size = 512
        config.optimization.enable_gradient_checkpointing = True
        """, dict(per_device_generation_batch_size=2, tensor_batch_size=512, activation_checkpointing=True)),
    "balanced": ("""
        # Moderate batch sizes with optimizations
        config.optimization.generation_batch_size = 4
        config.optimization.tensor_batch_size = 1024
        config.optimization.enable_mixed_precision = True
        """, dict(per_device_generation_batch_size=4, tensor_batch_size=1024)),
    "do this instead": ("""
        # Calculate per-device batch size correctly
        total_gpus = 8
        desired_global_batch_size = 32
        per_device_batch_size = desired_global_batch_size // total_gpus  # = 4
        config.optimization.generation_batch_size = per_device_batch_size
        """, dict(per_device_generation_batch_size=4)),
    "oom 1": ("config.optimization.generation_batch_size = 1", dict(per_device_generation_batch_size=1)),
    "oom 2": ("config.optimization.enable_gradient_checkpointing = True", dict(activation_checkpointing=True)),
    "oom 3": ("config.optimization.tensor_batch_size = 256", dict(tensor_batch_size=256)),
    "slow 1": ("config.optimization.generation_batch_size = 8", dict(per_device_generation_batch_size=8)),
    "slow 2": ("config.optimization.enable_mixed_precision = True", dict()),
}

EXAMPLES = {
    "8xA100 ZeRO-2": ("""
        config = ImprovedDiffuGRPOConfig()
        config.optimization.per_device_train_batch_size = 2
        config.optimization.generation_batch_size = 8
        config.optimization.tensor_batch_size = 2048

        # Effective global batch sizes:
        # Training: 2 x 8 = 16
        # Generation: 8 x 8 = 64
        """, dict(per_device_train_batch_size=2, per_device_generation_batch_size=8, tensor_batch_size=2048)),
    "4x4090 ZeRO-3": ("""
        config = create_memory_optimized_config()
        config.optimization.per_device_train_batch_size = 1
        config.optimization.generation_batch_size = 2
        config.optimization.tensor_batch_size = 512

        # Effective global batch sizes:
        # Training: 1 x 4 = 4
        # Generation: 2 x 4 = 8
        """, dict(per_device_train_batch_size=1, per_device_generation_batch_size=2, tensor_batch_size=512,
                  activation_checkpointing=True)),
    "single GPU": ("""
        config = ImprovedDiffuGRPOConfig()
        config.optimization.per_device_train_batch_size = 1
        config.optimization.generation_batch_size = 2
        config.optimization.tensor_batch_size = 256

        # Effective global batch sizes:
        # Training: 1 x 1 = 1
        # Generation: 2 x 1 = 2
        """, dict(per_device_train_batch_size=1, per_device_generation_batch_size=2, tensor_batch_size=256)),
}

PITFALL = """
    # Setting global batch size directly (incorrect)
    total_gpus = 8
    global_batch_size = 32
    per_device_batch_size = global_batch_size  # Wrong!
    """

MONITORING = """
    trainer = ImprovedDiffuGRPOTrainer(...)

    # Log effective batch sizes
    num_processes = trainer.accelerator.num_processes
    logger.info(f"Per-device generation batch size: {config.optimization.generation_batch_size}")
    logger.info(f"Effective global generation batch size: {config.optimization.generation_batch_size * num_processes}")
    """

MEMORY = """
    # Enable memory profiling to tune batch sizes
    config.optimization.enable_profiling = True
    config.log_memory_usage = True

    # Check memory stats after training
    stats = trainer.get_performance_stats()
    print(f"Peak memory usage: {stats['memory_manager_stats']}")
    """


def run(code, namespace):
    exec(compile(textwrap.dedent(code), "<guide>", "exec"), namespace)
    return namespace


def namespace(**extra):
    return {"ImprovedDiffuGRPOConfig": ImprovedDiffuGRPOConfig, "ImprovedDiffuGRPOTrainer": ImprovedDiffuGRPOTrainer,
            "create_memory_optimized_config": create_memory_optimized_config,
            "logger": logging.getLogger("guide"), **extra}


@pytest.mark.parametrize("name", sorted(FIELD_SNIPPETS))
def test_field_snippets_write_the_flat_fields(name):
    code, expected = FIELD_SNIPPETS[name]
    config = ImprovedDiffuGRPOConfig()  # as the guide builds it: no arguments (works on a CPU-only machine too)
    run(code, namespace(config=config))
    for field, value in expected.items():
        assert getattr(config, field) == value, field


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_configuration_examples(name):
    code, expected = EXAMPLES[name]
    scope = run(code, namespace())
    config = scope["config"]
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.optimization.generation_batch_size == expected["per_device_generation_batch_size"]


def test_automatic_scaling_numbers_match_the_batch_plan():
    # per_device_train_batch_size = 1; generation_batch_size = 4; num_gpus = 8
    # effective_train_batch_size = 1 x 8 = 8; effective_generation_batch_size = 4 x 8 = 32
    config = ImprovedDiffuGRPOConfig(per_device_train_batch_size=1, num_generations=4, steps_per_generation=4,
                                     gradient_accumulation_steps=4)
    config.optimization.generation_batch_size = 4
    plan = config.batch_plan(world_size=8)
    assert plan.per_device_train_batch_size * plan.world_size == 8
    assert config.optimization.generation_batch_size * plan.world_size == 32
    assert plan.generation_chunks == 1 and plan.rollout_per_device == 4


def test_pitfall_snippet_runs():
    assert run(PITFALL, namespace())["per_device_batch_size"] == 32


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("DIFFU_BATCH_SIZE", "8")
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "2")
    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "1024")
    config = ImprovedDiffuGRPOConfig(num_generations=2, steps_per_generation=4)
    assert (config.per_device_generation_batch_size, config.per_device_train_batch_size,
            config.tensor_batch_size) == (8, 2, 1024)


def test_monitoring_and_memory_snippets_after_a_short_training_run(tmp_path, capsys, caplog):
    tokenizer = build_diffusion_tokenizer()
    config = ImprovedDiffuGRPOConfig(output_dir=str(tmp_path), report_to=[], max_steps=1, num_generations=4,
                                     max_completion_length=4, block_length=4, diffusion_steps=2,
                                     disable_tqdm=True, save_strategy="no", logging_steps=1)
    config.optimization.per_device_train_batch_size = 8
    config.optimization.generation_batch_size = 4  # a trainer re-checks the fields written this way
    config.optimization.enable_gradient_checkpointing = False
    arguments = "model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer"
    scope = namespace(config=config, model=build_tiny_diffusion_model(tokenizer), tokenizer=tokenizer,
                      reward=lambda completions, **kw: [c.count("a") / 4 for c in completions],
                      dataset=Dataset.from_dict({"prompt": ["ab>", "c>"] * 8}))
    caplog.set_level(logging.INFO, logger="guide")
    run(MONITORING.replace("ImprovedDiffuGRPOTrainer(...)", f"ImprovedDiffuGRPOTrainer({arguments})"), scope)
    assert "Effective global generation batch size: 4" in caplog.text
    trainer = scope["trainer"]
    assert trainer.batch_plan().generation_chunks == 2 and trainer.args.generation_batch_size == 8
    trainer.train()
    run(MEMORY, scope)
    assert "Peak memory usage: {'device': 'cpu', 'peak_memory_gib':" in capsys.readouterr().out
    assert scope["stats"]["memory_manager_stats"]["peak_memory_gib"] > 0
