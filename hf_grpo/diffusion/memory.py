"""Memory figures of a run (``memory_manager_stats`` in ``get_performance_stats()``, the guide's key).

On CUDA: peak and current allocated and reserved memory of the training device; with ``enable_profiling``
also the peak of each phase (generation, logprob, train), measured by resetting CUDA's peak counter at
each phase start while this tracker keeps the run's maximum itself. On CPU: the process's peak and
current resident set size (per-phase peaks are not separable there and are left out).
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import contextmanager

import torch

from ..memory.stats import peak_memory_gib

GIB = 2**30


def current_rss_gib() -> float:
    """Resident set size of this process now (Linux /proc; 0.0 where unavailable)."""
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):
        return 0.0


class MemoryTracker:
    def __init__(self, device: torch.device, config=None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.config = config  # read at every phase: ``config.enable_profiling`` may be switched on later
        self._run_peak = 0.0
        self._phase_peaks: dict[str, float] = defaultdict(float)

    @property
    def profile(self) -> bool:
        return self.cuda and bool(getattr(self.config, "enable_profiling", False))

    @contextmanager
    def phase(self, name: str):
        if not self.profile:
            yield
            return
        self._run_peak = max(self._run_peak, torch.cuda.max_memory_allocated(self.device) / GIB)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            peak = torch.cuda.max_memory_allocated(self.device) / GIB
            self._phase_peaks[name] = max(self._phase_peaks[name], peak)
            self._run_peak = max(self._run_peak, peak)

    def stats(self) -> dict:
        if self.cuda:
            peak = max(self._run_peak, torch.cuda.max_memory_allocated(self.device) / GIB)
            figures = {
                "device": str(self.device),
                "peak_memory_gib": peak,
                "current_memory_gib": torch.cuda.memory_allocated(self.device) / GIB,
                "reserved_memory_gib": torch.cuda.memory_reserved(self.device) / GIB,
                "peak_reserved_memory_gib": torch.cuda.max_memory_reserved(self.device) / GIB,
            }
            if self.profile:
                figures["phase_peak_memory_gib"] = dict(self._phase_peaks)
            return figures
        return {
            "device": str(self.device),
            "peak_memory_gib": peak_memory_gib(None),  # peak resident set size of the process
            "current_memory_gib": current_rss_gib(),
        }
