"""A checkpoint saved under DeepSpeed ZeRO resumes only in the launch shape that can read its optimizer state.

ZeRO-1/2/3 save the optimizer state (Adam's moments, the fp32 master weights) partitioned by data-parallel
rank under ``checkpoint-N/global_stepN/`` (``zero_pp_rank_R_mp_rank_00_optim_states.pt``), not as the
``optimizer.pt`` the Trainer reads without DeepSpeed. Resumed without DeepSpeed, the Trainer finds no
``optimizer.pt`` and carries on with a fresh optimizer; with another number of processes, the partitions do not
match the new ranks. Both broke "exact resume" without a word, so both are refused here, naming what would be
lost and the launch that restores it.
"""

from __future__ import annotations

import os
import re

from ..runtime.collectives import max_over_ranks

OPTIMIZER_PARTITION = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")


def zero_state_dir(checkpoint: str) -> str | None:
    """The ``global_stepN`` directory DeepSpeed saved in ``checkpoint`` (named by its ``latest`` file), or None."""
    latest = os.path.join(checkpoint, "latest")
    if os.path.isfile(latest):
        with open(latest) as handle:
            tag = handle.read().strip()
        if os.path.isdir(os.path.join(checkpoint, tag)):
            return os.path.join(checkpoint, tag)
    tags = [name for name in os.listdir(checkpoint) if re.fullmatch(r"global_step\d+", name)]
    return os.path.join(checkpoint, max(tags, key=lambda t: int(t[len("global_step"):]))) if tags else None


def saved_partitions(checkpoint: str) -> int:
    """Processes whose ZeRO optimizer partitions this disk holds: highest rank seen + 1 (0: none)."""
    state = zero_state_dir(checkpoint) if os.path.isdir(checkpoint) else None
    if state is None:
        return 0
    ranks = [int(m.group(1)) for name in os.listdir(state) if (m := OPTIMIZER_PARTITION.fullmatch(name))]
    return max(ranks) + 1 if ranks else 0


def check_resume_shape(checkpoint: str | None, world_size: int, uses_deepspeed: bool) -> None:
    """Refuse to resume a ZeRO checkpoint without DeepSpeed or with another world size. Every rank must call it
    (a node without a shared disk sees only its own ranks' files: the count is the maximum over ranks)."""
    if checkpoint is None:
        return
    saved = max_over_ranks(saved_partitions(checkpoint))
    if saved == 0:
        return
    lost = (f"{checkpoint} holds the optimizer state (Adam's moments and the fp32 master weights) of a DeepSpeed "
            f"ZeRO run of {saved} process{'es' if saved > 1 else ''}, partitioned under "
            f"{os.path.relpath(zero_state_dir(checkpoint), checkpoint)}/")
    relaunch = (f"resume with the launch that saved it (accelerate launch --num_processes {saved} --config_file "
                f"accelerate_configs/zero2.yaml or the ZeRO config you used), or drop --resume_from_checkpoint and "
                f"start a new run from the saved model weights")
    if not uses_deepspeed:
        raise ValueError(f"{lost}; this run does not use DeepSpeed, so it would resume with a fresh optimizer and "
                         f"lose that state: {relaunch}")
    if saved != world_size:
        raise ValueError(f"{lost}; this run has {world_size} process{'es' if world_size > 1 else ''}, whose "
                         f"partitions would not match the saved ones and lose that state: {relaunch}")
