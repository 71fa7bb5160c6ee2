"""bench/grpo_realistic.py's ``--profile_step``: one optimizer step's trace and tables, and with
``--profile_with_stack`` Python's functions in the trace, which ``bench/trace_gaps.py`` names in the host's gaps."""

import gzip
import json
import types

import pytest
import torch

from tests.project_files import ROOT, load_file

realistic = load_file(ROOT / "bench" / "grpo_realistic.py", "grpo_realistic_bench")


def host_work_between_kernels():
    return torch.ones(64).cumsum(0).sum()


@pytest.mark.parametrize("with_stack", [False, True])
def test_the_profiled_step_is_written_with_pythons_functions_when_asked(tmp_path, with_stack):
    profiler = realistic.StepProfiler(1, str(tmp_path), "zero2 x1, hf_grpo", with_stack=with_stack)
    state = types.SimpleNamespace(global_step=0)
    profiler.on_step_begin(None, state, None)
    host_work_between_kernels()
    profiler.on_step_end(None, state, None)
    stem = tmp_path / "profile_zero2_x1_hf_grpo_step1"
    assert "sorted by self_cpu_time_total" in (stem.with_suffix(".txt")).read_text()
    events = json.load(gzip.open(f"{stem}.json.gz", "rt"))["traceEvents"]
    python = [e["name"] for e in events if e.get("cat") == "python_function"]
    assert any("host_work_between_kernels" in name for name in python) == with_stack
    assert any(e.get("name") == "aten::cumsum" for e in events)
