"""Countdown with a masked-diffusion LM (diffu-GRPO, the d1 method): LLaDA-8B-Instruct + LoRA by default.

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/diffu_countdown.py --config recipes/diffu_countdown.yaml
    python recipes/diffu_countdown.py --tiny --max_steps 5 --max_completion_length 16 --block_length 8 --diffusion_steps 8
                                                            # offline smoke run with a tiny bidirectional model on CPU
    python recipes/diffu_countdown.py --model_name_or_path ./my-diffusion-checkpoint --trust_remote_code true

The sampler and estimator settings default to d1's published ones (DiffuGRPOConfig's defaults): 256
completion tokens in blocks of 32, 128 denoising steps, low-confidence remasking, prompt tokens masked
with p=0.15; the YAML adds T 0.9, epsilon 0.5, beta 0.04, num_iterations 12, lr 3e-6, max_grad_norm 0.2,
and d1's loss term by term (``objective="d1"``: bnpo token mean, plain k3 KL, advantages r - mean, raw-logit
scoring). Any of them is a flag (--block_length 64, --logprob_estimator coupled, --objective none, ...).
Reward: 1.0 for a correct equation using every number once, 0.1 for a well-formed wrong one.
"""

import string

from hf_grpo.recipe_support.diffusion_launch import run_diffu_recipe
from hf_grpo.recipe_support.launch import chat_prompts_if_templated
from hf_grpo.recipe_support.rewards import countdown_reward
from hf_grpo.recipe_support.tasks import countdown_dataset

DEFAULTS = dict(
    output_dir="outputs/diffu_countdown",
    model_name_or_path="GSAI-ML/LLaDA-8B-Instruct",
    trust_remote_code=True,
    use_peft=True,
    lora_r=128,
    lora_alpha=64,
    lora_dropout=0.05,
    lora_target_modules=["q_proj", "k_proj", "v_proj"],
    gradient_checkpointing=False,  # LLaDA's remote code does not implement transformers' checkpointing
    learning_rate=3e-6,
    max_grad_norm=0.2,
    per_device_train_batch_size=6,
    num_generations=6,
    max_completion_length=256,
    temperature=0.9,
    epsilon=0.5,
    beta=0.04,
    num_iterations=12,
    objective="d1",  # d1's loss: bnpo, plain k3 KL, r - mean advantages, raw-logit scoring
    max_steps=500,
    logging_steps=5,
    save_steps=100,
    report_to="none",
    num_train_samples=20000,
)


def build_dataset(recipe_args, training_args, tokenizer):
    return chat_prompts_if_templated(countdown_dataset(recipe_args.num_train_samples, seed=training_args.seed), tokenizer)


def main(argv=None):
    return run_diffu_recipe(DEFAULTS, countdown_reward, build_dataset, argv, alphabet=string.printable)


if __name__ == "__main__":
    main()
