"""bench/trace_phases.py: a training half's kernel time by phase and kernel family, read from a profiler trace."""

import gzip
import json

import pytest

from tests.project_files import ROOT, load_file

trace_phases = load_file(ROOT / "bench" / "trace_phases.py", "trace_phases")


def _kernel(ts, dur, name):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def _span(ts, dur):
    return {"cat": "gpu_user_annotation", "name": "hf_grpo/logprob", "ts": ts, "dur": dur}


def test_phases_follow_the_logprob_spans_and_kernels_go_to_their_family(tmp_path):
    events = [_kernel(0, 60, "Memcpy HtoD (Pageable -> Device)"),
              _span(100, 300), _kernel(100, 200, "nvjet_sm90_tst_256x160"), _kernel(350, 40, "triton_red_fused_x"),
              _span(500, 100), _kernel(500, 80, "void pytorch_flash::flash_fwd_kernel<cutlass::bfloat16_t>"),
              _kernel(700, 50, "void at::native::elementwise_kernel<128, 4>"),  # the backward, to the end
              _kernel(900, 100, "cutlass_80_tensorop_gemm")]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    got = trace_phases.summary(json.load(gzip.open(path, "rt"))["traceEvents"], top=2)
    assert list(got) == ["before", "reference", "forward_1", "backward_1"]
    assert got["before"]["families_ms"] == {"copy": 0.1}
    assert got["reference"] == {"span_ms": 0.3, "kernel_ms": 0.2, "families_ms": {"gemm": 0.2, "triton": 0.0},
                                "top_ms": {"nvjet_sm90_tst_256x160": 0.2, "triton_red_fused_x": 0.0}}
    assert got["forward_1"]["families_ms"] == {"flash_attention": 0.1}
    assert got["backward_1"]["span_ms"] == 0.4 and got["backward_1"]["families_ms"] == {"gemm": 0.1,
                                                                                          "aten_other": 0.1}


def test_a_trace_without_logprob_spans_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="hf_grpo/logprob"):
        trace_phases.phases([_kernel(0, 10, "k")])
