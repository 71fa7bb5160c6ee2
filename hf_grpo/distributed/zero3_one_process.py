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

So the hooks go (``detach``): at the first rollout of a run, every parameter is gathered (pointed at its
partition) and DeepSpeed's fetch and release hooks are removed from the model's submodules, as TRL removes them
for a rollout. The model then runs as a plain one: no host work per module, and micro-batches replayed from CUDA
graphs as under ZeRO-2 (a gathered parameter is a view of its partition, whose address the optimizer's step keeps;
compiled layers: ``training.compiled_layers.ZERO3_CUDA_REASON``). What
DeepSpeed does outside the forward stays: its gradient hooks partition the gradients, its step updates the
partitions, then gathers the persistent parameters again; a save's gather releases what it gathered, which the
next micro-batch gathers back (``keep_whole``). Not with parameters offloaded or quantized (a gathered parameter
would be a copy), nor for a mixture-of-experts model (DeepSpeed makes its expert blocks leaf modules, whose
gradients it reduces in module hooks).
"""

from __future__ import annotations

import logging

import torch

from .. import checkpointing
from ..run_state import is_moe
from ..runtime import upstream
from .zero3_leaves import LeafMarking, is_zero3_config, mark_for_deepspeed

KEY = "stage3_param_persistence_threshold"


def offloads_parameters(config: dict) -> bool:
    """Whether a DeepSpeed ``config`` offloads the parameters (to the host or NVMe)."""
    device = ((config.get("zero_optimization") or {}).get("offload_param") or {}).get("device", "none")
    return str(device).lower() not in ("none", "")


def quantizes_weights(config: dict) -> bool:
    """Whether a DeepSpeed ``config`` quantizes the ZeRO-3 weights it gathers (ZeRO++)."""
    zero = config.get("zero_optimization") or {}
    return bool(zero.get("zero_quantized_weights") or zero.get("zero_quantized_nontrainable_weights"))


def whole_in_one_process(config: dict | None, num_processes: int) -> bool:
    """Whether each ZeRO-3 partition holds its whole parameter on the device: ZeRO-3, one process, no offload."""
    return num_processes == 1 and is_zero3_config(config) and not offloads_parameters(config)


def removes_hooks(config: dict | None, num_processes: int, moe: bool) -> bool:
    """Whether a run removes DeepSpeed's gathering hooks (``detach``): ZeRO-3 with one process, its parameters
    neither offloaded nor quantized, not a mixture-of-experts model."""
    return whole_in_one_process(config, num_processes) and not quantizes_weights(config) and not moe


def detach(engines: list, main: bool) -> int:
    """Every parameter of each ZeRO-3 engine in ``engines`` gathered and DeepSpeed's gathering hooks removed (once;
    logged on ``main``), then any parameter DeepSpeed released since gathered again (``keep_whole``); returns how
    many hooks were removed by this call."""
    removed = 0
    for engine in engines:
        offload = upstream.zero3_gathering(engine)
        if offload is None:
            continue
        if not getattr(offload, "hf_grpo_hooks_removed", False):
            removed += upstream.remove_zero3_gathering_hooks(offload)
            offload.hf_grpo_hooks_removed = True
        keep_whole(engine.module)
    if removed and main:
        logging.getLogger("hf_grpo").info(
            "ZeRO-3 with one process: DeepSpeed's %d gathering hooks removed, every parameter gathered in place (a "
            "view of its partition): the model runs as a plain one", removed)
    return removed


def keep_whole(module: torch.nn.Module) -> int:
    """Gather the parameters of ``module`` that DeepSpeed has released (after its step, or a save's gather); returns
    how many. With one process a gather points a parameter at its partition: no copy, no memory."""
    released = upstream.released_zero3(module.parameters())
    upstream.gather_zero3(released)
    return len(released)


def make_persistent(config: dict | None, model: torch.nn.Module | None, num_processes: int) -> int | None:
    """Raise ``config``'s persistence threshold above ``model``'s largest parameter where it is ZeRO-3 with one
    process, no parameter offload and the threshold left to DeepSpeed; returns the threshold set, or None."""
    if model is None or not whole_in_one_process(config, num_processes):
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


def configure(config: dict | None, model: torch.nn.Module | None, num_processes: int, args,
              main: bool) -> tuple[bool, LeafMarking]:
    """What the trainer sets up in a DeepSpeed ``config`` before DeepSpeed wraps ``model``: ``(hooks to be removed,
    leaf modules marked)``. With one process the hooks go, no module is marked a leaf (a leaf's gradients are
    reduced in a module hook, which a replayed graph would not run) and activation checkpointing is non-reentrant
    again where TRL made it reentrant for the hooks (``checkpointing.unforce_reentrant``); elsewhere under ZeRO-3
    ``args.zero3_leaf_modules``' leaves."""
    removed = removes_hooks(config, num_processes, is_moe(getattr(model, "config", None)))
    marking = mark_for_deepspeed(model, "off" if removed else args.zero3_leaf_modules, config, main)
    apply(config, model, num_processes, main)
    if removed and checkpointing.unforce_reentrant(args) and main:
        logging.getLogger("hf_grpo").info(
            "ZeRO-3 with one process: activation checkpointing non-reentrant (TRL makes it reentrant for PEFT under "
            "ZeRO-3, whose hooks gather parameters in the recompute; they are removed here)")
    return removed, marking
