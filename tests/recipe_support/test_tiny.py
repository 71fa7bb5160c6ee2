"""The tiny checkpoint stands in for a hub download: it must reload as one would."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model, save_tiny_checkpoint


def test_saved_checkpoint_reloads_with_a_matching_tokenizer_and_chat_template(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert len(tokenizer) == model.config.vocab_size  # no special token past the embeddings
    text = "Use 3 5 12 to make 24!\n(a+b)*c = ?"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text) and max(ids) < model.config.vocab_size  # one token per character
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+2"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "2+2> "
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


def test_benchmark_shapes_keep_their_own_positions():
    """The benchmark shapes have the positions of the models they stand in for (reasoning-length completions
    fit); the CPU test shape keeps 4096. Built on the meta device: no weights are made."""
    tokenizer = build_char_tokenizer()
    with torch.device("meta"):
        positions = {shape: build_tiny_model(tokenizer, shape=shape).config.max_position_embeddings
                     for shape in ("tiny", "0.5b", "1.5b", "7b")}
    assert positions == {"tiny": 4096, "0.5b": 32768, "1.5b": 32768, "7b": 40960}
