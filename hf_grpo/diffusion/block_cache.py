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
import logging
import weakref

import torch
from transformers.cache_utils import DynamicLayer

from ..runtime.graph_capture import capture_graph
from .model import base_module

logger = logging.getLogger("hf_grpo")

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


def recomputed_columns(block_cache: str, start: torch.Tensor, offset: int, block_length: int,
                       gen_length: int) -> torch.Tensor:
    """``[B, n]`` columns the cached steps recompute: the block (dual), or the block and the later blocks (prefix)."""
    count = block_length if block_cache == "dual" else gen_length - offset
    return start[:, None] + offset + torch.arange(count, device=start.device)[None, :]


class BlockKVCache:
    """The key/value cache of one ``diffusion_generate`` call's blocks: one buffer per layer, written in place.

    At a block's first step ``begin_block(recompute, valid, total)`` returns the cache object to give the full
    forward (``recompute``: [B, n] columns the block's later steps run): each layer's update writes the
    keys/values of the other columns, the kept ones, into the front of its buffer and attends over the
    forward's own; ``end_block_start()`` then switches the layers to the cached steps, and ``forward`` runs
    the model on the ``recompute`` columns of a canvas, writing their keys/values into the last n slots of
    each buffer and attending over all of it; it returns the hidden states / logits ``[B, n, ...]``
    (whatever ``output.logits`` holds).

    So the keys/values exist once: a full forward does not build a second copy to take the kept columns
    from, and a step does not concatenate (a ``DynamicLayer`` would). The buffers and the step's inputs
    keep their addresses for the whole call, so with ``cuda_graph`` a step of the same width as the last
    one (every step, with ``"dual"``) is captured once and replayed: a cached step runs a few hundred
    tokens, and eagerly its time was the host launching the kernels (PEFT's LoRA layers especially).
    """

    def __init__(self, model: torch.nn.Module, kwarg: str = "cache", cuda_graph: bool = False) -> None:
        from transformers import DynamicCache

        config = base_module(model).config
        self.kwarg, self.cuda_graph = kwarg, cuda_graph
        self.past_key_values = DynamicCache(config=config)
        if any(getattr(layer, "is_sliding", False) for layer in self.past_key_values.layers):
            raise ValueError("block_cache needs full-attention layers; this model has sliding-window ones")
        self.past_key_values.layers = [_BlockLayer(self) for _ in self.past_key_values.layers]
        self.full = True  # the layers serve a block's full forward (else its cached steps)
        self.rows = slice(None)  # the rows the full forward now running covers (it may run a piece at a time)
        self.kept: torch.Tensor | None = None  # [B, kept] the kept columns, ascending
        self.recompute: torch.Tensor | None = None  # [B, n] column indices (also the position ids)
        self.ids: torch.Tensor | None = None  # [B, n] the recomputed columns' tokens
        self.mask: torch.Tensor | None = None  # [B, kept + n] key padding mask, kept columns first
        self.graph = None
        self.out: torch.Tensor | None = None  # the captured forward's output
        self.bypassed = False  # whether the captured forward skipped the head (HeadBypass)

    def begin_block(self, recompute: torch.Tensor, valid: torch.Tensor | None, total: int):
        """Set the block's columns (of ``total`` a row); the cache object for its full forward."""
        rows, n = recompute.shape
        keep = torch.ones((rows, total), dtype=torch.bool, device=recompute.device).scatter_(1, recompute, False)
        # the kept columns of each row in ascending order, without a host sync: a stable sort puts them first
        kept = keep.to(torch.int8).sort(dim=1, descending=True, stable=True).indices[:, : total - n]
        mask = None if valid is None else torch.cat([valid.gather(1, kept), valid.gather(1, recompute)], 1).long()
        if self.recompute is not None and self.recompute.shape == recompute.shape and \
                (self.mask is None) == (mask is None):
            # in place: a captured step reads these addresses
            self.kept.copy_(kept)
            self.recompute.copy_(recompute)
            if mask is not None:
                self.mask.copy_(mask)
        else:
            self.kept, self.recompute, self.mask = kept, recompute.clone(), mask
            self.ids = torch.empty_like(recompute)
            self.graph, self.out = None, None
        self.full, self.rows = True, slice(None)
        return self.past_key_values

    def end_block_start(self) -> None:
        self.full, self.rows = False, slice(None)

    def forward(self, model: torch.nn.Module, canvas: torch.Tensor, bypass=None, **kwargs) -> torch.Tensor:
        torch.gather(canvas, 1, self.recompute, out=self.ids)
        if not self.cuda_graph:
            return self._run(model, kwargs)
        if self.graph is None:
            try:
                self._capture(model, bypass, kwargs)
            except Exception as err:  # noqa: BLE001 - whatever broke the capture, the eager step still serves
                logger.warning("block_cache: capturing the cached step failed (%s: %s); running it eagerly",
                               type(err).__name__, err)
                self.cuda_graph = False
                return self._run(model, kwargs)
        self.graph.replay()
        if bypass is not None:
            bypass.bypassed = self.bypassed  # the replay ran no Python: tell the head what the capture did
        return self.out

    def _run(self, model: torch.nn.Module, kwargs: dict) -> torch.Tensor:
        kwargs = {**kwargs, "input_ids": self.ids, "position_ids": self.recompute, "use_cache": True,
                  self.kwarg: self.past_key_values}
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask
        output = model(**kwargs)
        return output.logits if hasattr(output, "logits") else output[0]

    def _capture(self, model: torch.nn.Module, bypass, kwargs: dict) -> None:
        """Warm up, then capture one step. Both only rewrite the recomputed slots, which every step writes
        before it reads them, so the captured step's result is the eager one's."""
        def step():
            if bypass is not None:
                bypass.reset()  # so that the flag read below is the captured call's
            return self._run(model, kwargs)

        self.graph, self.out = capture_graph(step, model, self.ids.device)
        self.bypassed = bypass.bypassed if bypass is not None else False


class _BlockLayer(DynamicLayer):
    """One layer's buffer [B, heads, kept + n, dim] for keys and one for values (see ``BlockKVCache``)."""

    def __init__(self, owner: BlockKVCache) -> None:
        super().__init__()
        # weakly: a strong reference back would make a cycle, and the cache's buffers (GiBs at 8B) would
        # outlive the sampler call until Python's cyclic collector happened to run
        self._owner = weakref.ref(owner)
        self.is_initialized = True

    @property
    def owner(self) -> BlockKVCache:
        return self._owner()

    def update(self, key_states, value_states, *args, **kwargs):
        owner = self.owner
        if owner.full:
            shape = (owner.kept.size(0), *key_states.shape[1:])  # all rows, though a forward may cover some
            if self.keys is None or self.keys.shape != shape or self.keys.dtype != key_states.dtype:
                self.keys = key_states.new_empty(shape)
                self.values = value_states.new_empty((shape[0], *value_states.shape[1:]))
                self.device = key_states.device
            kept, rows = owner.kept.size(1), owner.rows
            for buffer, states in ((self.keys, key_states), (self.values, value_states)):
                index = owner.kept[rows, None, :, None].expand(-1, states.size(1), -1, states.size(3))
                buffer[rows, :, :kept].copy_(states.gather(2, index))
            return key_states, value_states  # the full forward attends over its own, in column order
        kept = owner.kept.size(1)
        if key_states.size(-2) != self.keys.size(-2) - kept:
            raise ValueError(f"this block cache recomputes {self.keys.size(-2) - kept} columns, "
                             f"got {key_states.size(-2)}")
        self.keys[:, :, kept:].copy_(key_states)
        self.values[:, :, kept:].copy_(value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # positions cached before this forward's: none for a block's full forward; the kept ones for a step
        return 0 if self.owner.full or self.owner.kept is None else self.owner.kept.size(1)
