"""Build locks left behind by an interrupted C++-extension build, on which DeepSpeed would wait forever.

DeepSpeed compiles some of its ops on first use (CPU Adam for an offloaded optimizer, the CPU
communication op) through torch's extension builder, which holds a ``lock`` file in the build
directory while it compiles. A build killed half-way (Ctrl-C, a job time-out) leaves the file,
and every later run waits on it silently. Naming the file before that wait turns a hang into a fix:
a recipe does it before it builds its config (under DeepSpeed, building the config may already build
DeepSpeed's CPU communication op), and the trainer does it before TRL prepares the model and optimizer, for
code that builds its own config. Each lock is named once per process.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from typing import Any

logger = logging.getLogger("hf_grpo")
# A build of DeepSpeed's largest CPU op takes about a minute on two cores: a lock this old is left over.
STALE_AFTER_S = 600.0
_named: set[pathlib.Path] = set()  # locks already logged by this process


def extensions_root() -> pathlib.Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else its per-user cache folder."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root  # imports setuptools: only when asked

    return pathlib.Path(get_default_build_root())


def stale_build_locks(root: pathlib.Path | None = None, older_than_s: float = STALE_AFTER_S) -> list[pathlib.Path]:
    """The ``lock`` files of extension builds last touched more than ``older_than_s`` seconds ago.

    Build folders sit right under a ``TORCH_EXTENSIONS_DIR``, or one level down (``py311_cu130/``) in
    the default cache folder; both are searched.
    """
    root = extensions_root() if root is None else root
    cutoff = time.time() - older_than_s
    found = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return sorted(path for path in found if path.is_file() and path.stat().st_mtime < cutoff)


def launched_with_deepspeed(deepspeed_field: Any) -> bool:
    """Whether this process trains under DeepSpeed: a ``deepspeed`` config given, or ``accelerate launch``'s
    DeepSpeed launcher (which says so in ``ACCELERATE_USE_DEEPSPEED``)."""
    return bool(deepspeed_field) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def warn_about_stale_build_locks(is_main_process: bool = True) -> list[pathlib.Path]:
    """Log each stale lock not yet named by this process (on the main process) with the command that removes
    it; returns the stale locks."""
    locks = stale_build_locks()
    if locks and is_main_process:
        for lock in (lock for lock in locks if lock not in _named):
            _named.add(lock)
            age_min = (time.time() - lock.stat().st_mtime) / 60
            logger.warning(
                "%s is an extension-build lock last touched %.0f minutes ago, most likely left by an interrupted "
                "build; DeepSpeed waits on it for ever when it builds that op. If no build is running, "
                "remove it: rm %s", lock, age_min, lock)
    return locks


def warn_if_launched_with_deepspeed(deepspeed_field: Any = None) -> list[pathlib.Path]:
    """Under DeepSpeed, name the stale build locks it would wait on (main process only); returns them."""
    if not launched_with_deepspeed(deepspeed_field):
        return []
    return warn_about_stale_build_locks(is_main_process=os.environ.get("RANK", "0") == "0")
