"""bench/kernel_resources.py: the decode attention's kernels compiled for sm_90 on a machine without a GPU."""

import importlib.util

import pytest

from tests.project_files import ROOT, load_file

kernel_resources = load_file(ROOT / "bench" / "kernel_resources.py", "kernel_resources")


def test_an_architecture_without_bf16_tensor_cores_is_refused(capsys):
    with pytest.raises(SystemExit):
        kernel_resources.main(["--arch", "75"])
    err = capsys.readouterr().err
    assert "--arch must be 80 or more" in err and "got 75" in err


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (not a project dependency)")
@pytest.mark.parametrize("shared", [False, True])
def test_each_launched_kernel_is_compiled_and_its_limits_read(shared):
    """The attention and its reduction, as the op launches them at the 7B rollout, each with its own resources."""
    rows = kernel_resources.compiled_launches(90, 132, shared)
    assert [row["kernel"] for row in rows] == ["attend", "reduce_splits"]
    attend = rows[0]
    assert attend["grid"] == [32, 4, 3]  # 32 rows x 4 KV heads x 3 splits at 132 SMs
    assert 0 < attend["registers"] <= 255 and attend["shared_memory_bytes"] > 0
    assert attend["programs_per_sm"] == min(attend["programs_per_sm_by_registers"],
                                            attend["programs_per_sm_by_shared_memory"], 64 // attend["num_warps"])
