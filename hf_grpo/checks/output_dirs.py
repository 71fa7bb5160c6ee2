"""Output directories are never overwritten by surprise.

A fresh run (no ``resume_from_checkpoint``) into an ``output_dir`` that already holds ``checkpoint-N``
directories is refused: otherwise its checkpoint rotation (``save_total_limit``) would delete the previous
run's last good checkpoint, and a run that then fails leaves nothing good behind. The user says what they
mean: ``resume_from_checkpoint`` (continue that run; rotation then only drops checkpoints older than a newer
one of the same run) or ``overwrite_output_dir`` (start over; the previous checkpoints are deleted first, said
in the log). ``metrics.jsonl`` is only appended to, after a torn last line is moved aside (``hf_grpo.run_files``).
"""

from __future__ import annotations

import logging
import os
import shutil

from .checkpoints import checkpoint_dirs, complete_checkpoints

logger = logging.getLogger("hf_grpo")


def previous_checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` directories in ``output_dir``, complete or not, oldest step first."""
    return checkpoint_dirs(output_dir)


def is_resuming(resume_from_checkpoint) -> bool:
    """``resume_from_checkpoint`` as ``Trainer.train`` reads it: a path, or True for output_dir's latest."""
    return resume_from_checkpoint not in (None, False, "", "false", "False")


def check_fresh_run(args, resume_from_checkpoint, accelerator) -> None:
    """Refuse a fresh run into another run's checkpoints, or clear them when ``overwrite_output_dir`` says so."""
    if is_resuming(resume_from_checkpoint):
        return
    found = previous_checkpoints(args.output_dir)
    if not found:
        return
    if not getattr(args, "overwrite_output_dir", False):
        complete = complete_checkpoints(args.output_dir)
        listed = ", ".join(name if name in complete else f"{name} (incomplete: its save was interrupted)"
                           for name in found)
        resume = (f"To continue that run pass --resume_from_checkpoint {os.path.join(args.output_dir, complete[-1])} "
                  f"(or true for the newest complete checkpoint); " if complete else
                  "None of them is complete, so that run cannot be resumed; ")
        raise ValueError(
            f"output_dir={args.output_dir!r} holds checkpoints of another run ({listed}) and this run is not "
            f"resuming: its checkpoint rotation would delete them. {resume}to start over here and delete them pass "
            f"--overwrite_output_dir true; or choose another --output_dir"
        )
    if accelerator.is_main_process:
        logger.warning("overwrite_output_dir: deleting the previous run's %s in %s", ", ".join(found),
                       args.output_dir)
        for name in found:
            shutil.rmtree(os.path.join(args.output_dir, name))
    accelerator.wait_for_everyone()  # no rank starts (and saves) before the old checkpoints are gone
