"""Where one captured decode step of the ``cuda_graph`` backend spends its time (GPU only).

Builds the random-init Qwen2 shape of ``hf_grpo.recipe_support.tiny`` in bf16, warms the backend up with one
rollout (compile + capture, timed as ``first_call_s``), then:

* ``replay_ms``: wall time of one graph replay (one token for every row) on a full cache, averaged over 100;
* ``rollout_ms_per_token``: a whole warm rollout (prefill, then every step on a cache that fills as it goes)
  divided by the tokens a row generated: what the attention pays for the filled part of the cache only;
* ``memory``: what a call allocates above the weights at its peak, and what it keeps after the call
  and after ``release()``;
* ``kernels``: the kernels of one decode step as the profiler sees them when the compiled step runs
  outside the graph (a replay runs the same kernels without the launch gaps): how many, their summed
  GPU time, and the top ones by time with their share. ``kernels_per_layer`` divides by the layers.
* ``floor``: the time to read the weights and the rows' filled caches (prompt + completion; a prompt that
  ``--group`` rows share counted once) once at the copy bandwidth measured in the same run, and ``replay_ms``
  over it.
* ``rollout_floor`` (with ``--rollout-timeline``): what the run's decode efficiency counts (``ModelWork``), a step
  reading the layers' matmul weights and the head (not the input embeddings) and each row's cache at the rollout's
  mean fill (a shared prompt once), and ``of_copy_bandwidth``: that floor over the timeline's mean replay.
* ``rollout_profile`` (with ``--rollout-profile``): one whole warm rollout under the profiler (the
  replays' kernels included): per generated token, its wall time, the GPU time its kernels took, the
  difference (the GPU idle or waiting on the host), and the top kernels by time per token. This is
  the step at the fills a rollout really has, not at a full cache.
* ``rollout_timeline`` (with ``--rollout-timeline``): one whole warm rollout *without* the profiler, with
  CUDA events recorded in the stream around the prefill and around every graph replay: the GPU time of
  the prefill and of the replays, the gaps between one replay's end and the next one's start (the GPU
  waiting on the host), and the host time outside the GPU's span. The profiler's own overhead on a
  graph's kernels is not in these figures.

Prints one JSON object; ``--out FILE`` appends it.

    python bench/decode_profile.py --shape 0.5b --batch 32 --cache-len 768
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import emit, with_provenance  # noqa: E402
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

from rollout import EOS, PAD, VOCAB, build_model, build_tokenizer, trl_like_generation_config  # noqa: E402
from hf_grpo.generation.cuda_graph import CudaGraphBackend  # noqa: E402
from hf_grpo.generation import packed_weights  # noqa: E402
from hf_grpo.generation.fused_projections import projection_groups  # noqa: E402
from hf_grpo.memory.flops import ModelWork  # noqa: E402


def kernel_times(prof) -> dict[str, list[float]]:
    """GPU kernel name -> the microseconds of each of its runs in ``prof``."""
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name].append(event.device_time_total if hasattr(event, "device_time_total")
                                          else event.cuda_time_total)
    return per_kernel


class _TimedGraph:
    """Stands in for a decoder's graph: records a CUDA event in the stream before and after each replay."""

    def __init__(self, graph):
        self.graph = graph
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def replay(self):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        self.graph.replay()
        after.record()
        self.events.append((before, after))


def rollout_timeline(backend, decoder, model, prompts, call) -> dict:
    """One warm rollout with events around the prefill and every replay (see the module doc)."""
    timed = _TimedGraph(decoder.graph)
    prefill = decoder._prefill
    marks: dict[str, torch.cuda.Event] = {}

    def timed_prefill(*args, **kwargs):
        marks["prefill_start"] = torch.cuda.Event(enable_timing=True)
        marks["prefill_start"].record()
        prefill(*args, **kwargs)
        marks["prefill_end"] = torch.cuda.Event(enable_timing=True)
        marks["prefill_end"].record()

    run = decoder.run
    host: dict[str, float] = {}

    def timed_run(*args, **kwargs):
        result = run(*args, **kwargs)
        marks["run_end"] = torch.cuda.Event(enable_timing=True)
        marks["run_end"].record()
        host["run_end"] = time.perf_counter()
        return result

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    decoder.graph, decoder._prefill, decoder.run = timed, timed_prefill, timed_run
    try:
        host_start = time.perf_counter()
        start.record()
        out = backend.generate(model, prompts, **call)
        end.record()
        host["returned"] = time.perf_counter()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - host_start) * 1e3
    finally:
        decoder.graph = timed.graph
        del decoder._prefill, decoder.run  # the class's methods again
    if not timed.events or "prefill_end" not in marks:
        raise RuntimeError("the timed rollout did not prefill and replay the warm decoder (was it replaced?)")
    replays = [b.elapsed_time(a) for b, a in timed.events]
    gaps = [timed.events[i][1].elapsed_time(timed.events[i + 1][0]) for i in range(len(timed.events) - 1)]
    ordered = sorted(replays)
    tokens = max(len(row) for row in out)
    return {
        "tokens": tokens, "replays": len(replays), "wall_ms": round(wall_ms, 2),
        "gpu_span_ms": round(start.elapsed_time(end), 2),
        "host_outside_gpu_span_ms": round(wall_ms - start.elapsed_time(end), 2),
        "before_prefill_ms": round(start.elapsed_time(marks["prefill_start"]), 2),
        "prefill_ms": round(marks["prefill_start"].elapsed_time(marks["prefill_end"]), 2),
        "prefill_to_first_replay_ms": round(marks["prefill_end"].elapsed_time(timed.events[0][0]), 2),
        "replay_ms_mean": round(sum(replays) / len(replays), 4),
        "replay_ms_median": round(ordered[len(ordered) // 2], 4),
        "replay_ms_p90": round(ordered[int(len(ordered) * 0.9)], 4),
        "gaps_ms_total": round(sum(gaps), 2), "gap_ms_max": round(max(gaps, default=0.0), 4),
        "after_last_replay_ms": round(timed.events[-1][1].elapsed_time(end), 2),
        "last_replay_to_run_end_ms": round(timed.events[-1][1].elapsed_time(marks["run_end"]), 2),
        "host_run_end_to_return_ms": round((host["returned"] - host["run_end"]) * 1e3, 2),
        "wall_ms_per_token": round(wall_ms / tokens, 4),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b", "7b"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--group", type=int, default=1,
                        help="rows a prompt: GRPO's num_generations (8 writes each of batch/8 prompts 8 times); "
                             "the floors count a shared prompt once, as the decode attention reads it")
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--compile", choices=["on", "off"], default="on")
    parser.add_argument("--compile_scope", choices=["layers", "model"], default="layers")
    parser.add_argument("--fuse", default="qkv",
                        help="projections fused in the captured step: comma-separated parts, or 'none'")
    parser.add_argument("--pack", action="store_true",
                        help="freeze the weights and lay q/k/v and gate/up side by side first, as a LoRA run's "
                             "merge does (generation.packed_weights): both fused as views, no copy")
    parser.add_argument("--attention", default=None, help="decode_attention (default: the backend's)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--rollout-profile", action="store_true",
                        help="also profile one whole warm rollout (kernel time per token, GPU idle per token)")
    parser.add_argument("--rollout-timeline", action="store_true",
                        help="also time one whole warm rollout with CUDA events (prefill, replays, gaps), no profiler")
    parser.add_argument("--pdl", choices=["on", "off"], default="on",
                        help="the backend's overlap_launches (programmatic dependent launch, Hopper)")
    parser.add_argument("--blas", choices=["default", "cublaslt"], default="default",
                        help="torch.backends.cuda.preferred_blas_library for the whole process")
    parser.add_argument("--label", default=None, help="a name for this variant, kept in the row")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("decode_profile needs a CUDA device")

    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    tokenizer = build_tokenizer()
    model = build_model(args.shape, tokenizer).eval()
    packed_groups = 0
    if args.pack:
        model.requires_grad_(False)
        packed_groups = packed_weights.pack(projection_groups(model))
    fuse = () if args.fuse == "none" else tuple(args.fuse.split(","))
    extra = {} if args.attention is None else {"decode_attention": args.attention}
    backend = CudaGraphBackend(compile=args.compile == "on", compile_scope=args.compile_scope, fuse_projections=fuse,
                               overlap_launches=args.pdl == "on", **extra)
    gc = trl_like_generation_config(args.completion_len)
    g = torch.Generator().manual_seed(0)
    if args.group < 1 or args.batch % args.group:
        parser.error(f"--group must divide --batch ({args.batch}); got {args.group}")
    distinct = args.batch // args.group
    prompts = [torch.randint(2, VOCAB, (args.prompt_len,), generator=g).tolist() for _ in range(distinct)]
    prompts = [prompt for prompt in prompts for _ in range(args.group)]
    call = dict(generation_config=gc, chunk_size=args.batch, pad_token_id=PAD, eos_token_ids=[EOS])

    gib = 2**30
    memory = {}
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        memory["before_gib"] = torch.cuda.memory_allocated() / gib
        start = time.perf_counter()
        backend.generate(model, prompts, **call)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - start
        memory["first_call_peak_above_gib"] = torch.cuda.max_memory_allocated() / gib - memory["before_gib"]
        memory["kept_after_call_gib"] = torch.cuda.memory_allocated() / gib - memory["before_gib"]
        memory["cache_bytes_gib"] = backend.cache_bytes() / gib
        backend.release(empty_cache=False)
        memory["kept_after_release_gib"] = torch.cuda.memory_allocated() / gib - memory["before_gib"]
        torch.cuda.reset_peak_memory_stats()
        backend.generate(model, prompts, **call)  # compiled already: captures again, as after each release
        torch.cuda.synchronize()
        memory["second_call_peak_above_gib"] = torch.cuda.max_memory_allocated() / gib - memory["before_gib"]
        decoder = next(iter(backend._entries.values()))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = backend.generate(model, prompts, **call)  # warm: the graph is kept
        torch.cuda.synchronize()
        rollout_ms_per_token = (time.perf_counter() - start) * 1e3 / max(len(row) for row in out)

        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            decoder.graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - start) * 10

        from torch.profiler import ProfilerActivity, profile

        with decoder._compiled_step(model):
            decoder._decode_step(model)  # warm (compiled already)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                decoder._decode_step(model)
                torch.cuda.synchronize()
        rollout_record = None
        if args.rollout_profile:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as whole:
                start = time.perf_counter()
                out = backend.generate(model, prompts, **call)
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - start) * 1e3
            tokens = max(len(row) for row in out)
            kernels = kernel_times(whole)
            kernel_ms = sum(sum(v) for v in kernels.values()) / 1e3
            ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[: args.top]
            rollout_record = {
                "tokens": tokens, "wall_ms_per_token": round(wall_ms / tokens, 3),
                "kernel_ms_per_token": round(kernel_ms / tokens, 3),
                "idle_ms_per_token": round((wall_ms - kernel_ms) / tokens, 3),
                "top": [{"kernel": name[:90], "calls_per_token": round(len(times) / tokens, 2),
                         "us_per_token": round(sum(times) / tokens, 2)} for name, times in ranked],
            }
        timeline_record = rollout_timeline(backend, decoder, model, prompts, call) if args.rollout_timeline else None
    per_kernel = kernel_times(prof)
    total_us = sum(sum(v) for v in per_kernel.values())
    count = sum(len(v) for v in per_kernel.values())
    layers = model.config.num_hidden_layers
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    record = {
        "bench": "decode_profile", "label": args.label, "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        # inductor's settings from the environment (max-autotune, PDL...): they change the compiled step
        "inductor_env": {key: value for key, value in sorted(os.environ.items()) if key.startswith("TORCHINDUCTOR_")},
        "shape": args.shape, "batch": args.batch, "group": args.group, "prompt_len": args.prompt_len,
        "cache_len": decoder.cache_len,
        "compile": args.compile, "compile_scope": args.compile_scope, "fuse": args.fuse, "packed_groups": packed_groups,
        "pdl": args.pdl, "pdl_codegen": decoder.pdl_codegen, "blas": args.blas,
        "fused_parts": decoder.fused.parts() if decoder.fused is not None else {},
        "first_call_s": round(first_call_s, 2), "replay_ms": round(replay_ms, 3),
        "decode_attention": decoder.decode_attention,  # as the decoder resolved the backend's setting
        "rollout_ms_per_token": round(rollout_ms_per_token, 3),
        "kernels": count, "kernels_per_layer": round(count / layers, 1), "kernel_time_ms": round(total_us / 1e3, 3),
        "launch_gap_ms": round(replay_ms - total_us / 1e3, 3),
        "memory": {key: round(value, 3) for key, value in memory.items()},
        "top": [{"kernel": name[:90], "calls": len(times), "ms": round(sum(times) / 1e3, 4),
                 "share": round(sum(times) / total_us, 3)} for name, times in top],
    }
    if rollout_record is not None:
        record["rollout_profile"] = rollout_record
    if timeline_record is not None:
        record["rollout_timeline"] = timeline_record
    # the floor: reading the weights and the rows' filled caches once at the copy bandwidth measured here
    from long_context import cache_bytes_per_position, copy_bandwidth_bytes_per_s

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    positions = distinct * args.prompt_len + args.batch * args.completion_len  # a shared prompt read once
    cache_bytes = positions * cache_bytes_per_position(model.config)
    bandwidth = copy_bandwidth_bytes_per_s()
    floor_ms = (weight_bytes + cache_bytes) / bandwidth * 1e3
    record["floor"] = {"copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "weights_gb": round(weight_bytes / 1e9, 2),
                       "filled_cache_gb": round(cache_bytes / 1e9, 2), "floor_ms": round(floor_ms, 3),
                       "replay_over_floor": round(replay_ms / floor_ms, 3)}
    if timeline_record is not None:
        # What the run's decode efficiency counts (hf_grpo.memory.flops.ModelWork, as the trainer's perf/ fields):
        # the layers' matmul weights and the head once a step, and each row's keys and values at the mean fill.
        work = ModelWork.from_model(model)
        mean_cache = (distinct * args.prompt_len + args.batch * args.completion_len / 2) * work.kv_bytes_per_token
        mean_floor_ms = (work.decode_weight_bytes + mean_cache) / bandwidth * 1e3
        record["rollout_floor"] = {"weights_read_gb": round(work.decode_weight_bytes / 1e9, 2),
                                   "mean_cache_gb": round(mean_cache / 1e9, 2), "floor_ms": round(mean_floor_ms, 3),
                                   "of_copy_bandwidth": round(mean_floor_ms / timeline_record["replay_ms_mean"], 4)}
    emit(with_provenance(record), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
