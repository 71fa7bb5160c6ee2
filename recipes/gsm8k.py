"""GSM8K: grade-school math, format reward plus correctness of the final number.

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/gsm8k.py --config recipes/gsm8k.yaml
    python recipes/gsm8k.py --tiny --dataset_name data.jsonl --max_steps 5   # offline: a local JSON-lines file

--dataset_name is a hub dataset name (default openai/gsm8k) or a local .jsonl/.json file with
``question`` and ``answer`` columns (answers end in ``#### N``).
"""

import string

from hf_grpo.recipe_support.launch import chat_prompts_if_templated, recipe_defaults, run_recipe
from hf_grpo.recipe_support.rewards import gsm8k_correctness_reward, gsm8k_format_reward
from hf_grpo.recipe_support.tasks import gsm8k_dataset

# The settings are written once, in gsm8k.yaml. A run without --config takes them but for these keys, which
# the YAML sets for the multi-GPU launch on its first line and which stay at the library's defaults otherwise.
LAUNCH_ONLY = (
    "dtype", "gradient_accumulation_steps", "per_device_generation_batch_size", "tensor_batch_size", "beta",
    "save_total_limit", "seed",
)
DEFAULTS = recipe_defaults(__file__, LAUNCH_ONLY)


def build_dataset(recipe_args, training_args, tokenizer):
    return chat_prompts_if_templated(gsm8k_dataset(recipe_args.dataset_name, split=recipe_args.dataset_split), tokenizer)


def main(argv=None):
    rewards = [gsm8k_format_reward, gsm8k_correctness_reward]
    return run_recipe(DEFAULTS, rewards, build_dataset, argv, alphabet=string.printable)


if __name__ == "__main__":
    main()
