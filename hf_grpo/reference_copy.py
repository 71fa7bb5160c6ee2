"""The reference model of a policy built in code.

With ``beta > 0`` (and no PEFT) TRL builds the frozen reference model by loading the policy's
``config._name_or_path``. A model object built in code has an empty one, which TRL passes to the hub
("Repo id must use alphanumeric chars ..."). Here such a policy gets a private copy of its weights on disk
for the time TRL loads the reference from it, so the reference is built by TRL's own code (its dtype, its
attention, ZeRO-3 partitioning at load time) from the policy's initial weights.

Each process writes and reads its own copy, in its own temporary directory: no shared disk is needed, and
the directory is gone when ``GRPOTrainer.__init__`` returns (or fails). Every process must therefore hold the
same initial weights, as a seeded model built the same way on every process does.

Under ZeRO-3 the reference loads inside ``zero.Init``, which needs DeepSpeed's communication layer up; a policy
loaded from a directory before the trainer (no copy needed) gets that too.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from unittest import mock

import torch

from .runtime import upstream

PREFIX = "hf_grpo_reference_"


def needs_copy(model, beta: float, peft_config) -> bool:
    """A policy model object from which TRL would try to load a reference model but cannot: beta > 0, no
    PEFT (whose reference is the base with the adapters disabled), and no ``_name_or_path``."""
    if beta == 0.0 or peft_config is not None or isinstance(model, (str, type(None))):
        return False
    if hasattr(model, "peft_config"):  # already a PeftModel
        return False
    config = getattr(model, "config", None)
    return config is not None and not upstream.name_or_path(config)


@contextlib.contextmanager
def reference_loadable(model, beta: float, peft_config=None):
    """Within the block, a policy built in code (``needs_copy``) names a directory holding its weights, from
    which TRL loads the reference model; after it, the directory is removed and the name is empty again."""
    if beta != 0.0 and peft_config is None and not hasattr(model, "peft_config"):
        _deepspeed_comm_up_for_zero3()  # TRL loads the reference from a path (the copy's, below), inside zero.Init
    if not needs_copy(model, beta, peft_config):
        yield
        return
    if any(hasattr(parameter, "ds_id") for parameter in model.parameters()):
        raise ValueError(
            f"beta={beta} needs a reference model, which TRL loads from the policy's path, and this "
            f"{type(model).__name__} was built in code with its parameters already partitioned by DeepSpeed "
            f"ZeRO-3 (built inside zero.Init), so its weights cannot be copied here: save it with "
            f"save_pretrained and pass that directory as model=, or build it before the GRPOConfig, or set beta=0"
        )
    directory = tempfile.mkdtemp(prefix=PREFIX)
    try:
        # save_pretrained writes on rank 0 only once torch.distributed is up; here every process writes its own
        every_rank = mock.patch.object(model, "should_save_on_this_rank", lambda is_main_process: True,
                                       create=True)
        with every_rank, torch.no_grad():
            model.save_pretrained(directory)
        upstream.set_name_or_path(model.config, directory)
        yield
    finally:
        upstream.set_name_or_path(model.config, "")
        shutil.rmtree(directory, ignore_errors=True)


def _deepspeed_comm_up_for_zero3() -> None:
    """Under ZeRO-3, TRL loads the reference inside ``zero.Init``, which reads the world size from DeepSpeed's
    communication layer before starting it; a run whose policy was built or loaded before the trainer has not
    started it yet (on a CPU Accelerate leaves it to DeepSpeed), so it would read 1 and refuse the batch sizes.
    Started here on the process group torch.distributed already has."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled() or not torch.distributed.is_initialized():
        return
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
