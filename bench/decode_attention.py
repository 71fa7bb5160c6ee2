"""The decode attention alone: the block-skipping kernel against the matmul attention (GPU only).

At the rollout table's head shapes (Qwen2-0.5B: 2 KV heads of 7 query heads, dim 64; 1.5B: 2 of 6,
dim 128), a 768-position cache, left-padded rows, filled to the average of a 64 + 512 rollout (320) and
to the end (768). Each variant is captured in a CUDA graph (20 calls) so launch gaps do not count; the
matmul attention is compiled as the decode step compiles it. ``--sweep`` also times the kernel's launch
settings (``filled_attention.KernelConfig``). One JSON object per line: ms per call and the K/V bytes
the mask admits per ms (``gb_per_s``). The op is called directly, so the kernel is timed at 32 rows too,
where a decoder keeps the matmul attention (fewer programs than SMs, ``filled_attention.serves``).

The sweep in ``bench/results/decode_attention_sweep_h100.jsonl`` was taken with an earlier form of the
kernel that split every cache, however short, over several programs per row; the kernel now splits only long
caches (``filled_attention.splits``), and the 768-position shapes here run unsplit.

``--rollout-sweep`` times the kernel's launch settings at the 7B full-length rollout's decode step (32 rows of
Qwen2.5-7B's heads, a 3072-position cache filled to a 544-token prompt plus half and all of a 2048-token completion),
the splits per (row, KV head) included (``programs_per_sm``); then the same with the run's own layout, four prompts
of 64 to 1024 tokens left-padded to the longest, whose rows' spans differ by up to 960 positions, and last the
default settings with each row reading its prompt from its group's first row (``prompt_source``; ``gb_per_s``
then counts a shared prompt once, ``admitted_gb_per_s`` every row's).

``--lengths`` times long caches instead (reasoning-length rollouts): at each length L the cache is filled to
L (the last decode step of a rollout) and to L / 2 (its average step), with 32 rows of 0.5B's heads and 8 rows
of a 7B's (Qwen2.5-7B: 4 KV heads of 7 query heads, dim 128); ``filled`` is the kernel as a decoder runs it
(split over ``filled_attention.splits`` programs per row and KV head), ``filled_one_program`` the kernel
without splits. ``gb_per_s`` counts the admitted keys and values read once.

    python bench/decode_attention.py [--sweep | --rollout-sweep [--default-only]] [--caches N]
        [--lengths 1024,4096,16384,32768] [--out FILE]
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
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_grpo.generation import filled_attention  # noqa: E402
from hf_grpo.generation.filled_attention import KernelConfig, reference_decode_attention  # noqa: E402

SHAPES = {"0.5b-x32": (32, 2, 7, 64), "0.5b-x128": (128, 2, 7, 64), "1.5b-x128": (128, 2, 6, 128)}
LONG_SHAPES = {"0.5b-x32": (32, 2, 7, 64), "7b-x8": (8, 4, 7, 128)}
CACHE_LEN = 768


def _inputs(batch, kv_heads, groups, dim, filled, cache_len=CACHE_LEN, pads=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(batch, kv_heads, groups, dim, generator=g, device="cuda").bfloat16()
    key = torch.randn(batch, kv_heads, cache_len, dim, generator=g, device="cuda").bfloat16()
    value = torch.randn(batch, kv_heads, cache_len, dim, generator=g, device="cuda").bfloat16()
    if pads is None:
        pads = torch.randint(0, 48, (batch,), generator=g, device="cuda").cpu()
    pos = torch.arange(cache_len)
    valid = ((pos[None, :] >= pads[:, None]) & (pos[None, :] < filled)).cuda()
    return query, key, value, valid


def _time_graph(fn, calls: int = 20, repeats: int = 5) -> float:
    """ms per call of ``fn(i)``, replayed from a CUDA graph of calls i = 0..calls-1; the best of ``repeats``."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
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


def _long_caches(lengths, caches, compiled_matmul) -> list[dict]:
    """Each long shape at each cache length, filled to half and to the end: matmul, split kernel, one program."""
    records = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (batch, kv_heads, groups, dim) in LONG_SHAPES.items():
        for length in lengths:
            for filled in (length // 2, length):
                q, k, v, valid = _inputs(batch, kv_heads, groups, dim, filled, cache_len=length)
                keys = [k] + [k.clone() for _ in range(caches - 1)]
                values = [v] + [v.clone() for _ in range(caches - 1)]
                scale = dim**-0.5
                admitted_bytes = int(valid.sum()) * kv_heads * dim * 2 * 2
                base = {"bench": "decode_attention_long", "gpu": torch.cuda.get_device_name(0), "shape": name,
                        "cache_len": length, "filled": filled, "caches": caches,
                        "splits": filled_attention.splits(batch, kv_heads, length, sms)}
                variants = {
                    "matmul": lambda i: compiled_matmul(q, keys[i % caches], values[i % caches], valid, scale),  # noqa: B023
                    "filled": lambda i: filled_attention.filled_decode_attention(  # noqa: B023
                        q, keys[i % caches], values[i % caches], valid, scale),  # noqa: B023
                }
                for variant, fn in variants.items():
                    records.append({**base, "variant": variant, "ms": round(ms := _time_graph(fn), 4),
                                    "gb_per_s": round(admitted_bytes / ms / 1e6, 1)})
                filled_attention.CONFIG = KernelConfig(max_splits=1)
                ms = _time_graph(variants["filled"])
                filled_attention.CONFIG = KernelConfig()
                records.append({**base, "variant": "filled_one_program", "ms": round(ms, 4),
                                "gb_per_s": round(admitted_bytes / ms / 1e6, 1)})
                del q, k, v, valid, keys, values
                torch.cuda.empty_cache()
    return records


ROLLOUT_7B = (32, 4, 7, 128)  # rows, KV heads, query heads a KV head, head dim
ROLLOUT_CACHE, ROLLOUT_FILLS = 3072, (544 + 1024, 544 + 2048)
# The run's own layout: 4 prompts of 64 to 1024 tokens (mean 544), 8 rows each, left-padded to the longest.
RAGGED_PROMPTS, RAGGED_FILLS = (64, 384, 704, 1024), (1024 + 1024, 1024 + 2048)


def rollout_configs(default_only: bool = False) -> list[KernelConfig]:
    """The launch settings ``--rollout-sweep`` times: the default first (alone with ``default_only``)."""
    configs = [KernelConfig()]
    if default_only:
        return configs
    settings = [(128, warps, stages, per_sm)
                for warps, stages, per_sm in itertools.product((4, 8), (2, 3), (1, 2, 3, 4))]
    settings += [(64, 4, 3, 2), (64, 4, 3, 4)]
    for block, warps, stages, per_sm in settings:
        config = KernelConfig(block=block, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
        if config != configs[0]:
            configs.append(config)
    return configs


def _rollout_sweep(caches: int, ragged: bool, default_only: bool = False) -> list[dict]:
    """Every ``rollout_configs`` setting at the 7B rollout's mean and last decode step: rows of one 544-token
    prompt, or (``ragged``) the run's prompts of 64 to 1024 tokens, whose rows' spans differ by up to 960."""
    batch, kv_heads, groups, dim = ROLLOUT_7B
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    pads = torch.tensor([max(RAGGED_PROMPTS) - n for n in RAGGED_PROMPTS]).repeat_interleave(batch // 4)
    for filled in RAGGED_FILLS if ragged else ROLLOUT_FILLS:
        q, k, v, valid = _inputs(batch, kv_heads, groups, dim, filled, cache_len=ROLLOUT_CACHE,
                                 pads=pads if ragged else None)
        keys = [k] + [k.clone() for _ in range(caches - 1)]
        values = [v] + [v.clone() for _ in range(caches - 1)]
        admitted_bytes = int(valid.sum()) * kv_heads * dim * 2 * 2
        expected = reference_decode_attention(q, k, v, valid, dim**-0.5).float()
        configs = rollout_configs(default_only)
        for config in configs:
            filled_attention.CONFIG = config
            got = filled_attention.filled_decode_attention(q, k, v, valid, dim**-0.5).float()
            ms = _time_graph(lambda i: filled_attention.filled_decode_attention(  # noqa: B023
                q, keys[i % caches], values[i % caches], valid, dim**-0.5))  # noqa: B023
            records.append({"bench": "decode_attention_rollout_7b", "gpu": torch.cuda.get_device_name(0),
                            "shape": "7b-x32", "cache_len": ROLLOUT_CACHE, "filled": filled, "caches": caches,
                            "prompts": "64-1024 (ragged)" if ragged else "544",
                            "config": dataclasses.asdict(config),
                            "splits": filled_attention.splits(batch, kv_heads, ROLLOUT_CACHE, sms, config),
                            "mean_admitted": round(float(valid.sum(1).float().mean()), 1),
                            "max_abs_diff": round(float((got - expected).abs().max()), 5),
                            "ms": round(ms, 4), "gb_per_s": round(admitted_bytes / ms / 1e6, 1)})
        filled_attention.CONFIG = KernelConfig()
        if ragged:  # each prompt read from its first row, as a decoder of GRPO's groups runs the kernel
            records.append(_shared_prompt_record(records[-len(configs)], q, keys, values, valid, caches))
        del q, k, v, valid, keys, values
        torch.cuda.empty_cache()
    return records


def _shared_prompt_record(unshared: dict, q, keys, values, valid, caches: int) -> dict:
    """The default settings with each row's prompt (the first ``max(RAGGED_PROMPTS)`` positions) read from its
    group's first row, beside ``unshared`` (the same call reading every row's own copy)."""
    batch, kv_heads, _, dim = q.shape
    group = batch // len(RAGGED_PROMPTS)
    source = (torch.arange(batch, device="cuda") // group * group).int()
    prompt_end = torch.tensor([max(RAGGED_PROMPTS)], dtype=torch.int32, device="cuda")
    for cache in (*keys, *values):  # the prompt's keys and values in each of its rows, as the shared prefill writes
        cache[:, :, :max(RAGGED_PROMPTS)] = cache[source.long(), :, :max(RAGGED_PROMPTS)]
    expected = reference_decode_attention(q, keys[0], values[0], valid, dim**-0.5).float()
    got = filled_attention.filled_decode_attention(q, keys[0], values[0], valid, dim**-0.5, source, prompt_end).float()
    ms = _time_graph(lambda i: filled_attention.filled_decode_attention(
        q, keys[i % caches], values[i % caches], valid, dim**-0.5, source, prompt_end))
    in_prompt = valid[:, :max(RAGGED_PROMPTS)]
    read_once = int(valid.sum()) - int(in_prompt.sum()) + int(in_prompt[::group].sum())
    bytes_per_position = kv_heads * dim * 2 * 2
    return {**unshared, "prompt_source": f"the first of its {group} rows", "max_abs_diff": round(float(
        (got - expected).abs().max()), 5), "ms": round(ms, 4), "unshared_ms": unshared["ms"],
        "gb_per_s": round(read_once * bytes_per_position / ms / 1e6, 1),
        "admitted_gb_per_s": round(int(valid.sum()) * bytes_per_position / ms / 1e6, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's launch settings")
    parser.add_argument("--caches", type=int, default=4,
                        help="copies of the cache the timed calls cycle over (1: the same, L2-warm, cache each call)")
    parser.add_argument("--rollout-sweep", action="store_true",
                        help="time the kernel's launch settings at the 7B full-length rollout's decode step")
    parser.add_argument("--default-only", action="store_true",
                        help="with --rollout-sweep: the default launch settings alone (and the shared prompt's row)")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated long cache lengths to time instead of the 768-position shapes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.caches < 1:
        parser.error(f"--caches must be at least 1, got {args.caches}")
    if not torch.cuda.is_available():
        parser.error("decode_attention needs a CUDA device")
    configs = [KernelConfig()]
    if args.sweep:
        configs += [KernelConfig(block=b, num_warps=w, num_stages=s)
                    for b, w, s in itertools.product((64, 128), (4, 8), (2, 3))]
    torch._dynamo.config.recompile_limit = 64  # one compile of the matmul attention per shape and length
    compiled_matmul = torch.compile(reference_decode_attention, dynamic=False)
    records = []
    if args.rollout_sweep:
        records = [record for ragged in (False, True)
                   for record in _rollout_sweep(args.caches, ragged, args.default_only)]
    elif args.lengths:
        records = _long_caches([int(n) for n in args.lengths.split(",")], args.caches, compiled_matmul)
    for name, (batch, kv_heads, groups, dim) in ({} if args.lengths or args.rollout_sweep else SHAPES).items():
        for filled in (320, CACHE_LEN):
            q, k, v, valid = _inputs(batch, kv_heads, groups, dim, filled)
            # Calls cycle over copies of the cache (--caches), as a decode step's layers each read their own:
            # one cache replayed 20 times would sit in L2 (42 MB filled at 1.5B x 128 x 320; 50 MB of L2 on an H100).
            keys = [k] + [k.clone() for _ in range(args.caches - 1)]
            values = [v] + [v.clone() for _ in range(args.caches - 1)]
            scale = dim**-0.5
            admitted_bytes = int(valid.sum()) * kv_heads * dim * 2 * 2  # keys and values, bf16
            base = {"bench": "decode_attention", "gpu": torch.cuda.get_device_name(0), "shape": name,
                    "cache_len": CACHE_LEN, "filled": filled, "caches": args.caches}
            ms = _time_graph(lambda i: compiled_matmul(q, keys[i % args.caches], values[i % args.caches], valid,  # noqa: B023
                                                       scale))
            records.append({**base, "variant": "matmul", "ms": round(ms, 4),
                            "gb_per_s": round(admitted_bytes / ms / 1e6, 1)})
            for config in configs:
                filled_attention.CONFIG = config
                ms = _time_graph(lambda i: filled_attention.filled_decode_attention(  # noqa: B023
                    q, keys[i % args.caches], values[i % args.caches], valid, scale))  # noqa: B023
                records.append({**base, "variant": "filled", "config": dataclasses.asdict(config),
                                "ms": round(ms, 4), "gb_per_s": round(admitted_bytes / ms / 1e6, 1)})
            filled_attention.CONFIG = KernelConfig()
    records = [with_provenance(record) for record in records]
    for record in records:
        print(json.dumps(record))
    if args.out:
        with open(args.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
