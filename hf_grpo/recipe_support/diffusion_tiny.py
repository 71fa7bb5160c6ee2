"""Tiny bidirectional (masked-diffusion) models and a character tokenizer with a mask token, built in code.

transformers 5.x has no LLaDA or Dream class, but its Llama/Qwen2 decoders switch to bidirectional
attention when the config says ``is_causal=False`` (``masking_utils.create_causal_mask`` then builds a
bidirectional mask, for sdpa and eager alike; ``tests/diffusion/test_diffu_model.py`` checks that a later token
changes an earlier position's output). So a tiny Qwen2 config with ``is_causal=False`` is a tiny
LLaDA-style model: unshifted logits (position i predicts token i), the mask id in ``config.mask_token_id``.
It saves and reloads through ``AutoModelForCausalLM`` with ``is_causal`` kept.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from .tiny import EOS, PAD, build_tiny_model

MASK = "<mask>"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " +-*/=()<>.,?:"


def build_diffusion_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet``; ids 0, 1, 2 are ``<pad>``, ``<eos>`` and ``<mask>``."""
    chars = list(dict.fromkeys(alphabet))
    vocab = {PAD: 0, EOS: 1, MASK: 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, mask_token=MASK)
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_diffusion_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    shape: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> Qwen2ForCausalLM:
    """A random Qwen2-shaped model with bidirectional attention (``is_causal=False``) and the tokenizer's mask id."""
    return build_tiny_model(tokenizer, shape=shape, seed=seed, dtype=dtype, attn_implementation=attn_implementation,
                            is_causal=False, mask_token_id=tokenizer.mask_token_id, use_cache=False)


def save_tiny_diffusion_checkpoint(directory, *, seed: int = 0, alphabet: str = DEFAULT_ALPHABET) -> str:
    """Write a tiny bidirectional model and its tokenizer with ``save_pretrained`` (TRL reloads it for a reference)."""
    tokenizer = build_diffusion_tokenizer(alphabet)
    model = build_tiny_diffusion_model(tokenizer, seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
