"""Every rank's random state is in a checkpoint before the checkpoint is marked complete.

transformers' Trainer writes a checkpoint's weights and optimizer, then each rank's ``rng_state_R.pth``, then
rank 0's ``trainer_state.json``, the file that says a checkpoint was written to the end. Nothing waits between
another rank's random-state file and rank 0's state file: a rank killed in that gap leaves a checkpoint that looks
whole but lacks its random state, and a run resumed from it samples other rollouts on that rank than the
interrupted run would have, with only an info line from transformers. The trainer's ``_save_rng_state`` ends
with a barrier, so every rank has written its file before rank 0 marks the checkpoint complete; a resume from a
checkpoint saved without it, lacking its rank's file, says what it loses (``warn_if_missing``).
"""

from __future__ import annotations

import glob
import logging
import os

logger = logging.getLogger("hf_grpo")


def warn_if_missing(checkpoint: str | None, world_size: int, rank: int) -> bool:
    """Warn (and return True) where ``checkpoint`` was saved by several ranks but lacks ``rank``'s random state."""
    if checkpoint is None or world_size <= 1 or not os.path.isdir(checkpoint):
        return False
    if os.path.isfile(os.path.join(checkpoint, f"rng_state_{rank}.pth")):
        return False
    saved = sorted(os.path.basename(path) for path in glob.glob(os.path.join(checkpoint, "rng_state_*.pth")))
    if not saved:  # saved without random states (save_only_model) or by one process: transformers says so
        return False
    logger.warning("%s holds the random state of other ranks (%s) but not rank %d's (rng_state_%d.pth): rank %d "
                   "resumes from a fresh random state, so its rollouts will differ from those the interrupted run "
                   "would have sampled. The checkpoint was saved while that rank was stopping; the checkpoint "
                   "before it resumes exactly.", checkpoint, ", ".join(saved), rank, rank, rank)
    return True
