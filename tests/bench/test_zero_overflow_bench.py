"""bench/zero_overflow.py: DeepSpeed ZeRO's optimizer step timed with its own overflow search and with the search
left to the global norm, one row (no speed asserted: that is the benchmark's to print). Run as a user runs it: its
own process, where it starts a one-process gloo group."""

import json
import subprocess
import sys

import pytest

from tests.project_files import ROOT

pytest.importorskip("deepspeed")


def test_one_row_with_both_steps_timed_and_where_it_ran(tmp_path):
    out = tmp_path / "rows.jsonl"
    run = subprocess.run([sys.executable, "bench/zero_overflow.py", "--params", "4", "--steps", "1", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(out.read_text())
    assert row == json.loads(run.stdout.strip().splitlines()[-1])
    assert row["bench"] == "zero_overflow" and row["params"] == 4 and row["stage"] == 2 and row["dtype"] == "bf16"
    assert row["own_step_ms"] > 0 and row["norm_only_step_ms"] > 0
    assert {"commit", "gpu", "torch", "trl", "deepspeed", "cpu"} <= row.keys()
