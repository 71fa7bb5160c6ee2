"""LoRA rollouts from the policy's own weights, its adapters merged in place for the rollout and restored after.

Why: the captured decode step runs a LoRA policy's adapters as extra matmuls in every step (seven adapted
projections a layer, and no fused q/k/v), about half the plain model's speed. Decoding from weights with the
adapters merged runs at the plain model's speed; a merged *copy* (``dense_mirror``) costs one model copy of GPU
memory for the whole run, which put a 1.5B LoRA run's peak above TRL's. Here there is no copy on the GPU:

- ``module`` is a plain (adapter-free) model of the same architecture whose every parameter and buffer *is* the
  policy's tensor (the LoRA layers' base weights, the embeddings, the norms): no memory, and a captured graph
  reads the same addresses every rollout.
- ``refresh`` adds each active adapter's delta to its base weight in place, as PEFT's ``merge`` does, so the
  values equal ``merge_and_unload``'s bit for bit.
- ``restore`` writes the base weights back from a host copy taken when the view is built. Restoring by
  subtracting the delta again would not give the same bits back in bf16, and the frozen base would drift a
  rounding error every rollout; the copy makes it exact. The copy back is queued on the current stream
  (pinned host memory), so it overlaps the host work that follows the rollout (decoding text, rewards); with
  ``overlap`` a decoder layer's weights are copied on a side stream and its next forward waits for them alone
  (``layerwise_restore``), so the copy also overlaps the reference pass.

The host copy holds the adapted base weights (``host_nbytes``, pinned where the host allows). A base weight that
is itself trained (``requires_grad``) is copied to the host again before each merge.

Under ZeRO-3 with one process, each parameter's partition (``ds_tensor``) holds the whole weight on the GPU, so the
same holds there (``partitions_whole``): ``module`` reads the partitions in place, in their full shape, where a dense
mirror would keep a second copy of the model for the whole run (1.5B: 2.9 GiB, above TRL's peak). The optimizer
writes its steps into the partitions, so there is nothing to copy; the adapters' weights are gathered one unit at a
time for the merge. A partition DeepSpeed moved after the view was built is an error, not a stale read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..runtime import upstream
from ..runtime.regional_compile import decoder_layers
from . import packed_weights
from .base import is_zero3_param, model_device
from .layerwise_restore import LayerwiseRestore
from .fused_projections import projection_groups
from .weight_sources import add_lora_deltas, gathered, live_base, skeleton, unsupported_reason, walk


@dataclass
class _Adapted:
    tensor: torch.nn.Parameter  # the live base weight or bias, merged in place
    original: torch.Tensor  # its unmerged value on the host


def whole_partition(param: torch.nn.Parameter, device: torch.device | None = None) -> torch.Tensor | None:
    """A ZeRO-3 parameter's partition viewed in the parameter's shape, where it holds the whole parameter (one
    process) on ``device`` (any device when None); else None."""
    part = upstream.zero3_partition(param)
    if part is None or part.numel() < param.ds_numel:
        return None
    if device is not None and (part.device.type, part.device.index or 0) != (device.type, device.index or 0):
        return None  # offloaded ("cpu" and "cpu:0" are one device)
    return part.narrow(0, 0, param.ds_numel).view(param.ds_shape)


def partitions_whole(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every ZeRO-3 parameter of ``model`` has its whole value in its partition on ``device`` (one process,
    parameters not offloaded), so that a decoder can read the partitions in place."""
    params = [p for p in live_base(model).parameters() if is_zero3_param(p)]
    return bool(params) and all(whole_partition(p, device) is not None for p in params)


def _readable(live: torch.nn.Parameter) -> torch.nn.Parameter:
    """The tensor the plain model reads for ``live``: itself, or its whole ZeRO-3 partition in its shape."""
    if not is_zero3_param(live):
        return live
    view = whole_partition(live)
    if view is None:
        raise ValueError("a ZeRO-3 parameter's partition does not hold the whole parameter (several processes or "
                         "offloaded parameters): decode from a dense mirror instead")
    return torch.nn.Parameter(view, requires_grad=False)  # the same storage: the optimizer's steps show through


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cuda":
        try:
            return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)
        except RuntimeError:  # pinning refused (locked-memory limit): pageable memory, a slower copy back
            pass
    return tensor.detach().to("cpu", copy=True)


def layerwise_restore(base: torch.nn.Module) -> LayerwiseRestore | None:
    """The side-stream restore of ``base``'s decoder layers, on a GPU (None: restored on the current stream)."""
    layers, device = decoder_layers(base), model_device(base)
    return LayerwiseRestore(layers, device) if layers is not None and device.type == "cuda" else None


class InPlaceLoraMerge:
    """A plain model sharing ``model``'s tensors; ``refresh`` merges the LoRA adapters into them, ``restore`` undoes it.

    ``model`` is a policy whose weights are whole on this device - a PEFT LoRA model, or under ZeRO-3 with one
    process any model (``partitions_whole``) - possibly under a DDP/DeepSpeed ``.module`` wrapper. Between
    ``refresh`` and ``restore`` the policy itself computes with merged base weights *and* its adapters, so only
    ``module`` may run in that window.
    """

    nbytes = 0  # GPU memory it adds

    def __init__(self, model: torch.nn.Module):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LoRA adapters cannot be merged for generation: {reason}; "
                             f"set lora_generation_mirror='off'")
        base = live_base(model)
        self.module = skeleton(base)
        self._originals: dict[int, _Adapted] = {}  # id(live tensor) -> what the plain model reads, its host copy
        self._partitions: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (ZeRO-3 parameter, the view read)
        made: dict[int, torch.nn.Parameter] = {}  # meta parameter id -> the tensor read (tied weights stay tied)
        for _, members in walk(self.module, base):
            for mirror_module, source, lora, _ in members:
                for name, meta in list(mirror_module.named_parameters(recurse=False)):
                    live = getattr(source, name)
                    shape = live.ds_shape if is_zero3_param(live) else live.shape
                    if tuple(shape) != tuple(meta.shape):
                        raise ValueError(
                            f"{name} of {type(mirror_module).__name__}: the policy holds {tuple(shape)} but its "
                            f"config builds {tuple(meta.shape)}; merging for generation needs a config that "
                            f"describes the model")
                    if id(meta) not in made:
                        made[id(meta)] = _readable(live)
                        if made[id(meta)] is not live:
                            self._partitions.append((live, made[id(meta)]))
                    mirror_module._parameters[name] = made[id(meta)]
                    if lora is not None and id(live) not in self._originals:
                        self._originals[id(live)] = _Adapted(made[id(meta)], _host_copy(made[id(meta)]))
                for name, _ in list(mirror_module.named_buffers(recurse=False)):
                    mirror_module._buffers[name] = getattr(source, name)
        # the frozen q/k/v and gate/up weights side by side: the decoder fuses them with no copy (not ZeRO-3's
        # partitions, whose views here are not the tensors the optimizer writes)
        self.packed_groups = 0 if self._partitions else packed_weights.pack(projection_groups(self.module))
        self.host_nbytes = sum(a.original.numel() * a.original.element_size() for a in self._originals.values())
        self._layerwise = None if self._partitions else layerwise_restore(base)
        self.module.eval()
        self.module.generation_config = copy.deepcopy(base.generation_config)
        self._merged: list[_Adapted] = []

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> torch.nn.Module:
        """Merge ``model``'s active adapters into its base weights in place; return the plain model that reads them."""
        self.restore()  # a rollout that raised before its restore must not merge twice; waits for an overlapped one
        for live, view in self._partitions:
            if upstream.zero3_partition(live).data_ptr() != view.data_ptr():
                raise RuntimeError(f"DeepSpeed moved a ZeRO-3 partition of shape {tuple(live.ds_shape)} after the "
                                   f"in-place view was built; build it again")
        merged: set[int] = set()
        for _, members in walk(self.module, live_base(model)):
            adapters_weights = [p for _, _, lora, adapters in members if lora is not None and adapters
                                for n, p in lora.named_parameters() if n.startswith(("lora_A.", "lora_B."))]
            with gathered(adapters_weights):  # ZeRO-3: this unit's adapters, whole for the merge
                for _, source, lora, adapters in members:
                    if lora is not None and adapters:
                        self._merge(source, lora, adapters, merged)
        return self.module

    def _merge(self, source: torch.nn.Module, lora, adapters: list[str], merged: set[int]) -> None:
        for name in ("weight", "bias"):
            tensor = getattr(source, name, None)
            if tensor is None or id(tensor) in merged:
                continue
            adapted = self._originals.get(id(tensor))
            if adapted is None:
                raise RuntimeError(f"{type(source).__name__}.{name} was replaced after the LoRA merge view was "
                                   f"built; build it again")
            if name == "bias" and not any(lora.lora_bias.get(a, False) for a in adapters):
                continue  # no adapter adds to this bias
            if tensor.requires_grad:  # a trained base weight: its host copy must be the current value
                adapted.original.copy_(adapted.tensor)
            add_lora_deltas(adapted.tensor, lora, name, adapters)
            merged.add(id(tensor))
            self._merged.append(adapted)

    @torch.no_grad()
    def restore(self, overlap: bool = False) -> None:
        """Write the unmerged base weights back, queued on the current stream (later kernels see them); with
        ``overlap`` (on a GPU) each layer's on a side stream, waited for by that layer's next forward. The trainer
        asks for it where every reader goes through the layers' forwards: a training rollout, followed by its step's
        forwards, where no micro-batch is replayed from a CUDA graph (a replay runs no hook); not an evaluation's,
        which a checkpoint save may follow."""
        pairs = [(adapted.tensor, adapted.original) for adapted in self._merged]
        self._merged = []
        if overlap and pairs and self._layerwise is not None:
            self._layerwise.copy(pairs)
            return
        self.settle()
        for tensor, original in pairs:
            tensor.copy_(original, non_blocking=True)

    def settle(self) -> None:
        """Order every copy of an overlapped restore before what the current stream runs next."""
        if self._layerwise is not None:
            self._layerwise.settle()
