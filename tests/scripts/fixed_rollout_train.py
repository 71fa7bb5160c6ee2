"""Train a tiny model on fixed completions and save its full parameters (for stage-invariance tests).

    python tests/scripts/fixed_rollout_train.py OUT_DIR PER_DEVICE_BATCH [STEPS]
    accelerate launch --num_processes 2 --config_file accelerate_configs/zero3.yaml --mixed_precision no \
        tests/scripts/fixed_rollout_train.py OUT_DIR PER_DEVICE_BATCH [STEPS]

Completions depend only on the prompt and the row's place in its group, so one process with a
per-device batch of 2P sees the same global batch as two processes with P each.
"""

import sys

import torch
from datasets import Dataset
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed
from hf_grpo.generation import HFGenerateBackend
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

GROUP = 4
TOKENIZER = build_char_tokenizer()
LETTERS = TOKENIZER.convert_tokens_to_ids(list("abcab"))


class FixedBackend(HFGenerateBackend):
    def generate(self, model, prompt_ids, **kwargs):
        return [[LETTERS[(len(p) + row % GROUP) % 5]] * (1 + row % GROUP) + [TOKENIZER.eos_token_id]
                for row, p in enumerate(prompt_ids)]


def reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def main(out_dir, per_device_batch, steps):
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=steps, seed=3,
        per_device_train_batch_size=per_device_batch, num_generations=GROUP, max_completion_length=6,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no", logging_steps=1,
        disable_tqdm=True, activation_checkpointing=False, tensor_batch_size=5, max_grad_norm=0.0,
    )
    prompts = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]
    trainer = GRPOTrainer(
        model=build_tiny_model(TOKENIZER, seed=0), reward_funcs=reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts * 4}), processing_class=TOKENIZER,
    )
    trainer.decisions.backend = FixedBackend()
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = list(model.parameters())
    if is_deepspeed_zero3_enabled():
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    if trainer.is_world_process_zero():
        torch.save(state, f"{out_dir}/params.pt")
    close_distributed(trainer)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
