"""The host's time in DeepSpeed ZeRO-1/2's optimizer step, with its search for a non-finite gradient gradient by
gradient (DeepSpeed's own) and with that search left to the global norm (``hf_grpo.distributed.zero_overflow``).

The search launches seven small operations a gradient; at a LoRA run's 392 gradients (r16 on every linear layer of
a 28-layer model) that is about 2,700 launches a step, each a few microseconds of the host's time, with the GPU
idle behind them at the end of the step. This builds a one-process ZeRO engine (gloo) whose parameters have a LoRA
run's count (``--params``) at tiny sizes, bf16 and clipping as ``zero2.yaml`` runs, and times its ``step()``: the
engine's own, then with the search left to the norm, in one process. On a CPU every operation also runs where it is
launched, so this is the host's cost of the launches plus tiny kernels: a bound on what a GPU host spends.

    python bench/zero_overflow.py --params 392 --out bench/results/zero_overflow_cpu.jsonl
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import socket
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import emit, with_provenance  # noqa: E402


def engine(params: int, stage: int, quick: bool):
    import deepspeed
    import torch

    from hf_grpo.distributed import zero_overflow

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(params // 2)])  # a weight and a bias each
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
              "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    built, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                     config=config)
    if quick and not zero_overflow.install(built, main=False):
        raise SystemExit("the search could not be left to the norm on this engine")
    return built


def step_ms(built, steps: int) -> list[float]:
    import torch

    x = torch.randn(2, 16, dtype=torch.bfloat16)
    times = []
    for _ in range(steps + 2):  # two warm-ups
        built.backward(built(x).float().square().mean())
        start = time.perf_counter()
        built.step()
        times.append(1e3 * (time.perf_counter() - start))
    return times[2:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=392, help="parameters (gradients) of the engine; even")
    parser.add_argument("--stage", type=int, choices=[1, 2], default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="append the JSON row to this file")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    from hf_grpo.runtime import upstream

    upstream.compatible_ops()["deepspeed_shm_comm"] = False  # the CPU comm op a training run never calls: not built
    deepspeed.init_distributed(dist_backend="gloo")
    row = {"bench": "zero_overflow", "params": args.params, "stage": args.stage, "dtype": "bf16",
           "cpu": platform.processor() or platform.machine(), "deepspeed": deepspeed.__version__}
    for name, quick in (("own_step_ms", False), ("norm_only_step_ms", True)):
        row[name] = round(statistics.median(step_ms(engine(args.params, args.stage, quick), args.steps)), 3)
    row["saved_ms_a_step"] = round(row["own_step_ms"] - row["norm_only_step_ms"], 3)
    emit(with_provenance(row), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
