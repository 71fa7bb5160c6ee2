"""The decoder's static KV cache: its length ladder, sliding windows, construction, and the forward against it.

Shared by ``static_decoder`` (one decoder per cache length) and ``cuda_graph`` (which picks the length).
"""

from __future__ import annotations

import torch


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT (or DDP-style ``.module``) wrappers."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and not hasattr(model, "config"):
        model = model.module
    return model


def cache_len_ladder(need: int, minimum: int = 256) -> int:
    """The smallest rung of ``minimum x {1, 1.5} x 2^k`` that holds ``need`` positions.

    Rungs 1.5x or 4/3x apart bound the compiles of a run to about 2 log2(longest / minimum) while
    wasting at most a third of the cache on attention over masked positions.
    """
    if need < 1 or minimum < 1:
        raise ValueError(f"cache lengths must be positive, got need={need}, minimum={minimum}")
    rung = minimum
    while True:
        for candidate in (rung, rung * 3 // 2):
            if need <= candidate:
                return candidate
        rung *= 2


# A reserved cache is rounded up to a multiple of this many positions (whole blocks for the decode attention).
RESERVED_ALIGN = 256


def cache_positions(need: int, reserved: int, minimum: int = 256) -> int:
    """The static cache's length for a call that needs ``need`` positions, in a run that reserved ``reserved`` (its
    longest prompt + ``max_completion_length``, ``CudaGraphBackend.reserve``; 0 when unknown).

    Unreserved, the cache climbs ``cache_len_ladder``'s rungs (a bounded number of compiles). A reserved length is
    the run's one cache, so it is sized to the rows: the ladder's rung or the reserved length rounded up to
    ``RESERVED_ALIGN``, whichever is shorter. At long completions a rung wastes up to a third of the cache (8 x
    (1k + 64k) positions of a 7B model: 45 GB on rung 98,304 against 30.5 GB for 66,560).
    """
    if need > reserved:
        return cache_len_ladder(need, minimum)
    return min(cache_len_ladder(reserved, minimum), max(minimum, -(-reserved // RESERVED_ALIGN) * RESERVED_ALIGN))


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


def weights_signature(model: torch.nn.Module) -> tuple:
    """What a captured graph depends on besides shapes: tensor addresses and forward-path flags.

    * ``data_ptr`` of every parameter and buffer: a graph reads fixed addresses, so a moved
      tensor (ZeRO-3 gather, replaced module/parameter, ``.to()``) needs a new capture.
    * PEFT tuner flags (``merged``, ``disable_adapters``, active adapters) and ``training``:
      they choose which Python branch the forward takes, which the graph has frozen.
    """
    ptrs = tuple(t.data_ptr() for t in model.parameters()) + tuple(b.data_ptr() for b in model.buffers())
    flags = []
    for module in model.modules():
        if hasattr(module, "merged") and hasattr(module, "disable_adapters"):
            adapters = repr(getattr(module, "active_adapters", None))
            flags.append((bool(module.merged), bool(module.disable_adapters), adapters))
    return ptrs, tuple(flags), model.training


def last_logits(model, input_ids, attention_mask, position_ids, cache, cache_kw: str, logits_to_keep: bool,
                float32: bool = True):
    """One forward against the static cache; the last position's logits [B, V], as float32 unless told not to."""
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        cache_kw: cache,
        "use_cache": True,
    }
    if logits_to_keep:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1, :].float() if float32 else logits[:, -1, :]
