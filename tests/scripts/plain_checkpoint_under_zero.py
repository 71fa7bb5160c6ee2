"""A checkpoint saved by one process (no ZeRO state), resumed under 2-process DeepSpeed ZeRO-2.

    python tests/scripts/plain_checkpoint_under_zero.py OUT_DIR save
    accelerate launch --num_processes 2 --config_file accelerate_configs/zero2.yaml --mixed_precision no \
        tests/scripts/plain_checkpoint_under_zero.py OUT_DIR resume

``save`` trains 2 steps with AdamW (16 completions per step), saves OUT_DIR/checkpoint-2 and, by parameter name,
Adam's moments there (OUT_DIR/moments.pt). ``resume`` (8 completions per rank: the same batch) resumes from it;
before its first step rank 0 writes OUT_DIR/loaded.json: for each parameter the largest difference between the
ZeRO engine's full fp32 weight and Adam moments (each rank's partition gathered) and the saved ones, and Adam's step
count; then it trains a third step.
"""

import json
import os
import sys

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()


class CompareLoaded(TrainerCallback):
    def __init__(self, trainer, out_dir):
        self.trainer, self.out_dir = trainer, out_dir

    def on_train_begin(self, args, state, control, **kwargs):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        engine = self.trainer.model_wrapped
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # DeepSpeed links the moments at the first step
        weights = load_file(os.path.join(self.out_dir, "checkpoint-2", "model.safetensors"))
        moments = torch.load(os.path.join(self.out_dir, "moments.pt"))
        adam_steps = sorted({float(s["step"]) for s in engine.optimizer.optimizer.state.values()})
        diffs = {"global_step": state.global_step, "adam_steps": adam_steps}
        for name, param in engine.module.named_parameters():
            found = {"weight": safe_get_full_fp32_param(param)}
            for key in ("exp_avg", "exp_avg_sq"):
                found[key] = safe_get_full_optimizer_state(param, key)
            expected = {"weight": weights[name], **moments[name]}
            diffs[name] = {k: (found[k].cpu() - expected[k]).abs().max().item() for k in found}
            diffs[name]["exp_avg_norm"] = expected["exp_avg"].norm().item()
        if self.trainer.accelerator.is_main_process:
            with open(os.path.join(self.out_dir, "loaded.json"), "w") as handle:
                json.dump(diffs, handle)


def main(out_dir, mode):
    resume = mode == "resume"
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=3 if resume else 2, seed=3,
        logging_steps=1, per_device_train_batch_size=8 if resume else 16, num_generations=4, max_completion_length=4,
        learning_rate=0.01, save_strategy="steps", save_steps=2, disable_tqdm=True, activation_checkpointing=False,
        generation_backend="hf",
    )
    prompts = ["ab>", "c>", "def>", "g>", "hi>", "jkl>", "m>", "no>"]
    trainer = GRPOTrainer(model=build_tiny_model(TOKENIZER, seed=0), args=args, processing_class=TOKENIZER,
                          reward_funcs=lambda completions, **kwargs: [len(c) / 4 for c in completions],
                          train_dataset=Dataset.from_dict({"prompt": prompts * 4}))
    if resume:
        trainer.add_callback(CompareLoaded(trainer, out_dir))
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
        return
    trainer.train()
    state = trainer.optimizer.state
    torch.save({name: {k: state[p][k] for k in ("exp_avg", "exp_avg_sq")}
                for name, p in trainer.model.named_parameters()}, os.path.join(out_dir, "moments.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
    close_distributed()
