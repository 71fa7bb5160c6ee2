"""Metrics a person looks at: a JSON-lines file per logging step and a PNG of reward and loss."""

from __future__ import annotations

import json
import math
import os

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_loss.png"


class MetricsFileCallback(TrainerCallback):
    """Appends ``{"step", "reward", "loss", ...}`` to ``output_dir/metrics.jsonl`` at every training log."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, METRICS_FILE)

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run keeps the lines of the steps it already did and drops the ones it will redo.
        if state.is_world_process_zero and os.path.exists(self.path):
            rows = [r for r in read_metrics(self.path) if r["step"] <= state.global_step]
            with open(self.path, "w") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in rows)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def read_metrics(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_metrics(metrics_path: str, png_path: str, title: str = "GRPO training") -> str:
    """Draw reward (left axis) and loss (right axis) per step; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "reward" in r]
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
