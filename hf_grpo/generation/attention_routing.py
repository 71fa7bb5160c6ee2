"""Attention routing for the cuda_graph decoder: a packed grouped-query attention for the one-token decode step
while it is compiled and captured, and prefill pieces that attend to the cache positions up to their end.

Each routing registers an attention function with transformers and switches the model's
``_attn_implementation`` to it inside a ``with`` block, putting the model back as it was after.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..runtime import upstream
from ..runtime.model_wrappers import base_model
from . import filled_attention


# While the decode step is traced by torch.compile, transformers' sdpa path cannot use its
# eager "pack GQA" trick (it checks is_torchdynamo_compiling) and materialises every KV head
# num_key_value_groups times (repeat_kv): 7x the KV-cache traffic for Qwen2-0.5B, per layer
# and per token. This attention does the pack instead: the one query token of the
# num_key_value_groups query heads sharing a KV head become the "query length" of one SDPA
# call on the un-repeated cache. Head h maps to KV head h // groups, as in repeat_kv, and the
# [B, 1, 1, L] mask broadcasts over both, so the result equals sdpa's.
# "filled" packs the same way and hands the call to ``filled_attention``, whose kernel reads only the cache
# blocks the mask lets a row attend to (the matmul variant serves where that kernel cannot: CPU, no Triton).
GQA_DECODE_ATTENTION = {
    "sdpa": "hf_grpo_gqa_decode_sdpa",
    "matmul": "hf_grpo_gqa_decode_matmul",
    "filled": "hf_grpo_gqa_decode_filled",
}


def _gqa_decode_attention(variant: str):
    """The attention function transformers calls for ``variant``: "sdpa" (one torch SDPA call on the packed
    query, cuDNN/efficient kernels), "matmul" (two batched matmuls and a float32 softmax, which inductor
    fuses around) or "filled" (one kernel that skips the cache blocks the mask excludes)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        return _gqa_decode(module, query, key, value, attention_mask, dropout, scaling, is_causal, variant, **kwargs)

    return attention


# The keyword arguments a decode step's forward passes down to its attention (transformers hands a model's extra
# keyword arguments to every layer's attention function): each row's prompt source and where the prompts end
# (``filled_attention``). Only the "filled" kernel reads them; the rows' own copies serve every other path.
PROMPT_SOURCE = "hf_grpo_prompt_source"
PROMPT_END = "hf_grpo_prompt_end"


def _gqa_decode(module, query, key, value, attention_mask, dropout, scaling, is_causal, variant, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    source, prompt_end = kwargs.pop(PROMPT_SOURCE, None), kwargs.pop(PROMPT_END, None)
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, head_dim = query.shape
    filled = (
        variant == "filled"
        and q_len == 1
        and attention_mask is not None
        and attention_mask.shape[-1] == key.shape[2]
        and filled_attention.usable(query, key, attention_mask)
    )
    special = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if q_len != 1 or special or (groups == 1 and not filled):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups, head_dim)  # [B, KV heads, groups, D]
    scale = head_dim**-0.5 if scaling is None else scaling
    if filled:
        valid = attention_mask[:, 0, -1, :].expand(batch, key.shape[2])  # [B, L]: this token's row of the mask
        out = torch.ops.hf_grpo.filled_decode_attention(packed, key, value, valid, float(scale), source, prompt_end)
    elif variant != "sdpa":
        out = filled_attention.matmul_decode_attention(packed, key, value, attention_mask, scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=attention_mask, scale=scaling
        )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _register_gqa_decode_attention() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    functions = {name: _gqa_decode_attention(variant) for variant, name in GQA_DECODE_ATTENTION.items()}
    functions[PREFILL_ATTENTION] = _prefill_attention
    for name, function in functions.items():
        if name not in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.register(name, function)
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


# A prefill piece over prompt positions [start, end) attends to cache positions [0, end) only: the static cache
# hands every layer all ``cache_len`` positions, and those past ``end`` are masked for every query of the piece
# (causally). Slicing them off leaves the result as it was and spares the attention, and the copy sdpa's GQA
# path makes of the keys and values for each query head (600 MB a layer at 1.5B x 128 rows x 768 positions).
PREFILL_ATTENTION = "hf_grpo_prefill_sdpa"
_prefill_keys: list[int] = []  # the key positions of the prefill piece being run (set by prefill_keys)


def _prefill_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    keys = _prefill_keys[-1] if _prefill_keys else key.shape[2]
    if attention_mask is not None and keys < key.shape[2]:
        key, value = key[:, :, :keys], value[:, :, :keys]
        attention_mask = attention_mask[..., :keys]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def is_sdpa(model: torch.nn.Module) -> bool:
    """Whether the model attends with transformers' sdpa: the only implementation this module reroutes."""
    return upstream.attention_internal(base_model(model).config) == "sdpa"


@contextmanager
def _attention_routed(model: torch.nn.Module, name: str):
    """The model's attention is this module's registered function ``name`` while inside; the config is restored
    on exit, so ``model.generate`` and training see it unchanged."""
    config = base_model(model).config
    original = upstream.attention_internal(config)
    _register_gqa_decode_attention()
    upstream.set_attention_internal(config, name)
    try:
        yield
    finally:
        upstream.set_attention_internal(config, original)


@contextmanager
def prefill_keys(model: torch.nn.Module, keys: int):
    """Run an sdpa model's prefill forward attending to the first ``keys`` cache positions only.

    For a cache of plain static layers, whose position i holds token i. An eager model keeps attending over the
    whole cache."""
    if not is_sdpa(model):
        yield
        return
    _prefill_keys.append(keys)
    try:
        with _attention_routed(model, PREFILL_ATTENTION):
            yield
    finally:
        _prefill_keys.pop()


@contextmanager
def decode_attention(model: torch.nn.Module, variant: str | None):
    """Route an sdpa model's attention through the packed-GQA decode attention while tracing/capturing.

    The model's config is restored on exit, so `model.generate` and training see it unchanged;
    the captured graph keeps the kernels it recorded.
    """
    if variant is None or not is_sdpa(model):
        yield
        return
    with _attention_routed(model, GQA_DECODE_ATTENTION[variant]):
        yield
