"""Where a ``train()`` call starts, checked on every rank before any step.

A fresh run into another run's checkpoints is refused (``output_dirs``); ``resume_from_checkpoint=True`` becomes
the newest complete checkpoint, and an incomplete one named is refused (``checkpoints``); a checkpoint the launch
shape cannot read is refused (``hf_grpo.distributed.zero_resume``, ``plain_to_zero``); a missing random state is
named (``hf_grpo.distributed.rng_files``). Only then are the incomplete checkpoints set aside.
"""

from __future__ import annotations

from ..distributed import plain_to_zero, rng_files, zero_resume
from . import checkpoints, output_dirs


def checkpoint_to_resume(trainer, resume_from_checkpoint) -> str | None:
    """The checkpoint ``trainer.train`` resumes from (None: a fresh run), after every check. Every rank calls it."""
    args, accelerator = trainer.args, trainer.accelerator
    output_dirs.check_fresh_run(args, resume_from_checkpoint, accelerator)
    checkpoint = checkpoints.resolve_resume(resume_from_checkpoint, args.output_dir, accelerator.is_main_process)
    if checkpoint is None:
        return None
    zero_resume.check_resume_shape(checkpoint, accelerator.num_processes, trainer.is_deepspeed_enabled)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    plain_to_zero.check_stage(checkpoint, trainer.is_deepspeed_enabled, getattr(plugin, "zero_stage", None))
    rng_files.warn_if_missing(checkpoint, args.world_size, args.process_index)
    checkpoints.set_aside_incomplete(args.output_dir, args, accelerator)
    return checkpoint
