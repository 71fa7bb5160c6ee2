"""The files every run writes into ``output_dir``, recipe or library script alike: ``metrics.jsonl`` (a line per
logging step) and ``performance.json`` (every rank's timings and peak memory, at the end of training).

``GRPOTrainer`` adds both callbacks itself (``add_run_files``), once each: a callback of the same class passed in
``callbacks=`` is used instead, and a metrics writer added later for the same file stays silent. To write neither, ``trainer.remove_callback(MetricsFileCallback)`` and
``trainer.remove_callback(PerformanceFileCallback)`` before ``train()``.
"""

from __future__ import annotations

import json
import os
import weakref

import torch
from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"
PERFORMANCE_FILE = "performance.json"
# The one callback that writes each metrics file during a train() (keyed by path; the run told by its TrainerState):
# a second MetricsFileCallback added to the same trainer, as scripts written before the trainer added its own do,
# stays silent instead of writing every row twice.
_WRITERS: dict[str, tuple[weakref.ref, "MetricsFileCallback"]] = {}


class MetricsFileCallback(TrainerCallback):
    """Appends ``{"step", "reward", "loss", ..., "run", "run_start_step"}`` to ``output_dir/metrics.jsonl`` at
    every training log.

    The file is only ever appended to: each ``train()`` into the directory is a new ``run`` (1, 2, ...) whose
    rows carry the step it started from (0 fresh, N resumed from ``checkpoint-N``). ``current_run_rows`` reads
    back the rows of the latest run's history; nothing a failed or redone run logged is lost from the file.
    """

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.run = None

    def on_train_begin(self, args, state, control, **kwargs):
        writer = _WRITERS.get(self.path)
        if writer is None or writer[0]() is not state:  # the first writer of this path in this train()
            _WRITERS[self.path] = (weakref.ref(state), self)
        self.writing = _WRITERS[self.path][1] is self
        if state.is_world_process_zero and self.writing:
            earlier = read_metrics(self.path) if os.path.exists(self.path) else []
            self.run = 1 + max((row.get("run", 0) for row in earlier), default=0)
            self.run_start_step = state.global_step  # after a resume: the checkpoint's step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs or not getattr(self, "writing", True):
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        if self.run is not None:
            row.update(run=self.run, run_start_step=self.run_start_step)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def read_metrics(path: str) -> list[dict]:
    """Every row of a metrics file, in the order written (all runs)."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def current_run_rows(rows: list[dict]) -> list[dict]:
    """The history of the latest run: each run replaces the rows of earlier runs past the step it started from
    (a fresh run, started at 0, replaces them all; a resumed one only the steps it redid)."""
    kept: list[dict] = []
    for row in rows:
        start = row.get("run_start_step")
        if start is not None and (not kept or kept[-1].get("run") != row.get("run")):
            kept = [r for r in kept if r["step"] <= start]  # the first row of a new run
        kept.append(row)
    return kept


class PerformanceFileCallback(TrainerCallback):
    """Writes ``output_dir/performance.json``, ``{"per_rank": [stats of rank 0, rank 1, ...]}``, when training ends
    (``GRPOTrainer.get_performance_stats``): peak memory differs per GPU under ZeRO, so every rank's figures are
    kept. A ``train()`` that ran no step leaves an existing file as it is."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.start_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        stats = self.trainer.get_performance_stats()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        per_rank = [None] * torch.distributed.get_world_size() if distributed else [stats]
        if distributed:  # every rank reaches on_train_end: the gather is a collective they all join
            torch.distributed.all_gather_object(per_rank, stats)
        # a train() that trained no step (a finished run resumed) keeps the figures of the run that trained
        kept = state.global_step == self.start_step and os.path.exists(os.path.join(args.output_dir, PERFORMANCE_FILE))
        if state.is_world_process_zero and not kept:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, PERFORMANCE_FILE), "w") as handle:
                json.dump({"per_rank": per_rank}, handle, indent=1)


def add_run_files(trainer) -> None:
    """The trainer's ``metrics.jsonl`` and ``performance.json`` writers, each unless one is there already."""
    present = trainer.callback_handler.callbacks
    if not any(isinstance(callback, MetricsFileCallback) for callback in present):
        trainer.add_callback(MetricsFileCallback(trainer.args.output_dir))
    if not any(isinstance(callback, PerformanceFileCallback) for callback in present):
        trainer.add_callback(PerformanceFileCallback(trainer))
