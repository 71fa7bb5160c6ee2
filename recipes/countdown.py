"""Countdown: reach a target from 3-4 numbers with + - * / (data generated locally, seeded).

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/countdown.py --config recipes/countdown.yaml
    python recipes/countdown.py --tiny --max_steps 5          # offline smoke run with a tiny model on CPU

Reward: 1.0 for a correct equation using every number once, 0.1 for a well-formed wrong one
(hf_grpo.recipe_support.rewards.countdown_reward).
"""

import string

from hf_grpo.recipe_support.launch import chat_prompts_if_templated, recipe_defaults, run_recipe
from hf_grpo.recipe_support.rewards import countdown_reward
from hf_grpo.recipe_support.tasks import countdown_dataset

# The settings are written once, in countdown.yaml. A run without --config takes them but for these keys, which
# the YAML sets for the multi-GPU launch on its first line and which stay at the library's defaults otherwise.
LAUNCH_ONLY = (
    "dtype", "gradient_accumulation_steps", "per_device_generation_batch_size", "tensor_batch_size",
    "save_total_limit", "seed",
)
DEFAULTS = recipe_defaults(__file__, LAUNCH_ONLY)


def build_dataset(recipe_args, training_args, tokenizer):
    return chat_prompts_if_templated(countdown_dataset(recipe_args.num_train_samples, seed=training_args.seed), tokenizer)


def main(argv=None):
    return run_recipe(DEFAULTS, countdown_reward, build_dataset, argv, alphabet=string.printable)


if __name__ == "__main__":
    main()
