"""The tiny bidirectional models really are bidirectional; the row layout, mask id, logit shift and head bypass."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_grpo.diffusion.model import (
    HeadBypass,
    pack_rows,
    padding_kwargs,
    resolve_logits_shift,
    resolve_mask_token_id,
    slot_columns,
)
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

TOKENIZER = build_diffusion_tokenizer()


def tiny(cls, config_cls, attn, is_causal):
    config = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=40, is_causal=is_causal)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("cls, config_cls", [(Qwen2ForCausalLM, Qwen2Config), (LlamaForCausalLM, LlamaConfig)],
                         ids=["qwen2", "llama"])
def test_is_causal_false_gives_bidirectional_attention(cls, config_cls, attn):
    """transformers 5.x: a decoder config with is_causal=False attends both ways (with and without a mask)."""
    x = torch.randint(3, 40, (2, 7))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 40  # change the LAST token only
    for is_causal, earlier_changes in ((False, True), (True, False)):
        model = tiny(cls, config_cls, attn, is_causal)
        with torch.no_grad():
            for mask in (None, torch.ones_like(x)):
                a = model(x, attention_mask=mask).logits[:, 0]
                b = model(y, attention_mask=mask).logits[:, 0]
                assert (not torch.allclose(a, b)) == earlier_changes, (is_causal, mask is None)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_trailing_padding_masked_by_attention_mask_changes_nothing(attn):
    model = build_tiny_diffusion_model(TOKENIZER, attn_implementation=attn).eval()
    x = torch.randint(3, 40, (1, 6))
    padded = torch.cat([x, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = model(x).logits
        kwargs = padding_kwargs("mask2d", torch.tensor([[True] * 6 + [False] * 3]))
        with_pad = model(padded, **kwargs).logits[:, :6]
    torch.testing.assert_close(alone, with_pad, rtol=1e-5, atol=1e-5)


def test_tiny_checkpoint_reloads_bidirectional(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_grpo.recipe_support.diffusion_tiny import save_tiny_diffusion_checkpoint

    save_tiny_diffusion_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.is_causal is False and model.config.mask_token_id == TOKENIZER.mask_token_id


def test_pack_rows_puts_each_prompt_at_position_zero():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    packed = pack_rows(prompt_ids, prompt_mask, 3, fill_id=2, pad_token_id=0)
    assert packed.input_ids.tolist() == [[5, 6, 2, 2, 2, 0, 0], [7, 8, 9, 10, 2, 2, 2]]
    assert packed.valid.tolist() == [[True] * 5 + [False] * 2, [True] * 7]
    assert packed.start.tolist() == [2, 4]
    assert slot_columns(packed.start, 1, 2, shift=False).tolist() == [[3, 4], [5, 6]]
    assert slot_columns(packed.start, 0, 2, shift=True).tolist() == [[1, 2], [3, 4]]
    unpadded = pack_rows(prompt_ids[1:], prompt_mask[1:], 3, fill_id=2, pad_token_id=0)
    assert unpadded.valid is None  # no padding: no mask is passed at all


def test_padding_styles():
    valid = torch.tensor([[True, True, False]])
    assert padding_kwargs("mask2d", valid)["attention_mask"].tolist() == [[1, 1, 0]]
    bias = padding_kwargs("bias4d", valid)["attention_bias"]  # LLaDA: a key mask for every query row
    assert bias.shape == (1, 1, 3, 3) and bias[0, 0].tolist() == [[True, True, False]] * 3
    assert padding_kwargs("mask4d", valid)["attention_mask"].shape == (1, 1, 3, 3)
    assert padding_kwargs("mask2d", None) == {}


def test_mask_token_resolution_order_and_error():
    model = build_tiny_diffusion_model(TOKENIZER)
    assert resolve_mask_token_id(7, model, TOKENIZER) == 7  # the config's field wins
    assert resolve_mask_token_id(None, model, TOKENIZER) == TOKENIZER.mask_token_id
    model.config.mask_token_id = None
    assert resolve_mask_token_id(None, model, TOKENIZER) == TOKENIZER.mask_token_id  # from the tokenizer
    from hf_grpo.recipe_support.tiny import build_char_tokenizer

    with pytest.raises(ValueError, match=r"mask_token_id is None.*DiffuGRPOConfig\(mask_token_id=\.\.\.\)"):
        resolve_mask_token_id(None, model, build_char_tokenizer())
    model.config.model_type = "llada"
    assert resolve_mask_token_id(None, model, build_char_tokenizer()) == 126336


def test_logits_shift_from_model_type():
    model = build_tiny_diffusion_model(TOKENIZER)
    assert resolve_logits_shift(True, model) is True and resolve_logits_shift(False, model) is False
    assert resolve_logits_shift("auto", model) is False  # neither family: LLaDA's convention
    model.config.model_type = "Dream"
    assert resolve_logits_shift("auto", model) is True
    model.config.model_type = "llada"
    assert resolve_logits_shift("auto", model) is False


def test_head_bypass_returns_hidden_states_and_projects_them_back():
    model = build_tiny_diffusion_model(TOKENIZER).eval()
    x = torch.randint(3, 40, (2, 5))
    with torch.no_grad():
        logits = model(x).logits
        bypass = HeadBypass(model)
        with bypass:
            hidden = model(x).logits
            assert bypass.bypassed and hidden.shape[-1] == model.config.hidden_size
            torch.testing.assert_close(bypass.to_logits(hidden[:, 2:4]), logits[:, 2:4])
        assert model(x).logits.shape[-1] == model.config.vocab_size  # restored
