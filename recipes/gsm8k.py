"""GSM8K: grade-school math, format reward plus correctness of the final number.

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/gsm8k.py --config recipes/gsm8k.yaml
    python recipes/gsm8k.py --tiny --dataset_name data.jsonl --max_steps 5   # offline: a local JSON-lines file

--dataset_name is a hub dataset name (default openai/gsm8k) or a local .jsonl/.json file with
``question`` and ``answer`` columns (answers end in ``#### N``).
"""

import string

from hf_grpo.recipe_support.launch import chat_prompts_if_templated, run_recipe
from hf_grpo.recipe_support.rewards import gsm8k_correctness_reward, gsm8k_format_reward
from hf_grpo.recipe_support.tasks import gsm8k_dataset

DEFAULTS = dict(
    output_dir="outputs/gsm8k",
    model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct",
    dataset_name="openai/gsm8k",
    learning_rate=1e-6,
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=512,
    max_steps=500,
    logging_steps=5,
    save_steps=100,
    report_to="none",
)


def build_dataset(recipe_args, training_args, tokenizer):
    return chat_prompts_if_templated(gsm8k_dataset(recipe_args.dataset_name, split=recipe_args.dataset_split), tokenizer)


def main(argv=None):
    rewards = [gsm8k_format_reward, gsm8k_correctness_reward]
    return run_recipe(DEFAULTS, rewards, build_dataset, argv, alphabet=string.printable)


if __name__ == "__main__":
    main()
