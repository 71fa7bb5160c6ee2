"""Padding-free scoring: a micro-batch's rows packed into one sequence for the backbone's forward.

TRL scores ``[prompt | completion]`` rows padded to the longest row of the micro-batch (prompts padded on
the left, completions on the right). With prompts of varied length a third or more of those positions are
padding, and every layer's projections and MLP run over them. Here the real tokens of all rows are
concatenated into one sequence ``[1, T]``: each row keeps its own positions (0, 1, ... from its first real
token, as ``model.generate`` numbers them) and attends only to itself, causally. On CUDA that is one
variable-length flash-attention call per layer (``torch.nn.attention.varlen``); elsewhere, or where that op
is missing, one SDPA call per row. The training graphs replay the same attention over a packed sequence of a
bucketed length (``hf_grpo.training.graph_inputs``), which only the flash-attention call allows: it reads the row bounds
from the device.

GRPO's rows repeat each prompt once per completion. Rows whose prompt is the same share it (``pack_rows``'s
``shared_prefix``): the prompt's tokens are packed and run once, and a later row attends to them through its keys,
gathered (``key_index``). Its queries are then fewer than its keys, and causality counts from the last key back.

How the layers find it: transformers' registry entries for ``sdpa`` and flash attention are wrapped once
(``_route_packed``) so that a call carrying ``packed_rows`` runs the packed attention and every other call runs
the original, untouched. The rows travel as a forward keyword, which activation checkpointing replays with
the recomputed forward; the mask argument is a zero-size 4-D tensor, which transformers passes through without
building a mask and which no attention kernel would accept, so a layer that missed the routing fails loudly.

The result equals the padded forward to rounding for rotary-position models (attention scores depend on
relative positions only). Models this cannot serve exactly keep the padded path: ``unsupported_reason``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops.equal_rows import first_equal_row
from ..runtime import upstream

# Registry entries whose math is plain causal softmax attention: the packed function computes the same. (Eager
# attention is each model's own function, which may add soft-capping or sinks: those models stay padded.)
ROUTED = ("sdpa", "flash_attention_2", "flash_attention_3")

try:  # flash attention over variable-length rows (torch >= 2.9, CUDA)
    from torch.nn.attention.varlen import varlen_attn

    # Its keywords grew over releases: causal masking was `is_causal` before `window_size`, and grouped key/value
    # heads (`enable_gqa`) came later; without them the heads are repeated and causality is asked the old way.
    _VARLEN_KEYWORDS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch
    varlen_attn, _VARLEN_KEYWORDS = None, set()


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Where each real token of a padded ``[B, L]`` micro-batch sits in the packed ``[1, T]`` sequence."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], 0.. within each row
    index: torch.Tensor  # [B, L], packed position of each (row, column); meaningless where padded
    bounds: tuple[tuple[int, int], ...]  # (start, end) of each row's segment in the packed sequence
    cu_seq_lens: torch.Tensor  # [B + 1] int32, the bounds as flash attention takes them
    cu_seq_lens_host: torch.Tensor  # the same on the host, read by the attention op without a device sync
    longest: int  # tokens of the longest row
    # Rows that repeat an earlier row's prompt (``shared_prefix``): the prompt is packed once, with the first of
    # them, and a later row's segment holds only its own tokens. Its attention reads the keys of its whole row,
    # gathered: ``key_index`` lists the packed place of every row's every token, rows one after another, as
    # packing without sharing would lay them out; ``cu_key_lens`` bounds each row there. None: nothing shared.
    key_index: torch.Tensor | None = None  # [K]
    cu_key_lens: torch.Tensor | None = None  # [B + 1] int32
    cu_key_lens_host: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


# Rows that repeat a prompt run its tokens once (``pack_rows``'s ``shared_prefix``). A switch for benchmarks
# (bench/grpo_realistic.py --share_prompts off); the result is the same either way, to rounding.
SHARE_PROMPTS = True


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
              shared_prefix: int | torch.Tensor = 0) -> PackedRows | None:
    """The packed layout of a padded batch, or None where a row's tokens are not one contiguous run (a mask
    with holes) or a row is empty: those batches keep the padded forward.

    Rows whose first ``shared_prefix`` columns are equal (tokens and mask; GRPO's completions of one prompt) share
    those tokens: a causal model computes the same states for them in every such row, so they are packed and run
    once, and each later row attends to them through ``key_index``. Exact in the math; what changes is only that
    the prompt's gradient is summed over its rows inside the backward rather than in the weights' gradients.
    ``shared_prefix`` may be a 0-d device tensor (no host read)."""
    real = attention_mask.bool()  # [B, L]
    columns = torch.arange(real.shape[1], device=real.device)
    counts = real.sum(dim=1)
    first = torch.where(real, columns, real.shape[1]).amin(dim=1)
    last = torch.where(real, columns, -1).amax(dim=1)
    stats = [counts, last - first + 1]
    share = SHARE_PROMPTS and input_ids.shape[0] > 1 and not (isinstance(shared_prefix, int) and shared_prefix < 1)
    if share:
        prefix = real & (columns < shared_prefix)  # [B, L]
        # rows with the same prefix (padding never equals a token: -1), and the prefix's real tokens
        leader = first_equal_row(input_ids.masked_fill(~prefix, -1).masked_fill(~(columns < shared_prefix), -2))
        stats += [leader, prefix.sum(dim=1)]
    # one device-to-host copy: the row lengths are needed on the host for the per-row attention bounds
    counts_host, runs_host, *sharing = torch.stack(stats).tolist()
    if min(counts_host) == 0 or counts_host != runs_host:
        return None
    follows = {r for r, (lead, shared) in enumerate(zip(*sharing)) if lead != r and shared > 0} if share else set()
    position_ids = real.cumsum(dim=1) - 1  # [B, L]
    own = real  # the tokens each row puts into the packed sequence
    index = own.flatten().cumsum(0).view_as(own) - 1  # [B, L]
    own_counts = counts_host
    if follows:
        leader_host, shared_host = sharing
        is_follower = torch.zeros(real.shape[0], dtype=torch.bool)
        is_follower[sorted(follows)] = True
        borrowed = is_follower.to(real.device)[:, None] & prefix  # the prefix tokens a row reads from its leader
        own = real & ~borrowed
        own_index = own.flatten().cumsum(0).view_as(own) - 1
        index = torch.where(borrowed, own_index[torch.tensor(leader_host, device=real.device)], own_index)
        own_counts = [count - (shared if r in follows else 0)
                      for r, (count, shared) in enumerate(zip(counts_host, shared_host))]
    ends = torch.tensor(own_counts).cumsum(0).tolist()
    cu_seq_lens_host = torch.tensor([0] + ends, dtype=torch.int32)
    keys = (None, None, None)
    if follows:  # every row's keys, rows one after another as without sharing
        cu_key_lens_host = torch.tensor([0, *torch.tensor(counts_host).cumsum(0).tolist()], dtype=torch.int32)
        keys = (index[real], cu_key_lens_host.to(real.device), cu_key_lens_host)
    return PackedRows(input_ids[own].unsqueeze(0), position_ids[own].unsqueeze(0), index,
                      tuple(zip([0] + ends[:-1], ends)), cu_seq_lens_host.to(real.device), cu_seq_lens_host,
                      max(counts_host), *keys)


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether rows of one prompt may share its states in ``model``'s forward now: not while a dropout draws
    (training mode and some dropout's probability above 0), where each row's copy would draw its own mask."""
    if not SHARE_PROMPTS:
        return False
    if not model.training:
        return True
    drops = model.__dict__.get("_hf_grpo_draws_dropout")
    if drops is None:
        drops = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
        config = getattr(model, "config", None)
        drops = drops or bool(config is not None and getattr(config.get_text_config(), "attention_dropout", 0.0))
        model.__dict__["_hf_grpo_draws_dropout"] = drops
    return not drops


def sliding_window(config) -> int | None:
    """The smallest attention window of the model's layers (None: every layer attends to all earlier tokens)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model``'s rows cannot be scored packed (they are then scored padded), or None."""
    config = model.config.get_text_config()
    if model.config is not config:
        return "the model has several sub-models (vision-language): its inputs are not plain token rows"
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        return "the model does not attend causally (encoder-decoder or bidirectional)"
    implementation = upstream.attention_implementation(config)
    if implementation not in ROUTED:
        return f"attn_implementation={implementation!r} is not one of {list(ROUTED)}"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        return f"the model has layers other than attention ({sorted(layer_types)}), which read the padding mask"
    if getattr(config, "attention_dropout", 0.0):
        return "the model's attention has dropout (attention_dropout > 0)"
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, name, None) is not None:
            return f"the model's attention has {name} set, which packed attention does not compute"
    if getattr(config, "rope_parameters", None) is None:
        # absolute position embeddings see a row's offset in the padded batch: packed positions would differ
        return "the model has no rotary position embeddings (rope_parameters)"
    return None


def _attend(query, key, value, cu_seq_lens, ends: list[int], scale: float, key_index=None, cu_key_lens=None,
            key_ends: list[int] | None = None):
    """Causal attention within each packed row: query ``[1, Hq, T, D]``, key/value ``[1, Hkv, T, D]`` ->
    ``[1, T, Hq, D]``, as transformers' attention functions return it. With ``key_index`` (rows sharing a
    prompt: ``PackedRows``) a row's queries are its own segment's tokens and its keys those ``key_index`` gathers
    between ``cu_key_lens``: the row's last queries against all its keys (causal from the bottom right)."""
    if key_index is not None:
        key, value = key.index_select(2, key_index), value.index_select(2, key_index)
    else:
        cu_key_lens, key_ends = cu_seq_lens, ends
    if varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        # The packed length bounds every row from above (flash attention's blocks past a row's end return at
        # once): nothing read on the host, so a CUDA graph replays it with other row bounds (graphs).
        return _varlen_attention(query, key, value, cu_seq_lens, cu_key_lens, scale)
    if query.is_cuda and torch.cuda.is_current_stream_capturing():  # the graph would keep this batch's bounds
        raise RuntimeError("packed attention is captured in a CUDA graph only through variable-length flash "
                           f"attention (fp16/bf16 on CUDA, torch >= 2.9); here dtype {query.dtype}")
    grouped = query.shape[1] != key.shape[1]
    pieces = []
    for start, end, key_start, key_end in zip(ends, ends[1:], key_ends, key_ends[1:]):
        queries, keys = end - start, key_end - key_start
        # a row's queries are its last tokens: query i sees the keys up to its own place, keys - queries + i
        mask = (None if queries == keys else
                torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries))
        pieces.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, key_start:key_end], value[:, :, key_start:key_end],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=grouped))
    return torch.cat(pieces, dim=2).transpose(1, 2)


def _causal_keywords() -> dict:
    """How this torch's ``varlen_attn`` is asked for causal attention (``window_size``, earlier ``is_causal``)."""
    return {"window_size": (-1, 0)} if "window_size" in _VARLEN_KEYWORDS else {"is_causal": True}


def _varlen_attention(query, key, value, cu_seq_lens, cu_key_lens, scale: float):
    """One variable-length flash-attention call over every packed row, ``[1, T, Hq, D]``. Flash attention aligns
    causality to the bottom right where a row has more keys than queries, as ``_attend`` needs."""
    keywords = {"scale": scale, **_causal_keywords()}
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and "enable_gqa" in _VARLEN_KEYWORDS:
        keywords["enable_gqa"] = True
    elif groups > 1 and not _grouped_heads_taken(query.device):
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = varlen_attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                      cu_seq_lens, cu_key_lens, query.shape[2], key.shape[2], **keywords)  # [T, Hq, D]
    return out.unsqueeze(0)


_GROUPED_HEADS_TAKEN: dict[torch.device, bool] = {}


def _grouped_heads_taken(device: torch.device) -> bool:
    """Whether this torch's ``varlen_attn`` (before its ``enable_gqa`` keyword) takes fewer key/value heads than
    query heads as they are, forward and backward: flash attention's kernels group the heads themselves, where
    repeating them wrote each key and value head ``groups`` times over (7 at Qwen2.5-7B: 0.18 s of a 32 x 2048
    step's training half on an H100). Probed once per device on a tiny batch against the repeated heads; never
    while a CUDA graph is being captured (the repeat serves then)."""
    if device not in _GROUPED_HEADS_TAKEN:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        _GROUPED_HEADS_TAKEN[device] = _probe_grouped_heads(device)
    return _GROUPED_HEADS_TAKEN[device]


def _probe_grouped_heads(device: torch.device) -> bool:
    keywords = _causal_keywords()
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(24, heads, 64, device=device, dtype=torch.bfloat16, generator=g)
               for heads in (4, 2, 2))
    cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=device)
    results = []
    # First asked inside the packed attention op, where the dispatcher turns autograd off: with autograd off the
    # probe's backward raised, it answered no, and the heads were repeated on every call (7 times at Qwen2.5-7B).
    with _autograd_inside_op():
        for repeat in (False, True):
            inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
            key, value = ((t.repeat_interleave(2, dim=1) for t in inputs[1:]) if repeat else inputs[1:])
            try:
                out = varlen_attn(inputs[0], key, value, cu, cu, 15, 15, **keywords)
                grads = torch.autograd.grad(out.float().square().sum(), inputs)
            except (RuntimeError, ValueError):
                return False
            results.append((out, *grads))
    return all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(*results))


def _host_ends(cu_lens_host: torch.Tensor | None) -> list[int] | None:
    return None if cu_lens_host is None else cu_lens_host.tolist()


# One opaque op to torch.compile (hf_grpo.training.compiled_layers): the row bounds are read on the host inside it (off
# CUDA), so they never enter a graph as constants, and no graph breaks around it (a break inside activation
# checkpointing's recompute is not allowed). Its backward recomputes the attention: it saves only q, k, v.
@torch.library.custom_op("hf_grpo::packed_attention", mutates_args=())
def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                     cu_seq_lens_host: torch.Tensor, scale: float, key_index: torch.Tensor | None = None,
                     cu_key_lens: torch.Tensor | None = None,
                     cu_key_lens_host: torch.Tensor | None = None) -> torch.Tensor:
    return _attend(query, key, value, cu_seq_lens, cu_seq_lens_host.tolist(), scale, key_index, cu_key_lens,
                   _host_ends(cu_key_lens_host)).contiguous()


@packed_attention.register_fake
def _(query, key, value, cu_seq_lens, cu_seq_lens_host, scale, key_index=None, cu_key_lens=None,
      cu_key_lens_host=None):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


@contextlib.contextmanager
def _autograd_inside_op():
    """Record autograd inside a custom op's implementation, which the dispatcher runs with autograd excluded."""
    keys = torch._C.DispatchKey
    with (torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False),
          torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False), torch.enable_grad()):
        yield


@torch.library.custom_op("hf_grpo::packed_attention_backward", mutates_args=())
def packed_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              cu_seq_lens: torch.Tensor, cu_seq_lens_host: torch.Tensor, scale: float,
                              key_index: torch.Tensor | None = None, cu_key_lens: torch.Tensor | None = None,
                              cu_key_lens_host: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs = [t.detach().requires_grad_() for t in (query, key, value)]
    with _autograd_inside_op():
        out = _attend(*inputs, cu_seq_lens, cu_seq_lens_host.tolist(), scale, key_index, cu_key_lens,
                      _host_ends(cu_key_lens_host))
        # contiguous, as the fake below says: a compiled backward lays out what follows by the fake's strides
        return tuple(g.contiguous() for g in torch.autograd.grad(out, inputs, grad))


@packed_attention_backward.register_fake
def _(grad, query, key, value, cu_seq_lens, cu_seq_lens_host, scale, key_index=None, cu_key_lens=None,
      cu_key_lens_host=None):
    return tuple(t.new_empty(t.shape) for t in (query, key, value))


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], *inputs[6:])
    ctx.scale = inputs[5]


def _backward(ctx, grad):
    query, key, value, cu_seq_lens, cu_seq_lens_host, *keys = ctx.saved_tensors
    grads = packed_attention_backward(grad, query, key, value, cu_seq_lens, cu_seq_lens_host, ctx.scale, *keys)
    return (*grads, None, None, None, None, None, None)


packed_attention.register_autograd(_backward, setup_context=_save_inputs)


def _route_packed(original):
    """``original`` (a registry entry), except for calls that carry ``packed_rows``."""
    if getattr(original, "routes_packed_rows", False):
        return original  # already wrapped (the module imported twice)

    @functools.wraps(original)
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  packed_rows: PackedRows | None = None, **kwargs: Any):
        if packed_rows is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        device = query.device.type
        if torch.is_autocast_enabled(device):
            # As autocast casts SDPA's inputs: fp32 weights leave q and k fp32 after the rotary embedding and v in
            # the autocast dtype, and the op's backward (outside autocast) would meet the mixed dtypes.
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        return packed_attention(query, key, value, packed_rows.cu_seq_lens, packed_rows.cu_seq_lens_host, scale,
                                packed_rows.key_index, packed_rows.cu_key_lens, packed_rows.cu_key_lens_host), None

    attention.routes_packed_rows = True
    return attention


for _name in ROUTED:
    if _name in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_name, _route_packed(ALL_ATTENTION_FUNCTIONS[_name]))


def packable(model: torch.nn.Module, rows: PackedRows) -> bool:
    """Whether this batch can run packed: every row fits the model's smallest attention window (inside it the
    window never binds, so causal attention within the row is exact)."""
    window = sliding_window(model.config.get_text_config())
    return window is None or rows.longest <= window


def packed_hidden_states(model: torch.nn.Module, backbone: torch.nn.Module, rows: PackedRows,
                         **kwargs: Any) -> torch.Tensor:
    """The backbone's last hidden states for the packed sequence, ``[1, T, H]``."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "position_ids")}
    no_mask = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=rows.input_ids.device)  # see the module doc
    return backbone(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=no_mask,
                    packed_rows=rows, **kwargs).last_hidden_state
