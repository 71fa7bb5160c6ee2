"""DeepSpeed ZeRO-1/2's search for a non-finite gradient left to its global norm (``distributed.zero_overflow``): the
same steps taken and skipped, the same weights, the same logged norms, without the search gradient by gradient; and
the configurations where the norm does not cover it keep DeepSpeed's own. On a one-process engine on the CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_grpo.distributed import zero_overflow
from tests.project_files import ROOT
from tests.side_by_side import free_port

pytest.importorskip("deepspeed")

# Four steps of one engine: finite gradients, NaN ones, overflowing ones (inf), finite again; bf16 and clipping, as
# accelerate's zero2.yaml runs them. Printed: every weight after each step, the logged norm, the skip flag, and how
# often DeepSpeed's own search ran.
STEPS = """
import json, os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch, deepspeed
from hf_grpo.runtime import upstream
from hf_grpo.distributed import zero_overflow
upstream.compatible_ops()["deepspeed_shm_comm"] = False  # the CPU comm op a training run never calls: not built
deepspeed.init_distributed(dist_backend="gloo")
stage, quick = int(sys.argv[2]), sys.argv[3] == "quick"
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
          "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1), config=config)
searches = []
search = engine.optimizer.has_overflow_partitioned_grads_serial
engine.optimizer.has_overflow_partitioned_grads_serial = lambda: searches.append(1) or search()
installed = zero_overflow.install(engine, main=False) if quick else None
x = torch.randn(4, 8)
steps = []
for batch in (x, torch.full_like(x, float("nan")), x * 1e30, x):
    engine.backward(engine(batch.to(torch.bfloat16)).float().square().mean())
    engine.step()
    steps.append({"weights": [p.detach().float().tolist() for p in engine.module.parameters()],
                  "norm": float(engine.get_global_grad_norm()), "skipped": bool(engine.optimizer.overflow)})
print(json.dumps({"steps": steps, "searches": len(searches), "installed": installed}))
"""


def run_steps(stage: int, variant: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", STEPS, str(free_port()), str(stage), variant], capture_output=True,
                         text=True, env=env, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage", [1, 2])
def test_the_norm_alone_takes_and_skips_the_steps_deepspeeds_two_searches_do(stage):
    own, quick = run_steps(stage, "own"), run_steps(stage, "quick")
    assert quick["installed"] is True
    assert [s["skipped"] for s in own["steps"]] == [False, True, True, False]  # NaN, then inf: skipped
    assert quick["steps"] == own["steps"]  # every weight, norm and skip the same, bit for bit
    assert own["searches"] == 4 and quick["searches"] == 0


class Optimizer:
    """A stand-in with DeepSpeedZeroOptimizer's name and the facts ``covered_by_the_norm`` reads."""

    def __init__(self, **facts):
        values = dict(check_grad_overflow=True, compute_grad_norm=True, cpu_offload=False, has_moe_layers=False,
                      model_parallel_world_size=1, zenflow=False)
        values.update(facts)
        vars(self).update(values)


Optimizer.__name__ = "DeepSpeedZeroOptimizer"


@pytest.mark.parametrize("facts, why", [
    (dict(check_grad_overflow=False), "no overflow check"), (dict(compute_grad_norm=False), "no global norm"),
    (dict(cpu_offload=True), "CPU offload"), (dict(has_moe_layers=True), "experts"),
    (dict(model_parallel_world_size=2), "model parallelism"), (dict(zenflow=True), "ZenFlow"),
])
def test_where_the_norm_does_not_cover_the_search_deepspeeds_own_stays(facts, why):
    assert zero_overflow.covered_by_the_norm(Optimizer()) is None
    assert why in zero_overflow.covered_by_the_norm(Optimizer(**facts))
    assert zero_overflow.covered_by_the_norm(object()) == "not a DeepSpeed ZeRO-1/2 optimizer"


def test_an_engine_that_is_not_deepspeeds_is_left_alone_and_nothing_is_logged(caplog):
    with caplog.at_level("INFO", logger="hf_grpo"):
        assert zero_overflow.install(object(), main=True) is False
    assert caplog.text == ""
