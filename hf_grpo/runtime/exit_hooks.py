"""What a process must undo before it ends abruptly, registered by whoever holds it, run by whoever ends it.

A training process can end without unwinding its stack: ``distributed.launcher_watch`` calls ``os._exit`` when
the launcher is gone or SIGTERM arrives, and no ``finally`` block runs. What the run holds outside the process (the
output directory's lock, ``checks.output_lock``) registers its release here, so that the code ending the process
runs it without importing the code that took it.

May import: nothing of hf_grpo.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("hf_grpo")

_hooks: dict[str, Callable[[], None]] = {}


def register(name: str, hook: Callable[[], None]) -> None:
    """Run ``hook()`` before this process ends abruptly; registering a name again replaces its hook."""
    _hooks[name] = hook


def unregister(name: str) -> None:
    _hooks.pop(name, None)


def run_all() -> list[str]:
    """Run every registered hook, in the order registered; one that raises is logged and the rest still run.
    Returns the names of those that raised."""
    failed = []
    for name, hook in list(_hooks.items()):
        try:
            hook()
        except Exception:  # the process is ending: the other hooks must still run
            logger.exception("hf_grpo: the exit hook %r failed", name)
            failed.append(name)
    return failed
