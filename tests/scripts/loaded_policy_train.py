"""A policy loaded from a saved checkpoint before the trainer is built, trained with a reference model (beta > 0).

    accelerate launch --num_processes 2 --config_file accelerate_configs/zero3.yaml --mixed_precision no \
        tests/scripts/loaded_policy_train.py CHECKPOINT OUT_DIR

As a user's script does it: ``from_pretrained(CHECKPOINT)``, then ``GRPOTrainer(model=that model)``; TRL loads the
reference from the policy's path (under ZeRO-3 inside ``zero.Init``). Rank 0 writes the logged rows to
OUT_DIR/logged.json.
"""

import json
import os
import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed


def reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def main(checkpoint, out_dir):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)  # before the config: no zero.Init around it
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=2, seed=3, beta=0.04,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, learning_rate=0.05,
        save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    prompts = ["ab>", "c>", "defg>", "h>"]
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts * 4}))
    trainer.train()
    if trainer.is_world_process_zero():
        rows = [row for row in trainer.state.log_history if "loss" in row]
        with open(os.path.join(out_dir, "logged.json"), "w") as handle:
            json.dump(rows, handle)
    close_distributed(trainer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
