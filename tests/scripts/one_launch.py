"""Several trainings in turn in the processes of one launch: each launch pays ~10 s of imports per process on a
2-core machine, so a test script that trains several variants to compare them trains them all in one launch."""

import gc

import torch


def release_for_the_next_run(trainer) -> None:
    """Free a finished run's engines, keeping the process group for the next run, and forget accelerate's state: a
    singleton that would otherwise hand the next trainer this run's DeepSpeed plugin (and its config) instead of
    the one its own arguments build."""
    from accelerate.state import AcceleratorState, GradientState

    torch.distributed.barrier()
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None:
        engine.empty_partition_cache()  # ZeRO-3: waits for in-flight all-gathers
    trainer.accelerator.free_memory()
    trainer.deepspeed = trainer.optimizer = trainer.lr_scheduler = None
    gc.collect()
    torch.distributed.barrier()
    AcceleratorState._reset_state()
    GradientState._reset_state()

