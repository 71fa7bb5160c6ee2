"""A forced out-of-memory on ONE of two GPUs, mid-run: both ranks back off together and the run goes on.

Launched with two processes (DDP), each capped at ``--memory_fraction`` of its GPU; during rollouts 2
and 3 a hog tensor on rank 1 only leaves ``--hog_free_mib`` MiB of its cap free, so rank 1's generation
runs out of memory while rank 0's does not. Without the synchronised back-off rank 0 would wait in the
next collective forever; with it both ranks halve ``per_device_generation_batch_size`` and retry.
Each rank prints ``RESULT {...}``: steps done, back-offs, the final chunk size, peak memory.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2 bench/oom_two_gpus.py

(``--tiny`` runs the same on two CPU processes, with the out-of-memory injected on rank 1.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--memory_fraction", type=float, default=0.4)
    parser.add_argument("--hog_free_mib", type=int, default=160)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=256)
    parser.add_argument("--min_prompt", type=int, default=32)
    parser.add_argument("--max_prompt", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tiny:
        args.max_completion_length, args.min_prompt, args.max_prompt = 8, 2, 12

    from accelerate import PartialState

    state = PartialState(cpu=args.tiny)  # sets this rank's device before anything is allocated
    args.device = "cpu" if args.tiny else "cuda"
    if not args.tiny:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)

    import autotune  # bench/autotune.py: the model, the prompts, the hog

    from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed

    model, tokenizer, dataset = autotune.build(args)
    config = GRPOConfig(
        output_dir=f"/tmp/oom_two_gpus_{state.process_index}", num_generations=8 if not args.tiny else 4,
        max_completion_length=args.max_completion_length, beta=0.0, learning_rate=1e-6, max_steps=args.max_steps,
        logging_steps=1, save_strategy="no", report_to=[], bf16=not args.tiny, use_cpu=args.tiny,
        disable_tqdm=True, seed=args.seed, generation_backend="hf", **autotune.sizes_for(args, "default"),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [random.random() for _ in completions],
                          args=config, train_dataset=dataset, processing_class=tokenizer)
    chunk_before = trainer.sizes.per_device_generation_batch_size
    if state.process_index == 1:
        autotune.hog_rollouts(trainer, args)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    record = dict(
        bench="oom_two_gpus", rank=state.process_index, world_size=state.num_processes,
        device=torch.cuda.get_device_name() if not args.tiny else "cpu", memory_fraction=args.memory_fraction,
        hog_on_rank=1, steps_done=trainer.state.global_step, max_steps=args.max_steps,
        oom_backoffs=sum(entry.get("perf/oom_backoffs", 0) for entry in logged),
        generation_chunk=[chunk_before, trainer.sizes.per_device_generation_batch_size],
        losses=[entry["loss"] for entry in logged],
        peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if not args.tiny else None,
    )
    print("RESULT " + json.dumps(with_provenance(record)), flush=True)
    close_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
