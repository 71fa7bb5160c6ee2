"""The trainer's callbacks around a run: what is set up at train begin, and whole steps and the optimizer timed."""

from __future__ import annotations

import logging
import time

from transformers import TrainerCallback

from .training import eager_packing, graphs as training_graphs

logger = logging.getLogger("hf_grpo")


class RunCallbacks(TrainerCallback):
    """Logs the batch plan at train start; times whole optimizer steps and the optimizer itself."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._optimizer_start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._train_layers = self.trainer._compiled_training_layers(state.max_steps)
        self.trainer._align_lengths_for_compiled_layers()
        # eager micro-batches packed or padded (padding_free=None), now that the sizes are settled; logged below
        self.trainer._eager_rows = eager_packing.for_trainer(
            self.trainer, self.trainer.args.per_device_train_batch_size, self.trainer._longest_prompt)
        self.trainer._train_graphs = training_graphs.start(self.trainer)
        self.trainer._generation_mirror()  # decided on every rank before the plan is printed
        if state.is_world_process_zero:
            plan = self.trainer.batch_plan()
            logger.info("hf-grpo batch plan (world size %d):\n%s", plan.world_size, plan)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.perf.sync()
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._optimizer_start is not None:
            self.trainer.perf.sync()
            self.trainer.perf.add("optimizer_s", time.perf_counter() - self._optimizer_start)
            self._optimizer_start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.perf.sync()
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.perf.sync()
        self.trainer.perf.add("step_s", time.perf_counter() - self._step_start)
        self.trainer.perf.add("optimizer_steps", 1)
