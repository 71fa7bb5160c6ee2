"""Output directories are never overwritten by surprise.

A fresh run (no ``resume_from_checkpoint``) into an ``output_dir`` that already holds ``checkpoint-N``
directories is refused: otherwise its checkpoint rotation (``save_total_limit``) would delete the previous
run's last good checkpoint, and a run that then fails leaves nothing good behind. The user says what they
mean: ``resume_from_checkpoint`` (continue that run; rotation then only drops checkpoints older than a newer
one of the same run) or ``overwrite_output_dir`` (start over; the previous checkpoints are deleted first, said
in the log). ``metrics.jsonl`` is only ever appended to (``hf_grpo.recipe_support.reporting``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil

logger = logging.getLogger("hf_grpo")
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


def previous_checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` directories in ``output_dir``, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir)
             if (m := CHECKPOINT_NAME.fullmatch(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return [name for _, name in sorted(found)]


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
        raise ValueError(
            f"output_dir={args.output_dir!r} holds checkpoints of another run ({', '.join(found)}) and this run "
            f"is not resuming: its checkpoint rotation would delete them. To continue that run pass "
            f"--resume_from_checkpoint {os.path.join(args.output_dir, found[-1])} (or true for the latest); to "
            f"start over here and delete them pass --overwrite_output_dir true; or choose another --output_dir"
        )
    if accelerator.is_main_process:
        logger.warning("overwrite_output_dir: deleting the previous run's %s in %s", ", ".join(found),
                       args.output_dir)
        for name in found:
            shutil.rmtree(os.path.join(args.output_dir, name))
    accelerator.wait_for_everyone()  # no rank starts (and saves) before the old checkpoints are gone
