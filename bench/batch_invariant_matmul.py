"""Time the batch-invariant GEMM (``hf_grpo/ops/_triton_invariant.py``) against cuBLAS on a model's linear shapes, for
a decode step's rows and a training forward's, under several tile configurations; prints one JSON line per shape.

A configuration may depend on the weight's shape only (never on the number of rows: that would break the
invariance), so each shape's pick weighs a rollout's decode steps against a step's training forwards:
``objective = decode_steps x t(decode rows) + forwards x t(train rows)``.

    python bench/batch_invariant_matmul.py --shape 1.5b --decode_rows 32 --train_rows 16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from hf_grpo.ops import _triton_invariant as kernels
from hf_grpo.recipe_support.tiny import SHAPES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402

CANDIDATES = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 32, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3),
              (128, 64, 64, 4, 3), (128, 32, 64, 4, 4), (128, 64, 128, 8, 3), (128, 256, 64, 8, 3), (64, 32, 128, 4, 3)]


def timed(fn, reps: int = 20) -> float:
    """Seconds a call takes on the GPU: ``reps`` calls captured in one CUDA graph and replayed, as the decoder replays
    its step (timed with host launches, a 30 us launch would hide a 5 us decode GEMM)."""
    fn()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1.5b", choices=["0.5b", "1.5b", "7b"])
    parser.add_argument("--decode_rows", type=int, default=32)
    parser.add_argument("--train_rows", type=int, default=16384)
    parser.add_argument("--decode_steps", type=int, default=512, help="a rollout's one-token steps")
    parser.add_argument("--forwards", type=int, default=4, help="training forwards a step (reference, policy, recompute)")
    args = parser.parse_args()
    dims = SHAPES[args.shape]
    h, i = dims["hidden_size"], dims["intermediate_size"]
    kv = dims["num_key_value_heads"] * h // dims["num_attention_heads"]
    shapes = {"q/o": (h, h), "k/v": (kv, h), "gate/up": (i, h), "down": (h, i), "lm_head": (dims["vocab_size"], h)}
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        row = dict(bench="batch_invariant_matmul", shape=args.shape, weight=name, n=n, k=k, gpu=torch.cuda.get_device_name())
        for label, m in (("decode", args.decode_rows), ("train", args.train_rows)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reps = 20 if label == "decode" else 3  # each call's output stays allocated in the graph's pool
            row[f"cublas_{label}_us"] = round(timed(lambda: torch.nn.functional.linear(x, weight), reps) * 1e6, 1)
            row[f"configs_{label}_us"] = {
                str(c): round(timed(lambda c=c: kernels.matmul(x, weight, None, c), reps) * 1e6, 1) for c in CANDIDATES}
            del x
        objective = {c: args.decode_steps * row["configs_decode_us"][c] + args.forwards * row["configs_train_us"][c]
                     for c in row["configs_decode_us"]}
        row["best"] = min(objective, key=objective.get)
        row["objective_us"] = {c: round(v) for c, v in objective.items()}
        row["cublas_objective_us"] = round(args.decode_steps * row["cublas_decode_us"] + args.forwards
                                           * row["cublas_train_us"])
        print(json.dumps(with_provenance(row)), flush=True)


if __name__ == "__main__":
    main()
