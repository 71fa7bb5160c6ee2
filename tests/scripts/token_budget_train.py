"""Train a float64 tiny model (float32 under ZeRO-3) on fixed completions, with or without a token budget, and save
its parameters.

    accelerate launch --num_processes 2 --config_file accelerate_configs/multi_gpu.yaml --mixed_precision no \
        tests/scripts/token_budget_train.py OUT_DIR BUDGET_OR_none [BUDGET_OR_none ...]

(or zero2.yaml, zero3.yaml). Each budget trains in turn in the same two processes (tests/scripts/one_launch.py),
into OUT_DIR/budget_<BUDGET_OR_none>. Each rank gets other prompts (lengths 2 to 12) and completions (1 to 4
tokens), so the ranks need different numbers of token-budget passes; each rank writes
``passes_rank<r>.json``: per micro-batch, the passes its own rows needed and the passes it ran. RoPE
angles are computed in float64, so packing is exact to rounding.
"""

import json
import os
import sys

import torch
from datasets import Dataset

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed
from hf_grpo.generation import HFGenerateBackend
from hf_grpo.generation.weight_sources import gathered
from hf_grpo.memory import packing
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

GROUP = 4
TOKENIZER = build_char_tokenizer()
LETTERS = TOKENIZER.convert_tokens_to_ids(list("abcab"))
PROMPTS = ["a>", "bcdefghijk>", "c>", "defghijklmn>", "e>", "fg>", "hijklmnopq>", "r>"]


class FixedBackend(HFGenerateBackend):
    def generate(self, model, prompt_ids, **kwargs):
        return [[LETTERS[(len(p) + row % GROUP) % 5]] * (row % GROUP) + [TOKENIZER.eos_token_id]
                for row, p in enumerate(prompt_ids)]


def reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def float64_rope(model):
    """RoPE angles in float64 (transformers computes them in float32 even for a float64 model)."""
    rotary = model.model.rotary_emb
    dim = 2 * rotary.inv_freq.numel()
    theta = model.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def forward(x, position_ids):
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        scale = rotary.attention_scaling
        return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)

    rotary.forward = forward
    return model


PLAN_PASSES = packing.plan_passes  # the real one: a second run in the process records around it, not around the first's


def record_pass_counts(counts):
    real = PLAN_PASSES

    def recording(ext, budget, agree=lambda count: count):
        passes = real(ext, budget, agree)
        counts.append([len(packing.first_fit_decreasing(ext, budget)), len(passes)])
        return passes

    packing.plan_passes = recording


def model_dtype() -> torch.dtype:
    """float64, except under ZeRO-3, whose parameter partitioning takes half, bfloat16 or float32 only."""
    return torch.float32 if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3" else torch.float64


def main(out_dir, budget):
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=2, seed=3,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=GROUP,
        max_completion_length=4, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no",
        logging_steps=1, disable_tqdm=True, activation_checkpointing=False, max_grad_norm=0.0, loss_type="bnpo",
        max_tokens_per_micro_batch=budget,
        # two updates per rollout: TRL scores the old policy's log-probs in row chunks cut to the budget, whose
        # widths differ per rank; every rank must run as many chunks (a 2-process run once hung there)
        num_iterations=2,
    )
    trainer = GRPOTrainer(
        model=float64_rope(build_tiny_model(TOKENIZER, seed=0, dtype=model_dtype())), reward_funcs=reward,
        args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=TOKENIZER,
    )
    trainer.decisions.backend = FixedBackend()
    counts = []
    record_pass_counts(counts)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(f"{out_dir}/passes_rank{rank}.json", "w") as handle:
        json.dump(counts, handle)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with gathered(list(model.parameters())):  # ZeRO-3 holds a shard of each parameter on each rank
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    if trainer.is_world_process_zero():
        torch.save(state, f"{out_dir}/params.pt")
    return trainer


if __name__ == "__main__":
    from one_launch import release_for_the_next_run  # next to this file (tests/ imports this file as scripts.*)

    budgets = sys.argv[2:]
    for index, budget in enumerate(budgets):
        run_dir = os.path.join(sys.argv[1], f"budget_{budget}")
        os.makedirs(run_dir, exist_ok=True)
        trainer = main(run_dir, None if budget == "none" else int(budget))
        if index < len(budgets) - 1:
            release_for_the_next_run(trainer)
    close_distributed(trainer)
