"""How fast cuBLAS reads a decode step's weights at a few rows, by product and by formulation (GPU only).

A decode step multiplies 32 rows by every weight once: each product is bound by reading its weight, so what
matters is the fraction of the copy bandwidth it reaches. For the products of one decoder layer of a shape
(q/k/v fused, o, gate/up packed, down) and the LM head, each formulation below is captured in a CUDA graph
that calls it on enough copies of the weight to overflow L2, replayed, and timed a call:

* ``linear``: ``F.linear(x, W, bias)``, what the model runs;
* ``weight_first``: ``W @ x.T`` (the weight as the first operand, the rows as the second), which cuBLAS
  tiles differently;
* ``cublaslt``: ``F.linear`` with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
* ``residual_epilogue`` (o and down only): ``torch.addmm(residual, x, W.T)``, the residual add in the
  product's epilogue, against ``linear`` plus a separate add (``linear_then_add``).

Prints one JSON object a product and formulation; ``--out FILE`` appends them.

    python bench/skinny_gemm.py --shape 7b --rows 32
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py, long_context.py
from provenance import emit, with_provenance  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (hidden, intermediate, q/k/v outputs, vocabulary) of the shapes bench/rollout.py builds
SHAPES = {"7b": (3584, 18944, 3584 + 2 * 512, 152064), "1.5b": (1536, 8960, 1536 + 2 * 256, 151936)}
L2_OVERFLOW_BYTES = 512 * 2**20  # the weights a graph cycles through: ten times an H100's L2


def products(shape: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (inputs, outputs, has a bias)."""
    hidden, intermediate, qkv, vocab = SHAPES[shape]
    return {"qkv": (hidden, qkv, True), "o": (hidden, hidden, False), "gate_up": (hidden, 2 * intermediate, False),
            "down": (intermediate, hidden, False), "head": (hidden, vocab, False)}


def formulations(name: str) -> list[str]:
    extra = ["residual_epilogue", "linear_then_add"] if name in ("o", "down") else []
    return ["linear", "weight_first", "cublaslt", *extra]


def call(formulation: str, x, x_t, weight, bias, residual):
    if formulation in ("linear", "cublaslt"):
        return F.linear(x, weight, bias)
    if formulation == "weight_first":
        out = weight @ x_t
        return out if bias is None else out + bias[:, None]
    if formulation == "residual_epilogue":
        return torch.addmm(residual, x, weight.t())
    if formulation == "linear_then_add":
        return F.linear(x, weight) + residual
    raise ValueError(f"unknown formulation {formulation!r}")


def time_per_call(formulation: str, rows: int, inputs: int, outputs: int, has_bias: bool, replays: int) -> float:
    """Microseconds a call, replayed from a graph over copies of the weight that overflow L2."""
    weight_bytes = inputs * outputs * 2
    copies = max(2, -(-L2_OVERFLOW_BYTES // weight_bytes))
    weights = [torch.randn(outputs, inputs, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    bias = torch.randn(outputs, device="cuda", dtype=torch.bfloat16) if has_bias else None
    x = torch.randn(rows, inputs, device="cuda", dtype=torch.bfloat16)
    x_t = x.t().contiguous()
    residual = torch.randn(rows, outputs, device="cuda", dtype=torch.bfloat16)
    previous = torch.backends.cuda.preferred_blas_library()
    if formulation == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for weight in weights:  # warm-up outside the capture (cuBLAS picks its kernels)
                call(formulation, x, x_t, weight, bias, residual)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for weight in weights:
                call(formulation, x, x_t, weight, bias, residual)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--only", default=None, help="comma-separated products (default: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("skinny_gemm needs a CUDA device")
    from long_context import copy_bandwidth_bytes_per_s

    bandwidth = copy_bandwidth_bytes_per_s()
    chosen = products(args.shape)
    if args.only:
        chosen = {name: chosen[name] for name in args.only.split(",")}
    for name, (inputs, outputs, has_bias) in chosen.items():
        for formulation in formulations(name):
            us = time_per_call(formulation, args.rows, inputs, outputs, has_bias, args.replays)
            read = inputs * outputs * 2
            row = with_provenance({
                "bench": "skinny_gemm", "shape": args.shape, "rows": args.rows, "product": name,
                "inputs": inputs, "outputs": outputs, "formulation": formulation, "us": round(us, 2),
                "weight_gb_s": round(read / us / 1e3, 1), "of_copy_bandwidth": round(read / (us * 1e-6) / bandwidth, 3),
                "copy_tb_s": round(bandwidth / 1e12, 3),
                "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("CUBLAS", "TORCH_BLAS"))}})
            emit(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
