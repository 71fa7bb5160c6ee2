"""The masked-diffusion trainer under DeepSpeed ZeRO-2, two processes, launched as a user launches it
(``accelerate launch`` with the shipped ``accelerate_configs/zero2.yaml``): it trains, every rank ends with the same
weights (ZeRO-2 replicates them; its gradient reduce-scatter and the optimizer shards must bring both ranks to the
same update), the weights moved, and every logged loss is finite.

The GPU check (two CUDA devices, bf16, the config's own mixed precision) is for a GPU machine:

    python -m pytest tests/diffusion/test_diffu_zero2.py -m gpu -q

The same run on two CPU processes (fp32) checks the script and the launch anywhere (slow: about 3 minutes on a
busy 2-core machine).
"""

import json
import math
import os
import pathlib

import pytest
import torch

from tests.launching import accelerate_command, run_launch
from tests.side_by_side import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


def launch_zero2(out_dir: pathlib.Path, *, cpu: bool) -> dict:
    out_dir.mkdir()
    command = accelerate_command("--main_process_port", free_port(),
                                 "--config_file", ROOT / "accelerate_configs" / "zero2.yaml",
                                 *(["--mixed_precision", "no"] if cpu else []),
                                 ROOT / "tests" / "scripts" / "diffu_zero2_train.py", out_dir, processes=2)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "ACCELERATE_"))}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = run_launch(command, processes=2, timeout=540, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return json.loads((out_dir / "result.json").read_text())


def check_zero2_run(result: dict, device_type: str) -> None:
    assert (result["processes"], result["zero_stage"]) == (2, 2), result
    assert result["device"].startswith(device_type)
    assert [row["step"] for row in result["logged"]] == [1, 2]
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in result["logged"])
    ranks = result["ranks"]
    assert [rank["rank"] for rank in ranks] == [0, 1] and all(rank["finite_loss"] for rank in ranks)
    assert ranks[0]["checksum_before"] == ranks[1]["checksum_before"]  # the same start on both ranks
    assert ranks[0]["checksum_after"] == ranks[1]["checksum_after"], "the ranks' weights diverged"
    assert ranks[0]["checksum_after"] != ranks[0]["checksum_before"], "training moved no weight"


@pytest.mark.gpu
@pytest.mark.launch
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_diffusion_trainer_under_zero2_on_two_gpus(tmp_path):
    result = launch_zero2(tmp_path / "run", cpu=False)
    check_zero2_run(result, "cuda")
    assert all(rank["peak_memory_gib"] > 0 for rank in result["ranks"])
    print(json.dumps(result["ranks"]), result["diffusion_plan"], sep="\n")


@pytest.mark.slow
@pytest.mark.launch
def test_diffusion_trainer_under_zero2_on_two_cpu_processes(tmp_path):
    check_zero2_run(launch_zero2(tmp_path / "run", cpu=True), "cpu")
