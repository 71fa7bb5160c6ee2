"""Countdown: reach a target from 3-4 numbers with + - * / (data generated locally, seeded).

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/countdown.py --config recipes/countdown.yaml
    python recipes/countdown.py --tiny --max_steps 5          # offline smoke run with a tiny model on CPU

Reward: 1.0 for a correct equation using every number once, 0.1 for a well-formed wrong one
(hf_grpo.rewards.countdown_reward).
"""

import string

from hf_grpo import GRPOTrainer
from hf_grpo.launch import finish, load_model_and_tokenizer, metrics_callback, parse_recipe_args, peft_config
from hf_grpo.rewards import countdown_reward
from hf_grpo.tasks import as_chat, countdown_dataset

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


def build_dataset(recipe_args, tokenizer, seed):
    dataset = countdown_dataset(recipe_args.num_train_samples, seed=seed)
    if tokenizer.chat_template:  # chat models get the prompt as a user turn; TRL applies the template
        dataset = dataset.map(lambda row: {"prompt": as_chat(row["prompt"])})
    return dataset


def main(argv=None):
    training_args, recipe_args, model_args = parse_recipe_args(DEFAULTS, argv)
    model, tokenizer = load_model_and_tokenizer(model_args, recipe_args, training_args, alphabet=string.printable)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=countdown_reward,
        args=training_args,
        train_dataset=build_dataset(recipe_args, tokenizer, training_args.seed),
        processing_class=tokenizer,
        peft_config=peft_config(model_args),
        callbacks=[metrics_callback(training_args)],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    finish(trainer, recipe_args)
    return trainer


if __name__ == "__main__":
    main()
