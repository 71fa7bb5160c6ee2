"""Where a ``train()`` call starts, checked on every rank before any step.

A fresh run into another run's checkpoints is refused (``output_dirs``); ``resume_from_checkpoint=True`` becomes
the newest complete checkpoint, and an incomplete one named is refused (``checkpoints``); a checkpoint the launch
shape cannot read is refused (``hf_grpo.distributed.zero_resume``, ``plain_to_zero``); a missing random state is
named (``hf_grpo.distributed.rng_files``). Only then are the incomplete checkpoints set aside.

A checkpoint at or past the run's ``max_steps`` is a finished run: ``finished`` says so, and the trainer then runs no
epoch (``no_epoch_if_finished``; transformers would train one step past ``max_steps`` and save it, its rotation
deleting the run's final checkpoint). The model still loads the checkpoint's weights, so that a run killed between
its last save and its final model gets that model written from the checkpoint, with no step trained.
"""

from __future__ import annotations

import functools
import logging

from ..distributed import plain_to_zero, rng_files, zero_resume
from . import checkpoints, output_dirs

logger = logging.getLogger("hf_grpo")


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


def finished(checkpoint: str | None, global_step: int, max_steps: int, is_main_process: bool) -> bool:
    """Whether this ``train()`` resumes a run already at (or past) ``max_steps``: it then trains no step and saves no
    checkpoint; the main process says so."""
    if checkpoint is None or global_step < max_steps:
        return False
    if is_main_process:
        where = "the" if global_step == max_steps else "past the"
        logger.warning("resume_from_checkpoint: %s is at step %d, %s run's max_steps=%d: the run is finished, so "
                       "this run trains no step and saves no checkpoint; the model holds that checkpoint's weights "
                       "(the recipes write them as the final model). Pass a larger --max_steps to train on",
                       checkpoint, global_step, where, max_steps)
    return True


def no_epoch_if_finished(init_training_state):
    """transformers' ``Trainer._init_training_state`` (which loads the checkpoint's ``TrainerState``), returning
    every epoch as trained where the resumed run is ``finished``: then no epoch runs. (Left alone, transformers runs
    the epoch the step falls in, trains one step past ``max_steps``, saves it and rotates the final checkpoint away.)
    The checkpoint's weights and optimizer are still loaded, before and after this."""

    @functools.wraps(init_training_state)
    def wrapped(trainer, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial):
        trained = init_training_state(trainer, max_steps, num_update_steps_per_epoch, num_train_epochs,
                                      resume_from_checkpoint, trial)
        if finished(resume_from_checkpoint, trainer.state.global_step, max_steps,
                    trainer.accelerator.is_main_process):
            return num_train_epochs, 0
        return trained

    return wrapped
