"""ZeRO-3 "leaf modules": each decoder layer's parameters fetched by one hook (``zero3_leaf_modules``).

DeepSpeed ZeRO-3 puts fetch/release hooks on every submodule (q/k/v/o, gate/up/down, norms, ...); for small
models that per-module host work dominates a step. A module flagged as a leaf (``deepspeed.utils``'s
``set_z3_leaf_modules``) gets one hook that gathers all its parameters, and its children get none. The flag
must be on the module before DeepSpeed registers its hooks (``deepspeed.initialize``). The forward computes the
same values either way; gradients agree to float rounding, not bit for bit (without leaves DeepSpeed's identity
functions on every submodule's inputs change the order in which autograd sums the residual stream's gradient).

Two routes, both DeepSpeed's own: the policy's modules are flagged directly (``mark``), and the class names are
added to the DeepSpeed config's ``zero_optimization.leaf_module.classes`` (``add_to_deepspeed_config``), which
DeepSpeed applies to every engine built from that config: TRL builds the reference model inside its
``__init__`` and prepares it from a copy of that config, so that is the only way to reach it in time.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch

from ..runtime import upstream

FIELD = "zero3_leaf_modules"
SETTINGS = ("auto", "off")
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class LeafMarking:
    """What ``mark`` flagged: the class names and how many module instances."""

    classes: tuple[str, ...]
    count: int

    def __str__(self) -> str:
        if not self.count:
            return f"no ZeRO-3 leaf modules ({FIELD})"
        return (f"{self.count} ZeRO-3 leaf modules ({', '.join(self.classes)}): one parameter gather per module, "
                f"no hooks on their children ({FIELD})")


def validate_setting(setting) -> None:
    """``setting``'s form: "auto", "off", or comma-separated class names (which classes occur is checked in ``mark``)."""
    if isinstance(setting, str) and setting in SETTINGS:
        return
    if setting == "on":  # zero3_generation_mirror's word; here the decoder layers are "auto"
        raise ValueError(f"{FIELD}='on' is not a setting: use 'auto' (the decoder layers), 'off', or class names")
    names = [name.strip() for name in setting.split(",")] if isinstance(setting, str) else None
    if not names or not all(_CLASS_NAME.match(name) for name in names):
        raise ValueError(
            f"{FIELD} must be 'auto', 'off' or comma-separated module class names such as 'Qwen2DecoderLayer', "
            f"got {setting!r}"
        )


def _no_split_classes(model: torch.nn.Module) -> set[str]:
    """The classes transformers keeps whole when it splits the model over devices: its decoder layers."""
    names: set[str] = set()
    for module in model.modules():  # a PEFT wrapper's base model is one of them
        names.update(upstream.no_split_modules(module))
    return names


def leaf_classes(model: torch.nn.Module, setting: str) -> tuple[str, ...]:
    """The class names ``setting`` picks that occur in ``model`` (sorted); a named class that does not occur raises."""
    validate_setting(setting)
    if setting == "off":
        return ()
    present = {type(module).__name__ for module in model.modules()}
    if setting == "auto":
        return tuple(sorted(_no_split_classes(model) & present))
    wanted = {name.strip() for name in setting.split(",")}
    unknown = sorted(wanted - present)
    if unknown:
        found = sorted(_no_split_classes(model) & present)
        raise ValueError(
            f"{FIELD}={setting!r}: no module of class {', '.join(unknown)} in the model; its decoder layers are "
            f"{', '.join(found) or 'unknown (no _no_split_modules)'}; every class that occurs: "
            f"{', '.join(sorted(present))} (or use 'auto' or 'off')"
        )
    return tuple(sorted(wanted))


def mark(model: torch.nn.Module, setting: str, *, zero3: bool) -> LeafMarking:
    """Flag as ZeRO-3 leaves the modules of the classes ``setting`` picks; outside ZeRO-3, nothing (and no checks).

    Call it before DeepSpeed wraps ``model``: a flag set after its hooks are registered changes nothing."""
    if not zero3:
        return LeafMarking((), 0)
    classes = leaf_classes(model, setting)
    if not classes:
        return LeafMarking((), 0)
    # DeepSpeed's own flag; imported only under ZeRO-3
    from deepspeed.utils import set_z3_leaf_modules

    leaves = set_z3_leaf_modules(model, list(classes))
    _make_leaf_inputs_need_grad(model, leaves)
    return LeafMarking(classes, len(leaves))


def mark_for_deepspeed(model: torch.nn.Module | None, setting: str, config: dict | None, main: bool) -> LeafMarking:
    """``mark`` under a ZeRO-3 DeepSpeed ``config`` (the accelerator's plugin's; None without DeepSpeed), the classes
    then added to ``config``, so every engine built from it (the reference's too) flags them; logged on ``main``."""
    if model is None or not is_zero3_config(config):
        return LeafMarking((), 0)
    marking = mark(model, setting, zero3=True)
    add_to_deepspeed_config(config, marking.classes)
    if main:
        logging.getLogger("hf_grpo").info("%s", marking)
    return marking


def _make_leaf_inputs_need_grad(model: torch.nn.Module, leaves: list[torch.nn.Module]) -> None:
    """DeepSpeed reduces a leaf's gradients in a full backward hook on the leaf. PyTorch calls that hook before the
    leaf's own backward when none of its inputs needs a gradient (frozen embeddings: LoRA without gradient
    checkpointing): DeepSpeed then fills the not yet computed gradients with zeros of the released, empty
    parameters and the backward fails. The embeddings' output needing a gradient (as under PEFT with gradient
    checkpointing) puts the hook after the leaf's backward; the weights' gradients are unchanged."""
    if not any(p.requires_grad for leaf in leaves for p in leaf.parameters()):
        return  # no leaf has gradients to reduce
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    if embeddings is None:
        raise ValueError(f"{FIELD}: the model has trainable parameters inside its leaf modules but no input "
                         f"embeddings to make its layers' inputs need a gradient; set {FIELD}='off'")
    if not any(p.requires_grad for p in embeddings.parameters()):
        model.enable_input_require_grads()


def add_to_deepspeed_config(config: dict, classes: tuple[str, ...]) -> None:
    """Add ``classes`` to ``config``'s ``zero_optimization.leaf_module.classes``, keeping DeepSpeed's defaults (its
    MoE blocks) or the user's own list; every engine built from ``config`` then flags them before its hooks."""
    if not classes:
        return
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    leaf = config.setdefault("zero_optimization", {}).setdefault("leaf_module", {})
    current = leaf.get("classes", DEFAULT_LEAF_MODULE_CLASSES)
    current = [current] if isinstance(current, str) else list(current)
    leaf["classes"] = current + [name for name in classes if name not in current]


def is_zero3_config(config: dict | None) -> bool:
    """Whether a DeepSpeed config dict (the accelerator's plugin's) says ZeRO stage 3."""
    stage = ((config or {}).get("zero_optimization") or {}).get("stage")
    return str(stage) == "3"
