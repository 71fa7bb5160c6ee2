"""Performance figures of a run: time per phase, tokens per second, peak memory, and on a GPU how near each phase
runs to the device's measured rates (``flops``, ``device_rates``)."""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from .device_rates import DeviceRates

PHASES = ("generation", "reward", "logprob", "optimizer")
COUNTS = ("decode_compiles", "graph_captures", "train_compiles", "train_graph_captures", "train_graph_reuses",
          "oom_backoffs")


def peak_memory_gib(device: torch.device | None = None) -> float:
    """GPU max allocated on CUDA, else the process's peak resident set size."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


class PerformanceStats:
    """Accumulates phase times and token counts; reports per optimizer step and per second.

    Two windows are kept: the whole run (``summary``) and the span since the last log
    (``window``), so logged curves show the current speed rather than a running average.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.rates: DeviceRates | None = None  # set on a GPU (device_rates): the efficiency figures need them
        self._total = defaultdict(float)
        self._window = defaultdict(float)

    def sync(self):
        # Device work is asynchronous: without a sync a phase would be charged to the next one. The current stream
        # only: copies left running on a side stream (layerwise_restore) overlap the phases that follow.
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @contextmanager
    def phase(self, name: str, *also: str):
        """Time the block as ``name`` (and as each of ``also``: one span counted in several sums, synced once)."""
        self.sync()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"hf_grpo/{name}"):  # a named span in profiler traces
                yield
        finally:
            self.sync()
            elapsed = time.perf_counter() - start
            for each in (name, *also):
                self.add(f"{each}_s", elapsed)

    def total(self, key: str) -> float:
        """The whole run's sum for ``key`` (seconds or a count)."""
        return self._total[key]

    def add(self, key: str, amount: float):
        self._total[key] += amount
        self._window[key] += amount

    @staticmethod
    def _efficiency(counts: dict, rates: DeviceRates, steps: float) -> dict[str, float]:
        """Achieved rates against the device's, and the floor each phase's work sets (``flops``): only what was
        counted and timed (the decode loop is timed by the cuda_graph backend alone)."""
        report = {}
        matmul, copy = rates.matmul_tflops * 1e12, rates.copy_gbps * 1e9
        for name, flops, seconds in (("train", "train_flops", "train_s"), ("scoring", "scoring_flops", "scoring_s")):
            if counts.get(flops) and counts.get(seconds):
                achieved = counts[flops] / counts[seconds]
                report[f"{name}_tflops"] = achieved / 1e12
                report[f"{name}_matmul_fraction"] = achieved / matmul
        if counts.get("decode_bytes") and counts.get("decode_s"):
            achieved = counts["decode_bytes"] / counts["decode_s"]
            report["decode_gbps"] = achieved / 1e9
            report["decode_bandwidth_fraction"] = achieved / copy
        if counts.get("train_flops"):
            report["training_half_floor_s"] = counts["train_flops"] / matmul / steps
        if counts.get("decode_bytes"):
            report["generation_floor_s"] = (counts["decode_bytes"] / copy + counts.get("prefill_flops", 0.0) / matmul
                                            ) / steps
        if "training_half_floor_s" in report and "generation_floor_s" in report:
            report["step_floor_s"] = report["training_half_floor_s"] + report["generation_floor_s"]
        return report

    def _report(self, counts: dict, device) -> dict[str, float]:
        steps = max(counts.get("optimizer_steps", 0.0), 1.0)
        report = {"step_s": counts.get("step_s", 0.0) / steps}
        report.update({f"{name}_s_per_step": counts.get(f"{name}_s", 0.0) / steps for name in PHASES})
        gen_s, train_s = counts.get("generation_s", 0.0), counts.get("train_s", 0.0)
        report["rollout_tokens_per_s"] = counts.get("generated_tokens", 0.0) / gen_s if gen_s else 0.0
        report["train_tokens_per_s"] = counts.get("train_tokens", 0.0) / train_s if train_s else 0.0
        report["peak_memory_gib"] = peak_memory_gib(device)
        # compiles and captures of the cuda_graph decoder (a number that keeps rising is thrash), OOM back-offs
        for count in COUNTS:
            report[count] = counts.get(count, 0.0)
        if self.rates is not None:
            report.update(self._efficiency(counts, self.rates, steps))
        return report

    def summary(self) -> dict[str, float]:
        return self._report(self._total, self.device)

    def pop_window(self) -> dict[str, float]:
        report = self._report(self._window, self.device)
        self._window.clear()
        return report
