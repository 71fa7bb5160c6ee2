"""Launches run from the tests: one to its end within a time limit, or several side by side (two "nodes").

A launcher starts its ranks as children: on a time-out the whole process group is stopped, and the
test fails with the output so far, instead of leaving ranks behind that wait on each other or on a lock.
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


def run_to_end(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)``, stopping the process group on a time-out.

    The failure then shows where the launch got to (the tails of its output), since a hang shows no error.
    """
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(map(str, command))}\n"
            f"--- stdout (tail) ---\n{stdout[-2000:]}\n--- stderr (tail) ---\n{stderr[-6000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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
