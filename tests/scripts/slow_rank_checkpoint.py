"""Two ranks under DDP saving a checkpoint each step, rank 1 slow to write its random state (a rank being stopped).

    accelerate launch --num_processes 2 --config_file accelerate_configs/multi_gpu.yaml --mixed_precision no \
        tests/scripts/slow_rank_checkpoint.py OUT_DIR

Rank 0 writes OUT_DIR/marked_complete.json: for each checkpoint, the random-state files and hf-grpo's sizes file
present when its ``trainer_state.json`` (what marks a checkpoint complete) was written.
"""

import json
import os
import sys
import time

from datasets import Dataset
from transformers import TrainerState

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed
from hf_grpo.memory.autosize import SIZES_FILE
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()


class SlowRankOne(GRPOTrainer):
    def _save_rng_state(self, output_dir):
        if self.accelerator.process_index == 1:
            time.sleep(3.0)
        super()._save_rng_state(output_dir)


def main(out_dir):
    seen = {}
    save_state = TrainerState.save_to_json

    def recording_save(state, json_path):
        checkpoint = os.path.dirname(json_path)
        seen[os.path.basename(checkpoint)] = sorted(n for n in os.listdir(checkpoint)
                                                    if n.startswith("rng_state") or n == SIZES_FILE)
        save_state(state, json_path)

    TrainerState.save_to_json = recording_save
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=2, seed=3, logging_steps=1,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4, max_completion_length=4,
        learning_rate=0.1, optim="sgd", save_strategy="steps", save_steps=1, disable_tqdm=True,
        activation_checkpointing=False, generation_backend="hf",
    )
    trainer = SlowRankOne(model=build_tiny_model(TOKENIZER, seed=0), args=args, processing_class=TOKENIZER,
                          reward_funcs=lambda completions, **kwargs: [len(c) / 4 for c in completions],
                          train_dataset=Dataset.from_dict({"prompt": ["ab>", "c>", "def>", "g>"] * 4}))
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(os.path.join(out_dir, "marked_complete.json"), "w") as handle:
            json.dump(seen, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    close_distributed()
