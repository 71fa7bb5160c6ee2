"""A checkpoint save that fails is re-raised naming the checkpoint, the free space on its disk and the checkpoint it
left intact.

A full disk stops a save with whatever wrote last: torch's ``[enforce fail at inline_container.cc:672] unexpected pos
...`` (``optimizer.pt``), or an ``OSError`` (``[Errno 28] No space left on device``) from safetensors or json. Neither
names the checkpoint or says that nothing was lost: transformers removes older checkpoints (``save_total_limit``)
only after a save completes, so the newest complete one is still there, and a resume takes it and sets the
incomplete one aside (``checks.checkpoints``).
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch

from .checkpoints import complete_checkpoints


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed; the message says where, the free space there and what was kept."""


def _free_space(path: str) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free on its disk"
    except OSError:
        return "the free space on its disk could not be read"


def failure_message(run_dir: str, step: int, error: BaseException) -> str:
    checkpoint = os.path.join(run_dir, f"checkpoint-{step}")
    complete = complete_checkpoints(run_dir)
    kept = (f"The newest complete checkpoint, {os.path.join(run_dir, complete[-1])}, is intact (older checkpoints "
            f"are removed only after a save completes): free space, then resume with --resume_from_checkpoint true, "
            f"which takes it and sets the incomplete {checkpoint} aside"
            if complete else f"No complete checkpoint was saved before it: free space and start the run again with "
            f"--overwrite_output_dir true (which deletes the incomplete {checkpoint})")
    return (f"saving {checkpoint} failed: {type(error).__name__}: {error}. {_free_space(run_dir)} (a full disk is the "
            f"usual cause). {kept}")


@contextlib.contextmanager
def explained(run_dir: str, step: int):
    """Re-raise an ``OSError`` or ``RuntimeError`` of the save in the block as ``CheckpointSaveError`` (the original
    chained); an out-of-memory keeps its type, for the handlers that look for it."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        if isinstance(err, (CheckpointSaveError, torch.OutOfMemoryError)):
            raise
        raise CheckpointSaveError(failure_message(run_dir, step, err)) from err
