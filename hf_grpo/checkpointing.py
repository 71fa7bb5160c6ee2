"""Activation checkpointing under transformers' current names.

transformers 5.23 renamed the config fields ``gradient_checkpointing`` / ``gradient_checkpointing_kwargs`` and the
model's ``gradient_checkpointing_enable`` / ``gradient_checkpointing_disable`` / ``is_gradient_checkpointing`` to
``activation_checkpointing*``; the old names stay deprecated aliases, each use of which warns (FutureWarning) until
transformers 6. This package uses the new names. Users may still pass the old field: transformers takes it when the
new one is unset (and says so). TRL 1.16 still reads and writes the old fields, which transformers mirrors from the
new ones once, when the config is built; ``set_checkpointing`` keeps them in step after that.

May import: nothing of ``hf_grpo``; no torch at import (``hf_grpo.config`` reads it).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterator
from typing import Any

FIELD = "activation_checkpointing"
ALIAS = "gradient_checkpointing"  # transformers' deprecated alias, TRL 1.16's name (its default: True)


def explicit_fields(explicit: Collection[str]) -> frozenset[str]:
    """The fields the user set, the deprecated alias counted as the field it stands for: a preset then leaves a
    user's ``gradient_checkpointing=False`` alone, as it would ``activation_checkpointing=False``."""
    return frozenset(explicit) | ({FIELD} if ALIAS in explicit else frozenset())


def fill_default(config: Any) -> None:
    """Checkpointing on, TRL's default, where neither name was given (nor set by a preset): under the current name,
    so building a config warns about no deprecated one. ``GRPOConfig`` leaves the alias' default at None for this.
    Also kept: the ``use_reentrant`` the user gave, before TRL rewrites it (``unforce_reentrant``)."""
    if getattr(config, FIELD) is None and getattr(config, ALIAS) is None:
        setattr(config, FIELD, True)
    given = getattr(config, f"{FIELD}_kwargs", None) or getattr(config, f"{ALIAS}_kwargs", None) or {}
    if isinstance(given, str):  # JSON from a command line, which transformers parses after this
        try:
            given = json.loads(given)
        except ValueError:
            given = {}  # transformers names the field and the bad value
    config.hf_grpo_user_reentrant = given.get("use_reentrant") if isinstance(given, dict) else None


def reentrant(args: Any) -> bool:
    """Whether the run checkpoints activations reentrantly (``use_reentrant=True`` in TRL's kwargs): the backward
    then reaches the parameters inside a checkpoint only through ``.grad``, never as ``torch.autograd.grad`` inputs."""
    return bool(getattr(args, ALIAS, False) and (getattr(args, f"{ALIAS}_kwargs", None) or {}).get("use_reentrant"))


def unforce_reentrant(args: Any) -> bool:
    """Non-reentrant checkpointing again where TRL 1.16 forced ``use_reentrant=True`` (PEFT under ZeRO-3: DeepSpeed
    gathers and releases parameters inside the recompute) and the user did not ask for it. For a run whose ZeRO-3
    hooks are removed (every parameter whole, ``distributed.zero3_one_process``): the recompute then reads the same
    parameters, and a replayed graph's backward can ask for their gradients. Returns whether it changed."""
    if not reentrant(args) or getattr(args, "hf_grpo_user_reentrant", None) is True:
        return False
    for name in (f"{ALIAS}_kwargs", f"{FIELD}_kwargs"):  # transformers mirrors the alias (a copy or the same dict)
        if isinstance(getattr(args, name, None), dict):
            getattr(args, name)["use_reentrant"] = False
    return True


def set_checkpointing(config: Any, value: bool) -> None:
    """Set activation checkpointing on a built config: transformers reads ``activation_checkpointing``, TRL 1.16
    its alias ``gradient_checkpointing``; the config's ``__post_init__`` mirrored them once, so set both."""
    setattr(config, FIELD, value)
    setattr(config, ALIAS, value)


def rollout_kwargs(args: Any) -> dict | None:
    """The checkpointing kwargs TRL's rollout re-enables checkpointing with: its own field (the alias), which TRL
    1.16 rewrites after the config is built (PEFT under ZeRO-3 forces ``use_reentrant=True`` there only)."""
    return args.gradient_checkpointing_kwargs


@contextlib.contextmanager
def paused(model: Any, kwargs: dict | None) -> Iterator[None]:
    """Activation checkpointing off inside the block (scoring without gradients), back on after it with ``kwargs``
    as transformers' Trainer first enabled it (``every_n_layers`` and ``offload`` are arguments, not kwargs of
    ``torch.utils.checkpoint``)."""
    was_on = model.is_activation_checkpointing
    if was_on:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if was_on:
            rest = dict(kwargs or {})
            every_n_layers, offload = rest.pop("every_n_layers", 1), rest.pop("offload", False)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=rest or None,
                                                  every_n_layers=every_n_layers, offload=offload)
