"""Weights copied back from the host while the next forward runs: a side stream, layer by layer, each decoder
layer's next forward waiting for its own copies only.

Why: after a LoRA rollout the merged base weights are written back from their pinned host copy
(``lora_merge.InPlaceLoraMerge.restore``): 13 GB at 7B, 0.24 s at the 55 GB/s an H100's host link gave. Queued on
the compute stream, the reference pass that follows waited for all of it; here its first layer waits for that
layer's share (1/28 at 7B) and the rest arrives while the layers before it compute.

Only for readers that go through the layers' forwards: a forward pre-hook on each layer makes the current stream
wait for that layer's copies, then removes itself. A CUDA graph replay runs no hook, so the trainer asks for this
only where no training micro-batch is replayed; anything else must ``settle`` first (the next merge does).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch


class LayerwiseRestore:
    """Copies into the parameters of ``layers`` (a model's decoder layers, on ``device``), overlapped as above."""

    def __init__(self, layers: torch.nn.ModuleList, device: torch.device):
        self.layers = layers
        self.device = device
        self._layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
        self._stream = torch.cuda.Stream(device)
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write each ``(tensor, host source)``: a decoder layer's tensors on the side stream, ready before that
        layer's next forward; any other tensor at once on the current stream (read outside the layers)."""
        self.settle()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the rollout's reads of the merged weights
        by_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for tensor, source in pairs:
            index = self._layer_of.get(id(tensor))
            if index is None:
                tensor.copy_(source, non_blocking=True)
            else:
                by_layer[index].append((tensor, source))
        with torch.cuda.stream(self._stream):
            for index in sorted(by_layer):  # in the order the forward reads them
                for tensor, source in by_layer[index]:
                    tensor.copy_(source, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._stream)
                self._hooks[index] = self.layers[index].register_forward_pre_hook(
                    functools.partial(self._wait, index, ready))

    def _wait(self, index: int, ready: torch.cuda.Event, module, args) -> None:
        torch.cuda.current_stream(self.device).wait_event(ready)
        self._hooks.pop(index).remove()

    @property
    def pending(self) -> bool:
        return bool(self._hooks)

    def settle(self) -> None:
        """Every copy ordered before whatever the current stream runs next; the layers' hooks removed."""
        if self._hooks:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
