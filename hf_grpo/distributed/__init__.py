"""Distributed plumbing: what DeepSpeed and torch.distributed need around a run.

``zero3_leaves`` marks the modules ZeRO-3 fetches with one hook, ``zero_resume`` refuses a ZeRO checkpoint
resumed in another shape, ``rng_files`` says when a resumed checkpoint lacks this rank's random state,
``build_locks`` finds stale DeepSpeed op-build locks, ``cpu_comm_op`` spares CPU runs a DeepSpeed op build they
never use, ``shutdown`` closes the process group cleanly, ``launcher_watch`` ends a training process whose
launcher died, ``launch_precision`` turns off a launcher's bf16 for an fp32 run on a CPU (``prepare_process`` does
both for a training process), ``deepspeed_replay`` and ``ddp_replay`` do around a training forward replayed from
CUDA graphs what DeepSpeed's engine or DistributedDataParallel would have done in their forward.

May import: ``hf_grpo.runtime`` (rank collectives, exit hooks, DeepSpeed's private names), torch, accelerate,
deepspeed. Never ``hf_grpo.checks``, which imports from here (``launcher_watch`` runs ``runtime.exit_hooks``, where
the output-dir lock registers its release), nor the trainer or the config class.
"""

from typing import Any

from . import build_locks, cpu_comm_op, launch_precision, launcher_watch


def before_deepspeed_starts(deepspeed_field: Any = None) -> None:
    """Under DeepSpeed, before it builds or loads its ops: name the stale build locks it would wait on, and spare a
    CPU run the communication op it never uses. Without DeepSpeed, nothing."""
    build_locks.warn_if_launched_with_deepspeed(deepspeed_field)
    cpu_comm_op.skip_unused_cpu_comm_op(deepspeed_field)


def prepare_process(config: Any = None) -> None:
    """What a training process sets up beyond its config, which is data (building one starts no thread and leaves
    ``os.environ`` as it was). ``GRPOTrainer`` calls it first thing; a recipe before it parses its flags; a script
    of your own that trains without the trainer calls it itself. Idempotent.

    - Under ``accelerate launch`` or torchrun, the process ends when its launcher dies (``launcher_watch``).
    - On a machine without CUDA, an fp32 run turns off the launch config's mixed precision
      (``launch_precision``): ``config``'s decision, made and said when it was built; without a config, decided
      here for a run that will train in fp32."""
    launcher_watch.exit_with_launcher()
    if config is None:
        import torch

        launched = launch_precision.to_drop(True, torch.cuda.is_available)
        if launched is not None:
            launch_precision.say_dropped(launched)
    else:
        launched = getattr(config, "_launch_precision_dropped", None)
    if launched is not None:
        launch_precision.turn_off()
