"""The trainer's callbacks around a run: the run set up at train begin, whole steps and the optimizer timed.

They take the trainer's callables, not the trainer: what is decided at train begin is the trainer's own code."""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import TrainerCallback

from .memory.stats import PerformanceStats


class RunCallbacks(TrainerCallback):
    """Sets the run up at train begin (``begin(max_steps, world_process_zero)``: the trainer's decisions and batch
    plan); times whole optimizer steps and the optimizer itself into ``perf()`` (the trainer's stats)."""

    def __init__(self, begin: Callable[[int, bool], None], perf: Callable[[], PerformanceStats]):
        self.begin, self.perf = begin, perf
        self._optimizer_start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin(state.max_steps, state.is_world_process_zero)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.perf().sync()
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._optimizer_start is not None:
            self.perf().sync()
            self.perf().add("optimizer_s", time.perf_counter() - self._optimizer_start)
            self._optimizer_start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.perf().sync()
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        perf = self.perf()
        perf.sync()
        perf.add("step_s", time.perf_counter() - self._step_start)
        perf.add("optimizer_steps", 1)
