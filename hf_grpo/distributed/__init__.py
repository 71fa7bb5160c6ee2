"""Distributed plumbing: what DeepSpeed and torch.distributed need around a run.

``zero3_leaves`` marks the modules ZeRO-3 fetches with one hook, ``zero_resume`` refuses a ZeRO checkpoint
resumed in another shape, ``rng_files`` says when a resumed checkpoint lacks this rank's random state,
``build_locks`` finds stale DeepSpeed op-build locks, ``cpu_comm_op`` spares CPU runs a DeepSpeed op build they
never use, ``shutdown`` closes the process group cleanly, ``launcher_watch`` ends a training process whose
launcher died, ``deepspeed_replay`` and ``ddp_replay`` do around a training forward replayed from CUDA graphs what
DeepSpeed's engine or DistributedDataParallel would have done in their forward.

May import: ``hf_grpo.memory`` (rank agreement helpers), torch, accelerate, deepspeed. Never the trainer or the
config class (``launcher_watch`` releases ``hf_grpo.checks.output_lock``'s lock before it exits).
"""

from typing import Any

from . import build_locks, cpu_comm_op


def before_deepspeed_starts(deepspeed_field: Any = None) -> None:
    """Under DeepSpeed, before it builds or loads its ops: name the stale build locks it would wait on, and spare a
    CPU run the communication op it never uses. Without DeepSpeed, nothing."""
    build_locks.warn_if_launched_with_deepspeed(deepspeed_field)
    cpu_comm_op.skip_unused_cpu_comm_op(deepspeed_field)
