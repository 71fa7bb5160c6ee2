"""A PEFT LoRA linear layer's forward in three operations: the base projection, the down-projection, and one
``addmm`` that adds the scaled up-projection to the base output inside the matrix multiply.

Why: PEFT's forward (``peft.tuners.lora.layer.Linear.forward``) casts the layer's input to the adapters' dtype
(float32 by default under a bf16 model), then multiplies, scales and adds as separate kernels. Under autocast the
cast is undone at once (the down-projection runs in bf16 again), so a micro-batch's input is written and read
twice more per adapted projection, for nothing, and the scaled output is written once more before it is added. At
1.5B with LoRA r16 on all seven projections (8 rows of 64-1024 prompt tokens packed, activation checkpointing) the
fused forward took the replayed backward from 0.75 to 0.62 s a step and the forward 0.07-0.11 s down, on an H200
(``docs/performance.md``, "LoRA's forward").

The base projection and the add run as one opaque op (``hf_grpo::lora_linear``): the scaled up-projection is
added into the base output in place. Written as ``torch.addmm(out, ...)`` the add allocated a new output and
copied the base output into it first, inside compiled layers too: at 7B with LoRA r16 on all seven projections
(32 x 2048-token completions) those copies took 0.27 s of a step's training half on an H100.

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
    dropout = layer.lora_dropout[name]
    down = F.linear(x if isinstance(dropout, torch.nn.Identity) else dropout(x), layer.lora_A[name].weight)
    tensors = (x, base.weight, base.bias, down, layer.lora_B[name].weight)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # what autocast makes of a linear's and an addmm's inputs
        dtype = torch.get_autocast_dtype(device)
        tensors = tuple(None if t is None else t.to(dtype) for t in tensors)
    return lora_linear(*tensors, float(layer.scaling[name]))


@torch.library.custom_op("hf_grpo::lora_linear", mutates_args=())
def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor,
                up: torch.Tensor, scaling: float) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scaling * down @ up.T``, the add done in place in the base output."""
    out = F.linear(x, weight, bias)
    out.view(-1, out.shape[-1]).addmm_(down.reshape(-1, down.shape[-1]), up.t(), alpha=scaling)
    return out


@lora_linear.register_fake
def _(x, weight, bias, down, up, scaling):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _save(ctx, inputs, output):
    x, weight, _, down, up, scaling = inputs
    ctx.scaling = scaling
    ctx.save_for_backward(x, weight, down, up)


def _backward(ctx, grad):
    x, weight, down, up = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    wants = ctx.needs_input_grad
    grad_x = (rows @ weight).view(x.shape) if wants[0] else None
    grad_weight = rows.t() @ x.reshape(-1, x.shape[-1]) if wants[1] else None
    grad_bias = rows.sum(0) if wants[2] else None
    grad_down = (rows @ up).mul_(ctx.scaling).view(down.shape) if wants[3] else None
    grad_up = (rows.t() @ down.reshape(-1, down.shape[-1])).mul_(ctx.scaling) if wants[4] else None
    return grad_x, grad_weight, grad_bias, grad_down, grad_up, None


lora_linear.register_autograd(_backward, setup_context=_save)


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
