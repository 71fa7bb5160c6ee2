"""Where an optimizer step's time goes, phase by phase, for trl.GRPOTrainer and hf_grpo.GRPOTrainer alike.

``PhaseTimer(trainer, device)`` wraps, on the trainer instance, the methods both trainers share (TRL 1.16):

* ``generation``: ``_generate_single_turn``; ``reward``: ``_calculate_rewards``;
* ``_get_per_token_logps_and_entropies``, split by caller: ``reference_logprobs`` (the reference model, or the
  policy with its LoRA adapters disabled), ``old_logprobs`` (the policy without grad: the rollout's old
  log-probs) and ``policy_forward`` (with grad: the training forward);
* ``backward``: ``accelerator.backward``; ``optimizer``: from ``on_pre_optimizer_step`` to ``on_optimizer_step``;
* ``loss_other``: the rest of ``compute_loss`` (TRL's loss math, hf_grpo's token-budget bookkeeping);
* ``prepare_other``: the rest of ``_prepare_inputs`` (tokenizing, advantages, buffers, gathers);
* ``step_other``: the rest of the optimizer step (the Trainer's loop, clipping, logging, host gaps).

Phases are exclusive: a phase that runs inside another (the forward inside ``compute_loss``) is charged to
itself only. Every boundary synchronizes the device, so a phase's time is its own work, not the work it
queued; the syncs cost both trainers alike. ``summary()`` gives the per-step records and, for steps after the
first, the median of each phase over steps with a rollout and over steps without one (``num_iterations > 1``).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
from transformers import TrainerCallback

PHASES = ("generation", "reward", "reference_logprobs", "old_logprobs", "policy_forward", "loss_other", "backward",
          "optimizer", "prepare_other", "step_other")
TRAINING_HALF = ("reference_logprobs", "old_logprobs", "policy_forward", "loss_other", "backward", "optimizer")


class PhaseTimer(TrainerCallback):
    def __init__(self, trainer, device: str):
        self.trainer, self.device = trainer, device
        self.steps: list[dict[str, float]] = []
        self._current = defaultdict(float)
        self._stack: list[list[float]] = []  # [start, time of nested phases] of each open phase
        self._lora_layer = next((m for m in trainer.model.modules() if hasattr(m, "lora_A")), None)
        self._wrap(trainer, "_generate_single_turn", lambda *a, **k: "generation")
        self._wrap(trainer, "_calculate_rewards", lambda *a, **k: "reward")
        self._wrap(trainer, "_get_per_token_logps_and_entropies", self._scoring_phase)
        self._wrap(trainer, "compute_loss", lambda *a, **k: "loss_other")
        self._wrap(trainer, "_prepare_inputs", lambda *a, **k: "prepare_other")
        self._wrap(trainer.accelerator, "backward", lambda *a, **k: "backward")
        trainer.add_callback(self)

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _scoring_phase(self, model, *args, **kwargs) -> str:
        if torch.is_grad_enabled():
            return "policy_forward"
        if model is self.trainer.ref_model or getattr(self._lora_layer, "disable_adapters", False):
            return "reference_logprobs"
        return "old_logprobs"

    def _wrap(self, owner, name: str, phase_of):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            phase = phase_of(*args, **kwargs)
            self._open()
            try:
                return inner(*args, **kwargs)
            finally:
                self._close(phase)

        setattr(owner, name, timed)

    def _open(self):
        self._sync()
        self._stack.append([time.perf_counter(), 0.0])

    def _close(self, phase: str):
        self._sync()
        start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self._current[phase] += elapsed - nested
        if self._stack:
            self._stack[-1][1] += elapsed

    # ---- callbacks ----------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        self._current = defaultdict(float)
        self._sync()
        self._step_start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._open()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._close("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        total = time.perf_counter() - self._step_start
        record = {phase: self._current.get(phase, 0.0) for phase in PHASES if phase != "step_other"}
        record["step_other"] = total - sum(record.values())
        record["step"] = total
        record["training_half"] = sum(record[phase] for phase in TRAINING_HALF)
        self.steps.append({key: round(value, 4) for key, value in record.items()})

    def summary(self) -> dict:
        def medians(steps):
            if not steps:
                return None
            return {key: round(statistics.median(step[key] for step in steps), 4) for key in steps[0]}

        later = self.steps[1:]
        return dict(
            per_step=self.steps,
            median_with_rollout=medians([s for s in later if s["generation"] > 0]),
            median_without_rollout=medians([s for s in later if s["generation"] == 0]),
        )


def table(records: list[dict]) -> str:
    """One line per run and step kind: the median phases (seconds), as ``python bench/phase_timer.py FILE``."""
    names = ("step", "training_half", *PHASES)
    lines = [f"{'run':34} {'kind':8} " + " ".join(f"{n[:12]:>12}" for n in names)]
    for r in records:
        label = r["impl"] if r["impl"] == "trl" else f"{r['backend']} pf={r.get('padding_free')} c={r.get('compile_training')}"
        label += f" lora{r['lora_r']}" if r.get("lora_r") else ""
        for kind in ("with_rollout", "without_rollout"):
            row = (r.get("phases") or {}).get(f"median_{kind}")
            if row:
                lines.append(f"{label:34} {kind[:8]:8} " + " ".join(f"{row.get(n, 0):12.4f}" for n in names))
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys

    print(table([json.loads(line) for path in sys.argv[1:] for line in open(path) if line.strip()]))
