"""The training half of a profiler trace split by phase and kernel family (``grpo_realistic.py --profile_step N
--profile_after_generation``'s ``.json.gz``).

The phases come from the trace's ``hf_grpo/logprob`` spans on the device: the first is the reference pass, each
later one a micro-batch's forward, and the time from its end to the next span's start that micro-batch's backward
(and, after the last, the optimizer step). Each phase gets its span, its kernel time (the rest of the span the
device sat idle), that time by family (GEMMs, flash attention, Triton kernels, other ATen kernels, copies), and its
largest kernels. Prints one JSON line.

    python bench/trace_phases.py profile_zero2_x1_hf_grpo_step2.json.gz [--top 12]
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: trace_gaps.py
from trace_gaps import DEVICE_CATEGORIES, run  # noqa: E402

SPAN = "hf_grpo/logprob"


def family(name: str) -> str:
    """The kind of kernel ``name`` is; flash attention first (its kernels name cutlass types too)."""
    if "flash" in name.lower():
        return "flash_attention"
    if re.search(r"nvjet|gemm|cutlass|cublas", name, re.I):
        return "gemm"
    if name.startswith("triton_"):
        return "triton"
    if name.startswith(("Memcpy", "Memset")):
        return "copy"
    return "aten_other"


def phases(events: list[dict]) -> list[tuple[str, float, float]]:
    """(phase, start, end) in trace microseconds: before, reference, then forward/backward of each micro-batch."""
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "gpu_user_annotation" and e.get("name") == SPAN)
    if not spans:
        raise SystemExit(f"the trace holds no {SPAN!r} spans on the device (was CUDA profiled, after generation?)")
    first, last = min(k["ts"] for k in kernels), max(k["ts"] + k["dur"] for k in kernels)
    found = [("before", first, spans[0][0]), ("reference", *spans[0])]
    for index, (start, end) in enumerate(spans[1:], start=1):
        found.append((f"forward_{index}", start, end))
        found.append((f"backward_{index}", end, spans[index + 1][0] if index + 1 < len(spans) else last))
    return found


def summary(events: list[dict], top: int) -> dict:
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]  # each phase takes those it spans
    report = {}
    for name, start, end in phases(events):
        inside = [k for k in kernels if start <= k["ts"] < end]
        families, by_name = collections.Counter(), collections.Counter()
        for kernel in inside:
            families[family(kernel["name"])] += kernel["dur"]
            by_name[kernel["name"][:90]] += kernel["dur"]
        busy = sum(k["dur"] for k in inside)
        report[name] = {"span_ms": round((end - start) / 1e3, 1), "kernel_ms": round(busy / 1e3, 1),
                        "families_ms": {f: round(v / 1e3, 1) for f, v in families.most_common()},
                        "top_ms": {k: round(v / 1e3, 1) for k, v in by_name.most_common(top)}}
    return report


def main(argv=None) -> int:
    return run(argv, __doc__, "trace_phases", lambda events, top: {"phases": summary(events, top)}, 12,
               "how many of each phase's largest kernels to list")


if __name__ == "__main__":
    raise SystemExit(main())
