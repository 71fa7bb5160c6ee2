"""Checks of what a user hands the trainer, made before any model loads or step runs, so that a mistake is
an error naming what was found and what is needed, not an exception deep inside TRL or a run that "succeeds"
at doing nothing."""

from __future__ import annotations

import functools
import importlib.util
import numbers
import os
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

PROMPT_COLUMN = "prompt"
MODEL_CONFIG_FILE = "config.json"


def check_train_dataset(dataset) -> None:
    """Refuse a training set with no rows or without the ``prompt`` column TRL reads.

    An empty set would train zero steps and then save the untouched model as if trained; a missing column
    would fail only once training began. Streaming datasets (no length, maybe no column list) pass.
    """
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and PROMPT_COLUMN not in columns:
        raise ValueError(
            f"train_dataset has no {PROMPT_COLUMN!r} column (found columns {list(columns)}); GRPO generates from "
            f"each row's {PROMPT_COLUMN!r}: rename the column holding the prompts, e.g. "
            f"dataset.rename_column({(list(columns) or ['question'])[0]!r}, 'prompt')"
        )
    try:
        rows = len(dataset)
    except TypeError:  # an IterableDataset: its length is unknown before it is read
        return
    if rows == 0:
        raise ValueError(
            "train_dataset has 0 rows: training would run no step and save the untouched model as if trained; "
            "check the dataset's split, filter or path (it needs at least one row with a 'prompt')"
        )


def check_dataset_fills_a_rollout(dataset, args) -> None:
    """Refuse a training set with fewer rows than one rollout's prompts.

    TRL's sampler (``RepeatSampler``) takes the rows ``generation_batch_size / num_generations`` at a time (the
    global rollout's unique prompts, R x W / G) and drops a last chunk that is not whole; each prompt is then
    repeated ``num_generations`` times and the rollout split whole over the processes. So a set of fewer rows
    gives an empty dataloader: zero steps, and the untouched model saved as if trained. Exactly that many rows
    train (the rows are reused every epoch). Streaming datasets (no length) pass.
    """
    rollout, group = getattr(args, "generation_batch_size", None), getattr(args, "num_generations", None)
    if dataset is None or not isinstance(rollout, int) or not isinstance(group, int) or group < 1:
        return
    try:
        rows = len(dataset)
    except TypeError:  # an IterableDataset
        return
    prompts = rollout // group
    if 0 < rows < prompts:
        raise ValueError(
            f"train_dataset has {rows} rows, fewer than one rollout takes: {prompts} prompts (the rollout's "
            f"{rollout} completions{_rollout_shape(args, rollout)}, / num_generations {group}). TRL's sampler draws "
            f"whole rollouts only, so training would run no step and save the untouched model as if trained. Give "
            f"at least {prompts} rows (the recipes' --num_train_samples), or make the rollout smaller: lower "
            f"per_device_train_batch_size, steps_per_generation (gradient_accumulation_steps, when it is unset) or "
            f"the number of processes, or raise num_generations")


def _rollout_shape(args, rollout: int) -> str:
    """`` = per_device_train_batch_size P x steps_per_generation S x W processes``, where the fields say it."""
    per_device, steps = getattr(args, "per_device_train_batch_size", None), getattr(args, "steps_per_generation", None)
    if not (isinstance(per_device, int) and isinstance(steps, int) and per_device * steps > 0
            and rollout % (per_device * steps) == 0):
        return ""
    return (f" = per_device_train_batch_size {per_device} x steps_per_generation {steps} x "
            f"{rollout // (per_device * steps)} processes")


def looks_like_local_path(name: str) -> bool:
    """True for ``./dir``, ``../dir``, ``/abs/dir``, ``~/dir`` and ``a/b/c``: never hub ids (``org/name``)."""
    return (name.startswith(("./", "../", "/", "~")) or name in (".", "..") or os.path.isabs(name)
            or name.rstrip("/").count("/") > 1)


def check_model_path(name: str) -> None:
    """A local model directory must exist and hold a ``config.json``; hub ids are left to the hub.

    Without this, a mistyped ``./my-checkpoint`` reaches the hub client and fails with "Repo id must be in the
    form 'repo_name' or 'namespace/repo_name'", which does not say the directory is missing.
    """
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, MODEL_CONFIG_FILE)):
            raise ValueError(
                f"model_name_or_path={name!r} is a directory without {MODEL_CONFIG_FILE} (found "
                f"{sorted(os.listdir(path))[:10]}); give the directory model.save_pretrained(...) wrote"
            )
        return
    if looks_like_local_path(name):
        raise ValueError(
            f"model_name_or_path={name!r} is a local path, but no such directory exists ({os.path.abspath(path)}); "
            f"give a directory written by model.save_pretrained(...), or a hub id such as 'Qwen/Qwen2.5-0.5B'"
        )


def check_generation_backend_installed(generation_backend: str) -> None:
    """``generation_backend="vllm"`` needs the vllm package; say so in the user's terms (TRL's own message
    speaks of ``use_vllm``, which the user did not set)."""
    if generation_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "generation_backend='vllm' needs the vllm package, which is not installed: pip install vllm, or set "
            "generation_backend to 'auto', 'hf' or 'cuda_graph'"
        )


def check_config_type(config, expected: type) -> None:
    """``args`` must be hf_grpo's config (``expected``): the per-device batch fields live there."""
    if not isinstance(config, expected):
        got = "None (TRL would build its own default config)" if config is None else (
            f"{type(config).__module__}.{type(config).__name__}")
        raise TypeError(
            f"hf_grpo.GRPOTrainer needs args=hf_grpo.{expected.__name__}(...), got args={got}; the per-device batch "
            f"fields live on hf_grpo.{expected.__name__}: pass args=hf_grpo.{expected.__name__}(output_dir=..., ...)"
        )


def check_before_loading(model=None, reward_funcs=None, args=None, train_dataset=None, *_, **kwargs) -> None:
    """Before TRL loads anything (the trainer's arguments as given): the training set, a model given by path, the
    generation backend, and DeepSpeed's environment before TRL prepares its engine."""
    from ..distributed import before_deepspeed_starts

    check_train_dataset(train_dataset)
    check_dataset_fills_a_rollout(train_dataset, args)
    if isinstance(model, str):
        check_model_path(model)
    check_generation_backend_installed(args.generation_backend)
    before_deepspeed_starts(args.deepspeed)


def _is_number(value) -> bool:
    """None, a real number (Python's or numpy's, bools included), or a one-element tensor or numpy array."""
    if value is None or isinstance(value, (numbers.Real, np.bool_)):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, np.ndarray) and value.size == 1


def numeric_rewards(reward_func: Callable, name: str) -> Callable:
    """``reward_func`` wrapped so that a value that is not a number (or None) is an error naming the function,
    the value and its position, instead of torch's "too many dimensions 'str'"."""

    @functools.wraps(reward_func)
    def checked(*args, **kwargs):
        rewards = reward_func(*args, **kwargs)
        # a list, tuple, tensor or numpy array: whatever TRL turns into a tensor, but not a string or a mapping
        if isinstance(rewards, (str, bytes, Mapping)) or not isinstance(rewards, Iterable) or not hasattr(
                rewards, "__len__"):
            raise TypeError(
                f"reward function {name!r} returned {type(rewards).__name__} {rewards!r:.80}; a reward function "
                f"returns a list with one float (or None) per completion"
            )
        for index, value in enumerate(rewards):
            if not _is_number(value):
                raise TypeError(
                    f"reward function {name!r} returned {type(value).__name__} {value!r:.80} for completion "
                    f"{index}; rewards must be numbers (int or float) or None, one per completion"
                )
        return rewards

    return checked


def check_reward_outputs(trainer) -> None:
    """Wrap each plain (synchronous, non-model) reward function of a TRL trainer with ``numeric_rewards``."""
    for index, (func, name) in enumerate(zip(trainer.reward_funcs, trainer.reward_func_names, strict=True)):
        if isinstance(func, torch.nn.Module) or not callable(func) or _is_async(func):
            continue
        trainer.reward_funcs[index] = numeric_rewards(func, name)


def _is_async(func) -> bool:
    import inspect

    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))
