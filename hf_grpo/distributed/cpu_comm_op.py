"""DeepSpeed on CPU: skip building the shared-memory all-reduce op that training never calls.

When DeepSpeed starts its communication on a CPU accelerator it compiles (first use on a machine: 30-45 s on
two cores) and loads a shared-memory all-reduce op. Only ``inference_all_reduce`` reads it, which DeepSpeed's
inference-time tensor parallelism calls; a training run all-reduces through ``torch.distributed`` (gloo), and
``inference_all_reduce`` itself falls back to it when the op is absent. Marking the op incompatible before the
communication starts makes DeepSpeed skip the build and the load. GPU accelerators have no such op.
"""

from __future__ import annotations

from typing import Any

from ..runtime import upstream
from .build_locks import launched_with_deepspeed

SHM_COMM_OP = "deepspeed_shm_comm"  # deepspeed.ops.op_builder.cpu.ShareMemCommBuilder.NAME


def skip_unused_cpu_comm_op(deepspeed_field: Any = None) -> bool:
    """Under DeepSpeed on a CPU accelerator, mark the shared-memory comm op incompatible so that DeepSpeed neither
    builds nor loads it; returns whether it was marked. Call it before DeepSpeed's communication starts (an
    ``accelerate launch`` on CPU starts it in the Trainer's ``deepspeed.initialize``)."""
    if not launched_with_deepspeed(deepspeed_field):
        return False
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    compatible = upstream.compatible_ops()  # DeepSpeed's own probe of which ops this machine can build
    if not compatible.get(SHM_COMM_OP, False):
        return False
    compatible[SHM_COMM_OP] = False
    return True
