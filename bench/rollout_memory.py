"""Where the cuda_graph backend's peak GPU memory goes, phase by phase, beside the hf backend.

One rollout shape (default: the 0.5B shape, 32 completions x 512 tokens, 64-token prompts,
TRL's sampling settings), two calls per backend in a fresh process each. For the cuda_graph
backend, the peak and the resident memory are read around each prefill and around the capture;
the decode loop's own peak is the one reported at the end of the call. Prints one JSON line.

    python bench/rollout_memory.py --backend cuda_graph   # or: hf
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rollout  # noqa: E402  (the rollout benchmark's model, tokenizer and settings)
from hf_grpo.generation import HFGenerateBackend  # noqa: E402
from hf_grpo.generation.cuda_graph import CudaGraphBackend  # noqa: E402

GIB = 2**30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["hf", "cuda_graph"], default="cuda_graph")
    parser.add_argument("--decode-attention", choices=["matmul", "sdpa"], default="matmul")
    parser.add_argument("--shape", default="0.5b", choices=sorted(rollout.SHAPES))
    parser.add_argument("--completions", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/rollout_memory.py needs a CUDA device", file=sys.stderr)
        return 2

    model = rollout.build_model(args.shape, rollout.build_tokenizer())
    config = rollout.trl_like_generation_config(args.completion_len)
    rng = random.Random(args.completions)
    prompts = [[rng.randrange(2, rollout.VOCAB) for _ in range(args.prompt_len)] for _ in range(args.completions)]
    phases = []

    def mark(name: str) -> None:
        """Peak since the last mark, and what is allocated now (GiB). Never called while capturing."""
        torch.cuda.synchronize()
        phases.append(dict(phase=name, peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 4),
                           allocated_gib=round(torch.cuda.memory_allocated() / GIB, 4)))
        torch.cuda.reset_peak_memory_stats()

    if args.backend == "hf":
        backend = HFGenerateBackend()
    else:
        backend = CudaGraphBackend(decode_attention=args.decode_attention)
        for method in ("_prefill", "_capture"):
            original = getattr(backend, method)

            def timed_phase(*a, _original=original, _name=method.lstrip("_"), **kw):
                mark(f"before {_name}")
                result = _original(*a, **kw)
                mark(_name)
                return result

            setattr(backend, method, timed_phase)

    mark("weights")
    with torch.no_grad():
        for call in range(2):
            backend.generate(model, prompts, generation_config=config, chunk_size=args.completions,
                             pad_token_id=rollout.PAD, eos_token_ids=[rollout.EOS])
            mark(f"end of call {call}")
    print(json.dumps(with_provenance(dict(
        backend=args.backend, decode_attention=args.decode_attention if args.backend == "cuda_graph" else None,
        model_shape=args.shape, completions=args.completions, completion_len=args.completion_len,
        prompt_len=args.prompt_len, peak_mem_gib=max(p["peak_gib"] for p in phases), phases=phases,
        gpu_name=torch.cuda.get_device_name(0), torch=torch.__version__,
    ))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
