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

import functools
import logging
import types
from collections.abc import Callable
from contextlib import nullcontext

import torch
import transformers
from packaging.version import Version
from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

from .training import padding_free
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


def _static_window_states(model, backbone, args, kwargs, labels, scored_window: int, packed_rows, window_index):
    """Static shapes, for a CUDA graph (``hf_grpo.training.graphs``): every position of the last ``scored_window``
    label columns is scored, the unscored ones zeroed later. Packed (``packed_rows``), ``labels`` are
    ``[1, scored_window]``, the scored tokens gathered (graph_inputs.packed), and ``window_index`` the packed place of
    the state predicting each. Returns (scored states, scored mask, their targets, the backbone's outputs or None)."""
    backbone_outputs = None
    if packed_rows is not None:
        hidden = padding_free.packed_hidden_states(model, backbone, packed_rows, **kwargs)[0]  # [T, H]
        scored, targets = hidden[window_index.reshape(-1)], labels
    else:
        backbone_outputs = backbone(*args, **kwargs)
        hidden = backbone_outputs.last_hidden_state[:, -scored_window - 1:-1]
        targets = labels[:, -scored_window:]
        scored = hidden.reshape(-1, hidden.shape[-1])
    return scored, targets != -100, targets.clamp(min=0).reshape(-1), backbone_outputs  # mask: [B, window]


def _packed_states(model, backbone, packed, kwargs, labels):
    """Rows packed into one sequence: (a scored position's hidden state, from its packed place; the mask [B, L-1])."""
    hidden = padding_free.packed_hidden_states(model, backbone, packed, **kwargs)[0]  # [T, H]
    mask = labels[:, 1:] != -100
    return hidden[packed.index[:, :-1][mask]], mask


def _padded_states(backbone, args, kwargs, labels, shift_labels):
    """Padded rows: (the scored positions' hidden states, the mask [B, L-1], the backbone's outputs)."""
    backbone_outputs = backbone(*args, **kwargs)
    hidden = backbone_outputs.last_hidden_state  # [B, L, H]
    if shift_labels is None:  # causal LM: position i predicts token i + 1
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    mask = targets != -100
    return hidden[mask], mask, backbone_outputs


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


def install_chunked_lm_head(
    model: torch.nn.Module,
    *,
    temperature: float,
    chunk_rows: int | None | SizeKnob,
    return_entropy: bool,
    cast_lm_head_to_fp32: bool = False,
    padding_free_rows: bool | None | Callable[[], bool] = False,
) -> bool:
    """Patch ``model.forward`` (the base model, after TRL's ``add_fused_lm_head``). Returns False if skipped.

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
    previous_forward = model.forward
    backbone_name = model.base_model_prefix
    text_config = model.config.get_text_config()

    # Keep the model's own signature: `generate` reads it to decide which kwargs to pass, and without
    # `logits_to_keep` there its prefill would build logits for every prompt token.
    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                scored_window=None, packed_rows=None, window_index=None, **kwargs):
        if not fused_lm_head:
            return previous_forward(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
            )
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):  # as the model's own forward: the config asks
            kwargs.setdefault("output_router_logits", True)
        backbone = getattr(self, backbone_name)
        packed = None
        # MoE router logits are scored against the padded rows' mask (TRL's aux loss): those stay padded
        if (scored_window is None and rows_packed() and not args and shift_labels is None
                and kwargs.get("attention_mask") is not None and not kwargs.get("output_router_logits")):
            # rows of one prompt share its states: the columns before the first scored one (TRL's prompt)
            shared = (labels != -100).any(dim=0).int().argmax() if padding_free.shares_prompts(self) else 0
            packed = padding_free.pack_rows(kwargs["input_ids"], kwargs["attention_mask"], shared)
            packed = packed if packed is not None and padding_free.packable(self, packed) else None
        if scored_window is not None:
            scored, mask, scored_targets, backbone_outputs = _static_window_states(
                self, backbone, args, kwargs, labels, scored_window, packed_rows, window_index)
        elif packed is not None:
            scored, mask, backbone_outputs = *_packed_states(self, backbone, packed, kwargs, labels), None
        else:
            scored, mask, backbone_outputs = _padded_states(backbone, args, kwargs, labels, shift_labels)
        if scored_window is None:
            scored_targets = (labels[:, 1:] if shift_labels is None else shift_labels)[mask]  # [T]
        # (a static window runs inside a capture: no out-of-memory retry there, a failure ends the capture)
        rows = chunk_rows if scored_window is None else lambda full: min(
            (chunk_rows.value if isinstance(chunk_rows, SizeKnob) else chunk_rows) or full, STATIC_WINDOW_CHUNK_ROWS)
        result = _head_logprobs(self.get_output_embeddings(), scored, scored_targets, rows, temperature,
                                return_entropy, cast_lm_head_to_fp32)
        logps, entropy = result if return_entropy else (result, None)
        left = None if scored_window is None else 0 if packed_rows is not None else labels.shape[1] - 1 - scored_window
        log_probs, entropy, mask = _in_trl_layout(logps, entropy, mask, left)
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss, aux_loss = -log_probs.sum() / denominator, None
        if kwargs.get("output_router_logits"):
            aux_loss = router_aux_loss(self, backbone_outputs.router_logits, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)
    return True
