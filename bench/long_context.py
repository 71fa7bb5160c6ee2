"""The longest completion that fits: a whole GRPO step at rising completion lengths until one does not fit.

For a model shape (``--shape``, e.g. ``7b``), full fine-tuning or LoRA (``--lora_r``) and a number of
generations, each length of ``--lengths`` runs ``bench/grpo_realistic.py`` in its own process (a failed
length cannot leave memory behind for the next) with every completion running to the cap (``--eos_prob 0``),
one micro-batch a completion and activation checkpointing. The ladder stops at the first length that runs
out of memory or past ``--timeout``. One JSON line per length: ``fits``, the step time, decode tokens/s,
peak memory allocated and reserved, and the run's own record under ``run``; a last line names the longest
length that fitted. ``--trl`` also runs TRL's trainer at each length that hf_grpo fitted, under the same
time limit (TRL's one ``model.generate`` call is far slower at these lengths; a run past the limit is
recorded as ``"fits": null, "why": "time"``).

    python bench/long_context.py --shape 7b --lora_r 16 --num_generations 8 --lengths 8192,16384,20480,32768 \\
        --out bench/results/raw/long_context.jsonl

``--double_from 16384`` climbs 16k, 32k, 64k, ... instead, until a length does not fit (``--up_to`` caps it). The
last line also carries ``estimated_longest``: what ``hf_grpo.memory.context_fit`` says the device fits (GPU only).

CPU smoke run (tiny model, two short lengths): ``python bench/long_context.py --device cpu --shape tiny
--num_generations 2 --lengths 8,16 --steps 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository: hf_grpo
OUT_OF_MEMORY = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


def run_length(args, impl: str, length: int) -> dict:
    """One whole run of ``grpo_realistic.py`` at ``length`` tokens a completion; what it printed, summarised."""
    command = [
        sys.executable, os.path.join(HERE, "grpo_realistic.py"), "--impl", impl, "--shape", args.shape,
        "--device", args.device, "--num_generations", str(args.num_generations),
        "--per_device_train_batch_size", "1", "--steps_per_generation", str(args.num_generations),
        "--gradient_accumulation_steps", str(args.num_generations), "--max_completion_length", str(length),
        "--min_prompt", str(args.min_prompt), "--max_prompt", str(args.max_prompt), "--eos_prob", "0",
        "--max_steps", str(args.steps), "--num_prompts", "64", "--phases",
    ]
    if args.lora_r:
        command += ["--lora_r", str(args.lora_r)]
    if args.device == "cuda":
        command += ["--checkpointing", "on"]
    record = {"bench": "long_context", "impl": impl, "shape": args.shape, "lora_r": args.lora_r,
              "num_generations": args.num_generations, "completion_len": length, "steps": args.steps}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**record, "fits": None, "why": "time", "timeout_s": args.timeout}
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode == 0 and lines:
        run = json.loads(lines[-1][len("RESULT "):])
        later = run.get("step_s_mean_after_first")
        return {**record, "fits": True, "step_s": run["step_s"], "later_step_s": later,
                "generation_s": run["generation_s"], "decode_tokens_per_s": run["generated_tokens_per_s"],
                "peak_mem_gib": run.get("peak_mem_gib"), "peak_reserved_gib": run.get("peak_reserved_gib"), "run": run}
    tail = (result.stderr or result.stdout)[-2000:]
    if any(marker in tail for marker in OUT_OF_MEMORY):
        return {**record, "fits": False, "why": "out of memory", "tail": tail[-400:]}
    return {**record, "fits": None, "why": f"exit {result.returncode}", "tail": tail}


def copy_bandwidth_bytes_per_s(gib: float = 4.0, repeats: int = 10) -> float:
    """What a device-to-device copy reaches on this GPU (bytes read plus written a second): the floor's speed."""
    import torch

    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del source, target
    torch.cuda.empty_cache()
    return 2 * repeats * gib * 2**30 / seconds


def cache_bytes_per_position(config) -> int:
    """The KV cache's bytes at one position of one row: every layer's keys and values, bf16 (``config``: a model
    config, or anything with its attributes)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2


def decode_floor(record: dict, args, bandwidth: float) -> dict:
    """A decode step of the last rollout (a later step's with ``--steps`` 2 or more: no compile or capture in it)
    against the time to read the weights and the rows' filled caches once (on average the prompt and half the
    completion) at ``bandwidth``. The rollout's steps are its longest completion's tokens: a row that samples its
    end early leaves fewer tokens, not fewer steps."""
    from types import SimpleNamespace

    from hf_grpo.recipe_support.tiny import SHAPES

    dims = SHAPES[args.shape]
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    filled = (args.min_prompt + args.max_prompt) / 2 + record["completion_len"] / 2
    cache_bytes = args.num_generations * filled * cache_bytes_per_position(SimpleNamespace(**dims))
    h, inner, kv = dims["hidden_size"], dims["intermediate_size"], dims["num_key_value_heads"] * head_dim
    layer = 2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * inner + 2 * h  # q, o; k, v; biases; MLP; norms
    embeddings = dims["vocab_size"] * h * (1 if dims["tie_word_embeddings"] else 2)
    weight_bytes = 2 * (dims["num_hidden_layers"] * layer + embeddings + h)  # bf16; the merged LoRA adds none
    floor_ms = (weight_bytes + cache_bytes) / bandwidth * 1e3
    step_ms = 1e3 * record["run"]["generation_s"][-1] / record["run"]["rollout_max_len"][-1]
    return {"copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "weights_gb": round(weight_bytes / 1e9, 2),
            "mean_cache_gb": round(cache_bytes / 1e9, 2), "decode_floor_ms": round(floor_ms, 3),
            "decode_step_ms": round(step_ms, 3), "decode_step_over_floor": round(step_ms / floor_ms, 3)}


def ladder(start: int, up_to: int) -> list[int]:
    """``start``, twice it, ... while at most ``up_to``."""
    if start < 1:
        raise ValueError(f"--double_from must be positive, got {start}")
    lengths = []
    while start <= up_to:
        lengths.append(start)
        start *= 2
    return lengths


def estimated_longest(args, device_bytes: int | None = None) -> int | None:
    """What ``hf_grpo.memory.context_fit`` says this shape fits on the device (None on CPU): the measured ladder's
    longest beside the estimate's. The runs' own settings: one row a pass, checkpointing, the longest prompt."""
    from hf_grpo.memory import context_fit
    from hf_grpo.recipe_support.tiny import SHAPES

    if SHAPES[args.shape]["vocab_size"] is None:  # the tiny shape's vocabulary is its tokenizer's
        return None
    if device_bytes is None:
        if args.device != "cuda":
            return None
        import torch

        device_bytes = torch.cuda.get_device_properties(0).total_memory
    dims = context_fit.ModelDims.from_config({**SHAPES[args.shape], "model_type": "qwen2"})
    shape = context_fit.RunShape(prompt=args.max_prompt, generation_rows=args.num_generations, lora_rank=args.lora_r,
                                 checkpointing=args.device == "cuda")
    return context_fit.longest_completion(dims, shape, device_bytes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="7b", help="a shape of hf_grpo.recipe_support.tiny.SHAPES")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--lengths", default="8192,16384,20480,32768", help="comma-separated, rising")
    parser.add_argument("--double_from", type=int, default=None,
                        help="instead of --lengths: this length, then twice it, ... up to --up_to (the climb stops "
                        "at the first that does not fit)")
    parser.add_argument("--up_to", type=int, default=1 << 20, help="the longest length --double_from tries")
    parser.add_argument("--min_prompt", type=int, default=192)
    parser.add_argument("--max_prompt", type=int, default=320)
    parser.add_argument("--steps", type=int, default=1, help="steps a length runs (2 or more: a later step)")
    parser.add_argument("--timeout", type=float, default=580, help="seconds one length's run may take")
    parser.add_argument("--trl", action="store_true", help="also run TRL's trainer at each length that fitted")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lengths = ladder(args.double_from, args.up_to) if args.double_from else [int(n) for n in args.lengths.split(",")]
    if lengths != sorted(lengths) or any(n < 1 for n in lengths):
        parser.error(f"--lengths must be positive and rising, got {args.lengths!r}")
    if args.num_generations < 2:
        parser.error(f"--num_generations must be at least 2 (a GRPO group), got {args.num_generations}")
    records = []
    longest = None
    bandwidth = copy_bandwidth_bytes_per_s() if args.device == "cuda" else None
    for length in lengths:
        record = run_length(args, "hf_grpo", length)
        if record["fits"] and bandwidth is not None:
            record.update(decode_floor(record, args, bandwidth))
        record = with_provenance(record)
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "run"}), flush=True)
        if not record["fits"]:
            break
        longest = length
        if args.trl:
            trl_record = with_provenance(run_length(args, "trl", length))
            records.append(trl_record)
            print(json.dumps({k: v for k, v in trl_record.items() if k != "run"}), flush=True)
    summary = with_provenance({"bench": "long_context", "summary": True, "shape": args.shape, "lora_r": args.lora_r,
                               "num_generations": args.num_generations, "longest_fitting": longest,
                               "lengths_tried": [r["completion_len"] for r in records if r["impl"] == "hf_grpo"],
                               "estimated_longest": estimated_longest(args)})
    records.append(summary)
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
