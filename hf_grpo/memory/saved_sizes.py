"""The sizes a checkpoint holds (``SIZES_FILE``), and which of them a resumed run takes.

Each checkpoint saves the run's sizes as they stand (the "auto" ones as chosen, the chunk sizes as an out-of-memory
back-off left them), the value each chunk size started from in that run (``configured``), and what the sizes were
chosen for (``chosen_for``: the per-device batch per optimizer step and rollout, ``max_completion_length``). A
resume takes a saved size only where the user did not change what it came from:

- an "auto" size the saved run chose, where it was chosen for what this run has; otherwise this run chooses again;
- a chunk size the saved run lowered after an out-of-memory, where this run starts that chunk from the same value;
  otherwise this run's own value stands (the user changed it, or what it derives from: an unset
  ``per_device_generation_batch_size`` is the whole per-device rollout, so a larger batch means a larger chunk).

Each size taken, and each not taken, is logged with where it came from.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..run_state import SIZE_FIELDS, RunSizes
from .oom import BACKOFF_FIELDS

logger = logging.getLogger("hf_grpo")
SIZES_FILE = "hf_grpo_batch_sizes.json"


def chosen_for(sizes: RunSizes | dict[str, Any], max_completion_length: int | None = None) -> dict[str, int]:
    """What the sizes are chosen for, from a run's sizes or a saved file: invariant under the "auto" micro-batch."""
    get = sizes.get if isinstance(sizes, dict) else lambda name: getattr(sizes, name, None)
    P = get("per_device_train_batch_size")
    return {"per_device_batch_per_optimizer_step": P * get("gradient_accumulation_steps"),
            "per_device_rollout": P * get("steps_per_generation"),
            "max_completion_length": get("max_completion_length") if isinstance(sizes, dict) else
            max_completion_length}


def read_saved_sizes(checkpoint: str | None) -> dict[str, Any] | None:
    """The sizes saved in ``checkpoint`` (a directory), or None when it holds none.

    A file that does not parse, or does not hold sizes, is an error naming it and what to do: it is written before
    ``trainer_state.json`` marks the checkpoint complete, so in a complete checkpoint it was damaged or edited."""
    path = os.path.join(checkpoint, SIZES_FILE) if checkpoint else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            saved = json.load(handle)
    except ValueError as err:  # (JSONDecodeError, UnicodeDecodeError)
        raise ValueError(_unusable(path, f"it is not valid JSON ({err})")) from None
    problem = _shape_problem(saved)
    if problem is not None:
        raise ValueError(_unusable(path, problem))
    return saved


def _unusable(path: str, problem: str) -> str:
    return (f"{path} cannot be used: {problem}. It holds the sizes the saved run chose ('auto') or lowered after an "
            f"out-of-memory; delete it to resume with this run's own sizes (its 'auto' ones chosen again), or resume "
            f"from another checkpoint")


def _is_size(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _shape_problem(saved) -> str | None:
    """What makes ``saved`` not a sizes record (as ``save_sizes`` writes it, or an older one without
    ``chosen_for``), or None."""
    if not isinstance(saved, dict):
        return f"it holds a JSON {type(saved).__name__}, not an object of sizes"
    for name in SIZE_FIELDS:
        if name in saved and not _is_size(saved[name]):
            return f'"{name}" is {saved[name]!r}, not a positive integer or null'
    for part in ("configured", "chosen_for"):
        if part in saved and not (isinstance(saved[part], dict) and all(map(_is_size, saved[part].values()))):
            return f'"{part}" is {saved[part]!r}, not an object of positive integers or nulls'
    if "chosen_for" not in saved:  # an older file: what the sizes were chosen for is derived from three of them
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation"):
            if saved.get(name) is None:
                return f'it has neither "chosen_for" nor "{name}"'
    return None


def save_sizes(sizes: RunSizes, max_completion_length: int, directory: str) -> None:
    """Write the run's current sizes, where each chunk size started and what they are chosen for."""
    saved = {name: getattr(sizes, name) for name in SIZE_FIELDS}
    saved["configured"] = sizes.configured or {n: getattr(sizes, n) for n in BACKOFF_FIELDS}
    saved["chosen_for"] = chosen_for(sizes, max_completion_length)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, SIZES_FILE), "w") as handle:
        json.dump(saved, handle, indent=2)


def _saved_chosen_for(saved: dict[str, Any]) -> dict[str, int | None]:
    if "chosen_for" in saved:
        return saved["chosen_for"]
    found = chosen_for(saved)  # a file written before "chosen_for" was: no max_completion_length in it
    found["max_completion_length"] = None
    return found


def _differences(saved: dict[str, Any], sizes: RunSizes, max_completion_length: int) -> str:
    """How this run differs from what the saved sizes were chosen for ('' where it does not)."""
    then, now = _saved_chosen_for(saved), chosen_for(sizes, max_completion_length)
    return ", ".join(f"{k} {then[k]} then, {now[k]} now" for k in now if then.get(k) is not None and then[k] != now[k])


def _smaller(old, now) -> bool:
    return isinstance(old, int) and old >= 1 and (now is None or old < now)


@dataclass
class Reuse:
    """What a resume takes from a checkpoint's sizes, and what it leaves, in words for the log."""

    auto: dict[str, Any] = field(default_factory=dict)  # "auto" sizes as the saved run chose them
    # field: (started from, lowered to); started from None: a file that does not say (taken as a back-off)
    backoffs: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    not_taken: list[str] = field(default_factory=list)


def plan_reuse(saved: dict[str, Any] | None, sizes: RunSizes, max_completion_length: int, auto_fields) -> Reuse:
    """Which saved sizes this run takes; ``sizes`` holds this run's sizes (its "auto" ones still provisional)."""
    reuse = Reuse()
    if saved is None:
        return reuse
    changed = _differences(saved, sizes, max_completion_length)
    configured = saved.get("configured", {})
    for name in auto_fields:
        if name not in saved:
            continue
        if changed:
            reuse.not_taken.append(f"{name}={saved[name]} ('auto' chosen for another batch: {changed})")
        else:  # where the saved run then lowered it, it starts from the value it chose
            reuse.auto[name] = configured.get(name, saved[name])
    for name in BACKOFF_FIELDS:
        if name in auto_fields and name not in reuse.auto:
            continue  # chosen again by this run
        now = reuse.auto.get(name, getattr(sizes, name))
        if name in configured:
            start = configured[name]
        elif name == "per_device_generation_batch_size" and changed:  # an older file: derived from another batch
            if saved.get(name) != now:
                reuse.not_taken.append(f"{name}={saved.get(name)} (set for another batch: {changed})")
            continue
        else:  # an older file: a chunk smaller than this run's is taken as lowered after an out-of-memory
            if _smaller(saved.get(name), now):
                reuse.backoffs[name] = (None, saved[name])
            continue
        if not _smaller(saved.get(name), start):
            continue
        if start == now:
            reuse.backoffs[name] = (start, saved[name])
        else:
            reuse.not_taken.append(f"{name}={saved[name]} (lowered after an out-of-memory from {start}; this run "
                                   f"starts from {now})")
    return reuse


def log_reuse(reuse: Reuse, checkpoint: str) -> None:
    path = os.path.join(checkpoint, SIZES_FILE)
    for name, (start, lowered) in reuse.backoffs.items():
        how = f"lowered it from {start}" if start is not None else "had it below this run's (a back-off)"
        logger.warning("%s=%s kept from %s: the run that saved it %s after an out-of-memory", name, lowered, path,
                       how)
    if reuse.not_taken:
        logger.info("not taken from %s, this run's own sizes stand: %s", path, "; ".join(reuse.not_taken))
