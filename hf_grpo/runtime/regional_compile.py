"""Compile one decoder layer, not the whole model: the decode step's compile in seconds instead of a minute.

``torch.compile`` of the whole one-token forward traces and compiles every decoder layer anew:
34-42 s for a 24-layer 0.5B model on an H100, paid at the first rollout of every run (11 s even
with inductor's on-disk cache warm, since dynamo still traces all of it). The layers of a model are
one class running the same code on other weights, so one compiled graph can serve them all, if
nothing in the traced code tells them apart. Two things do:

* each layer writes its own slice of the KV cache, reached as ``cache.update(k, v, self.layer_idx)``:
  the layer index would be baked into the graph (one graph per layer). Each layer is handed a
  ``LayerCacheView`` of its own cache layer instead, whose ``update`` ignores the index, so the
  index never enters the graph;
* weights and cache tensors are inputs of the graph (dynamo lifts the parameters of modules it
  inlines, and the cache tensors are unguarded static addresses), so their addresses do not
  enter it either.

A static cache layer also advances its own length tensor at every update: one more one-element kernel
per layer and token, 28 of 468 in a decode step of a 1.5B model. Where every cache layer is a plain
``StaticLayer``, the views write at one shared position (all layers hold the same length) and leave the
lengths alone; ``route`` hands the caller ``advance(n)``, which moves every layer's length in one
``_foreach_add_`` once the step's layers have run.

The embedding, the mask, the rotary tables, the final norm and the LM head stay eager; they are a
few dozen kernels per step, recorded in the CUDA graph like the rest. Layers are routed through
the compiled function only inside ``CompiledLayers.route`` (the compile warm-up and the capture):
the model, its training forward and ``model.generate`` never see it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_CACHE_KWARGS = ("cache", "past_key_values")  # transformers 5.x name, and the deprecated one


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers (``num_hidden_layers`` modules with ``self_attn``), or None."""
    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    if not count:
        return None
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) == count
            and all(hasattr(layer, "self_attn") for layer in module)
        ):
            return module
    return None


class LayerCacheView:
    """One layer of a transformers cache, passed to that layer in place of the whole cache.

    The layer calls ``cache.update(key, value, self.layer_idx, ...)``; the view writes to its own
    layer whatever the index, so the compiled code does not depend on which layer runs it.
    """

    def __init__(self, layer, position: torch.Tensor | None = None) -> None:
        self.layer = layer
        self.position = position  # where every layer writes this step (lengths deferred), or None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.position is None:
            return self.layer.update(key_states, value_states, *args, **kwargs)
        # What StaticLayer.update does, less advancing its length (``CompiledLayers.route``'s ``advance``).
        where = torch.arange(key_states.shape[-2], device=key_states.device) + self.position
        self.layer.keys.index_copy_(2, where, key_states)
        self.layer.values.index_copy_(2, where, value_states)
        return self.layer.keys, self.layer.values


def _call_compiled(compiled, layer, view, *args, **kwargs):
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = view
    return compiled(layer, *args, **kwargs)


class CompiledLayers:
    """One ``torch.compile`` of ``forward`` per decoder-layer class, shared by every layer of the class.

    Shapes are fixed per decoder (batch, cache length), so ``dynamic=False``; a new shape is one
    more compile of one layer.
    """

    def __init__(self, backend: str | object = "inductor", options: dict | None = None) -> None:
        self.backend = backend  # torch.compile's backend (tests count graphs through their own)
        self.options = options  # torch.compile's options, read at each class's first compile
        self._compiled: dict[type, object] = {}

    @staticmethod
    def unavailable_reason(model: torch.nn.Module) -> str | None:
        """Why the layers of ``model`` (a transformers model) cannot share one compiled layer, or None."""
        layers = decoder_layers(model)
        if layers is None:
            return f"{type(model).__name__} has no list of decoder layers with self_attn"
        if any("forward" in vars(layer) for layer in layers):
            # Something (accelerate's offloading hooks, say) already replaced a layer's forward:
            # compiling the class's forward would skip it.
            return "a decoder layer's forward is replaced on the instance"
        return None

    def compiled_forward(self, layer: torch.nn.Module):
        cls = type(layer)
        if cls not in self._compiled:
            self._compiled[cls] = torch.compile(cls.forward, backend=self.backend, dynamic=False,
                                                options=self.options)
        return self._compiled[cls]

    @contextmanager
    def route(self, model: torch.nn.Module, cache) -> Iterator[Callable[[int], None]]:
        """Within the block, every decoder layer of ``model`` runs the compiled forward on its cache view.

        Yields ``advance(n)``, to call after each forward of ``n`` new positions: where the lengths are deferred
        (every cache layer a filled plain ``StaticLayer``) it moves them all at once, else it does nothing (each
        layer moved its own).
        """
        from transformers.cache_utils import StaticLayer

        layers = decoder_layers(model)
        cache_layers = getattr(cache, "layers", None)
        if layers is None or cache_layers is None or len(cache_layers) != len(layers):
            raise RuntimeError("regional compile needs one cache layer per decoder layer")
        deferred = all(type(c) is StaticLayer and c.is_initialized for c in cache_layers)
        position = cache_layers[0].cumulative_length if deferred else None
        lengths = [c.cumulative_length for c in cache_layers] if deferred else []

        def advance(n: int) -> None:
            if lengths:
                torch._foreach_add_(lengths, n)

        routed = []
        try:
            for layer, cache_layer in zip(layers, cache_layers):
                layer.forward = functools.partial(
                    _call_compiled, self.compiled_forward(layer), layer, LayerCacheView(cache_layer, position)
                )
                routed.append(layer)
            yield advance
        finally:
            for layer in routed:
                del layer.forward  # the instance attribute: the class's forward serves again
