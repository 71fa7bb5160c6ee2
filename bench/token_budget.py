"""Token-budget micro-batches on a GPU: peak memory and time of one training micro-batch, one pass vs packed.

One micro-batch of ``--rows`` completions with long-tailed lengths (most short, a few of
``--max_completion`` tokens, prompts of ``--min_prompt``..``--max_prompt``), as a rollout with long
reasoning traces gives: TRL runs it as one padded tensor, rows x (longest prompt + longest completion);
``max_tokens_per_micro_batch`` runs it as passes of at most that many padded tokens. For each budget
(``none`` = one pass), ``hf_grpo.GRPOTrainer.compute_loss`` + backward on a random-init
Qwen2-0.5B-shaped model (bf16, built from a config: no download) is timed ``--repeats`` times; one JSON
line per budget (``RESULT {...}``; also appended to ``--out``): peak allocated memory, median seconds,
passes, padded tokens actually run, and the gradient's relative difference to the one-pass gradient
(``out_of_memory: true`` where a run did not fit).

Beside them, what a user does without a budget (``--fixed_rows``): a smaller fixed micro-batch of k rows,
accumulated over B / k micro-batches, each padded to the whole rollout's width as TRL's micro-batches are.
Its record says ``fixed_rows`` instead of ``budget``. No run retries at a smaller size after an
out-of-memory (``hf_grpo.memory.train_backoff`` is off): the bench measures each setting as given.

On the GPU machine, from the repository root:

    python bench/token_budget.py --out bench/results/raw/token_budget.jsonl

CPU smoke test (tiny model, short lengths):

    python bench/token_budget.py --tiny
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch
from datasets import Dataset

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.memory import token_budget
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short lengths")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--min_prompt", type=int, default=64)
    parser.add_argument("--max_prompt", type=int, default=512)
    parser.add_argument("--max_completion", type=int, default=4096)
    parser.add_argument("--long_fraction", type=float, default=0.15, help="share of completions of full length")
    parser.add_argument("--budgets", default="none,8192,16384,32768")
    parser.add_argument("--fixed_rows", default="2,4,8", help="fixed micro-batches of k rows (k divides --rows)")
    parser.add_argument("--loss_type", default="grpo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.rows, args.min_prompt, args.max_prompt, args.max_completion = 8, 3, 12, 24
        args.budgets, args.repeats, args.fixed_rows = "none,48,96", 1, "2,4"
    return args


def micro_batch(args, device, vocab: int):
    """Left-padded prompts, right-padded completions: mostly short, ``long_fraction`` of full length."""
    rng = random.Random(args.seed)
    prompts = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.rows)]
    completions = [args.max_completion if rng.random() < args.long_fraction
                   else rng.randint(1, max(1, args.max_completion // 8)) for _ in range(args.rows)]
    width_p, width_c = max(prompts), max(completions)
    prompt_mask = torch.zeros(args.rows, width_p, dtype=torch.long)
    completion_mask = torch.zeros(args.rows, width_c, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        prompt_mask[row, width_p - p:] = 1
        completion_mask[row, :c] = 1
    g = torch.Generator().manual_seed(args.seed)
    inputs = {
        "prompt_ids": torch.randint(2, vocab, (args.rows, width_p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(2, vocab, (args.rows, width_c), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(args.rows, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def build_trainer(args, budget_max: int, output_dir: str) -> GRPOTrainer:
    tokenizer = build_char_tokenizer()
    cuda = torch.cuda.is_available() and not args.tiny
    model = build_tiny_model(tokenizer, shape="tiny" if args.tiny else "0.5b",
                             dtype=torch.bfloat16 if cuda else torch.float32)
    config = GRPOConfig(
        output_dir=output_dir, report_to=[], use_cpu=not cuda, bf16=cuda, per_device_train_batch_size=args.rows,
        num_generations=2, max_completion_length=args.max_completion, loss_type=args.loss_type,
        max_tokens_per_micro_batch=budget_max, activation_checkpointing=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                          train_dataset=Dataset.from_dict({"prompt": ["a"] * args.rows}), processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._train_backoff = None  # measure each setting as given, not a retry at half the budget
    return trainer


def fixed_micro_batches(trainer, inputs, rows_per_micro_batch: int):
    """The rows in fixed micro-batches of ``rows_per_micro_batch`` (full width each), gradients accumulated;
    each loss scaled by its share of the whole micro-batch's, so the sum is the one-pass gradient."""
    rows = inputs["prompt_ids"].shape[0]
    if rows % rows_per_micro_batch:
        raise SystemExit(f"--fixed_rows {rows_per_micro_batch} must divide --rows {rows}")
    for start in range(0, rows, rows_per_micro_batch):
        part = {key: value[start:start + rows_per_micro_batch] if value.dim() and value.shape[0] == rows else value
                for key, value in inputs.items()}
        scale = token_budget.pass_scale(trainer.loss_type, part, inputs)
        trainer.accelerator.backward(trainer.compute_loss(trainer.model, part) * scale)


def measure(trainer, inputs, budget, repeats, fixed_rows=None):
    trainer.sizes.max_tokens_per_micro_batch = budget
    cuda = inputs["prompt_ids"].is_cuda
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        trainer.model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if fixed_rows is None:
            trainer.accelerator.backward(trainer.compute_loss(trainer.model, inputs))
        else:
            fixed_micro_batches(trainer, inputs, fixed_rows)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    grad = torch.cat([p.grad.float().flatten() for p in trainer.model.parameters() if p.grad is not None])
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return statistics.median(times[1:]), peak, grad


def main(argv=None):
    args = parse_args(argv)
    budgets = [None if b == "none" else int(b) for b in args.budgets.split(",")]
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(args, max(b for b in budgets if b is not None), output_dir)
        inputs = micro_batch(args, trainer.accelerator.device, len(build_char_tokenizer()))
        ext = token_budget.extents(inputs)
        reference = None
        settings = [(budget, None) for budget in budgets] + [(None, int(k)) for k in args.fixed_rows.split(",") if k]
        for budget, fixed in settings:
            if fixed is not None:
                passes = [list(range(start, start + fixed)) for start in range(0, args.rows, fixed)]
            else:
                passes = [list(range(args.rows))] if budget is None else token_budget.plan_passes(ext, budget)
            try:
                seconds, peak, grad = measure(trainer, inputs, budget, args.repeats, fixed)
                oom = False
            except torch.cuda.OutOfMemoryError:  # the one-pass baseline may not fit: that is the point
                seconds, peak, grad, oom = None, None, None, True
                trainer.model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            reference = grad if reference is None and budget is None and fixed is None else reference
            diff = None if reference is None or grad is None else ((grad - reference).norm() / reference.norm()).item()
            full_width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
            record = {
                "budget": budget, "fixed_rows": fixed, "rows": args.rows, "loss_type": args.loss_type,
                "passes": len(passes),
                "rows_per_pass": [len(rows) for rows in passes],
                "padded_tokens": (sum(token_budget.pass_tokens(rows, ext) for rows in passes) if fixed is None
                                  else args.rows * full_width),
                "real_tokens": int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()),
                "out_of_memory": oom, "seconds": seconds, "peak_allocated_gib": peak, "grad_rel_diff_vs_one_pass": diff,
                "device": torch.cuda.get_device_name() if inputs["prompt_ids"].is_cuda else "cpu",
            }
            record = with_provenance(record)
            print("RESULT " + json.dumps(record), flush=True)
            if args.out:
                with open(args.out, "a") as handle:
                    handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
