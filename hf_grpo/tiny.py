"""Tiny models and character-level tokenizers built in code.

Tests, the quickstart and every recipe's ``--tiny`` flag use these so that nothing is
downloaded from a model hub: a 2-layer Qwen2-shaped model and a tokenizer whose
vocabulary is a fixed alphabet, one token per character.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS = "<pad>", "<eos>"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " +-*/=()<>.,?:"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet``; ids 0 and 1 are ``<pad>`` and ``<eos>``."""
    chars = list(dict.fromkeys(alphabet))  # de-duplicate, keep order
    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # Split every character into its own "word" so WordLevel maps it to one id.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS)
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-shaped causal LM sized for CPU tests (~100k parameters)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
