"""The files every run writes into ``output_dir``, recipe or library script alike: ``metrics.jsonl`` (a line per
logging step) and ``performance.json`` (every rank's timings and peak memory, at the end of training).

``GRPOTrainer`` adds both callbacks itself (``add_run_files``), once each: a callback of the same class passed in
``callbacks=`` is used instead, and a metrics writer added later for the same file stays silent. To write neither, ``trainer.remove_callback(MetricsFileCallback)`` and
``trainer.remove_callback(PerformanceFileCallback)`` before ``train()``.

A row of ``metrics.jsonl`` is written whole with its newline in one ``write``, so a kill or a full disk can cut
short only the file's last line (``{"step": 9, "loss": -0.01, "lea``). ``read_metrics`` leaves such a line out with
a warning naming the file, and a run moves it to ``metrics.jsonl.torn`` (kept) before it appends
(``set_aside_torn_line``). Any other line that is no JSON object is an error naming the file and the line: no
interrupted append makes it, and reading past it could hide rows.
"""

from __future__ import annotations

import json
import logging
import math
import os
import weakref
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

logger = logging.getLogger("hf_grpo")
METRICS_FILE = "metrics.jsonl"
TORN_SUFFIX = ".torn"  # a torn last line of metrics.jsonl is moved to metrics.jsonl.torn
PERFORMANCE_FILE = "performance.json"
# The one callback that writes each metrics file during a train() (keyed by path; the run told by its TrainerState):
# a second MetricsFileCallback added to the same trainer, as scripts written before the trainer added its own do,
# stays silent instead of writing every row twice.
_WRITERS: dict[str, tuple[weakref.ref, "MetricsFileCallback"]] = {}


class MetricsFileCallback(TrainerCallback):
    """Appends ``{"step", "reward", "loss", ..., "run", "run_start_step"}`` to ``output_dir/metrics.jsonl`` at
    every training log.

    The file is only appended to (a torn last line moved aside first): each ``train()`` into the directory is a
    new ``run`` (1, 2, ...) whose rows carry the step it started from (0 fresh, N resumed from ``checkpoint-N``).
    ``current_run_rows`` reads back the rows of the latest run's history; nothing a failed or redone run logged is
    lost from the file.
    """

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.run = None

    def on_train_begin(self, args, state, control, **kwargs):
        writer = _WRITERS.get(self.path)
        if writer is None or writer[0]() is not state:  # the first writer of this path in this train()
            _WRITERS[self.path] = (weakref.ref(state), self)
        self.writing = _WRITERS[self.path][1] is self
        if state.is_world_process_zero and self.writing:
            if os.path.exists(self.path):  # a torn last line (a kill mid-write) moved aside before appending
                set_aside_torn_line(self.path)
            earlier = read_metrics(self.path) if os.path.exists(self.path) else []
            self.run = 1 + max((row.get("run", 0) for row in earlier), default=0)
            self.run_start_step = state.global_step  # after a resume: the checkpoint's step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs or not getattr(self, "writing", True):
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        if self.run is not None:
            row.update(run=self.run, run_start_step=self.run_start_step)
        with open(self.path, "a") as handle:
            handle.write(json_line(row) + "\n")


def json_line(row: dict) -> str:
    """``row`` as one line of standard JSON: a non-finite float (a NaN loss, an infinite grad norm) as null. Python's
    ``json`` would write ``NaN`` and ``Infinity``, which JSON does not have and strict parsers (JavaScript's
    ``JSON.parse``, ``json.loads`` with ``parse_constant``) refuse."""
    finite = {key: None if isinstance(value, float) and not math.isfinite(value) else value
              for key, value in row.items()}
    return json.dumps(finite, allow_nan=False)


def read_metrics(path: str) -> list[dict]:
    """Every row of a metrics file, in the order written (all runs). A torn last line (a write cut short) is left
    out with a warning naming the file; any other line that is not a JSON object raises ValueError naming the file
    and the line."""
    parsed = _parse(path)
    if parsed.torn is not None:
        logger.warning("%s: its last line is cut short (a write interrupted by a kill or a full disk), left out: %s; "
                       "the next run into this folder moves it to %s", path, _shown(parsed.torn), path + TORN_SUFFIX)
    return parsed.rows


def current_run_rows(rows: list[dict]) -> list[dict]:
    """The history of the latest run: each run replaces the rows of earlier runs past the step it started from
    (a fresh run, started at 0, replaces them all; a resumed one only the steps it redid)."""
    kept: list[dict] = []
    for row in rows:
        start = row.get("run_start_step")
        if start is not None and (not kept or kept[-1].get("run") != row.get("run")):
            kept = [r for r in kept if r["step"] <= start]  # the first row of a new run
        kept.append(row)
    return kept


class PerformanceFileCallback(TrainerCallback):
    """Writes ``output_dir/performance.json``, ``{"per_rank": [stats of rank 0, rank 1, ...]}``, when training ends
    (``GRPOTrainer.get_performance_stats``): peak memory differs per GPU under ZeRO, so every rank's figures are
    kept. A ``train()`` that ran no step leaves an existing file as it is."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.start_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        stats = self.trainer.get_performance_stats()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        per_rank = [None] * torch.distributed.get_world_size() if distributed else [stats]
        if distributed:  # every rank reaches on_train_end: the gather is a collective they all join
            torch.distributed.all_gather_object(per_rank, stats)
        # a train() that trained no step (a finished run resumed) keeps the figures of the run that trained
        kept = state.global_step == self.start_step and os.path.exists(os.path.join(args.output_dir, PERFORMANCE_FILE))
        if state.is_world_process_zero and not kept:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, PERFORMANCE_FILE), "w") as handle:
                json.dump({"per_rank": per_rank}, handle, indent=1)


def add_run_files(trainer) -> None:
    """The trainer's ``metrics.jsonl`` and ``performance.json`` writers, each unless one is there already."""
    present = trainer.callback_handler.callbacks
    if not any(isinstance(callback, MetricsFileCallback) for callback in present):
        trainer.add_callback(MetricsFileCallback(trainer.args.output_dir))
    if not any(isinstance(callback, PerformanceFileCallback) for callback in present):
        trainer.add_callback(PerformanceFileCallback(trainer))


# ---- a torn last line of metrics.jsonl ----------------------------------------------------------------------------

@dataclass
class _Parsed:
    rows: list[dict]
    torn: bytes | None  # the last line, cut short (None: the file ends with a whole row, or is empty)
    whole_length: int  # bytes up to the torn line (the whole file when there is none)
    newline_missing: bool  # the last row is whole but its newline was cut off


def _parse(path: str) -> _Parsed:
    """Every row of ``path``; raises ValueError naming the file and line for a line that is not a row."""
    with open(path, "rb") as handle:
        data = handle.read()
    lines, offset = [], 0
    for number, raw in enumerate(data.split(b"\n"), 1):
        if raw.strip():
            lines.append((number, offset, raw))
        offset += len(raw) + 1
    rows: list[dict] = []
    for index, (number, start, raw) in enumerate(lines):
        try:
            row = json.loads(raw.decode("utf-8"))
        except ValueError as err:  # json's JSONDecodeError and a UnicodeDecodeError are both ValueErrors
            if index == len(lines) - 1:
                return _Parsed(rows, raw, start, False)
            raise ValueError(
                f"{path}, line {number} of {lines[-1][0]}: not a JSON row ({err}): {_shown(raw)}. Only the last "
                f"line can be cut short by an interrupted write (the next run sets it aside); this one is followed "
                f"by other rows. Delete or repair line {number}, or move {path} away to start a new file") from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}, line {number}: a JSON {type(row).__name__} where a row (a JSON object such as "
                f'{{"step": 1, "loss": 0.5}}) belongs: {_shown(raw)}. Delete or repair line {number}, or move {path} '
                f"away to start a new file")
        rows.append(row)
    return _Parsed(rows, None, len(data), bool(data) and not data.endswith(b"\n") and bool(lines))


def set_aside_torn_line(path: str) -> str | None:
    """Before appending to ``path``: move a torn last line to ``<path>.torn`` (appended there, so every one is
    kept) and end the file with its last whole row's newline. Returns the ``.torn`` file's path, or None."""
    parsed = _parse(path)
    if parsed.newline_missing:  # the row is whole: only its newline was cut off
        with open(path, "ab") as handle:
            handle.write(b"\n")
        return None
    if parsed.torn is None:
        return None
    aside = path + TORN_SUFFIX
    with open(aside, "ab") as handle:  # kept first, then cut from the file: a kill in between loses nothing
        handle.write(parsed.torn.rstrip(b"\r\n") + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.truncate(path, parsed.whole_length)
    logger.warning("%s: its last line was cut short (a write interrupted by a kill or a full disk): moved to %s, "
                   "and this run appends after the last whole row: %s", path, aside, _shown(parsed.torn))
    return aside


def _shown(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= 80 else text[:80] + "...")
