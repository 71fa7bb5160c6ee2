"""diffu-GRPO (d1) for masked-diffusion LMs (LLaDA, Dream) on TRL, chunked by hf_grpo's per-device sizes.

    from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer

``ImprovedDiffuGRPOConfig`` / ``ImprovedDiffuGRPOTrainer`` and ``create_memory_optimized_config`` (and the
balanced / speed ones) are the batch-size guide's names; here they build diffusion configs, whose
``config.optimization.<field>`` reads and writes the flat batch fields. ``SamplingSettings`` holds the
samplers' settings for calls outside a trainer (``sampler.diffusion_generate``, ``dream_sampler.dream_generate``).
"""

from .config import (
    DiffuGRPOConfig,
    ImprovedDiffuGRPOConfig,
    OptimizationView,
    create_balanced_config,
    create_memory_optimized_config,
    create_speed_optimized_config,
)
from .sampling_settings import SamplingSettings


def __getattr__(name):
    # The trainer pulls in TRL's trainer stack; import it on first use only.
    if name in ("DiffuGRPOTrainer", "ImprovedDiffuGRPOTrainer"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_grpo.diffusion' has no attribute {name!r}")


__all__ = [
    "DiffuGRPOConfig",
    "DiffuGRPOTrainer",
    "ImprovedDiffuGRPOConfig",
    "ImprovedDiffuGRPOTrainer",
    "OptimizationView",
    "SamplingSettings",
    "create_balanced_config",
    "create_memory_optimized_config",
    "create_speed_optimized_config",
]
