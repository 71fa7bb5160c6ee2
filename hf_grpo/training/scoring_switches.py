"""TRL's switches around a rollout, flipped on modules listed once instead of walks over the whole model.

For each rollout TRL 1.16 turns activation checkpointing off and on again twice: around the generation
(``unwrap_model_for_generation``) and around the no-grad scoring (``disable_gradient_checkpointing``), each time
through transformers' ``gradient_checkpointing_disable`` / ``_enable``, which walk every module (and the enable builds
the checkpoint function and PEFT's input hook again). It scores a LoRA policy's reference with the adapters off
through PEFT's ``disable_adapter``, which first builds the model's adapter status (a walk over every parameter) and
then walks every module twice more. None of it runs on the GPU, which waits: at Qwen2.5-7B's 28 layers with LoRA on
every linear layer, about 46 ms of a step's host time on a 2-core CPU (``bench/scoring_switches.py``), part of the
58 ms an H100's profile shows idle before the reference pass.

``QuickSwitches.installed`` lets the model carry, for the length of ``_generate_and_score_completions``, switches that
flip the same flags on modules listed when the switches are built:

- checkpointing off sets the ``gradient_checkpointing`` flag of every module that has one to False; on puts back the
  flags it found. The checkpoint function each layer holds stays: transformers' enable would make it again from the
  same kwargs. A checkpointing "on" that follows no "off" of these switches is transformers' own.
- adapters off sets every adapter layer's disabled flag (and the model's); leaving the block puts back each one. The
  adapters' ``requires_grad`` stays as it is: TRL scores under ``no_grad``, and PEFT's own switch would leave every
  active adapter trainable after, frozen on purpose or not. Models whose adapters PEFT switches another way (prompt
  learning, adaption prompts) or warns about (a trained bias) keep PEFT's switch.

A switch someone already set on the instance is left to them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..runtime import upstream


def switchable_adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The modules PEFT's ``disable_adapter`` turns off (its adapter layers and trained-module wrappers), or None
    where ``model`` is not a PEFT model whose adapters are switched by those flags alone."""
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # pragma: no cover - peft is a dependency; an older one keeps its own switch
        return None
    if not isinstance(model, PeftModel):
        return None
    configs = [model.peft_config[name] for name in model.active_adapters]
    if any(c.is_prompt_learning or c.is_adaption_prompt or getattr(c, "bias", "none") != "none" for c in configs):
        return None
    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


class QuickSwitches:
    """The switches of one model: ``model`` as TRL toggles its checkpointing (the trainer's ``model``), ``unwrapped``
    as TRL turns its adapters off (``accelerator.unwrap_model(model)``, most often the same object)."""

    def __init__(self, model: torch.nn.Module, unwrapped: torch.nn.Module):
        self.model, self.unwrapped = model, unwrapped
        # transformers sets this flag on the layers it checkpoints and on the modules that loop over them
        self.flagged = list(dict.fromkeys(m for root in (model, unwrapped) for m in root.modules()
                                          if hasattr(m, "gradient_checkpointing")))
        self.adapter_layers = switchable_adapter_layers(unwrapped)
        self._flags_before_off: list[bool] = []
        self._offs = 0  # checkpointing "off"s not yet followed by their "on"

    def _checkpointing_off(self) -> None:
        if self._offs == 0:  # the flags as the outermost "off" found them
            self._flags_before_off = [bool(m.gradient_checkpointing) for m in self.flagged]
            for module in self.flagged:
                module.gradient_checkpointing = False
        self._offs += 1

    def _checkpointing_on(self, original: Callable) -> Callable:
        def checkpointing_on(*args, **kwargs):
            if self._offs == 0:  # not turned off here: transformers' own
                return original(*args, **kwargs)
            self._offs -= 1
            if self._offs == 0:
                self._restore_flags()
        return checkpointing_on

    def _restore_flags(self) -> None:
        for module, flag in zip(self.flagged, self._flags_before_off):
            module.gradient_checkpointing = flag
        self._offs = 0

    @contextlib.contextmanager
    def _adapters_off(self) -> Iterator[None]:
        layers = self.adapter_layers
        before = [upstream.adapters_disabled(layer) for layer in layers]
        model_before = upstream.model_adapters_disabled(self.unwrapped)
        for layer in layers:
            upstream.set_adapters_disabled(layer, True)
        upstream.set_model_adapters_disabled(self.unwrapped, True)
        try:
            yield
        finally:
            for layer, flag in zip(layers, before):
                upstream.set_adapters_disabled(layer, flag)
            upstream.set_model_adapters_disabled(self.unwrapped, model_before)

    def _switches(self) -> list[tuple[torch.nn.Module, str, Callable]]:
        switches = []
        for target in dict.fromkeys((self.model, self.unwrapped)):
            if hasattr(target, "gradient_checkpointing_enable") and self.flagged:
                switches += [(target, "gradient_checkpointing_disable", self._checkpointing_off),
                             (target, "gradient_checkpointing_enable",
                              self._checkpointing_on(target.gradient_checkpointing_enable))]
        if self.adapter_layers is not None:
            switches.append((self.unwrapped, "disable_adapter", self._adapters_off))
        return switches

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The quick switches on the models' instances inside the block; the classes' own again after it."""
        placed = []
        try:
            for target, name, switch in self._switches():
                if name not in vars(target):
                    setattr(target, name, switch)
                    placed.append((target, name))
            yield
        finally:
            for target, name in placed:
                delattr(target, name)
            if self._offs:  # an exception between an "off" and its "on": the flags as they were
                self._restore_flags()


def installed(cache: dict, model: torch.nn.Module, unwrap: Callable) -> contextlib.AbstractContextManager:
    """``QuickSwitches(model, unwrap(model)).installed()``, the switches kept in ``cache`` while the trainer's model
    is the same object (listing the modules, and accelerate's unwrap, each walk the whole model)."""
    switches = cache.get("_quick_switches")
    if switches is None or switches.model is not model:
        switches = cache["_quick_switches"] = QuickSwitches(model, unwrap(model))
    return switches.installed()
