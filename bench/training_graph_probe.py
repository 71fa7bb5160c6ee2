"""One training micro-batch (forward + backward with activation checkpointing) eager, compiled, and replayed from
CUDA graphs captured by hand: median time, setup (compile or capture) time, peak memory and the gradients' largest
difference from eager's. The measurement behind ``hf_grpo.training.graphs``. Prints ``PROBE {json}`` lines.

    python3 bench/training_graph_probe.py --variants eager,graphed,compiled,compiled_graphed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402

from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from hf_grpo.training.compiled_layers import CompiledTrainingLayers  # noqa: E402


def make_batch(rows, width, keep, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    for r in range(rows):  # left padding of varied prompt lengths
        pad = int(torch.randint(0, width - keep - 16, (1,), generator=g))
        mask[r, :pad] = 0
    cmask = torch.ones(rows, keep)
    for r in range(rows):
        end = int(torch.randint(1, keep + 1, (1,), generator=g))
        cmask[r, end:] = 0
    return ids.to(device), mask.to(device), cmask.to(device)


def logps_fn(model, keep):
    def fwd(ids, mask):
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep + 1, use_cache=False).logits
        logits = logits[:, :-1].float()
        return logits.log_softmax(-1).gather(-1, ids[:, -keep:].unsqueeze(-1)).squeeze(-1)
    return fwd


def loss_of(logps, cmask):
    return -(logps * cmask).sum() / cmask.sum()


class Graphed:
    def __init__(self, fwd, params, ids, mask, warmup=3):
        self.params = params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.ids, self.mask = ids.clone(), mask.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                out = fwd(self.ids, self.mask)
                out.backward(torch.ones_like(out))
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.gf, self.gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.gf, pool=pool):
            self.out = fwd(self.ids, self.mask)
        self.gout = torch.zeros_like(self.out)
        with torch.cuda.graph(self.gb, pool=pool):
            torch.autograd.backward(self.out, self.gout, retain_graph=True)
        for p in params:
            p.grad.zero_()

    def step(self, ids, mask, cmask):
        self.ids.copy_(ids)
        self.mask.copy_(mask)
        self.gf.replay()
        logps = self.out.detach().clone().requires_grad_()
        loss = loss_of(logps, cmask)
        loss.backward()
        self.gout.copy_(logps.grad)
        self.gb.replay()
        return loss.detach()


def timed(fn, n):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--keep", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default="eager,graphed,compiled,compiled_graphed")
    ap.add_argument("--preserve_rng", type=int, default=1)
    args = ap.parse_args()
    dev = torch.device("cuda")
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, shape=args.shape, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev)
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": bool(args.preserve_rng)})
    model.config.use_cache = False
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    vocab = model.config.vocab_size
    ids, mask, cmask = make_batch(args.rows, args.width, args.keep, vocab, dev)
    ids2, mask2, cmask2 = make_batch(args.rows, args.width, args.keep, vocab, dev, seed=1)
    fwd = logps_fn(model, args.keep)
    ref_grads = None
    compiled = CompiledTrainingLayers()
    for variant in args.variants.split(","):
        rec = {"variant": variant, "shape": args.shape, "rows": args.rows, "width": args.width, "keep": args.keep,
               "preserve_rng_state": bool(args.preserve_rng)}
        try:
            ctx = compiled.route(model) if variant.startswith("compiled") else torch.enable_grad()
            with ctx:
                for p in params:
                    p.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                if variant.endswith("graphed"):
                    runner = Graphed(fwd, params, ids, mask)
                    one = lambda: runner.step(ids2, mask2, cmask2)  # noqa: E731
                else:
                    def one():
                        loss = loss_of(fwd(ids2, mask2), cmask2)
                        loss.backward()
                        return loss.detach()
                    one()
                torch.cuda.synchronize()
                rec["setup_s"] = round(time.perf_counter() - t0, 2)
                for p in params:
                    if p.grad is not None:
                        p.grad.zero_()
                one()
                grads = [p.grad.detach().float().clone() for p in params]
                if ref_grads is None:
                    ref_grads = grads
                else:
                    rec["grad_max_rel_diff"] = max(
                        float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(grads, ref_grads))
                rec["step_ms"] = round(timed(one, args.iters) * 1000, 2)
                rec["peak_over_base_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
                rec["reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 3)
                if variant.endswith("graphed"):
                    del runner
        except Exception as err:  # noqa: BLE001 - a probe: report and go on
            rec["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            rec["trace"] = traceback.format_exc()[-1500:]
        print("PROBE " + json.dumps(with_provenance(rec)), flush=True)


if __name__ == "__main__":
    main()
