"""Arguments every recipe under ``recipes/`` takes besides GRPOConfig and trl.ModelConfig."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecipeArguments:
    tiny: bool = field(
        default=False,
        metadata={"help": "Build a tiny random model and character tokenizer in code instead of loading one."},
    )
    tiny_shape: str = field(
        default="tiny",
        metadata={"help": "Shape of the --tiny model: tiny (CPU), 0.5b or 1.5b (random init, for GPU benchmarks)."},
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset name on the hub, or a local JSON-lines file (recipe-specific)."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    num_train_samples: int = field(
        default=2000, metadata={"help": "Prompts generated for synthetic tasks (quickstart, countdown)."}
    )
    plot: bool = field(default=True, metadata={"help": "Write reward/loss plot PNG to the output directory."})
