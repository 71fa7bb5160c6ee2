"""bench/kernel_resources.py: the decode attention's kernels compiled for sm_90 on a machine without a GPU."""

import importlib.util

import pytest

from tests.project_files import ROOT, load_file

kernel_resources = load_file(ROOT / "bench" / "kernel_resources.py", "kernel_resources")


@pytest.mark.parametrize("arch", ["75", "91"])
def test_an_architecture_without_bf16_tensor_cores_or_known_limits_is_refused(arch, capsys):
    with pytest.raises(SystemExit):
        kernel_resources.main(["--arch", arch])
    err = capsys.readouterr().err
    assert "--arch must be one of [80, 86, 89, 90, 100]" in err and f"got {arch}" in err


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
    assert attend["programs_per_sm_by_registers"] == 65536 // (attend["registers"] * 32 * attend["num_warps"])
