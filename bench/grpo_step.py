"""Whole GRPO step time and peak memory: hf_grpo.GRPOTrainer against trl.GRPOTrainer, same config.

    python bench/grpo_step.py --impl trl      --shape 0.5b     # TRL 1.16 default generation
    python bench/grpo_step.py --impl hf_grpo  --shape 0.5b     # generation_backend=auto (cuda_graph on CUDA)

Random-init Qwen2-shaped model (vocabulary 151936), 64-token random prompts, completions forced to
full length (min_new_tokens), bf16. Prints one JSON line; --out appends it to a file. Run each
implementation in its own process so their peak memory does not mix.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch
from datasets import Dataset
from transformers import TrainerCallback

from rollout import SHAPES, VOCAB, build_tokenizer  # bench/ is on sys.path when this script runs


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_begin(self, *args, **kwargs):
        torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["trl", "hf_grpo"], required=True)
    parser.add_argument("--shape", choices=SHAPES, default="0.5b")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--steps_per_generation", type=int, default=4)
    parser.add_argument("--completion_len", type=int, default=512)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--backend", default="auto", help="hf_grpo generation_backend")
    parser.add_argument("--per_device_generation_batch_size", type=int, default=None)
    parser.add_argument("--tensor_batch_size", type=int, default=4096)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from hf_grpo.recipe_support.tiny import build_tiny_model

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, shape=args.shape, dtype=torch.bfloat16)
    rng = random.Random(0)
    dataset = Dataset.from_dict({"prompt": [" ".join(f"t{rng.randrange(2, VOCAB)}" for _ in range(64))
                                            for _ in range(4096)]})

    def reward(completions, **kwargs):
        return [rng.random() for _ in completions]

    common = dict(
        output_dir="/tmp/grpo_step_bench", per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
        gradient_accumulation_steps=args.steps_per_generation, max_completion_length=args.completion_len,
        max_steps=args.max_steps, logging_steps=1, report_to=[], save_strategy="no", bf16=True,
        activation_checkpointing=args.activation_checkpointing, disable_tqdm=True, temperature=1.0,
        generation_kwargs={"min_new_tokens": args.completion_len},
    )
    if args.impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common)
    else:
        from hf_grpo import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common, generation_backend=args.backend, tensor_batch_size=args.tensor_batch_size,
                            per_device_generation_batch_size=args.per_device_generation_batch_size)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    generation_times = []
    generate = trainer._generate_single_turn

    def timed_generate(*a, **k):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(*a, **k)
        torch.cuda.synchronize()
        generation_times.append(time.perf_counter() - start)
        return out

    trainer._generate_single_turn = timed_generate
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    completions = args.per_device_train_batch_size * args.steps_per_generation
    record = dict(
        impl=args.impl, backend=getattr(getattr(trainer, "_backend", None), "name", "trl"), model_shape=args.shape,
        completions=completions, completion_len=args.completion_len,
        step_s=[round(t, 3) for t in timer.times], generation_s=[round(t, 3) for t in generation_times],
        # the first step pays for warm-up (CUDA graph capture, allocator growth): report the later ones
        step_s_median=round(statistics.median(timer.times[1:] or timer.times), 3),
        generation_s_median=round(statistics.median(generation_times[1:] or generation_times), 3),
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), gpu=torch.cuda.get_device_name(),
    )
    record["generated_tokens_per_s"] = round(completions * args.completion_len / record["generation_s_median"])
    record = with_provenance(record)
    print("RESULT", json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
