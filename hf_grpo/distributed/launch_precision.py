"""The launch config's mixed precision on a machine without CUDA: an fp32 run turns it off.

``accelerate launch`` passes its config's ``mixed_precision`` on as ``ACCELERATE_MIXED_PRECISION`` (the shipped
configs say bf16). On a machine without CUDA the run trains in fp32 (``batch_fields.device_defaults``), so the
launcher's bf16 and the config would disagree: transformers builds the DeepSpeed plugin and the Accelerator's
precision from the variable ("ds bf16.enabled=True vs hf bf16=False"). Such a run drops the launcher's value, in
two places, so that building a config leaves the environment as it was:

- ``GRPOConfig`` decides (``decide``) and shows transformers' ``TrainingArguments.__post_init__``, which reads
  the variable once while the config is built, ``"no"`` for that read only (``read_as``);
- ``hf_grpo.prepare_process`` writes ``ACCELERATE_MIXED_PRECISION=no`` for the rest of the process (``turn_off``),
  where the Accelerator and DeepSpeed read it: the trainer's first step, from the config's decision; a recipe's,
  before it parses its flags, deciding for an fp32 run itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

logger = logging.getLogger("hf_grpo")
VARIABLE = "ACCELERATE_MIXED_PRECISION"


def to_drop(trains_in_fp32: bool, cuda: Callable[[], bool]) -> str | None:
    """The launcher's mixed precision that an fp32 run on a machine without CUDA turns off, or None. ``cuda`` (a
    probe) is asked only when a launcher set a mixed precision and the run trains in fp32."""
    launched = os.environ.get(VARIABLE, "no")
    if launched == "no" or not trains_in_fp32 or cuda():
        return None
    return launched


def decide(trains_in_fp32: bool, cuda: Callable[[], bool]) -> str | None:
    """``to_drop``, said once (rank 0) when the launcher's value is dropped."""
    launched = to_drop(trains_in_fp32, cuda)
    if launched is not None:
        say_dropped(launched)
    return launched


def say_dropped(launched: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        logger.warning("no CUDA device: training in fp32, not the launch config's mixed_precision=%s "
                       "(pass --mixed_precision no to accelerate launch to say so)", launched)


@contextlib.contextmanager
def read_as(value: str | None) -> Iterator[None]:
    """Inside the block ``ACCELERATE_MIXED_PRECISION`` reads ``value`` (None: as it is); after it, as it was."""
    if value is None:
        yield
        return
    before = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = before


def turn_off() -> None:
    """Write ``ACCELERATE_MIXED_PRECISION=no`` for the rest of the process (``hf_grpo.prepare_process``)."""
    os.environ[VARIABLE] = "no"
