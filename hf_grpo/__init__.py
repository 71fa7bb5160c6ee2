"""hf-grpo: GRPO for the Hugging Face Trainer with per-device batch sizes and chunked memory."""

from .config import (
    GRPOConfig,
    create_balanced_config,
    create_memory_optimized_config,
    create_speed_optimized_config,
)
from .distributed import prepare_process
from .distributed.shutdown import close_distributed
from .plan import BatchPlan

__version__ = "0.1.0"


def __getattr__(name):
    # The trainer pulls in the whole of TRL's trainer stack; import it on first use only.
    if name == "GRPOTrainer":
        from .trainer import GRPOTrainer

        return GRPOTrainer
    if name in _DIFFUSION:  # masked-diffusion LMs (LLaDA, Dream): hf_grpo.diffusion
        from . import diffusion

        return getattr(diffusion, name)
    raise AttributeError(f"module 'hf_grpo' has no attribute {name!r}")


_DIFFUSION = ("DiffuGRPOConfig", "DiffuGRPOTrainer", "ImprovedDiffuGRPOConfig", "ImprovedDiffuGRPOTrainer")

__all__ = [
    "BatchPlan",
    "DiffuGRPOConfig",
    "DiffuGRPOTrainer",
    "ImprovedDiffuGRPOConfig",
    "ImprovedDiffuGRPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "close_distributed",
    "create_balanced_config",
    "create_memory_optimized_config",
    "create_speed_optimized_config",
    "prepare_process",
]
