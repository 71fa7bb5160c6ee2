"""Where the batch fields' values come from, before ``GRPOConfig`` checks them: presets, ``DIFFU_*``
environment overrides, the fields the user set explicitly, the device's defaults and the world size.

May import: ``hf_grpo.plan`` (which parses the "auto" sizes); no trainer, no ``hf_grpo.memory``, no torch at import.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import re
from collections.abc import Callable, Collection
from typing import Any

from .plan import AUTO, BatchPlan, take_auto

logger = logging.getLogger("hf_grpo")

PRESETS: dict[str, dict[str, Any]] = {
    # activation checkpointing trades ~20-30% step time for activation memory
    "memory": {"activation_checkpointing": True, "per_device_generation_batch_size": 2, "tensor_batch_size": 512},
    "balanced": {"per_device_generation_batch_size": 4, "tensor_batch_size": 1024},
    "speed": {"activation_checkpointing": False, "per_device_generation_batch_size": 8, "tensor_batch_size": 2048},
}

# The batch-size guide's factory per preset, built by ``preset_factory`` for each config class.
PRESET_FACTORY_NAMES = {"memory": "create_memory_optimized_config", "balanced": "create_balanced_config",
                        "speed": "create_speed_optimized_config"}


def preset_factory(preset: str, config_cls: type):
    """``create_<preset>_config(**overrides)``: a ``config_cls`` with ``PRESETS[preset]`` filling the fields
    ``overrides`` leave out (the config sees only the overrides as set); its docstring lists those values."""
    def create(**overrides: Any):
        return config_cls(**overrides, preset=preset)

    values = ", ".join(f"{name}={value!r}" for name, value in PRESETS[preset].items())
    create.__name__ = create.__qualname__ = PRESET_FACTORY_NAMES[preset]
    create.__module__ = config_cls.__module__
    create.__doc__ = f"A {config_cls.__name__} with the {preset!r} preset ({values}); ``overrides`` win over it."
    return create


ENV_OVERRIDES = {
    "DIFFU_BATCH_SIZE": "per_device_generation_batch_size",
    "DIFFU_TRAIN_BATCH_SIZE": "per_device_train_batch_size",
    "DIFFU_TENSOR_BATCH_SIZE": "tensor_batch_size",
}

# The fields the batch contract reads; `resolve_batch_fields` works on a dict of these.
BATCH_FIELDS = (
    "preset",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
    "num_iterations",
    "per_device_generation_batch_size",
    "tensor_batch_size",
    "max_tokens_per_micro_batch",
    "activation_checkpointing",
    "bf16",
)


def current_world_size() -> int:
    """Data-parallel processes of this launch (``accelerate launch`` and torchrun set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _bf16_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def device_defaults(cuda: bool | None = None) -> dict[str, Any]:
    """CPU-only machines train on the CPU in fp32; GPUs use bf16 where they have it. Applied to the fields a
    user leaves out, in the library as in the recipes (TRL's default bf16=True fails on a CPU). ``cuda``: whether
    CUDA is available, if already probed."""
    cuda = _cuda_available() if cuda is None else cuda
    return {"use_cpu": not cuda, "bf16": cuda and _bf16_available()}


def device_fields_left_out(explicit: Collection[str], fp16: bool, cuda: Callable[[], bool]) -> dict[str, Any]:
    """``device_defaults`` for ``use_cpu`` and ``bf16`` where the user left them out (``bf16`` not with ``fp16``);
    ``cuda`` (``cuda_probe``) is asked only if one of them is left out."""
    names = [name for name in ("use_cpu", "bf16") if name not in explicit and not (name == "bf16" and fp16)]
    defaults = device_defaults(cuda()) if names else {}
    return {name: defaults[name] for name in names}


def cuda_probe() -> Callable[[], bool]:
    """``torch.cuda.is_available()`` (which creates no CUDA context), asked once at the first call of the returned
    function, or never: a config probes the machine only for a default it needs."""
    return functools.cache(lambda: _cuda_available())


def env_override(variable: str) -> str | None:
    """The value of a ``DIFFU_*`` variable, or None when it is unset, empty or only whitespace: all three mean
    "no override" (``DIFFU_BATCH_SIZE= cmd`` or a blank line in a job file turns an override off)."""
    raw = os.environ.get(variable)
    return raw if raw is not None and raw.strip() else None


def parse_env_size(variable: str, raw: str) -> int | str:
    """A positive integer (or "auto") from an environment variable, or a ValueError naming it and the value."""
    text = raw.strip()
    if text.lower() == AUTO:
        return AUTO
    if not re.fullmatch(r"\+?[0-9]+", text) or int(text) < 1:
        raise ValueError(
            f"{variable}={raw!r} is not a positive integer or 'auto'; set it to a whole number >= 1 "
            f"(e.g. {variable}=4), to auto, or unset it"
        )
    value = int(text)
    return value


def resolve_batch_fields(values: dict[str, Any], explicit: Collection[str], world_size: int) -> dict[str, Any]:
    """Apply preset, then environment overrides, derive the rest, and validate.

    ``values`` holds the fields of ``BATCH_FIELDS`` as given; ``explicit`` names the fields the
    user set (a preset fills only the others, whatever their values). Returns the resolved
    values with ``steps_per_generation`` and ``per_device_generation_batch_size`` filled in
    and ``generation_batch_size`` left for TRL to derive. Raises ``ValueError``.
    """
    values = dict(values)
    preset = values.get("preset")
    preset_chunk = None
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)} or None, got {preset!r}")
        for name, value in PRESETS[preset].items():
            if name not in explicit:
                values[name] = value
        if "bf16" not in explicit:
            values["bf16"] = _bf16_available()
        # The preset's chunk size is a cap: a rollout smaller than it is generated in one chunk.
        if "per_device_generation_batch_size" not in explicit:
            preset_chunk = values["per_device_generation_batch_size"]

    for variable, name in ENV_OVERRIDES.items():
        raw = env_override(variable)
        if raw is None:
            continue
        value = parse_env_size(variable, raw)
        if is_main_process() and value != values[name]:
            was = "unset" if values[name] is None else values[name]
            logger.warning("%s=%s overrides %s (was %s)", variable, value, name, was)
        values[name] = value
        if name == "per_device_generation_batch_size":
            preset_chunk = None

    # "auto" sizes: the defaults on CPU; on CUDA the same defaults stand in until the trainer probes (autosize.py)
    values, auto = take_auto(values, probe_later=True)
    values["auto_batch_fields"] = auto if auto and _cuda_available() else ()  # the device probed only for "auto"

    P, W = values["per_device_train_batch_size"], world_size
    steps, rollout = values["steps_per_generation"], values["generation_batch_size"]
    if steps is not None and rollout is not None:
        raise ValueError(
            f"set either steps_per_generation ({steps}) or generation_batch_size ({rollout}), not both: "
            f"generation_batch_size is the global rollout, per_device_train_batch_size x world size x "
            f"steps_per_generation"
        )
    if steps is None and rollout is None:
        steps = values["gradient_accumulation_steps"]
    elif steps is None:
        if not isinstance(P, int) or P < 1 or rollout % (P * W):
            raise ValueError(
                f"generation_batch_size ({rollout}) is the global rollout and must be a multiple of "
                f"per_device_train_batch_size ({P}) x world size ({W}) = {P * W}; prefer setting "
                f"steps_per_generation, the number of micro-batches per rollout"
            )
        steps = rollout // (P * W)
    values["steps_per_generation"], values["generation_batch_size"] = steps, None

    if values["per_device_generation_batch_size"] is None:
        # derived from P x steps; from an invalid P or steps it stays a placeholder (1): validate() below refuses
        # the invalid field itself, and the user did not set this one, so it adds no second error
        derivable = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (P, steps))
        values["per_device_generation_batch_size"] = P * steps if derivable else 1
    elif preset_chunk is not None and isinstance(P, int) and isinstance(steps, int):
        values["per_device_generation_batch_size"] = min(preset_chunk, P * steps)

    BatchPlan.from_fields(values, world_size).validate()
    return values


def check_generation_choices(backend: str, use_vllm: bool, continuous_batching: bool, *, use_vllm_given: bool) -> None:
    """Refuse two generation settings that pick different generators: one of them would be ignored without a word
    (TRL's vLLM and continuous-batching paths bypass ``generation_backend``)."""
    if use_vllm and backend in ("hf", "cuda_graph"):
        raise ValueError(
            f"use_vllm=True and generation_backend={backend!r} contradict each other: with use_vllm TRL generates "
            f"with vLLM and the {backend!r} backend never runs; set generation_backend='vllm' (or 'auto') to "
            f"generate with vLLM, or use_vllm=False to generate with {backend!r}"
        )
    if backend == "vllm" and use_vllm_given and not use_vllm:
        raise ValueError(
            "generation_backend='vllm' and use_vllm=False contradict each other: generation_backend='vllm' is TRL's "
            "vLLM mode (use_vllm=True); drop use_vllm=False, or pick generation_backend 'auto', 'hf' or 'cuda_graph'"
        )
    if continuous_batching and backend != "auto":
        raise ValueError(
            f"use_transformers_continuous_batching=True and generation_backend={backend!r} contradict each other: "
            f"continuous batching is TRL's own generation path and the {backend!r} backend would never run; set "
            f"generation_backend='auto' to generate with continuous batching, or "
            f"use_transformers_continuous_batching=False"
        )


# Set while a parser builds the config from every field at once (YAML + flags): it then names the
# fields the user really gave, which keyword arguments alone cannot tell.
_EXPLICIT_FIELDS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "hf_grpo_explicit_fields", default=None
)


@contextlib.contextmanager
def explicit_fields(names: Collection[str]):
    """Configs built inside this block treat ``names`` as the fields the user set (for presets)."""
    token = _EXPLICIT_FIELDS.set(frozenset(names))
    try:
        yield
    finally:
        _EXPLICIT_FIELDS.reset(token)
