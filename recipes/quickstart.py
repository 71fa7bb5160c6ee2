"""Quickstart: a tiny model built in code learns, from reward alone, to repeat its prompt's letter.

    accelerate launch recipes/quickstart.py                 # CPU or one GPU, about two minutes on CPU
    python recipes/quickstart.py --max_steps 20             # same, without the launcher
    python recipes/quickstart.py --model_name_or_path ./my-checkpoint   # a saved checkpoint, not the tiny model
    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/quickstart.py
    accelerate launch recipes/quickstart.py --config recipes/quickstart.yaml --preset memory

Writes metrics.jsonl (one line per logging step) and reward_loss.png to --output_dir.
"""

from hf_grpo.recipe_support.launch import run_recipe
from hf_grpo.recipe_support.rewards import repeat_letter_reward
from hf_grpo.recipe_support.tasks import repeat_letter_dataset

COMPLETION_LENGTH = 8

# The embedded default: small enough for a 2-core CPU, large enough for a clearly rising reward.
DEFAULTS = dict(
    output_dir="outputs/quickstart",
    tiny=True,
    max_steps=100,
    learning_rate=3e-3,
    lr_scheduler_type="constant",
    per_device_train_batch_size=64,  # 8 prompts x 8 generations per step
    num_generations=8,
    max_completion_length=COMPLETION_LENGTH,
    temperature=1.0,
    beta=0.0,
    logging_steps=5,
    save_steps=50,
    save_total_limit=1,
    report_to="none",
    seed=0,
    num_train_samples=4000,
)


def reward(completions, letter=None, **kwargs):
    return repeat_letter_reward(completions, letter=letter, length=COMPLETION_LENGTH)


def build_dataset(recipe_args, training_args, tokenizer):
    return repeat_letter_dataset(recipe_args.num_train_samples, seed=training_args.seed)


def main(argv=None):
    return run_recipe(DEFAULTS, reward, build_dataset, argv)


if __name__ == "__main__":
    main()
