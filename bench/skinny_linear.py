"""The decode step's linear layers alone: ``ops.skinny_linear``'s kernel against cuBLAS (``F.linear``), GPU only.

Each product of a decode step at 32 rows (Qwen2.5-7B's q/k/v with its bias, o, gate and up side by side, down, the
LM head; Qwen2.5-1.5B's too), replayed from a CUDA graph over copies of the weight that together overflow L2, as a
step's layers each read their own. One JSON line per (shape, variant): ms a call, the bytes read (weight, input,
bias) per second, that over the copy bandwidth measured first, and the largest difference from a float32 reference
beside cuBLAS's own. ``--sweep`` also times other launch settings of the kernel around ``skinny_linear.choose``'s.

    python bench/skinny_linear.py [--sweep] [--rows 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_grpo.memory import device_rates  # noqa: E402
from hf_grpo.ops import skinny_linear  # noqa: E402

# name: (out_features, in_features, bias)
SHAPES = {
    "7b_qkv": (4608, 3584, True), "7b_o": (3584, 3584, False), "7b_gate_up": (37888, 3584, False),
    "7b_down": (3584, 18944, False), "7b_head": (152064, 3584, False),
    "1.5b_qkv": (2048, 1536, True), "1.5b_o": (1536, 1536, False), "1.5b_gate_up": (17920, 1536, False),
    "1.5b_down": (1536, 8960, False),
}
L2_OVERFLOW_BYTES = 256 * 2**20  # weight copies cycled per shape: several times an H100's or H200's 50-60 MB of L2


def _time_graph(fn, copies: int, calls: int = 24, repeats: int = 5) -> float:
    """ms per call of ``fn(i)``, replayed from a CUDA graph of ``calls`` calls cycling over ``copies``."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def sweep_configs(chosen: skinny_linear.SkinnyConfig, n: int, k: int, sms: int) -> list[skinny_linear.SkinnyConfig]:
    """Settings around ``chosen``: other column blocks, loop steps, splits that keep 1-8 programs per SM, stages."""
    configs = [chosen]
    for block_n, block_k, stages, warps in itertools.product((32, 64, 128), (128, 256), (3, 4, 6), (4, 8)):
        if k % block_k or (block_k == 256 and stages == 6) or (warps == 8 and block_n == 32):
            continue
        blocks, steps = -(-n // block_n), k // block_k
        for splits in sorted({1, 2, 3, 4, 6, 8, 12}):
            if sms <= blocks * splits <= 8 * sms and steps // splits >= 2:
                config = skinny_linear.SkinnyConfig(block_n, block_k, splits, warps, stages)
                if config not in configs:
                    configs.append(config)
    return configs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time launch settings around the chosen ones")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("skinny_linear needs a CUDA device")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; valid: {list(SHAPES)}")
    if not 0 < args.rows <= skinny_linear.MAX_ROWS:
        parser.error(f"--rows must be in 1..{skinny_linear.MAX_ROWS}, got {args.rows}")
    device = torch.device("cuda")
    rates = device_rates.measure(device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for name in args.shapes.split(","):
        n, k, has_bias = SHAPES[name]
        copies = max(2, -(-L2_OVERFLOW_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, generator=g, device=device).bfloat16() * k**-0.5 for _ in range(copies)]
        bias = torch.randn(n, generator=g, device=device).bfloat16() if has_bias else None
        x = torch.randn(args.rows, k, generator=g, device=device).bfloat16()
        expected = F.linear(x.float(), weights[0].float(), None if bias is None else bias.float())
        scale = float(expected.abs().max())
        read = (n * k + args.rows * k + (n if has_bias else 0)) * 2
        base = {"bench": "skinny_linear", "gpu": torch.cuda.get_device_name(0), "shape": name, "rows": args.rows,
                "out_features": n, "in_features": k, "bias": has_bias, "copy_gbps": rates.copy_gbps}

        def record(variant, fn, result, config=None):
            ms = _time_graph(fn, copies)
            records.append({**base, "variant": variant, "config": config and dataclasses.asdict(config),
                            "ms": round(ms, 4), "gb_per_s": round(read / ms / 1e6, 1),
                            "bandwidth_fraction": round(read / ms / 1e6 / rates.copy_gbps, 4),
                            "max_abs_diff": round(float((result.float() - expected).abs().max()), 5),
                            "reference_max_abs": round(scale, 3)})
            print(json.dumps(records[-1]), flush=True)

        record("cublas", lambda i: F.linear(x, weights[i], bias), F.linear(x, weights[0], bias))  # noqa: B023
        chosen = skinny_linear.choose(args.rows, n, k, sms)
        for config in sweep_configs(chosen, n, k, sms) if args.sweep else [chosen]:
            result = skinny_linear.run(x, weights[0], bias, config)
            record("skinny" if config == chosen else "skinny_sweep",
                   lambda i, c=config: skinny_linear.run(x, weights[i], bias, c), result, config)  # noqa: B023
        del weights
        torch.cuda.empty_cache()
    records = [with_provenance(r) for r in records]
    best = {}
    for r in records:
        if r["variant"] != "cublas" and (r["shape"] not in best or r["ms"] < best[r["shape"]]["ms"]):
            best[r["shape"]] = r
    for r in records:
        if r["variant"] == "cublas":
            b = best.get(r["shape"])
            print(json.dumps({"summary": r["shape"], "cublas_ms": r["ms"], "cublas_fraction": r["bandwidth_fraction"],
                              "best_skinny_ms": b and b["ms"], "best_fraction": b and b["bandwidth_fraction"],
                              "best_config": b and b["config"]}))
    if args.out:
        with open(args.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
