"""Which of the policy's tensors each module of a plain copy of its architecture reads, through PEFT and
DDP/DeepSpeed wrappers: what the dense mirror (``dense_mirror``) copies and the in-place LoRA merge (``lora_merge``)
shares.

``skeleton`` builds the architecture on the meta device; ``walk`` pairs each of its modules with the policy
module holding the base tensors and the LoRA layer whose deltas are added (``add_lora_deltas``, bit for bit
PEFT's ``merge``), one unit (a decoder layer, or a module outside the layer list) at a time.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from ..runtime import upstream
from .base import is_zero3_param


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP/DeepSpeed-style ``.module`` wrappers (a PEFT model stays a PEFT model).

    A wrapper is told by having no ``generation_config`` (a DeepSpeed engine has a ``config`` of its own)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module) and not hasattr(model, "generation_config"):
        model = model.module
    return model


def live_base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose module paths the mirror copies (under PEFT, the LoRA-injected one)."""
    model = unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """ZeRO-3: gather those of ``params`` that are released, for reading (released again on exit); the others, and
    parameters outside ZeRO-3, are read as they are (one that DeepSpeed keeps gathered stays so: ZeRO-3 with one
    process keeps every parameter gathered, ``distributed.zero3_one_process``)."""
    released = upstream.released_zero3(p for p in params if is_zero3_param(p))
    if not released:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(released, modifier_rank=None):
        yield


# ---- what each mirror tensor is read from ---------------------------------------------------------

def is_lora_layer(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return isinstance(module, LoraLayer)


def _is_modules_to_save(module: torch.nn.Module) -> bool:
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return False
    return isinstance(module, ModulesToSaveWrapper)


def _active_lora_adapters(layer) -> list[str]:
    """Adapters whose delta the live forward adds: none when disabled or already merged into the base."""
    if layer.disable_adapters or layer.merged:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A]


def _source_module(live: torch.nn.Module, path: str) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(module holding the base tensors, LoRA layer whose deltas are added or None) for a mirror module."""
    if is_lora_layer(live):
        for adapter in _active_lora_adapters(live):
            if adapter in getattr(live, "lora_variant", {}):
                raise ValueError(
                    f"{path}: LoRA adapter {adapter!r} uses a variant (DoRA or similar) whose merge is not a plain "
                    f"delta; the dense mirror supports plain LoRA: set zero3_generation_mirror='off'"
                )
        return live.get_base_layer(), live
    if _is_modules_to_save(live):
        active = live.active_adapters
        if live.disable_adapters or any(name not in live.modules_to_save for name in active):
            return live.original_module, None
        return live.modules_to_save[active[0]], None
    return live, None


def _check_plain(mirror_module: torch.nn.Module, source: torch.nn.Module, path: str) -> None:
    """The source must be the same kind of module: an unknown adapter wrapper would be copied without its effect."""
    if type(source) is not type(mirror_module):
        raise ValueError(
            f"{path}: the policy has a {type(source).__name__} where its architecture has a "
            f"{type(mirror_module).__name__}; the dense mirror copies plain modules and LoRA layers only: "
            f"set zero3_generation_mirror='off'"
        )


def add_lora_deltas(target: torch.Tensor, layer, name: str, adapters: list[str]) -> None:
    """Add what PEFT's merge adds to ``layer``'s base ``weight`` / ``bias``: one in-place add per adapter, in
    order, as ``merge`` does (``weight.data += delta``), so the values equal ``merge_and_unload``'s bit for bit."""
    for adapter in adapters:
        if name == "weight":
            target.add_(layer.get_delta_weight(adapter))
        elif name == "bias" and layer.lora_bias.get(adapter, False):
            target.add_(layer.lora_B[adapter].bias * layer.scaling[adapter])


def _units(mirror: torch.nn.Module) -> list[tuple[str, torch.nn.Module, bool]]:
    """(path, module, recurse) gathered together: each element of a ModuleList (a decoder layer) with all it
    holds, and every other module that owns parameters or buffers directly (embeddings, final norm, head)."""
    units: list[tuple[str, torch.nn.Module, bool]] = []

    def visit(path: str, module: torch.nn.Module, in_list: bool) -> None:
        if in_list:
            units.append((path, module, True))
            return
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            units.append((path, module, not any(True for _ in module.children())))
        is_list = isinstance(module, torch.nn.ModuleList)
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child, is_list)

    visit("", mirror, False)
    return units


def walk(mirror: torch.nn.Module, base: torch.nn.Module):
    """For each unit: (the policy's parameters to gather, [(mirror module, source module, LoRA layer or None,
    active adapters)] for every mirror module in it that holds tensors). Read afresh on every call, so a
    changed adapter state (disabled, merged, another active adapter) is followed."""
    for path, unit, recurse in _units(mirror):
        live_unit = base.get_submodule(path)
        members = []
        for mod_path, mirror_module in (unit.named_modules(prefix=path) if recurse else [(path, unit)]):
            if not any(True for _ in mirror_module.parameters(recurse=False)) and not any(
                    True for _ in mirror_module.buffers(recurse=False)):
                continue
            source, lora = _source_module(base.get_submodule(mod_path), mod_path)
            _check_plain(mirror_module, source, mod_path)
            members.append((mirror_module, source, lora, _active_lora_adapters(lora) if lora is not None else []))
        yield list(live_unit.parameters(recurse=recurse)), members


def skeleton(base: torch.nn.Module) -> torch.nn.Module:
    """The architecture of ``base`` on the meta device: no memory, no ZeRO-3 partitioning, no adapters."""
    config = copy.deepcopy(base.config)
    with torch.device("meta"):  # transformers skips weight init on meta; ties the embeddings as configured
        mirror = type(base)(config)
    attn = upstream.attention_implementation(base.config)
    if attn is not None:
        upstream.set_attention_implementation(mirror.config, attn)
    return mirror


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why a dense mirror cannot stand in for ``model`` (prompt-learning PEFT, quantized weights), or None."""
    model = unwrap(model)
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return f"the PEFT method {peft_config.peft_type} adds virtual tokens, not weights"
    base = live_base(model)
    if getattr(base, "hf_quantizer", None) is not None or getattr(base, "is_quantized", False):
        return "the model is quantized"
    if getattr(base, "config", None) is None:
        return f"{type(base).__name__} has no transformers config to build the copy from"
    return None
