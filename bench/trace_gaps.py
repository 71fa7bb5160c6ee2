"""Where the device sat idle in a torch.profiler Chrome trace (``grpo_realistic.py --profile_step``'s ``.json.gz``).

Prints one JSON line: the kernels' span and busy time, the idle time between one kernel's end and the next one's
start (in all, and over 10 us, 100 us, 1 ms and 10 ms), and the largest gaps, each with the kernels around it and
the host ops open when it began (none: Python outside any profiled op). A step bound by the GPU loses what these
gaps add up to; the host ops say what kept the queue empty.

    python bench/trace_gaps.py profile_zero2_x1_hf_grpo_step2.json.gz [--top 25]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def gaps(kernels: list[dict]) -> list[tuple[float, float, int]]:
    """(idle microseconds, when it began, the index of the kernel that ended it), kernels sorted by start."""
    found, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for index in range(1, len(kernels)):
        idle = kernels[index]["ts"] - end
        if idle > 0:
            found.append((idle, end, index))
        end = max(end, kernels[index]["ts"] + kernels[index]["dur"])
    return found


def summary(events: list[dict], top: int) -> dict:
    kernels = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not kernels:
        raise SystemExit("the trace holds no device kernels (was CUDA profiled?)")
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]

    def open_at(t: float) -> list[str]:
        last = bisect.bisect_right(starts, t)
        return [e["name"] for e in host[max(0, last - 4000):last] if e["ts"] + e["dur"] >= t][-6:]

    idle = gaps(kernels)
    origin = kernels[0]["ts"]
    return {
        "kernels": len(kernels),
        "span_ms": round((kernels[-1]["ts"] + kernels[-1]["dur"] - origin) / 1e3, 1),
        "busy_ms": round(sum(k["dur"] for k in kernels) / 1e3, 1),
        "idle_ms": round(sum(g for g, _, _ in idle) / 1e3, 1),
        "idle_ms_over": {f"{t}us": round(sum(g for g, _, _ in idle if g > t) / 1e3, 1) for t in (10, 100, 1000, 10000)},
        "largest": [{"ms": round(g / 1e3, 2), "at_s": round((t - origin) / 1e6, 3),
                     "after": kernels[i - 1]["name"][:60], "before": kernels[i]["name"][:60], "host": open_at(t + 50)}
                    for g, t, i in sorted(idle, reverse=True)[:top]],
    }


def run(argv, doc: str, bench: str, summarise, top: int, top_help: str) -> int:
    """The command line of a trace script: ``trace [--top N]``; prints ``summarise(events, top)``'s record."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=top, help=top_help)
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top must be 0 or more, got {args.top}")
    trace = load(args.trace)
    devices = trace.get("deviceProperties") or [{}]
    # the GPU the trace was taken on (the commit and versions added are this checkout's, not the trace's)
    record = {"bench": bench, "trace": os.path.basename(args.trace), "gpu": devices[0].get("name", "unknown"),
              **summarise(trace["traceEvents"], args.top)}
    print(json.dumps(with_provenance(record)))
    return 0


def main(argv=None) -> int:
    return run(argv, __doc__, "trace_gaps", summary, 25, "how many of the largest gaps to list")


if __name__ == "__main__":
    raise SystemExit(main())
