"""Distributed plumbing: what DeepSpeed and torch.distributed need around a run.

``zero3_leaves`` marks the modules ZeRO-3 fetches with one hook, ``zero_resume`` refuses a ZeRO checkpoint
resumed in another shape, ``build_locks`` finds stale DeepSpeed op-build locks, ``cpu_comm_op`` spares CPU runs
a DeepSpeed op build they never use, ``shutdown`` closes the process group cleanly.

May import: ``hf_grpo.memory`` (rank agreement helpers), torch, accelerate, deepspeed. Never the trainer or the
config class.
"""
