"""The decoder's static KV cache: its length ladder, sliding windows, construction, and the forward against it.

Shared by ``static_decoder`` (one decoder per cache length) and ``cuda_graph`` (which picks the length).
"""

from __future__ import annotations

import torch


def sliding_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window as its static cache layer will have it (None: full attention).

    Read from transformers' own dispatch: Mistral sets no ``layer_types``, yet every layer of a
    Mistral with ``sliding_window`` gets a sliding cache layer.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    _, per_layer = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [kwargs.get("sliding_window") for kwargs in per_layer]


def static_cache(config, cache_len: int):
    """A ``StaticCache`` of ``cache_len`` positions whose sliding layers that never fill are plain layers.

    A ``StaticSlidingWindowLayer`` keeps a Python int of its length, which a compiled step reads (its
    roll-over branch): dynamo compiles the layer anew at every length (seen with Mistral's default
    4096-token window). While ``cache_len`` fits the window the layer never rolls over and the model's
    sliding mask cuts nothing, so a plain ``StaticLayer`` holds the same keys and values.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cache = StaticCache(config=config, max_cache_len=cache_len)
    for i, (layer, window) in enumerate(zip(cache.layers, sliding_windows(config))):
        if isinstance(layer, StaticSlidingWindowLayer) and window is not None and cache_len <= window:
            cache.layers[i] = StaticLayer(max_cache_len=cache_len)
    return cache


def kv_heads(config) -> int:
    text = config.get_text_config(decoder=True)
    return getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", 1) or 1


def last_logits(model, input_ids, attention_mask, position_ids, cache, cache_kw: str, logits_to_keep: bool,
                float32: bool = True, attention_kwargs: dict | None = None):
    """One forward against the static cache; the last position's logits [B, V], as float32 unless told not to.
    ``attention_kwargs`` go to the model's forward, which hands them to its attention function."""
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        cache_kw: cache,
        "use_cache": True,
        **(attention_kwargs or {}),
    }
    if logits_to_keep:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1, :].float() if float32 else logits[:, -1, :]
