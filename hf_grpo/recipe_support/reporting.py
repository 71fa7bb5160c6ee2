"""Metrics a person looks at: a JSON-lines file per logging step and a PNG of reward and loss."""

from __future__ import annotations

import json
import math
import os

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_loss.png"


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
        if state.is_world_process_zero:
            earlier = read_metrics(self.path) if os.path.exists(self.path) else []
            self.run = 1 + max((row.get("run", 0) for row in earlier), default=0)
            self.run_start_step = state.global_step  # after a resume: the checkpoint's step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
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


def plot_metrics(metrics_path: str, png_path: str, title: str = "GRPO training") -> str:
    """Draw reward (left axis) and loss (right axis) per step; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    rows = [r for r in current_run_rows(read_metrics(metrics_path)) if "reward" in r]
    steps = [r["step"] for r in rows]
    fig, reward_axis = plt.subplots(figsize=(7, 4))
    reward_axis.plot(steps, [r["reward"] for r in rows], color="tab:blue", marker="o", markersize=3, label="reward")
    reward_axis.set_xlabel("optimizer step")
    reward_axis.set_ylabel("mean reward", color="tab:blue")
    loss_axis = reward_axis.twinx()
    losses = [r.get("loss", math.nan) for r in rows]
    loss_axis.plot(steps, losses, color="tab:orange", alpha=0.7, label="loss")
    loss_axis.set_ylabel("loss", color="tab:orange")
    reward_axis.set_title(title)
    reward_axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
