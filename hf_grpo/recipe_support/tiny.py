"""Tiny models and character-level tokenizers built in code.

Tests, the quickstart and every recipe's ``--tiny`` flag use these so that nothing is
downloaded from a model hub: a 2-layer Qwen2-shaped model and a tokenizer whose
vocabulary is a fixed alphabet, one token per character.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ..runtime import upstream

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


# Random-init shapes. "tiny" is for CPU tests; the others copy Qwen2.5-0.5B / 1.5B for GPU benchmarks
# (with their 151936-token vocabulary: ids past the char tokenizer's decode to nothing).
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False),
    # Qwen2.5-0.5B's and -1.5B's dimensions, with their 32k positions (reasoning-length completions fit)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    # Qwen2.5-7B's dimensions (its 152064-row embedding cut to the benchmarks' 151936-token vocabulary, so every
    # sampled id decodes); positions enough for 32k-token completions after a prompt
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960),
}


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    shape: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **config_overrides,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-shaped causal LM; ``"tiny"`` (~80k parameters) suits CPU tests.

    ``config_overrides`` go to ``Qwen2Config`` and win over the shape's values (the diffusion models
    pass ``is_causal=False`` and a mask id; tests pass ``num_hidden_layers``).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    dims = dict(SHAPES[shape])
    dims["vocab_size"] = dims["vocab_size"] or len(tokenizer)
    config = Qwen2Config(
        **{
            "max_position_embeddings": 4096,  # unless the shape gives its own
            **dims,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.eos_token_id,
            **config_overrides,
        }
    )
    if attn_implementation is not None:
        upstream.set_attention_implementation(config, attn_implementation)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# Mixture-of-experts stand-ins: the "tiny" shape with 4 experts of which 2 are routed per token. Each family keeps
# its own router_aux_loss_coef default (0.001; OLMoE's 0.01), so TRL turns the router's load-balancing loss on,
# as for a hub model.
TINY_MOE = {
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32),
}


def build_tiny_moe_model(tokenizer: PreTrainedTokenizerFast, model_type: str, *, seed: int = 0, **config_overrides):
    """A randomly initialised mixture-of-experts causal LM of ``model_type`` (a key of ``TINY_MOE``), "tiny"-sized."""
    if model_type not in TINY_MOE:
        raise ValueError(f"model_type must be one of {sorted(TINY_MOE)}, got {model_type!r}")
    dims = {**SHAPES["tiny"], "vocab_size": len(tokenizer), **TINY_MOE[model_type]}
    config = AutoConfig.for_model(
        model_type, **dims, max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_byte_level_tokenizer(alphabet: str = string.printable) -> PreTrainedTokenizerFast:
    """One token per byte of ``alphabet``, laid out as a byte-level BPE (GPT-2 / Qwen2 style) with no merges.

    Saved next to a Qwen2 model, it reloads through ``AutoTokenizer`` as the ``Qwen2Tokenizer`` a
    real Qwen checkpoint gets (which re-reads the vocabulary with a byte-level pre-tokenizer), and
    tokenizes the same way: a stand-in for a hub tokenizer. ids 0 and 1 are ``<pad>`` and ``<eos>``.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {PAD: 0, EOS: 1}
    for char in alphabet:
        for piece, _ in byte_level.pre_tokenize_str(char):
            vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, byte_fallback=False))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # unk named too: Qwen2Tokenizer would otherwise add its default "<|endoftext|>" past the vocabulary
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=PAD)
    tokenizer.padding_side = "left"
    return tokenizer


# Each user turn's text, then "> " as the assistant prefix: printable characters only.
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}> {% endif %}"
)


def save_tiny_checkpoint(
    directory,
    *,
    shape: str = "tiny",
    seed: int = 0,
    chat_template: bool = True,
    dtype: torch.dtype = torch.float32,
    moe: str | None = None,
    **config_overrides,
) -> str:
    """Write a tiny Qwen2 model (or, with ``moe``, a mixture-of-experts one of that family: ``TINY_MOE``) and its
    tokenizer with ``save_pretrained``, laid out as a hub download.

    The directory takes the same ``from_pretrained`` path as a real checkpoint (TRL also builds
    the reference model from it). Returns the directory as a string.
    """
    tokenizer = build_byte_level_tokenizer()
    if chat_template:
        tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    if moe is not None and shape != "tiny":
        raise ValueError(f"the mixture-of-experts stand-ins come in the 'tiny' shape only, got shape={shape!r}")
    if moe is None:
        model = build_tiny_model(tokenizer, shape=shape, seed=seed, dtype=dtype, **config_overrides)
    else:
        model = build_tiny_moe_model(tokenizer, moe, seed=seed, **config_overrides).to(dtype)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
