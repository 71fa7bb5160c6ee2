"""An opt-in, APPROXIMATE key/value cache for the diffusion sampler's steps within a block (Fast-dLLM style).

**Why no exact cache exists.** In a causal LM the keys and values of a prefix depend on the prefix only.
In a bidirectional (masked-diffusion) model every position attends to every other one, so from the
second layer on, the keys/values of the committed prefix are functions of the still-masked positions of
the current and later blocks too. Each step commits tokens of the current block, so the prefix's
keys/values change (a little) at every step even though its tokens do not. Only the first layer's
keys/values (a function of each token and its position alone) stay the same. Reusing them is therefore a
different model of the next step, not a faster evaluation of the same one, and the sampler's output
distribution changes. This module is off unless asked for (``block_cache=`` of
``hf_grpo.diffusion.sampler.diffusion_generate`` / ``DiffusionSampler``); its agreement with the exact
sampler is measured in ``tests/diffusion/test_diffu_block_cache.py`` (exact for a one-layer model, where
the reused keys/values are exactly the ones a full forward would compute).

**Modes.** The first step of every block runs the full row and keeps the keys/values of every column it
will not recompute; the block's other steps then run only

* ``"prefix"``: the current block and the later (still masked) blocks; the prompt and finished blocks
  come from the cache;
* ``"dual"``: the current block's ``block_length`` tokens; the prompt, finished blocks and later blocks
  come from the cache (the fastest: a step costs ``block_length`` tokens instead of the whole row).

Attention without a causal mask does not care in which order the keys sit, so the recomputed columns
are appended after the cached ones, each at its true position (``position_ids``), with the key-padding
mask permuted the same way. Needs a model whose forward takes ``position_ids`` and a transformers
``DynamicCache`` (``cache=``, or ``past_key_values=`` before transformers renamed it), e.g. Llama / Qwen2
with ``is_causal=False``; unshifted logits; the ``mask2d`` padding style. LLaDA's own remote code takes no
``position_ids`` and is refused with a ValueError.
"""

from __future__ import annotations

import inspect

import torch

from .model import base_module

BLOCK_CACHES = ("prefix", "dual")


def check_block_cache_name(block_cache) -> None:
    """A ValueError naming ``block_cache`` when it is neither None nor one of ``BLOCK_CACHES``."""
    if block_cache is not None and block_cache not in BLOCK_CACHES:
        raise ValueError(f"block_cache must be None (exact, the default) or one of {BLOCK_CACHES} (approximate), "
                         f"got {block_cache!r}")


def check_block_cache(block_cache, model: torch.nn.Module, logits_shift: bool, padding_style: str) -> None:
    """A ValueError naming ``block_cache`` when it is unknown or the model cannot take it."""
    check_block_cache_name(block_cache)
    if block_cache is None:
        return
    if cache_kwarg(model) is None or "position_ids" not in _parameters(model):
        raise ValueError(f"block_cache={block_cache!r} needs a model whose forward takes position_ids and a "
                         f"key/value cache (cache= or past_key_values=); {type(base_module(model)).__name__}"
                         f".forward takes {sorted(_parameters(model))}. Use block_cache=None")
    if logits_shift:
        raise ValueError(f"block_cache={block_cache!r} supports unshifted logits (LLaDA-style) only; "
                         f"logits_shift=True (Dream-style) needs block_cache=None")
    if padding_style != "mask2d":
        raise ValueError(f"block_cache={block_cache!r} supports padding_style='mask2d' only, got "
                         f"{padding_style!r}; use block_cache=None")


def _parameters(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(base_module(model).forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_kwarg(model: torch.nn.Module) -> str | None:
    """The forward's name for the key/value cache: ``cache`` (transformers >= 5.2x), ``past_key_values``, or None."""
    parameters = _parameters(model)
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def returned_cache(output):
    """The key/value cache a forward with ``use_cache=True`` returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def recomputed_columns(block_cache: str, start: torch.Tensor, offset: int, block_length: int,
                       gen_length: int) -> torch.Tensor:
    """``[B, n]`` columns the cached steps recompute: the block (dual), or the block and the later blocks (prefix)."""
    count = block_length if block_cache == "dual" else gen_length - offset
    return start[:, None] + offset + torch.arange(count, device=start.device)[None, :]


class BlockKVCache:
    """Keys/values of every column except ``recompute`` ([B, n]), taken from a full forward's ``past_key_values``.

    ``forward`` runs the model on the ``recompute`` columns of a canvas against them and returns the
    hidden states / logits ``[B, n, ...]`` (whatever ``output.logits`` holds); the cache is left as it was.
    """

    def __init__(self, past_key_values, recompute: torch.Tensor, valid: torch.Tensor | None, kwarg: str = "cache"):
        layers = getattr(past_key_values, "layers", None)
        if not layers or any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError("block_cache needs a transformers DynamicCache of full-attention layers, got "
                             f"{type(past_key_values).__name__}")
        rows, total = recompute.size(0), layers[0].keys.size(2)
        keep = torch.ones((rows, total), dtype=torch.bool, device=recompute.device).scatter_(1, recompute, False)
        # the kept columns of each row in ascending order, without a host sync: a stable sort puts them first
        kept = keep.to(torch.int8).sort(dim=1, descending=True, stable=True).indices[:, : total - recompute.size(1)]
        for layer in layers:
            index = kept[:, None, :, None].expand(-1, layer.keys.size(1), -1, layer.keys.size(3))
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.past_key_values, self.kwarg = past_key_values, kwarg
        self.saved = [(layer.keys, layer.values) for layer in layers]
        self.recompute = recompute
        self.mask = None if valid is None else torch.cat([valid.gather(1, kept), valid.gather(1, recompute)], 1).long()

    def forward(self, model: torch.nn.Module, canvas: torch.Tensor, **kwargs) -> torch.Tensor:
        kwargs.update(input_ids=canvas.gather(1, self.recompute), position_ids=self.recompute, use_cache=True)
        kwargs[self.kwarg] = self.past_key_values
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask
        try:
            output = model(**kwargs)
        finally:  # the forward appended the recomputed columns: drop them again
            for layer, (keys, values) in zip(self.past_key_values.layers, self.saved):
                layer.keys, layer.values = keys, values
        return output.logits if hasattr(output, "logits") else output[0]
