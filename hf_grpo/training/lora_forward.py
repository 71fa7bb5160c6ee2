"""A PEFT LoRA linear layer's forward in three operations: the base projection, the down-projection, and one
``addmm`` that adds the scaled up-projection to the base output inside the matrix multiply.

Why: PEFT's forward (``peft.tuners.lora.layer.Linear.forward``) casts the layer's input to the adapters' dtype
(float32 by default under a bf16 model), then multiplies, scales and adds as separate kernels. Under autocast the
cast is undone at once (the down-projection runs in bf16 again), so a micro-batch's input is written and read
twice more per adapted projection, for nothing, and the scaled output is written once more before it is added. At
1.5B with LoRA r16 on all seven projections (8 rows of 64-1024 prompt tokens packed, activation checkpointing) the
fused forward took the replayed backward from 0.75 to 0.62 s a step and the forward 0.07-0.11 s down, on an H200
(``docs/performance.md``, "LoRA's forward").

The values are the same sums in another rounding order: PEFT rounds the up-projection and its scaled value to the
compute dtype before the add, ``addmm`` adds in the multiply's float32 accumulator and rounds once. In float32 the
two agree to rounding (``tests/training/test_lora_forward.py``).

Layers keep PEFT's own forward where it does more than this: DoRA or another variant, a bias on the adapter,
``fan_in_fan_out`` weights, several active adapters, adapters disabled or merged, mixed-batch ``adapter_names``,
or inputs whose dtypes autocast would not bring together. Under ZeRO-3 or FSDP the adapters' weights are
gathered by hooks on their modules, which a forward reading the weights directly would bypass: the trainer does
not install it there.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

INSTALLED = "_hf_grpo_fused_lora_forward"  # True on a layer whose forward ``install`` replaced


def _lora_linear_class():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _takes_fused(module: torch.nn.Module, lora_linear: type) -> bool:
    """Whether ``module`` is a layer the fused forward serves in some state: PEFT's plain LoRA ``Linear`` (not a
    subclass: quantized bases compute otherwise) over a ``torch.nn.Linear`` in (out, in) layout."""
    return (type(module) is lora_linear and isinstance(module.get_base_layer(), torch.nn.Linear)
            and not getattr(module, "fan_in_fan_out", False))


def _fast_adapter(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one adapter this call adds with ``addmm``; None where PEFT's forward must run."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    if (name not in layer.lora_A or name in getattr(layer, "lora_variant", {})
            or getattr(layer, "use_dora", {}).get(name, False) or getattr(layer, "lora_bias", {}).get(name, False)):
        return None
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return name if x.dtype in (torch.get_autocast_dtype(device), torch.float32) else None
    weights = (layer.get_base_layer().weight, layer.lora_A[name].weight, layer.lora_B[name].weight)
    return name if all(w.dtype == x.dtype for w in weights) else None


def fused_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``layer``'s forward (bound to it by ``install``): base + scaling * B(A(dropout(x))) with the add inside
    ``addmm``, or PEFT's own where the call needs more (``_fast_adapter``)."""
    name = _fast_adapter(layer, x, args, kwargs)
    if name is None:
        return type(layer).forward(layer, x, *args, **kwargs)
    base = layer.get_base_layer()
    out = F.linear(x, base.weight, base.bias)
    dropout = layer.lora_dropout[name]
    down = F.linear(x if isinstance(dropout, torch.nn.Identity) else dropout(x), layer.lora_A[name].weight)
    fused = torch.addmm(out.reshape(-1, out.shape[-1]), down.reshape(-1, down.shape[-1]),
                        layer.lora_B[name].weight.t(), alpha=layer.scaling[name])
    return fused.view(out.shape)


def install(model: torch.nn.Module) -> int:
    """Give every plain LoRA Linear of ``model`` the fused forward (idempotent); returns how many layers have it.
    The forward is a method bound to its layer, so a deep copy of the model binds it to the copy's layer."""
    lora_linear = _lora_linear_class()
    if lora_linear is None:
        return 0
    count = 0
    for module in model.modules():
        if not getattr(module, INSTALLED, False) and _takes_fused(module, lora_linear):
            module.forward = types.MethodType(fused_forward, module)
            setattr(module, INSTALLED, True)
        count += bool(getattr(module, INSTALLED, False))
    return count


def uninstall(model: torch.nn.Module) -> None:
    """PEFT's own forward back on every layer ``install`` changed."""
    for module in model.modules():
        if getattr(module, INSTALLED, False):
            del module.forward  # the instance attribute: the class's forward again
            delattr(module, INSTALLED)
