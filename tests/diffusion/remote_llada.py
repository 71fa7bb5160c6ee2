"""A tiny LLaDA-shaped model written as remote code (``auto_map``), for the trust_remote_code tests.

Like LLaDA's own modelling file: unshifted logits, RoPE on absolute positions (no ``position_ids``
argument), the head called as a module (``transformer.ff_out``), an ``attention_bias`` argument, and
LLaDA's quirk that a 2-D ``attention_mask`` holding a zero switches on a causal bias.

``TinyLLaDAConfig(ignores_attention_mask=True)`` behaves like the released ``modeling_llada.py``: the bias is
built and then dropped (its attention is called with ``attn_mask=None``), so padding is attended.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class TinyLLaDAConfig(PretrainedConfig):
    model_type = "tiny_llada"

    def __init__(self, vocab_size=128, d_model=32, n_heads=4, n_layers=2, mask_token_id=2,
                 ignores_attention_mask=False, **kwargs):
        self.vocab_size, self.d_model, self.n_heads, self.n_layers = vocab_size, d_model, n_heads, n_layers
        self.mask_token_id = mask_token_id
        self.ignores_attention_mask = ignores_attention_mask
        super().__init__(**kwargs)


def rotate(x, positions):
    half = x.size(-1) // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.heads = config.n_heads
        self.attn_norm, self.ff_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.attn_out = nn.Linear(d, d)
        self.ff_proj, self.ff_down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, bias):
        batch, length, d = x.shape
        h = self.attn_norm(x)
        split = lambda t: t.view(batch, length, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        positions = torch.arange(length, device=x.device)  # absolute positions, as LLaDA's RoPE
        q, k, v = split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h))
        q, k = rotate(q, positions), rotate(k, positions)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, length, d))
        return x + self.ff_down(F.gelu(self.ff_proj(self.ff_norm(x))))


class TinyLLaDAModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ignores_attention_mask = config.ignores_attention_mask
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.d_model),
            blocks=nn.ModuleList(Block(config) for _ in range(config.n_layers)),
            ln_f=nn.LayerNorm(config.d_model),
            ff_out=nn.Linear(config.d_model, config.vocab_size, bias=False),
        ))

    def forward(self, input_ids, attention_mask=None, attention_bias=None):
        x = self.transformer.wte(input_ids)
        length = input_ids.size(1)
        bias = None
        if attention_mask is not None and (attention_mask == 0).any():
            # LLaDA's quirk: a padding mask comes with a causal bias
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            bias = causal[None, None] & attention_mask.bool()[:, None, None, :]
        if attention_bias is not None:
            bias = attention_bias if bias is None else bias & attention_bias
        if bias is not None:
            bias = torch.zeros(bias.shape, dtype=x.dtype, device=x.device).masked_fill(~bias, torch.finfo(x.dtype).min)
        if self.ignores_attention_mask:
            bias = None  # the released code: attention runs with attn_mask=None whatever was passed
        for block in self.transformer.blocks:
            x = block(x, bias)
        return self.transformer.ff_out(self.transformer.ln_f(x))


class TinyLLaDAModelLM(PreTrainedModel):
    config_class = TinyLLaDAConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = TinyLLaDAModel(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, attention_bias=None, use_cache=None, labels=None,
                **kwargs):
        assert not use_cache, "no KV cache for a masked-diffusion model"
        return CausalLMOutputWithPast(logits=self.model(input_ids, attention_mask, attention_bias))

    def prepare_inputs_for_generation(self, input_ids, **kwargs):  # LLaDA defines it; PEFT's wrapper needs it
        return {"input_ids": input_ids, **kwargs}

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def get_output_embeddings(self):
        return self.model.transformer.ff_out
