"""A checkpoint saved without ZeRO state (one process, or plain multi-GPU) resumes under DeepSpeed ZeRO-1/2.

Such a checkpoint holds the weights (``model.safetensors``) and the whole optimizer state (``optimizer.pt``), not
DeepSpeed's ``global_stepN/``, which transformers' resume under DeepSpeed reads and otherwise refuses ("Can't find
a valid checkpoint"). Here the weights are loaded into the model before DeepSpeed takes it (its fp32 master copy
is made from them), and each rank then takes its own slice of every optimizer tensor (Adam's moments) into its
ZeRO partition, at the offsets DeepSpeed links each parameter to. The learning-rate schedule, the random states
and the trainer state are read by transformers as in any resume. ZeRO-3, whose partitioned weights and optimizer
are built differently, is refused before the first step, naming the way that works.
"""

from __future__ import annotations

import logging
import os

import torch

from ..runtime import upstream

logger = logging.getLogger("hf_grpo")
OPTIMIZER_FILE = "optimizer.pt"


def applies(checkpoint: str | None, uses_deepspeed: bool) -> bool:
    """Whether ``checkpoint`` is one without ZeRO state, resumed under DeepSpeed."""
    from .zero_resume import zero_state_dir

    return bool(uses_deepspeed and checkpoint and os.path.isdir(checkpoint) and zero_state_dir(checkpoint) is None)


def check_stage(checkpoint: str | None, uses_deepspeed: bool, stage: int | None) -> None:
    """Refuse a checkpoint without ZeRO state under ZeRO-3 (every rank calls it, before any step)."""
    if applies(checkpoint, uses_deepspeed) and stage == 3:
        raise ValueError(
            f"{checkpoint} was saved without DeepSpeed ZeRO (one process or plain multi-GPU: model.safetensors and "
            f"optimizer.pt); it resumes under ZeRO-1 or ZeRO-2 (e.g. accelerate_configs/zero2.yaml) or without "
            f"DeepSpeed, not under ZeRO-3, which partitions the weights before they could be loaded: resume it with "
            f"one of those, or drop --resume_from_checkpoint and start a new ZeRO-3 run from the saved weights "
            f"(--model_name_or_path {checkpoint})")


def has_schedule(checkpoint: str, is_main_process: bool) -> bool:
    """Whether ``checkpoint`` holds the learning-rate schedule (``scheduler.pt``; not with ``save_only_model``)."""
    if os.path.isfile(os.path.join(checkpoint, "scheduler.pt")):
        return True
    if is_main_process:
        logger.warning("%s holds no scheduler.pt: the learning-rate schedule restarts from its first step", checkpoint)
    return False


def load_optimizer_state(engine, checkpoint: str, is_main_process: bool) -> None:
    """``optimizer.pt``'s state into the ZeRO-1/2 optimizer of ``engine``, each rank its own partition."""
    path = os.path.join(checkpoint, OPTIMIZER_FILE)
    zero = engine.optimizer
    if not os.path.isfile(path):
        if is_main_process:
            logger.warning("%s holds no %s: the run resumes with a fresh optimizer state under DeepSpeed", checkpoint,
                           OPTIMIZER_FILE)
        return
    saved = torch.load(path, map_location="cpu", weights_only=True)
    groups = upstream.zero_parameter_groups(zero)
    counts = [len(group) for group in groups] if groups is not None else None
    saved_counts = [len(group["params"]) for group in saved["param_groups"]]
    if counts != saved_counts:
        raise ValueError(
            f"{path} holds an optimizer of {len(saved_counts)} parameter groups ({saved_counts} parameters), which "
            f"does not match this run's DeepSpeed optimizer ({'not ZeRO-1/2' if counts is None else counts}): "
            f"resume with the model and optimizer settings that saved it")
    for i, group in enumerate(groups):
        flat = upstream.zero_fp32_partition(zero, i)
        scalars: dict = {}
        buffers: dict = {}
        for param, index in zip(group, saved["param_groups"][i]["params"]):
            for key, value in saved["state"].get(index, {}).items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    scalars.setdefault(key, value)  # Adam's step: the same for every parameter of the group
                    continue
                if value.shape != param.shape:
                    raise ValueError(f"{path}: the optimizer's {key} of parameter {index} in group {i} has shape "
                                     f"{tuple(value.shape)}, this run's parameter {tuple(param.shape)}: resume with "
                                     f"the model that saved it")
                fragment = upstream.zero_fragment(param)
                if fragment is None:  # no part of this parameter lies in this rank's partition
                    continue
                buffer = buffers.setdefault(key, torch.zeros_like(flat))
                lp, hp = fragment
                buffer.narrow(0, hp.start, hp.numel).copy_(value.flatten().narrow(0, lp.start, lp.numel))
        if buffers:
            zero.optimizer.state[flat] = {**scalars, **buffers}
    if is_main_process:
        logger.warning("resuming %s (saved without ZeRO) under DeepSpeed ZeRO: its weights and %s (%s) are loaded, "
                       "each rank taking its partition", checkpoint, OPTIMIZER_FILE,
                       ", ".join(sorted({k for s in saved["state"].values() for k in s})))
