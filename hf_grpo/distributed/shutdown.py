"""End a multi-process run so that every process exits with status 0."""

from __future__ import annotations

import gc

import torch


def close_distributed(trainer=None) -> None:
    """Drain and release the run's communication state, then destroy the process groups.

    Call it once on every rank after training and saving. A no-op outside torch.distributed.

    Why: a run that trained and saved fine can still abort at interpreter exit ("terminate
    called without an active exception", SIGABRT on one rank, so the launcher fails). Gloo's
    worker threads may still hold finished work whose tensors are freed during interpreter
    finalization, and DeepSpeed's engine keeps ZeRO-3 prefetch handles, module hooks and its
    own process groups alive past ``destroy_process_group`` (pytorch/pytorch#179291). So the
    engine is emptied and destroyed, and the garbage collected, while the interpreter is whole.
    The trainer cannot train again afterwards.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.barrier()  # every rank has finished its collectives
    if trainer is not None:
        engine = getattr(trainer, "deepspeed", None)
        if engine is not None:
            engine.empty_partition_cache()  # ZeRO-3: waits for in-flight all-gathers, re-partitions
        trainer.accelerator.free_memory()  # DeepSpeedEngine.destroy(): removes hooks, frees buffers
        trainer.deepspeed = None
        trainer.model_wrapped = trainer.model
        trainer.optimizer = trainer.lr_scheduler = None
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    gc.collect()
