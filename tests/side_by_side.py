"""Processes started side by side (two "nodes" of one launch): a free port, waiting for all, stopping all.

Imported by the tests that run a multi-node launch as two processes on this machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """End a launcher and everything it started (it runs in its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def wait_for_all(processes: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait until every process has exited, then stop what is left; the problem met, or None.

    A process that fails ends the wait at once: its peer would wait for it until the rendezvous times out.
    """
    deadline, problem = time.monotonic() + timeout, None
    try:
        while problem is None and any(p.poll() is None for p in processes):
            failed = [rank for rank, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed:
                problem = f"node {failed[0]} exited {processes[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                problem = f"timed out after {timeout} s"
            else:
                time.sleep(0.2)
    finally:
        for process in processes:
            stop(process)
    if problem is None and any(p.returncode != 0 for p in processes):
        problem = "exit codes " + str([p.returncode for p in processes])
    return problem
