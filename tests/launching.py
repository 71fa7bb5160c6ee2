"""Every process a test launches is started here, so that a launch of two or more processes only runs in a test
marked ``@pytest.mark.launch``.

Such a launch costs 15-60 s of a 2-core machine, most of it each process importing torch, transformers, TRL and
DeepSpeed. The README's command (``python -m pytest tests -q``) leaves the ``launch`` tests out (pyproject.toml's
addopts) and ``python -m pytest tests -q -m launch`` runs them (docs/testing.md). A test that starts two processes
without the marker is refused before anything starts: otherwise it would quietly slow the default run down.

``tests/conftest.py`` tells this module which test is being set up or run (``note_running_test``); a session or
module fixture that launches is set up inside the first test that requests it, so that test must carry the marker.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys

from tests.side_by_side import run_to_end

ROOT = pathlib.Path(__file__).resolve().parents[1]

_running_test = None  # the pytest item being set up or run (tests/conftest.py)


class UnmarkedLaunch(RuntimeError):
    """A test without ``@pytest.mark.launch`` asked to start two or more processes."""


def note_running_test(item) -> None:
    global _running_test
    _running_test = item


def refuse_unless_marked(processes: int, command) -> None:
    """Raise ``UnmarkedLaunch`` if ``processes`` >= 2 and the running test is not marked ``launch``."""
    if processes < 2:
        return
    item = _running_test
    if item is not None and item.get_closest_marker("launch") is not None:
        return
    who = f"test {item.nodeid}" if item is not None else "code outside any test"
    shown = command if isinstance(command, str) else " ".join(map(str, command))
    raise UnmarkedLaunch(
        f"{who} starts {processes} processes ({shown[:200]}) but is not marked @pytest.mark.launch: add "
        f"@pytest.mark.launch (with @pytest.mark.slow), so that the README's `python -m pytest tests -q` leaves it "
        f"out and `python -m pytest tests -q -m launch` runs it (docs/testing.md)")


def accelerate_command(*args, processes: int) -> list[str]:
    """``accelerate launch --num_processes N ARGS...`` with this virtualenv's Python."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), *map(str, args)]


def run_launch(command: list[str], *, processes: int, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``side_by_side.run_to_end`` for a command that starts ``processes`` processes in all."""
    refuse_unless_marked(processes, command)
    return run_to_end(command, timeout, **kwargs)


def start_launch(command, *, processes: int, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a process group of its own (``side_by_side.stop`` ends it and its ranks), for a
    command that starts ``processes`` processes in all (two "nodes" of one process each: 2)."""
    refuse_unless_marked(processes, command)
    return subprocess.Popen(command, start_new_session=True, **kwargs)


def spawn_ranks(function, args: tuple, processes: int):
    """``torch.multiprocessing.spawn(function, args, nprocs=processes, join=False)``: ranks of a test's own."""
    import torch.multiprocessing

    refuse_unless_marked(processes, f"torch.multiprocessing.spawn({function.__name__})")
    return torch.multiprocessing.spawn(function, args=args, nprocs=processes, join=False)


def join_ranks(context, timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for each of ``spawn_ranks``' ranks; kill any still running and return their
    pids (a rank that waits for the other forever: empty when none hung)."""
    for process in context.processes:
        process.join(timeout=timeout)
    hung = [process.pid for process in context.processes if process.is_alive()]
    for process in context.processes:
        if process.is_alive():
            process.kill()
    return hung


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world_size: int):
    """This process as ``rank`` of a gloo process group of ``world_size`` meeting on ``port``; the group is
    destroyed and the environment it needed restored after the block."""
    import torch.distributed as dist

    before = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
