"""Routes TRL's fused-LM-head forward through ``hf_grpo.ops.chunked_logprobs``.

TRL 1.16 patches the policy's ``forward`` so that ``model(..., labels=..., fused_lm_head=True)``
returns per-token log-probs instead of logits, in fixed 4096-row tiles. We patch the same
instance once more, on top of TRL's patch, so the row chunk is the user's
``tensor_batch_size``. Calls without ``fused_lm_head=True`` (generation) go to TRL's patch,
which hands them to the model's own forward. Because the call still enters through the
wrapped model (DDP, DeepSpeed, PEFT), their hooks run as usual.

Mixture-of-experts models: when router logits are asked for (TRL asks whenever the model's config has a
non-zero ``router_aux_loss_coef``; the config's ``output_router_logits`` asks on every call, as the model's own
forward does), the output carries the router's load-balancing loss as ``aux_loss``, the value TRL's head
returns (transformers' ``load_balancing_loss_func`` over the backbone's router logits and attention mask),
and ``loss`` includes it weighted by the config's ``router_aux_loss_coef``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable
from contextlib import nullcontext

import torch
import transformers
from packaging.version import Version
from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

from .training import padding_free, true_on_policy
from .memory.oom import SizeKnob
from .ops import chunked_logprobs

logger = logging.getLogger("hf_grpo")

# The static-window head runs inside a CUDA graph, whose memory pool keeps its chunk's fp32 logits (and their
# gradient) between steps: at most this many rows a chunk (~150 MB of logits at a 152k vocabulary), below any
# tensor_batch_size asked for. Replayed, smaller chunks cost next to no time.
STATIC_WINDOW_CHUNK_ROWS = 256


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the chunked head cannot stand in for TRL's on ``model`` (we then keep TRL's), or None."""
    config = model.config.get_text_config()
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "the model soft-caps its logits (final_logit_softcapping)"
    for scale in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(config, scale, None) not in (None, 1, 1.0):
            return f"the model scales its logits ({scale})"
    if model.get_output_embeddings() is None:
        return "the model has no output embedding (LM head)"
    return None


def _expert_counts(model: torch.nn.Module, config) -> tuple[int, int]:
    """(experts, experts per token) as TRL 1.16's head reads them: GPT-OSS's config lacks ``num_experts`` before
    transformers 5.6, where the model carries it."""
    if config.model_type == "gpt_oss" and Version(transformers.__version__) < Version("5.6.0"):
        return model.num_experts, model.num_experts_per_tok
    return config.num_experts, config.num_experts_per_tok


def router_aux_loss(model: torch.nn.Module, router_logits, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The MoE load-balancing loss of one forward: transformers' function, which every MoE family shares.

    ``attention_mask`` None (padding-free rows) counts every token."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts, per_token = _expert_counts(model, model.config.get_text_config())
    return load_balancing_loss_func(router_logits, experts, per_token, attention_mask)


@dataclasses.dataclass
class ScoredStates:
    """What a layout hands the head: the scored positions' hidden states ``[T, H]``, which label columns they are
    (``mask``), their target tokens ``[T]``, the backbone's outputs where it ran as a whole (the MoE router logits
    are read there), and ``left``: a static window's columns before it in TRL's layout (None: not a window)."""

    states: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    backbone_outputs: object | None = None
    left: int | None = None


class PaddedRows:
    """The rows as the caller padded them: the backbone runs them as they are."""

    def scored_states(self, model, backbone, args, kwargs, labels, shift_labels) -> ScoredStates:
        backbone_outputs = backbone(*args, **kwargs)
        hidden = backbone_outputs.last_hidden_state  # [B, L, H]
        if shift_labels is None:  # causal LM: position i predicts token i + 1
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        mask = targets != -100
        return ScoredStates(hidden[mask], mask, targets[mask], backbone_outputs)


class PackedRows:
    """The rows packed into one sequence (``padding_free.pack_rows``): a scored position's state read from its
    packed place."""

    def __init__(self, packed):
        self.packed = packed

    def scored_states(self, model, backbone, args, kwargs, labels, shift_labels) -> ScoredStates:
        hidden = padding_free.packed_hidden_states(model, backbone, self.packed, **kwargs)[0]  # [T, H]
        mask = labels[:, 1:] != -100
        return ScoredStates(hidden[self.packed.index[:, :-1][mask]], mask, labels[:, 1:][mask])


class StaticWindow:
    """Static shapes, for a CUDA graph (``hf_grpo.training.graphs``): every position of the last ``scored_window``
    label columns is scored, the unscored ones zeroed later. Packed (``packed_rows``), ``labels`` are
    ``[1, scored_window]``, the scored tokens gathered (graph_inputs.packed), and ``window_index`` the packed place of
    the state predicting each; TRL's layout is made outside the graph (graph_inputs' spread)."""

    def __init__(self, scored_window: int, packed_rows, window_index):
        self.scored_window, self.packed_rows, self.window_index = scored_window, packed_rows, window_index

    def chunk_rows(self, chunk_rows) -> Callable[[int], int]:
        """At most ``STATIC_WINDOW_CHUNK_ROWS`` a chunk; a capture has no out-of-memory retry (a failure ends it)."""
        asked = chunk_rows.value if isinstance(chunk_rows, SizeKnob) else chunk_rows
        return lambda full: min(asked or full, STATIC_WINDOW_CHUNK_ROWS)

    def scored_states(self, model, backbone, args, kwargs, labels, shift_labels) -> ScoredStates:
        if self.packed_rows is not None:
            hidden = padding_free.packed_hidden_states(model, backbone, self.packed_rows, **kwargs)[0]  # [T, H]
            scored, targets, backbone_outputs, left = hidden[self.window_index.reshape(-1)], labels, None, 0
        else:
            backbone_outputs = backbone(*args, **kwargs)
            hidden = backbone_outputs.last_hidden_state[:, -self.scored_window - 1:-1]
            targets = labels[:, -self.scored_window:]
            scored, left = hidden.reshape(-1, hidden.shape[-1]), labels.shape[1] - 1 - self.scored_window
        mask = targets != -100  # [B, window]
        return ScoredStates(scored, mask, targets.clamp(min=0).reshape(-1), backbone_outputs, left)


def _in_trl_layout(logps, entropy, mask, left: int | None):
    """The scored tokens' log-probs (and entropies) in TRL's ``[B, L - 1]`` layout, zeros where nothing is scored.
    ``left``: a static window's columns before it (None: not a window; packed windows are ``[1, scored_window]``,
    which graph_inputs' spread puts in TRL's layout outside the graph)."""
    if left is not None:
        log_probs = torch.nn.functional.pad(torch.where(mask, logps.view(mask.shape), 0), (left, 0))
        if entropy is not None:
            entropy = torch.nn.functional.pad(torch.where(mask, entropy.view(mask.shape), 0), (left, 0))
        return log_probs, entropy, torch.nn.functional.pad(mask, (left, 0), value=False)
    # masked_scatter keeps the graph connected even when no token is scored
    log_probs = logps.new_zeros(mask.shape).masked_scatter(mask, logps)
    if entropy is not None:
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
    return log_probs, entropy, mask


def _head_logprobs(head: torch.nn.Module, scored: torch.Tensor, targets: torch.Tensor, chunk_rows, temperature: float,
                   return_entropy: bool, in_fp32: bool):
    """``chunked_logprobs`` of the scored states through the head (gathered under ZeRO-3), ``chunk_rows`` rows at a
    time: a number (None: all), a ``SizeKnob`` (halved and retried after an out-of-memory), or a function of the
    scored row count."""
    scored, targets = scored.to(head.weight.device), targets.to(head.weight.device)
    autocast = nullcontext()
    if in_fp32:
        scored = scored.float()
        autocast = torch.autocast(scored.device.type, enabled=False)
    gather = lambda: maybe_gather_lm_head_ctx(head.weight, head.bias)  # noqa: E731 (ZeRO-3: full head)

    def logprobs(rows):  # only scored tokens reach the vocabulary projection
        # backward recomputes logits, so it gathers the head again (param_context)
        return chunked_logprobs(scored, head.weight, targets, chunk_rows=rows, temperature=temperature, bias=head.bias,
                                return_entropy=return_entropy, param_context=gather)

    with autocast, gather():
        if isinstance(chunk_rows, SizeKnob):
            return chunk_rows.run(logprobs, full=lambda: scored.shape[0])
        return logprobs(chunk_rows(scored.shape[0]) if callable(chunk_rows) else chunk_rows)


class ChunkedLogprobHead:
    """The policy's (or reference's) ``forward`` for TRL's ``fused_lm_head=True`` calls: the rows' layout chosen
    once per call (``layout``), the backbone run in it, the scored states' log-probs through ``chunked_logprobs``
    ``chunk_rows`` rows at a time, TRL's output built from them. Other calls go to ``previous_forward``."""

    def __init__(self, model: torch.nn.Module, previous_forward: Callable, *, temperature: float, chunk_rows,
                 return_entropy: bool, in_fp32: bool, rows_packed: Callable[[], bool]):
        self.previous_forward, self.rows_packed = previous_forward, rows_packed
        self.temperature, self.chunk_rows, self.return_entropy, self.in_fp32 = (temperature, chunk_rows,
                                                                                return_entropy, in_fp32)
        self.backbone_name = model.base_model_prefix
        self.text_config = model.config.get_text_config()

    def layout(self, model, args, kwargs, labels, shift_labels, scored_window, packed_rows, window_index):
        """The rows' layout for this call: a static window where a graph asks for one, packed where the run packs
        and the batch allows it, else padded as they came."""
        if scored_window is not None:
            return StaticWindow(scored_window, packed_rows, window_index)
        # MoE router logits are scored against the padded rows' mask (TRL's aux loss): those stay padded
        if (self.rows_packed() and not args and shift_labels is None and kwargs.get("attention_mask") is not None
                and not kwargs.get("output_router_logits")):
            # rows of one prompt share its states: the columns before the first scored one (TRL's prompt)
            shared = (labels != -100).any(dim=0).int().argmax() if padding_free.shares_prompts(model) else 0
            packed = padding_free.pack_rows(kwargs["input_ids"], kwargs["attention_mask"], shared)
            if packed is not None and padding_free.packable(model, packed):
                return PackedRows(packed)
        return PaddedRows()

    def __call__(self, model, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                 scored_window=None, packed_rows=None, window_index=None, **kwargs):
        if not fused_lm_head:
            return self.previous_forward(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
            )
        kwargs["use_cache"] = False
        if getattr(self.text_config, "output_router_logits", False):  # as the model's own forward: the config asks
            kwargs.setdefault("output_router_logits", True)
        bitwise = true_on_policy.installed(model)
        if bitwise and kwargs.get("attention_mask") is not None:  # the decoder's positions (RoPE rounds per position)
            kwargs.setdefault("position_ids", true_on_policy.position_ids(kwargs["attention_mask"]))
        layout = self.layout(model, args, kwargs, labels, shift_labels, scored_window, packed_rows, window_index)
        scored = layout.scored_states(model, getattr(model, self.backbone_name), args, kwargs, labels, shift_labels)
        rows = layout.chunk_rows(self.chunk_rows) if isinstance(layout, StaticWindow) else self.chunk_rows
        if bitwise:  # the decoder's own head: the same bits as its sampled tokens' log-probs
            head = functools.partial(true_on_policy.head_logprobs, model.get_output_embeddings(), scored.states,
                                     scored.targets, self.temperature, return_entropy=self.return_entropy)
            result = (rows.run(head, full=lambda: scored.states.shape[0]) if isinstance(rows, SizeKnob)
                      else head(rows))
        else:
            result = _head_logprobs(model.get_output_embeddings(), scored.states, scored.targets, rows,
                                    self.temperature, self.return_entropy, self.in_fp32)
        logps, entropy = result if self.return_entropy else (result, None)
        return self.output(model, scored, logps, entropy, num_items_in_batch, kwargs)

    def output(self, model, scored: ScoredStates, logps, entropy, num_items_in_batch, kwargs) -> FusedCausalLMOutput:
        """TRL's fused-head output: the log-probs in its layout, the mean negative log-likelihood (with the MoE
        load-balancing loss where router logits were asked for)."""
        log_probs, entropy, mask = _in_trl_layout(logps, entropy, scored.mask, scored.left)
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss, aux_loss = -log_probs.sum() / denominator, None
        if kwargs.get("output_router_logits"):
            aux_loss = router_aux_loss(model, scored.backbone_outputs.router_logits, kwargs.get("attention_mask"))
            loss = loss + getattr(self.text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)


def install_chunked_lm_head(
    model: torch.nn.Module,
    *,
    temperature: float,
    chunk_rows: int | None | SizeKnob,
    return_entropy: bool,
    cast_lm_head_to_fp32: bool = False,
    padding_free_rows: bool | None | Callable[[], bool] = False,
) -> bool:
    """Patch ``model.forward`` (the base model, after TRL's ``add_fused_lm_head``) with a ``ChunkedLogprobHead``.
    Returns False if skipped.

    ``chunk_rows`` as a ``SizeKnob`` is read at every call and halved on every rank after an out-of-memory
    in the head (``hf_grpo.memory.oom``); the backbone's forward has run by then, so the retry redoes the head only.
    With ``padding_free_rows`` the backbone runs the micro-batch's rows packed into one sequence
    (``hf_grpo.training.padding_free``) where the model and the batch allow it (None packs only the static-shape
    form a CUDA graph replays, ``packed_rows``; a callable is asked at every call: the trainer's choice for
    ``padding_free=None``, made at train begin, ``hf_grpo.training.eager_packing``).
    """
    reason = unsupported_reason(model)
    # Packing runs inside this head: a model the head refuses is refused packing too, and told so where packing was
    # asked for, with the attention's reason where there is one (Gemma2 soft-caps both its attention and its logits).
    refused = padding_free.unsupported_reason(model) or reason
    if padding_free_rows is True and refused is not None:
        logger.warning("padding_free is not applied: %s; rows are scored padded.", refused)
    if reason is not None:
        logger.warning("tensor_batch_size is not applied: %s; TRL's fused LM head is used instead.", reason)
        return False
    rows_packed = (padding_free_rows if callable(padding_free_rows) and refused is None
                   else (lambda: bool(padding_free_rows) and refused is None))
    head = ChunkedLogprobHead(model, model.forward, temperature=temperature, chunk_rows=chunk_rows,
                              return_entropy=return_entropy, in_fp32=cast_lm_head_to_fp32, rows_packed=rows_packed)

    # Keep the model's own signature: `generate` reads it to decide which kwargs to pass, and without
    # `logits_to_keep` there its prefill would build logits for every prompt token.
    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        return head(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    return True
