"""ZeRO-3 with one process: every parameter made persistent, which DeepSpeed then keeps gathered where it can.

With one process a ZeRO-3 partition holds the whole parameter, and gathering it only points the parameter at its
partition: no copy, no memory. DeepSpeed still releases each module's parameters after its forward and fetches
them again before the next use (the recompute, the backward, the next micro-batch), host work per module each
time. Parameters it counts as persistent (at most ``stage3_param_persistence_threshold`` elements) are not released
while its record of the modules' order (its trace) is complete; a threshold above the largest parameter makes them
all persistent, at no memory cost under one process. Not where parameters are offloaded (a persistent parameter
would hold a GPU copy of a host partition), nor where the user set the threshold: only DeepSpeed's "auto" (or no
value) is raised.

What it saves is bounded by DeepSpeed: while it records a trace, DeepSpeed 0.19.8 releases every parameter of a
module after use, persistent or not (``release_sub_module``). In a LoRA run with a reference pass the trace was
seldom complete: over 3 steps of ``tests/scripts/packed_exactness_train.py``'s tiny run it released persistent
parameters 347 times, against 389 releases at DeepSpeed's own threshold (``docs/performance.md``).
"""

from __future__ import annotations

import logging

import torch

from .zero3_leaves import is_zero3_config

KEY = "stage3_param_persistence_threshold"


def offloads_parameters(config: dict) -> bool:
    """Whether a DeepSpeed ``config`` offloads the parameters (to the host or NVMe)."""
    device = ((config.get("zero_optimization") or {}).get("offload_param") or {}).get("device", "none")
    return str(device).lower() not in ("none", "")


def make_persistent(config: dict | None, model: torch.nn.Module | None, num_processes: int) -> int | None:
    """Raise ``config``'s persistence threshold above ``model``'s largest parameter where it is ZeRO-3 with one
    process, no parameter offload and the threshold left to DeepSpeed; returns the threshold set, or None."""
    if model is None or num_processes != 1 or not is_zero3_config(config) or offloads_parameters(config):
        return None
    zero = config["zero_optimization"]
    if zero.get(KEY, "auto") != "auto":
        return None  # the user's own number
    # a parameter built under zero.Init is empty until gathered: its size is ds_numel
    largest = max((getattr(p, "ds_numel", p.numel()) for p in model.parameters()), default=0)
    zero[KEY] = int(largest)
    return int(largest)


def apply(config: dict | None, model: torch.nn.Module | None, num_processes: int, main: bool) -> int | None:
    """``make_persistent``, logged on ``main`` where it applies."""
    threshold = make_persistent(config, model, num_processes)
    if threshold is not None and main:
        logging.getLogger("hf_grpo").info(
            "ZeRO-3 with one process: every parameter persistent (%s=%d, the largest parameter's elements): a "
            "partition holds all of it, so DeepSpeed keeps it gathered while its module trace is complete", KEY,
            threshold)
    return threshold
