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
  (pinned host memory), so it overlaps the host work that follows the rollout (decoding text, rewards).

The host copy holds the adapted base weights (``host_nbytes``, pinned where the host allows). A base weight that
is itself trained (``requires_grad``) is copied to the host again before each merge.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .weight_sources import add_lora_deltas, live_base, skeleton, unsupported_reason, walk


@dataclass
class _Adapted:
    tensor: torch.nn.Parameter  # the live base weight or bias, merged in place
    original: torch.Tensor  # its unmerged value on the host


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cuda":
        try:
            return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)
        except RuntimeError:  # pinning refused (locked-memory limit): pageable memory, a slower copy back
            pass
    return tensor.detach().to("cpu", copy=True)


class InPlaceLoraMerge:
    """A plain model sharing ``model``'s tensors; ``refresh`` merges the LoRA adapters into them, ``restore`` undoes it.

    ``model`` is a PEFT LoRA policy whose weights are whole on this device (not ZeRO-3 partitioned), possibly
    under a DDP/DeepSpeed ``.module`` wrapper. Between ``refresh`` and ``restore`` the policy itself computes
    with merged base weights *and* its adapters, so only ``module`` may run in that window.
    """

    nbytes = 0  # GPU memory it adds

    def __init__(self, model: torch.nn.Module):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LoRA adapters cannot be merged for generation: {reason}; "
                             f"set lora_generation_mirror='off'")
        base = live_base(model)
        self.module = skeleton(base)
        self._originals: dict[int, _Adapted] = {}  # id(live tensor) -> its host copy
        made: dict[int, torch.nn.Parameter] = {}  # meta parameter id -> the live one (tied weights stay tied)
        for _, members in walk(self.module, base):
            for mirror_module, source, lora, _ in members:
                for name, meta in list(mirror_module.named_parameters(recurse=False)):
                    live = getattr(source, name)
                    if tuple(live.shape) != tuple(meta.shape):
                        raise ValueError(
                            f"{name} of {type(mirror_module).__name__}: the policy holds {tuple(live.shape)} but its "
                            f"config builds {tuple(meta.shape)}; merging for generation needs a config that "
                            f"describes the model")
                    mirror_module._parameters[name] = made.setdefault(id(meta), live)
                    if lora is not None and id(live) not in self._originals:
                        self._originals[id(live)] = _Adapted(live, _host_copy(live))
                for name, _ in list(mirror_module.named_buffers(recurse=False)):
                    mirror_module._buffers[name] = getattr(source, name)
        self.host_nbytes = sum(a.original.numel() * a.original.element_size() for a in self._originals.values())
        self.module.eval()
        self.module.generation_config = copy.deepcopy(base.generation_config)
        self._merged: list[_Adapted] = []

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> torch.nn.Module:
        """Merge ``model``'s active adapters into its base weights in place; return the plain model that reads them."""
        self.restore()  # a rollout that raised before its restore must not merge twice
        merged: set[int] = set()
        for _, members in walk(self.module, live_base(model)):
            for _, source, lora, adapters in members:
                if lora is None or not adapters:
                    continue
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
                        adapted.original.copy_(tensor)
                    add_lora_deltas(tensor, lora, name, adapters)
                    merged.add(id(tensor))
                    self._merged.append(adapted)
        return self.module

    @torch.no_grad()
    def restore(self) -> None:
        """Write the unmerged base weights back (queued on the current stream; later kernels see them)."""
        for adapted in self._merged:
            adapted.tensor.copy_(adapted.original, non_blocking=True)
        self._merged = []
