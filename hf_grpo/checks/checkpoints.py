"""Only a complete checkpoint is resumed from, recommended or kept in place of another.

A save writes a checkpoint's files in turn: the weights, the optimizer state (each rank its ZeRO partitions), every
rank's random state, then process 0's ``trainer_state.json``, after a barrier on all ranks
(``hf_grpo.distributed.rng_files``). ``trainer_state.json`` is therefore the mark that a checkpoint is complete:
a run killed during a save leaves ``checkpoint-N`` without it (or with half of it, which does not parse). Such a
directory is never resumed from: ``resume_from_checkpoint=True`` takes the newest complete checkpoint and says
which it skipped; a resume by name from an incomplete one stops naming what is missing and the checkpoint to use
instead. When a run resumes, the incomplete directories are moved aside (``_interrupted-checkpoint-N``), so that
its own save of step N starts in an empty directory and the checkpoint rotation (``save_total_limit``), which
counts every ``checkpoint-N`` directory, never keeps a broken one in place of a complete one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

from ..runtime.collectives import max_over_ranks, min_over_ranks

logger = logging.getLogger("hf_grpo")
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
MARK = "trainer_state.json"  # written last, by process 0, once every rank's files are written
# not matched by transformers' checkpoint-* glob nor its ^checkpoint-N$ regex; a leading "_" keeps it (as the lock)
# out of what transformers pushes to the Hub (its ignore_patterns "_*", "checkpoint-*")
SET_ASIDE_PREFIX = "_interrupted-"


def checkpoint_step(path: str) -> int | None:
    match = CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoint_dirs(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` directories in ``output_dir`` (names), oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(step, name) for name in os.listdir(output_dir)
             if (step := checkpoint_step(name)) is not None and os.path.isdir(os.path.join(output_dir, name))]
    return [name for _, name in sorted(found)]


def what_is_missing(checkpoint: str) -> str | None:
    """None when ``checkpoint`` is complete, else what it lacks, in words."""
    if not os.path.isdir(checkpoint):
        return "the directory does not exist"
    mark = os.path.join(checkpoint, MARK)
    if not os.path.isfile(mark):
        held = sorted(os.listdir(checkpoint))
        return (f"it has no {MARK}, the file a save writes last, so its save was interrupted "
                f"({'it is empty' if not held else 'it holds only ' + ', '.join(held)})")
    try:
        with open(mark) as handle:
            step = json.load(handle)["global_step"]
    except (ValueError, KeyError, TypeError) as err:
        return f"its {MARK} is cut short or unreadable ({type(err).__name__}), so its save was interrupted"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # written whole, then damaged or edited
        return (f'its {MARK} has "global_step": {json.dumps(step)}, not a step number (a non-negative integer), '
                f"so the file was damaged or edited after the save")
    return None


def complete_checkpoints(output_dir: str) -> list[str]:
    """The complete ``checkpoint-N`` directories of ``output_dir`` (names), oldest step first."""
    return [name for name in checkpoint_dirs(output_dir) if what_is_missing(os.path.join(output_dir, name)) is None]


def _newest_complete_everywhere(output_dir: str) -> int | None:
    """The newest step complete on every rank's disk (the same disk, or each node's with ``save_on_each_node``)."""
    steps = sorted((checkpoint_step(name) for name in complete_checkpoints(output_dir)), reverse=True)
    candidate = min_over_ranks(steps[0] if steps else -1)
    while candidate >= 0:
        if not max_over_ranks(int(candidate not in steps)):
            return candidate
        candidate = min_over_ranks(max((s for s in steps if s < candidate), default=-1))
    return None


def resolve_resume(resume_from_checkpoint, output_dir: str, is_main_process: bool):
    """The checkpoint a resume reads: True becomes the newest complete one (None/False: no resume).

    Every rank must call it (the ranks agree on the checkpoint). Raises ValueError for an incomplete or absent
    checkpoint named by path, and for True where ``output_dir`` holds no complete checkpoint."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        step = _newest_complete_everywhere(output_dir)
        skipped = [(name, what_is_missing(os.path.join(output_dir, name))) for name in checkpoint_dirs(output_dir)
                   if step is None or checkpoint_step(name) > step]
        if step is None:
            found = "; ".join(f"{name}: {why}" for name, why in skipped) or "no checkpoint-N directory"
            raise ValueError(f"resume_from_checkpoint=true: output_dir={output_dir!r} holds no complete checkpoint "
                             f"({found}); drop --resume_from_checkpoint to start a new run (with "
                             f"--overwrite_output_dir true if incomplete checkpoints are there)")
        chosen = os.path.join(output_dir, f"checkpoint-{step}")
        if is_main_process:
            for name, why in skipped:
                logger.warning("resume_from_checkpoint=true skips %s: %s", os.path.join(output_dir, name),
                               why or "it is not complete on every node")
            logger.info("resume_from_checkpoint=true: resuming from %s, the newest complete checkpoint", chosen)
        return chosen
    checkpoint = str(resume_from_checkpoint)
    missing = what_is_missing(checkpoint)
    if max_over_ranks(int(missing is not None)):
        newest = complete_checkpoints(os.path.dirname(os.path.normpath(checkpoint)) or ".")
        instead = (f"resume from {os.path.join(os.path.dirname(os.path.normpath(checkpoint)), newest[-1])}, the "
                   f"newest complete checkpoint there (or pass true for it)" if newest else
                   "no complete checkpoint is next to it: start a new run")
        raise ValueError(f"resume_from_checkpoint={checkpoint!r} is not a complete checkpoint: "
                         f"{missing or 'it is incomplete on another node'}; {instead}")
    return checkpoint


def set_aside_incomplete(output_dir: str, args, accelerator) -> list[str]:
    """Move ``output_dir``'s incomplete checkpoints to ``_interrupted-checkpoint-N`` (logged); returns the names.
    A resumed run calls it on every rank before its first save."""
    moved = []
    if args.should_save:  # the processes that write trainer_state.json: process 0, or each node's first
        for name in checkpoint_dirs(output_dir):
            path = os.path.join(output_dir, name)
            why = what_is_missing(path)
            if why is None:
                continue
            target = os.path.join(output_dir, SET_ASIDE_PREFIX + name)
            try:
                if os.path.isdir(target):  # an earlier interrupted save of the same step
                    logger.warning("%s: deleting an earlier interrupted save of the same step", target)
                    shutil.rmtree(target)
                os.rename(path, target)
            except FileNotFoundError:  # another node's first process moved it (a shared disk)
                continue
            moved.append(name)
            logger.warning("%s is incomplete (%s): moved to %s so that this run's save of that step starts clean "
                           "and checkpoint rotation keeps complete checkpoints only", path, why, target)
    accelerator.wait_for_everyone()  # no rank saves into a directory that is being moved
    return moved
