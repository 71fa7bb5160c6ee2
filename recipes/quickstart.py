"""Quickstart: a tiny model built in code learns, from reward alone, to repeat its prompt's letter.

    accelerate launch recipes/quickstart.py                 # CPU or one GPU, about two minutes on CPU
    python recipes/quickstart.py --max_steps 20             # same, without the launcher
    python recipes/quickstart.py --model_name_or_path ./my-checkpoint   # a saved checkpoint, not the tiny model
    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/quickstart.py
    accelerate launch recipes/quickstart.py --config recipes/quickstart.yaml --preset memory

Writes metrics.jsonl (one line per logging step) and reward_loss.png to --output_dir.
"""

from hf_grpo.recipe_support.launch import recipe_defaults, run_recipe
from hf_grpo.recipe_support.rewards import repeat_letter_reward
from hf_grpo.recipe_support.tasks import repeat_letter_dataset

# The settings are written once, in quickstart.yaml (small enough for a 2-core CPU, large enough for a clearly
# rising reward); a run without --config takes them all.
DEFAULTS = recipe_defaults(__file__)
COMPLETION_LENGTH = DEFAULTS["max_completion_length"]  # the reward's target length


def reward(completions, letter=None, **kwargs):
    return repeat_letter_reward(completions, letter=letter, length=COMPLETION_LENGTH)


def build_dataset(recipe_args, training_args, tokenizer):
    return repeat_letter_dataset(recipe_args.num_train_samples, seed=training_args.seed)


def main(argv=None):
    return run_recipe(DEFAULTS, reward, build_dataset, argv)


if __name__ == "__main__":
    main()
