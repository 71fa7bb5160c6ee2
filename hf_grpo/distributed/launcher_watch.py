"""A training process ends when the launcher that started it dies.

``accelerate launch`` of one process starts the training process and waits for it; SIGINT sent to the launcher's
pid alone (and SIGTERM, before accelerate 1.16) ends the launcher and leaves the training process running (still
saving and rotating checkpoints). accelerate 1.16 passes SIGTERM on to the training process, which then releases
its output-dir lock before it ends (``_release_on_sigterm``). Of a multi-process launch, torchrun's agent stops
its workers on SIGINT/SIGTERM, but SIGKILL of the agent leaves them all running, each in its own session. Any of these leaves a second writer in ``output_dir``.

So every training process started by a launcher watches its parent (the launcher, or torchrun's agent) from a
daemon thread: when its parent pid changes, the parent is gone, and the process releases its output-dir lock and
exits at once (status 1), whatever its main thread is doing. ``hf_grpo.prepare_process`` starts it (the trainer's
first step; a recipe's, before it parses its flags), not the config, which is data.

Why a thread polling ``os.getppid()`` rather than ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the
parent *thread* that started the process ends, not the parent process (a launcher starting workers from a helper
thread would kill healthy workers); it is lost if the parent died before the call; it is Linux only; and a signal
ends the process without releasing its lock. The poll costs a system call every half second, and every blocking
call of torch (collectives, kernels) releases the GIL, so the thread runs within that time.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from ..runtime import exit_hooks

logger = logging.getLogger("hf_grpo")
POLL_S = 0.5
OPT_OUT = "HF_GRPO_EXIT_WITH_LAUNCHER"  # "0": keep training when the launcher dies
# set by torchrun's agent (also behind accelerate launch --num_processes N > 1) and by accelerate's one-process launcher
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU")
# words of the parent's command line that name a launcher: accelerate's (its console script or -m
# accelerate.commands.launch, which also runs torchrun's agent in-process) and torchrun's
LAUNCHER_WORDS = ("accelerate", "torchrun", "torch.distributed.run", "torch.distributed.launch")
_watching: int | None = None  # the parent pid watched, once started


def _parent_command(parent: int) -> str:
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""  # no /proc: not known to be a launcher, so not watched


def launched_by_launcher() -> bool:
    """Whether this process was started by ``accelerate launch`` or torchrun: a launcher's variable in the
    environment AND a launcher as the parent. The variables alone are not enough: ``ACCELERATE_USE_CPU`` is also a
    setting users export, and a launched process's own children inherit them; a ``python script.py`` whose parent
    shell may end on purpose (``nohup``) is never watched."""
    if not any(name in os.environ for name in LAUNCHER_ENV):
        return False
    command = _parent_command(os.getppid())
    return any(word in command for word in LAUNCHER_WORDS)


def exit_with_launcher() -> bool:
    """Start watching the launcher, once per process; True if watching. A no-op outside a launcher, when the parent
    is already gone (pid 1), or with ``HF_GRPO_EXIT_WITH_LAUNCHER=0``."""
    global _watching
    if _watching is not None:
        return True
    if os.environ.get(OPT_OUT, "1") == "0" or not launched_by_launcher():
        return False
    parent = os.getppid()
    if parent <= 1:
        return False
    _watching = parent
    threading.Thread(target=_watch, args=(parent,), name="hf_grpo-launcher-watch", daemon=True).start()
    _release_on_sigterm()
    return True


def _release_on_sigterm() -> None:
    """SIGTERM releases the output-dir lock before the process ends. accelerate launch (1.16 and later) sends it to
    the training process when the launcher itself is stopped, as schedulers do on preemption; Python's default
    action ends the process at once, leaving the lock behind for the next run to take over. Installed only where
    nothing else handles SIGTERM, from the main thread (the only one that may)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def release_and_exit(signum, frame):
        try:
            print(f"hf_grpo: SIGTERM to this training process (pid {os.getpid()}): releasing the output-dir lock "
                  "and exiting", file=sys.stderr)
            exit_hooks.run_all()  # the output-dir lock's release (checks.output_lock registers it)
        finally:
            sys.stderr.flush()
            os._exit(128 + signum)  # as the default action's status; the step in progress is not waited for

    signal.signal(signal.SIGTERM, release_and_exit)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    message = f"hf_grpo: the launcher (pid {parent}) of this training process (pid {os.getpid()}) is gone: exiting"
    try:
        logger.error(message)
        exit_hooks.run_all()
    finally:
        sys.stderr.flush()
        os._exit(1)  # from this thread: the main thread may be inside a step or a collective
