"""Countdown with a masked-diffusion LM (diffu-GRPO, the d1 method): LLaDA-8B-Instruct + LoRA by default.

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/diffu_countdown.py --config recipes/diffu_countdown.yaml --trust_remote_code true
    python recipes/diffu_countdown.py --tiny --max_steps 5 --max_completion_length 16 --block_length 8 --diffusion_steps 8
                                                            # offline smoke run with a tiny bidirectional model on CPU
    python recipes/diffu_countdown.py --model_name_or_path ./my-diffusion-checkpoint --trust_remote_code true

Remote code is opt-in: LLaDA and Dream ship their own modelling code, which runs only with
``--trust_remote_code true`` (the YAML keeps it false; a checkpoint that needs it without the flag is refused,
naming the flag). The ``--tiny`` model is transformers' own Qwen2 class and needs none.

The sampler and estimator settings default to d1's published ones (DiffuGRPOConfig's defaults): 256
completion tokens in blocks of 32, 128 denoising steps, low-confidence remasking, prompt tokens masked
with p=0.15; the YAML adds T 0.9, epsilon 0.5, beta 0.04, num_iterations 12, lr 3e-6, max_grad_norm 0.2,
and d1's loss term by term (``objective="d1"``: bnpo token mean, plain k3 KL, advantages r - mean, raw-logit
scoring). Any of them is a flag (--block_length 64, --logprob_estimator coupled, --objective none, ...).
Reward: 1.0 for a correct equation using every number once, 0.1 for a well-formed wrong one.
"""

import string

from hf_grpo.recipe_support.diffusion_launch import run_diffu_recipe
from hf_grpo.recipe_support.launch import chat_prompts_if_templated, recipe_defaults
from hf_grpo.recipe_support.rewards import countdown_reward
from hf_grpo.recipe_support.tasks import countdown_dataset

# The settings are written once, in diffu_countdown.yaml. A run without --config takes them but for these keys, which
# the YAML sets for the multi-GPU launch on its first line and which stay at the library's defaults otherwise.
LAUNCH_ONLY = (
    "dtype", "gradient_accumulation_steps", "per_device_generation_batch_size", "tensor_batch_size",
    "save_total_limit", "seed",
)
DEFAULTS = recipe_defaults(__file__, LAUNCH_ONLY)


def build_dataset(recipe_args, training_args, tokenizer):
    return chat_prompts_if_templated(countdown_dataset(recipe_args.num_train_samples, seed=training_args.seed), tokenizer)


def main(argv=None):
    return run_diffu_recipe(DEFAULTS, countdown_reward, build_dataset, argv, alphabet=string.printable)


if __name__ == "__main__":
    main()
