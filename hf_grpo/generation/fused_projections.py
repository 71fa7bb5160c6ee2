"""The decode step's projections fused: q, k and v in one GEMM, gate and up in another.

At a few dozen rows a decode step's GEMMs are latency-bound, not bandwidth-bound: on an H100,
Qwen2-0.5B at 32 rows spends 12.5 us a layer in the three q/k/v GEMMs, 72 launches a step for 2 MB
of weights a layer (``bench/results/decode_profile_h100_rollout_shapes.jsonl``). One GEMM on the
concatenated weight reads the same bytes in one kernel.

The fused weights are copies: the parameters stay what the optimizer, DeepSpeed and PEFT see.
``FusedProjections`` makes the copies for a model, ``refresh()`` copies the parameters into them in
place (the captured graph reads their addresses, as it reads the parameters': the decoder refreshes
them before every chunk, so optimizer steps are followed), and ``route()`` swaps in the fused
forwards of the attention and MLP classes while the decode step is compiled and captured. Outside
``route()`` the model is its own: training and ``model.generate`` never see the fused forwards.

Where a group's parameters already lie side by side in one buffer (a LoRA policy's frozen base weights,
``packed_weights``), the fused weight is a view of them: no copy and no refresh. Such groups are fused whether or
not their part is asked for, since they cost nothing.

Only classes whose forward is the Llama template (Llama, Qwen2, Qwen3, Mistral in transformers 5.x)
are fused, and a class only when every instance's projections are plain ``nn.Linear``: LoRA-wrapped
or quantized projections, and other families, keep their own forward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..runtime import upstream
from .packed_weights import adjacent

PARTS = ("qkv", "gate_up")
_WEIGHT = {"qkv": "hf_grpo_qkv_weight", "gate_up": "hf_grpo_gate_up_weight"}
_BIAS = {"qkv": "hf_grpo_qkv_bias", "gate_up": "hf_grpo_gate_up_bias"}
_SOURCES = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def _no_sliding_window(attn) -> dict:
    return {}


def _own_sliding_window(attn) -> dict:  # Qwen2, Qwen3
    return {"sliding_window": attn.sliding_window}


def _config_sliding_window(attn) -> dict:  # Mistral
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def _attention_classes() -> dict[type, Callable]:
    """Attention classes with the Llama-template forward, and the sliding-window argument each passes."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    return {
        LlamaAttention: _no_sliding_window,
        Qwen2Attention: _own_sliding_window,
        Qwen3Attention: _own_sliding_window,  # also normalises q and k per head (q_norm, k_norm)
        MistralAttention: _config_sliding_window,
    }


def _mlp_classes() -> tuple[type, ...]:
    """MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mistral.modeling_mistral import MistralMLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    return (LlamaMLP, Qwen2MLP, Qwen3MLP, MistralMLP)


_FORWARDS: dict[type, Callable] = {}  # one function per class, so compiled code guards on the same object


def _fused_attention_forward(cls: type, sliding: Callable) -> Callable:
    """``cls.forward`` with one GEMM for q, k and v; everything after the projections as in transformers."""
    if cls in _FORWARDS:
        return _FORWARDS[cls]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modelling = sys.modules[cls.__module__]
    rope, eager_attention = modelling.apply_rotary_pos_emb, modelling.eager_attention_forward

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        qkv = F.linear(hidden_states, self.hf_grpo_qkv_weight, self.hf_grpo_qkv_bias)
        sizes = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
        query, key, value = (t.view(hidden_shape) for t in qkv.split(sizes, dim=-1))
        if getattr(self, "q_norm", None) is not None:  # Qwen3
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = position_embeddings
        query, key = rope(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(upstream.attention_implementation(self.config),
                                                           eager_attention)
        out, weights = attention(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **sliding(self), **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    _FORWARDS[cls] = forward
    return forward


def _fused_mlp_forward(self, x):
    gate, up = F.linear(x, self.hf_grpo_gate_up_weight, self.hf_grpo_gate_up_bias).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


@dataclass
class _Fused:
    module: torch.nn.Module
    part: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: bool = False  # views of the parameters themselves (nothing to copy or refresh)

    def sources(self) -> list[torch.nn.Linear]:
        return [getattr(self.module, name) for name in _SOURCES[self.part]]


def _packed_view(sources: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The fused weight and bias as views, where the sources' parameters lie side by side; else None."""
    weight = adjacent([s.weight for s in sources])
    biases = [s.bias for s in sources]
    if weight is None or len({b is None for b in biases}) > 1:
        return None
    if biases[0] is None:
        return weight, None
    bias = adjacent(biases)
    return None if bias is None else (weight, bias)


def _projection_modules(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, bool]]:
    """Each attention and MLP module of the fused classes in ``model``: (module, its part, whether its sources are
    all plain ``nn.Linear``)."""
    attention, mlps = _attention_classes(), _mlp_classes()
    for module in model.modules():
        part = "qkv" if type(module) in attention else "gate_up" if type(module) in mlps else None
        if part is not None:
            plain = all(type(getattr(module, name, None)) is torch.nn.Linear for name in _SOURCES[part])
            yield module, part, plain


def projection_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The parameter groups one fused GEMM reads, in order (q, k, v weights; their biases; gate, up weights), for
    every plain-``nn.Linear`` attention and MLP module of the fused classes: what ``packed_weights.pack`` lays out."""
    groups = []
    for module, part, plain in _projection_modules(model):
        if not plain:
            continue
        sources = [getattr(module, name) for name in _SOURCES[part]]
        groups.append([s.weight for s in sources])
        if all(s.bias is not None for s in sources):
            groups.append([s.bias for s in sources])
    return groups


def validate_parts(parts) -> tuple[str, ...]:
    """``parts`` as a tuple, or a ValueError naming the unknown ones and the valid names."""
    parts = tuple(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"fuse_projections: unknown part(s) {unknown}; valid parts are {list(PARTS)}")
    return parts


class FusedProjections:
    """Fused copies of a model's q/k/v and gate/up weights, and the forwards that read them.

    Args:
        model: the transformers model the decode step runs (not a PEFT or DDP wrapper).
        parts: which projections to fuse, a subset of ``PARTS``.
    """

    def __init__(self, model: torch.nn.Module, parts=PARTS) -> None:
        parts = validate_parts(parts)
        attention = _attention_classes()
        candidates: dict[type, list[tuple[torch.nn.Module, str]]] = {}
        refused: set[type] = set()
        for module, part, plain in _projection_modules(model):
            if plain:
                candidates.setdefault(type(module), []).append((module, part))
            else:
                refused.add(type(module))  # one wrapped instance keeps the whole class unfused (forward is per class)
        self.entries: list[_Fused] = []
        self.forwards: dict[type, Callable] = {}
        for cls, found in candidates.items():
            views = [_packed_view([getattr(module, name) for name in _SOURCES[part]]) for module, part in found]
            # the forward is per class: a part not asked for is fused only where every instance costs nothing
            if cls in refused or (found[0][1] not in parts and any(v is None for v in views)):
                continue
            self.forwards[cls] = (
                _fused_attention_forward(cls, attention[cls]) if cls in attention else _fused_mlp_forward
            )
            for (module, part), view in zip(found, views):
                if view is not None:
                    self.entries.append(_Fused(module, part, *view, packed=True))
                    continue
                sources = [getattr(module, name) for name in _SOURCES[part]]
                weight = torch.cat([s.weight.detach() for s in sources], dim=0)
                has_bias = [s.bias is not None for s in sources]
                if any(has_bias) and not all(has_bias):
                    raise ValueError(f"{cls.__name__}: {_SOURCES[part]} mix projections with and without bias")
                bias = torch.cat([s.bias.detach() for s in sources]) if all(has_bias) else None
                self.entries.append(_Fused(module, part, weight, bias))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def nbytes(self) -> int:
        """The copies' memory (views of packed parameters cost none)."""
        return sum(t.numel() * t.element_size() for e in self.entries if not e.packed
                   for t in (e.weight, e.bias) if t is not None)

    def parts(self) -> dict[str, str]:
        """Each fused part and how: "copy" or "packed" (views of the parameters), "mixed" where both occur."""
        ways: dict[str, set[str]] = {}
        for entry in self.entries:
            ways.setdefault(entry.part, set()).add("packed" if entry.packed else "copy")
        return {part: way.pop() if len(way) == 1 else "mixed" for part, way in ways.items()}

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the parameters into the fused weights, in place (a captured graph reads these addresses)."""
        for entry in self.entries:
            if entry.packed:
                continue  # the parameters themselves
            sources = entry.sources()
            torch.cat([s.weight for s in sources], dim=0, out=entry.weight)
            if entry.bias is not None:
                torch.cat([s.bias for s in sources], out=entry.bias)

    @contextmanager
    def route(self) -> Iterator[None]:
        """Within the block, the fused classes run their fused forward on the fused weights."""
        originals = {cls: vars(cls)["forward"] for cls in self.forwards}
        try:
            for entry in self.entries:
                setattr(entry.module, _WEIGHT[entry.part], entry.weight)
                setattr(entry.module, _BIAS[entry.part], entry.bias)
            for cls, forward in self.forwards.items():
                cls.forward = forward
            yield
        finally:
            for cls, forward in originals.items():
                cls.forward = forward
            for entry in self.entries:
                for name in (_WEIGHT[entry.part], _BIAS[entry.part]):
                    entry.module.__dict__.pop(name, None)
