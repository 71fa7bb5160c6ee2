#!/usr/bin/env python
"""Benchmark per-token log-probs through an LM head: peak extra memory and median fwd+bwd time.

Implementations:
  chunked     hf_grpo.ops.chunked_logprobs, one record per --chunk-rows value
  naive       torch.log_softmax(hidden @ W.T, -1).gather(...) on full logits, in the input dtype
  naive_fp32  same, with the logits upcast to fp32 before log_softmax (not run by default)
  trl         TRL's fused LM-head op (trl.trainer.utils._ChunkedLogProbFunction), called like add_fused_lm_head

Prints one JSON line per (impl, chunk_rows, H, N) with keys
  impl, chunk_rows, V, H, N, dtype, peak_extra_gib, median_ms, gpu,
plus status ("ok" | "oom" | "skipped" | "error"), note, grad_buffers_gib, reps and max_abs_err.

peak_extra_gib = torch.cuda.max_memory_allocated() during one fwd+bwd minus memory_allocated() once the inputs exist
(grads cleared). It includes the .grad buffers of hidden and W (grad_buffers_gib, identical for every impl).
max_abs_err = max |logp - fp32 full-logits logp| over the first 256 rows (accuracy sanity check).

  python bench/logprobs.py                          # full sweep on cuda
  python bench/logprobs.py --hidden 896 --tokens 8192 32768
  python bench/logprobs.py --quick --device cpu     # tiny smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch

from hf_grpo.ops import chunked_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ALL_IMPLS = ("chunked", "naive", "naive_fp32", "trl")
DEFAULT_IMPLS = ("chunked", "naive", "trl")
CHECK_ROWS = 256


def _load_trl():
    """Returns (apply_fn, token_tile, vocab_chunk, note). apply_fn is None when TRL's op can't be imported."""
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, _ChunkedLogProbFunction
    except Exception as exc:  # not installed, or a TRL without the fused head
        return None, None, None, f"trl import failed: {exc!r}"
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE as token_tile
    except Exception:
        token_tile = None

    def apply(hidden, weight, targets):
        # Same positional arguments as add_fused_lm_head passes: no bias, temperature 1, no softcap, scale 1,
        # only log-probs requested.
        out = _ChunkedLogProbFunction.apply(
            hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",)
        )
        return out[0]

    return apply, token_tile, _CHUNKED_LOGPROB_CHUNK_SIZE, ""


def _naive(hidden, weight, targets):
    return torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)


def _naive_fp32(hidden, weight, targets):
    return torch.log_softmax((hidden @ weight.T).float(), -1).gather(1, targets[:, None]).squeeze(1)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _run_case(impl_fn, hidden, weight, targets, device, warmup, reps):
    """Returns (peak_extra_gib or None, median_ms, max_abs_err)."""
    timer = _Timer(device)

    def step():
        hidden.grad = None
        weight.grad = None
        impl_fn(hidden, weight, targets).sum().backward()

    for _ in range(warmup):
        step()
    timer.sync()

    peak = None
    if device.type == "cuda":
        # Free the previous step's grads and cached blocks so the baseline is just the inputs
        hidden.grad = None
        weight.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30

    times = [timer.time_ms(step) for _ in range(reps)]
    hidden.grad = None
    weight.grad = None

    with torch.no_grad():
        h, t = hidden[:CHECK_ROWS], targets[:CHECK_ROWS]
        ref = torch.log_softmax(h.float() @ weight.float().T, -1).gather(1, t[:, None]).squeeze(1)
        err = (impl_fn(h, weight, t).float() - ref).abs().max().item()
    return peak, statistics.median(times), err


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:1, or cpu for a smoke run")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 151936; 4096 with --quick)")
    p.add_argument("--hidden", type=int, nargs="+", default=None, help="hidden sizes H (default 896 1536)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="row counts N (default 8192 32768 65536)")
    p.add_argument("--chunk-rows", type=int, nargs="+", default=None, help="chunk_rows for chunked (1024 4096)")
    p.add_argument("--impls", nargs="+", choices=ALL_IMPLS, default=None, help=f"default: {' '.join(DEFAULT_IMPLS)}")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=None, help="untimed fwd+bwd before measuring (default 2)")
    p.add_argument("--reps", type=int, default=None, help="timed fwd+bwd repetitions (default 5)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few reps (smoke check; works on CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if args.quick:
        vocab = args.vocab or 4096
        hiddens = args.hidden or [64]
        tokens = args.tokens or [256, 1024]
        chunks = args.chunk_rows or [64, 256]
        warmup = 1 if args.warmup is None else args.warmup
        reps = args.reps or 2
    else:
        vocab = args.vocab or 151936
        hiddens = args.hidden or [896, 1536]
        tokens = args.tokens or [8192, 32768, 65536]
        chunks = args.chunk_rows or [1024, 4096]
        warmup = 2 if args.warmup is None else args.warmup
        reps = args.reps or 5
    impls = args.impls or list(DEFAULT_IMPLS)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; pass --device cpu (with --quick) for a smoke run", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = DTYPES[args.dtype]
    trl_apply, trl_tile, trl_vchunk, trl_note = _load_trl() if "trl" in impls else (None, None, None, "")

    variants = []  # (impl name, chunk_rows, callable or None, note)
    for impl in impls:
        if impl == "chunked":
            for c in chunks:
                variants.append(
                    ("chunked", c, lambda h, w, t, c=c: chunked_logprobs(h, w, t, chunk_rows=c), "")
                )
        elif impl == "naive":
            variants.append(("naive", None, _naive, f"full logits in {args.dtype}"))
        elif impl == "naive_fp32":
            variants.append(("naive_fp32", None, _naive_fp32, "full logits upcast to fp32"))
        elif impl == "trl":
            note = trl_note or f"token tile {trl_tile}, vocab chunk {trl_vchunk}"
            variants.append(("trl", trl_tile, trl_apply, note))

    for h in hiddens:
        for n in tokens:
            gen = torch.Generator(device=device).manual_seed(args.seed)
            try:
                # Post-norm hidden states are O(1) per element; a 0.02-std head gives O(1) logits like a real LM
                hidden = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
                weight = (0.02 * torch.randn(vocab, h, device=device, generator=gen)).to(dtype).requires_grad_()
                targets = torch.randint(0, vocab, (n,), device=device, generator=gen)
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                for name, c, _, _ in variants:
                    _emit(name, c, vocab, h, n, args.dtype, gpu, "oom", "inputs do not fit", None, None, None, 0)
                continue
            grad_gib = (hidden.numel() + weight.numel()) * hidden.element_size() / 2**30

            for name, c, fn, note in variants:
                if fn is None:
                    _emit(name, c, vocab, h, n, args.dtype, gpu, "skipped", note, None, None, None, grad_gib)
                    continue
                print(f"# {name} chunk_rows={c} H={h} N={n}", file=sys.stderr, flush=True)
                status, peak, med, err = "ok", None, None, None
                try:
                    peak, med, err = _run_case(fn, hidden, weight, targets, device, warmup, reps)
                except Exception as exc:
                    if _is_oom(exc):
                        status = "oom"
                        note = (note + "; " if note else "") + str(exc).split("\n")[0][:200]
                    else:
                        status = "error"
                        note = (note + "; " if note else "") + repr(exc)[:300]
                    exc = None  # drop the traceback's frames (and the tensors they hold) before freeing
                finally:
                    hidden.grad = None
                    weight.grad = None
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                _emit(name, c, vocab, h, n, args.dtype, gpu, status, note, peak, med, err, grad_gib, reps=reps)

            del hidden, weight, targets
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


def _emit(impl, chunk_rows, v, h, n, dtype, gpu, status, note, peak, med, err, grad_gib, reps=0):
    rec = {
        "impl": impl,
        "chunk_rows": chunk_rows,
        "V": v,
        "H": h,
        "N": n,
        "dtype": dtype,
        "peak_extra_gib": None if peak is None else round(peak, 4),
        "median_ms": None if med is None else round(med, 3),
        "gpu": gpu,
        "status": status,
        "note": note,
        "grad_buffers_gib": round(grad_gib, 4),
        "reps": reps,
        "max_abs_err": None if err is None else float(f"{err:.3e}"),
    }
    print(json.dumps(with_provenance(rec)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
