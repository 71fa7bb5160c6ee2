"""bench/trace_gaps.py: the device's idle time between kernels, read from a profiler trace."""

import gzip
import json

from tests.project_files import ROOT, load_file

trace_gaps = load_file(ROOT / "bench" / "trace_gaps.py", "trace_gaps")


def _kernel(ts, dur, name="k"):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_gaps_are_the_idle_time_between_kernels_overlaps_included(tmp_path):
    events = [_kernel(0, 10, "a"), _kernel(5, 20, "b"),  # overlapping: busy until 25
              _kernel(125, 10, "c"),  # 100 us idle
              _kernel(2135, 5, "d"),  # 2000 us idle, the host in "loss" when it began
              {"cat": "cpu_op", "name": "loss", "ts": 100, "dur": 2000}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events, "deviceProperties": [{"name": "Test GPU"}]}, handle)
    got = trace_gaps.summary(trace_gaps.load(str(path))["traceEvents"], top=5)
    assert got["kernels"] == 4 and got["span_ms"] == 2.1 and got["idle_ms"] == 2.1
    assert got["idle_ms_over"] == {"10us": 2.1, "100us": 2.0, "1000us": 2.0, "10000us": 0.0}
    largest = got["largest"][0]
    assert (largest["ms"], largest["after"], largest["before"]) == (2.0, "c", "d")
    assert largest["host"] == ["loss"]
