"""Metrics a person looks at: the PNG of reward and loss drawn from ``metrics.jsonl``.

The files a run writes (``metrics.jsonl``, ``performance.json``) come from ``hf_grpo.run_files``, whose names
are re-exported here.
"""

from __future__ import annotations

import math

from ..run_files import (  # noqa: F401 (re-exported)
    METRICS_FILE, PERFORMANCE_FILE, MetricsFileCallback, PerformanceFileCallback, current_run_rows, read_metrics)

PLOT_FILE = "reward_loss.png"


def plot_metrics(metrics_path: str, png_path: str, title: str = "GRPO training") -> str:
    """Draw reward (left axis) and loss (right axis) per step; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    rows = [r for r in current_run_rows(read_metrics(metrics_path)) if "reward" in r]
    steps = [r["step"] for r in rows]
    fig, reward_axis = plt.subplots(figsize=(7, 4))
    rewards = [math.nan if r["reward"] is None else r["reward"] for r in rows]  # null: a non-finite value
    reward_axis.plot(steps, rewards, color="tab:blue", marker="o", markersize=3, label="reward")
    reward_axis.set_xlabel("optimizer step")
    reward_axis.set_ylabel("mean reward", color="tab:blue")
    loss_axis = reward_axis.twinx()
    losses = [math.nan if r.get("loss") is None else r["loss"] for r in rows]
    loss_axis.plot(steps, losses, color="tab:orange", alpha=0.7, label="loss")
    loss_axis.set_ylabel("loss", color="tab:orange")
    reward_axis.set_title(title)
    reward_axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
