"""Countdown: reach a target from 3-4 numbers with + - * / (data generated locally, seeded).

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/countdown.py --config recipes/countdown.yaml
    python recipes/countdown.py --tiny --max_steps 5          # offline smoke run with a tiny model on CPU

Reward: 1.0 for a correct equation using every number once, 0.1 for a well-formed wrong one
(hf_grpo.recipe_support.rewards.countdown_reward).
"""

import string

from hf_grpo.recipe_support.launch import chat_prompts_if_templated, run_recipe
from hf_grpo.recipe_support.rewards import countdown_reward
from hf_grpo.recipe_support.tasks import countdown_dataset

DEFAULTS = dict(
    output_dir="outputs/countdown",
    model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct",
    learning_rate=1e-6,
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=512,
    max_steps=500,
    logging_steps=5,
    save_steps=100,
    report_to="none",
    num_train_samples=20000,
)


def build_dataset(recipe_args, training_args, tokenizer):
    return chat_prompts_if_templated(countdown_dataset(recipe_args.num_train_samples, seed=training_args.seed), tokenizer)


def main(argv=None):
    return run_recipe(DEFAULTS, countdown_reward, build_dataset, argv, alphabet=string.printable)


if __name__ == "__main__":
    main()
