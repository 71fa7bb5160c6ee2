"""One writer per ``output_dir``: a run holds a lock file there, and a second run into the same folder is refused.

Two runs writing one folder at once (a resume started while the first run still trains, or a training process
left running by a launcher that died) save and rotate each other's checkpoints. So the main process of a run
writes ``_hf_grpo.lock`` into ``output_dir`` before the first step (host, pid, the process's start time, the
command) and removes it when the run ends, normally or by an exception. A run that finds the file is refused,
naming the holder, unless the holder is gone: on the same host a dead pid (or a pid reused by another process,
told apart by its start time) is taken over, with a log line. A lock from another host cannot be checked from
here, so it is never taken over: the message says so and how to clear it. Only the main process touches the
file; every process raises the same error, so none waits in a collective for a process that left.

The lock outlives a killed run and its holder is shown to whoever is refused, so it keeps no secret: the command is
recorded with the values of flags named like a secret (``--hub_token``, ``--api_key=...``) replaced by ``***``,
and the file is readable by its owner only (mode 600).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import socket
import sys

from ..runtime import exit_hooks

logger = logging.getLogger("hf_grpo")
LOCK_FILE = "_hf_grpo.lock"
# output_dir (real path) -> the record this process wrote there
_held: dict[str, dict] = {}
# flags whose values are not recorded: --hub_token, --wandb-api-key, --secret, --db_password, ... (any case)
_SECRET_FLAG = re.compile(r"^-{1,2}[\w.-]*(token|key|secret|password)[\w.-]*$", re.IGNORECASE)
REDACTED = "***"


class OutputDirLocked(RuntimeError):
    """Another live run holds the output directory's lock (or its holder cannot be checked)."""


def lock_path(output_dir: str) -> str:
    return os.path.join(output_dir, LOCK_FILE)


def _process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return int(fields[19])  # field 22 of proc(5); the split starts at field 3
    except (OSError, IndexError, ValueError):
        return None


def redact_command(argv: list[str]) -> list[str]:
    """``argv`` with the value of each secret-named flag replaced by ``***``, in both forms: ``--hub_token VALUE``
    and ``--hub_token=VALUE``. A secret-named flag followed by another flag is a switch and has no value."""
    out, hide_next = [], False
    for arg in argv:
        name, equals, _ = arg.partition("=")
        if hide_next and not arg.startswith("--"):  # the previous flag's value
            out.append(REDACTED)
            hide_next = False
            continue
        out.append(f"{name}={REDACTED}" if equals and _SECRET_FLAG.match(name) else arg)
        hide_next = not equals and bool(_SECRET_FLAG.match(arg))
    return out


def _this_process() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start_ticks": _process_start_ticks(os.getpid()),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(redact_command([os.path.basename(sys.executable), *sys.argv])),
    }


def describe(holder: dict) -> str:
    """The holder as the refusal names it: pid, host, start time and command (its secrets redacted again, for a
    lock written by an earlier version that recorded them)."""
    command = holder.get("command")
    command = " ".join(redact_command(command.split(" "))) if isinstance(command, str) and command else None
    return (f"pid {holder.get('pid')} on host {holder.get('host')!r}, started {holder.get('started')}, "
            f"command: {command or 'not recorded'}")


def _alive(holder: dict) -> bool:
    """Whether the holder (on this host) still runs: its pid exists and, where recorded, started when it did."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process with that pid: alive
    recorded, now = holder.get("pid_start_ticks"), _process_start_ticks(pid)
    return recorded is None or now is None or recorded == now  # a pid reused by a later process is not the holder


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])  # field 4 of proc(5)
    except (OSError, IndexError, ValueError):
        return None


def _is_own_ancestor(pid) -> bool:
    """Whether ``pid`` is 1 (this PID namespace's init) or a parent of this process, up the chain: a process that
    launched this one, or a container's init. Such a pid is never the other run writing this folder; a lock naming
    it comes from another PID namespace (a previous container whose run had that pid) or was copied here."""
    if pid == 1:
        return True
    current = os.getppid()
    for _ in range(64):  # (a bound against a /proc that loops)
        if current is None or current <= 1:
            return False
        if current == pid:
            return True
        current = _parent_pid(current)
    return False


def _in_use(output_dir: str, path: str, holder: dict) -> str:
    """The refusal for a live holder: stop it, unless it is this process's own init or parent (then the lock is
    not that process's, and stopping it would stop this run's own container or shell)."""
    pid = holder.get("pid")
    if _is_own_ancestor(pid):
        which = "this PID namespace's init" if pid == 1 else "a parent of this process"
        return (f"output_dir={output_dir!r} holds a lock naming {describe(holder)}; pid {pid} here is {which}, not a "
                f"run writing into this folder: the lock most likely comes from a run in another container or PID "
                f"namespace that had that pid, or was copied with the folder. If no run is writing into this "
                f"folder, delete {path} and start again; otherwise choose another --output_dir")
    return (f"output_dir={output_dir!r} is in use by another run ({describe(holder)}), which is still "
            f"running: two runs writing one folder save and rotate each other's checkpoints. Wait for it "
            f"to end, stop it (kill {pid}), or choose another --output_dir")


def _read(path: str) -> dict | None:
    """The lock's record; None if the file vanished; an empty record if it cannot be parsed."""
    try:
        with open(path) as handle:
            text = handle.read()
    except FileNotFoundError:
        return None
    except PermissionError:  # owner-only: another user's run holds the folder
        raise OutputDirLocked(
            f"{path}: a lock file this user cannot read (another user's run, mode 600) holds this folder; if no "
            f"run is writing into it, its owner deletes {path}; otherwise choose another --output_dir") from None
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _create(path: str, record: dict) -> bool:
    """Put the lock file in place, whole, only if none exists; False if one does. The record is written to a file
    of this process's own first and then hard-linked to the lock's name (atomic, on local and NFS disks), so a run
    that reads the lock never sees it empty. Owner-only (mode 600): it names the user's command."""
    draft = f"{path}.new-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(draft)  # left by a killed process of the same pid; O_EXCL below must not meet it
    with open(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        json.dump(record, handle, indent=1)
    try:
        os.link(draft, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(draft)
    return True


def _take_over(path: str, stale: dict) -> None:
    """Move a stale lock aside, unless another run replaced it meanwhile (then it is put back)."""
    aside = f"{path}.stale-{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another run moved it first; the caller reads the folder again
    if _read(aside) != stale:  # a newer holder's lock was moved: restore it
        try:
            os.link(aside, path)
        except FileExistsError:
            # yet another run took the name meanwhile: two live records, so leave the moved one beside it and stop
            raise OutputDirLocked(f"{path}: several runs are taking this folder's lock at once; start one run per "
                                  f"folder (the lock moved aside is kept as {aside})") from None
    os.unlink(aside)


def acquire(output_dir: str) -> bool:
    """Take the lock of ``output_dir`` for this process. True if taken now, False if this process holds it already.

    Raises ``OutputDirLocked`` naming the holder if another live run holds it, or a run on another host.
    """
    key = os.path.realpath(output_dir)
    if key in _held:
        return False
    os.makedirs(output_dir, exist_ok=True)
    path, mine = lock_path(output_dir), _this_process()
    for _ in range(5):  # each turn either creates the file or removes a stale one; a race costs a turn
        if _create(path, mine):
            _held[key] = mine
            return True
        holder = _read(path)
        if holder is None:
            continue
        if not holder:
            raise OutputDirLocked(
                f"output_dir={output_dir!r} holds a lock file {path} that cannot be read as a run's record: "
                f"if no run is writing into this folder, delete {path} and start again")
        if holder.get("host") != mine["host"]:
            raise OutputDirLocked(
                f"output_dir={output_dir!r} is in use by another run ({describe(holder)}), on another host: this "
                f"host ({mine['host']!r}) cannot check whether that process still runs. If it does not (check on "
                f"{holder.get('host')!r}), delete {path} and start again; otherwise choose another --output_dir")
        if holder.get("pid") == mine["pid"] and holder.get("pid_start_ticks") == mine["pid_start_ticks"]:
            _held[key] = holder  # written by this process, whose record was lost: hold it again
            return True
        if _alive(holder):
            raise OutputDirLocked(_in_use(output_dir, path, holder))
        logger.warning("output_dir %s: taking over the lock of a run that is gone (%s)", output_dir,
                       describe(holder))
        _take_over(path, holder)
    raise OutputDirLocked(f"output_dir={output_dir!r}: could not take the lock {path}, other runs keep "
                          f"replacing it; start one run per folder")


def release(output_dir: str) -> None:
    """Remove the lock this process holds on ``output_dir`` (a file another run has taken over since is kept)."""
    key = os.path.realpath(output_dir)
    mine = _held.pop(key, None)
    if mine is None:
        return
    path = lock_path(output_dir)
    if _read(path) == mine:
        os.unlink(path)


def release_all() -> None:
    """Remove every lock this process holds (a training process about to exit)."""
    for key in list(_held):
        release(key)


# A process that ends abruptly (distributed.launcher_watch: the launcher gone, SIGTERM) releases what it holds first.
# Looked up when run, so that a test may replace release_all.
exit_hooks.register("output-dir lock", lambda: release_all())


def take_for_run(output_dir: str, accelerator) -> bool:
    """The main process takes the lock; every process raises the same ``OutputDirLocked`` if it cannot.

    Returns True where this call took the lock (the caller releases it when the run ends), else False.
    """
    error, taken = None, False
    if accelerator.is_main_process:
        try:
            taken = acquire(output_dir)
        except (OutputDirLocked, OSError) as exc:
            error = str(exc) if isinstance(exc, OutputDirLocked) else (
                f"output_dir={output_dir!r}: cannot write the lock file {lock_path(output_dir)}: {exc}")
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        try:
            error = broadcast_object_list([error], from_process=0)[0]  # one answer for all processes
        except BaseException:
            if taken:  # a peer is gone: no run follows, so the folder is not held
                release(output_dir)
            raise
    if error is not None:
        raise OutputDirLocked(error)
    return taken


@contextlib.contextmanager
def held_for_run(output_dir: str, accelerator):
    """Hold ``output_dir`` for the block (``take_for_run``), released when it ends, by an exception too."""
    taken = take_for_run(output_dir, accelerator)
    try:
        yield
    finally:
        if taken:
            release(output_dir)
