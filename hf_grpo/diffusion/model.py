"""What the diffusion sampler and the log-prob estimator need to know about a masked-diffusion model.

* **Mask token** (``resolve_mask_token_id``): the config's ``mask_token_id``, else the model config's,
  the generation config's, the tokenizer's ``mask_token_id``, or the known id of the model family
  (LLaDA 126336, Dream 151666); none of them is a ``ValueError`` that says where to set it.
* **Logit shift** (``resolve_logits_shift``): LLaDA predicts token ``i`` at position ``i`` (unshifted);
  Dream predicts token ``i + 1`` at position ``i`` (shifted, as a causal LM).
* **Layout** (``pack_rows``): every row is packed to the left, ``[prompt | completion slots | padding]``,
  so each token sits at position ``0 .. len - 1`` exactly as if the row were alone: the positions a
  model derives from the attention mask of a left-padded batch are exactly these, so the layout is
  the same for models that take ``position_ids`` (Dream) and for those that cannot (LLaDA's RoPE
  uses absolute positions). Padding, where a batch has any, is hidden from the attention by a key
  mask passed in the form the model understands (``padding_kwargs``).
* **Models that ignore the mask** (``attends_to_padding``): the released LLaDA modelling file builds the
  attention bias and then calls its attention with ``attn_mask=None``, so padding is attended. A probe
  (one forward of two rows) finds such a model; the sampler and the estimator then never pad: they run
  rows of equal length together (``equal_length_groups``), so a row's numbers do not depend on its neighbours.
* **Head bypass** (``HeadBypass``): the forward runs with the output embedding replaced by the
  identity, so ``output.logits`` are the final hidden states; the caller projects only the rows it
  needs (the current block while sampling, the scored completion tokens in the estimator). Where
  the model computes its logits without calling its head module (a tied LLaDA head uses
  ``F.linear`` directly) the bypass notices and the caller receives real logits instead.
* **Full forward** (``full_forward``): one forward over whole rows, read at the given columns, optionally a
  few rows at a time; both samplers (LLaDA's and Dream's) run their full forwards through it.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("hf_grpo")

KNOWN_MASK_TOKEN_IDS = {"llada": 126336, "dream": 151666}

# How a model wants to be told which keys are padding (see ``padding_kwargs``).
#   mask2d: attention_mask [B, T] of 0/1, the transformers convention (Llama/Qwen2 with is_causal=False)
#   bias4d: attention_bias [B, 1, T, T] bool (LLaDA: its 2-D attention_mask path adds a causal bias as soon as the
#           mask holds a zero, which would silently make a padded batch causal)
#   mask4d: attention_mask [B, 1, T, T] bool (Dream hands the mask to scaled_dot_product_attention as it is)
PADDING_STYLES = ("mask2d", "bias4d", "mask4d")


def model_family(model: torch.nn.Module) -> str | None:
    """``"llada"``, ``"dream"`` or None, from the model's ``config.model_type``."""
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "").lower()
    for family in ("llada", "dream"):
        if family in model_type:
            return family
    return None


def base_module(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def resolve_mask_token_id(configured: int | None, model: torch.nn.Module, tokenizer) -> int:
    """The mask token id: ``configured``, then the model's configs, the tokenizer, the family's known id."""
    if configured is not None:
        return int(configured)
    module = base_module(model)
    candidates = [
        ("the model config's mask_token_id", getattr(getattr(module, "config", None), "mask_token_id", None)),
        ("the generation config's mask_token_id",
         getattr(getattr(module, "generation_config", None), "mask_token_id", None)),
        ("the tokenizer's mask_token_id", getattr(tokenizer, "mask_token_id", None)),
        (f"the known id of {model_family(module)} models", KNOWN_MASK_TOKEN_IDS.get(model_family(module) or "")),
    ]
    for _, value in candidates:
        if value is not None:
            return int(value)
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    raise ValueError(
        f"mask_token_id is None and no mask token was found for this model (model_type={model_type!r}): none of "
        f"{', '.join(name for name, _ in candidates[:3])} is set. Set DiffuGRPOConfig(mask_token_id=...) to the id "
        f"of the token the model was trained to fill in (LLaDA: 126336, Dream: 151666), or add a mask token to the "
        f"tokenizer (tokenizer.add_special_tokens({{'mask_token': ...}}))"
    )


def resolve_logits_shift(configured, model: torch.nn.Module) -> bool:
    """Whether position ``i`` predicts token ``i + 1`` (Dream) rather than token ``i`` (LLaDA)."""
    if isinstance(configured, bool):
        return configured
    family = model_family(base_module(model))
    if family == "dream":
        return True
    if family is None:
        model_type = getattr(getattr(base_module(model), "config", None), "model_type", None)
        logger.info("logits_shift='auto': model_type %r is neither LLaDA nor Dream; using unshifted logits "
                    "(position i predicts token i, as LLaDA). Set logits_shift=True for Dream-style models.",
                    model_type)
    return False


def padding_style(model: torch.nn.Module) -> str:
    """How to pass the key-padding mask to ``model`` (one of ``PADDING_STYLES``)."""
    family = model_family(base_module(model))
    return {"llada": "bias4d", "dream": "mask4d"}.get(family or "", "mask2d")


def padding_kwargs(style: str, valid: torch.Tensor | None) -> dict:
    """Forward keyword arguments that hide the padded keys ``~valid`` ([B, T] bool) from every query.

    Only keys are masked: a padded query still attends to the real tokens (so no row of the attention
    is empty and nothing turns NaN); its output is never read.
    """
    if valid is None:
        return {}
    if style == "mask2d":
        return {"attention_mask": valid.long()}
    rows, length = valid.shape
    square = valid[:, None, None, :].expand(rows, 1, length, length)
    if style == "bias4d":
        return {"attention_bias": square}
    if style == "mask4d":
        return {"attention_mask": square}
    raise ValueError(f"padding style must be one of {PADDING_STYLES}, got {style!r}")


# Probe rows: PROBE_REAL tokens followed by PROBE_PADDING padded columns.
PROBE_REAL, PROBE_PADDING = 4, 4


@torch.no_grad()
def attends_to_padding(model: torch.nn.Module, style: str, mask_token_id: int, pad_token_id: int,
                       device=None) -> bool:
    """Whether ``model`` lets keys hidden by ``padding_kwargs(style, ...)`` change the outputs at the real tokens.

    One forward of two rows with the same real tokens and different contents in their masked-out columns:
    a model that honours the mask gives the two rows the same outputs there.
    """
    device = device if device is not None else next(base_module(model).parameters()).device
    real = [mask_token_id] * PROBE_REAL
    other = mask_token_id if mask_token_id != pad_token_id else (0 if pad_token_id != 0 else 1)
    rows = torch.tensor([real + [pad_token_id] * PROBE_PADDING, real + [other] * PROBE_PADDING],
                        dtype=torch.long, device=device)
    valid = torch.zeros(rows.shape, dtype=torch.bool, device=device)
    valid[:, :PROBE_REAL] = True
    kwargs = padding_kwargs(style, valid)
    if accepts_kwarg(model, "use_cache"):
        kwargs["use_cache"] = False
    training = model.training
    model.eval()  # dropout would tell the two rows apart
    try:
        output = model(input_ids=rows, **kwargs)
    finally:
        model.train(training)
    states = (output.logits if hasattr(output, "logits") else output[0])[:, :PROBE_REAL].float()
    scale = states.abs().max().clamp_min(1e-6)
    # a model that honours the mask differs here by rounding at most; the released LLaDA code by O(scale)
    return bool(((states[0] - states[1]).abs().max() / scale) > 1e-3)


def equal_length_groups(lengths: list[int], max_rows: int | None) -> list[list[int]]:
    """Row indices grouped by equal ``lengths`` (first-seen order), each group split into pieces of ``max_rows``."""
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):
        groups.setdefault(length, []).append(row)
    step = max_rows or max(len(lengths), 1)
    return [rows[begin:begin + step] for rows in groups.values() for begin in range(0, len(rows), step)]


@dataclass
class PackedRows:
    """Rows laid out ``[prompt | slots | padding]``; ``start[b]`` is the first completion slot of row ``b``."""

    input_ids: torch.Tensor  # [B, T]
    valid: torch.Tensor | None  # [B, T] bool, None when no row is padded
    start: torch.Tensor  # [B] long, = prompt length of each row
    prompt_positions: torch.Tensor  # [B, T] bool, True on the prompt tokens


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_slots: int,
    fill_id: int,
    pad_token_id: int,
    *,
    has_padding: bool | None = None,
) -> PackedRows:
    """Pack left-padded prompts ``[B, P]`` (mask ``[B, P]``) into ``[prompt | num_slots x fill_id | padding]``.

    ``has_padding`` says whether prompt lengths differ (computed, with one host sync, when None).
    """
    rows, width = prompt_ids.shape
    device = prompt_ids.device
    lengths = prompt_mask.long().sum(dim=1)  # [B]
    if has_padding is None:
        has_padding = bool((lengths != width).any()) if rows else False
    total = width + num_slots
    cols = torch.arange(total, device=device).expand(rows, total)
    start = lengths
    is_prompt = cols < start[:, None]
    is_slot = (cols >= start[:, None]) & (cols < (start + num_slots)[:, None])
    input_ids = torch.full((rows, total), pad_token_id, dtype=torch.long, device=device)
    if width:
        # prompt token j of row b sits at column width - length_b + j of the left-padded input
        source = (cols + (width - lengths)[:, None]).clamp(max=width - 1)
        input_ids = torch.where(is_prompt, prompt_ids.gather(1, source), input_ids)
    input_ids = input_ids.masked_fill(is_slot, fill_id)
    valid = (is_prompt | is_slot) if has_padding else None
    return PackedRows(input_ids=input_ids, valid=valid, start=start, prompt_positions=is_prompt)


def left_pad_tensors(prompt_ids: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Token-id lists as a left-padded ``[B, P]`` tensor, its mask, and whether any row is padded (host-side)."""
    width = max((len(p) for p in prompt_ids), default=0)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, tokens in enumerate(prompt_ids):
        if tokens:
            ids[row, width - len(tokens):] = torch.as_tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens):] = 1
    padded = any(len(p) != width for p in prompt_ids)
    return ids.to(device), mask.to(device), padded


def slot_columns(start: torch.Tensor, offset: int, count: int, shift: bool) -> torch.Tensor:
    """Columns ``[B, count]`` of the hidden states that predict completion slots ``offset .. offset + count - 1``.

    Unshifted (LLaDA): slot ``j`` is predicted at its own column ``start + j``; shifted (Dream): at ``start + j - 1``.
    """
    cols = start[:, None] + offset + torch.arange(count, device=start.device)[None, :]
    return cols - 1 if shift else cols


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The output embedding (LM head) module of ``model`` (unwrapped), or a ValueError."""
    head = base_module(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(base_module(model)).__name__} has no output embedding (get_output_embeddings() "
                         f"returned None); the diffusion trainer projects hidden states through it")
    return head


def head_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the head cannot be applied as ``hidden @ weight.T + bias`` (then the estimator uses real logits)."""
    try:
        head = output_head(model)
    except ValueError as err:
        return str(err)
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(head, BaseTunerLayer):
            return "the LM head carries a PEFT adapter"
    except ImportError:  # pragma: no cover - peft is a dependency
        pass
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(head, torch.nn.Linear):
        return f"the output embedding is a {type(head).__name__}, not a Linear layer"
    config = base_module(model).config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "final_logit_softcapping", None) is not None or getattr(text_config, "scale_logits", False):
        return "the model rescales its logits after the head"
    for scale in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(text_config, scale, None) not in (None, 1, 1.0):
            return f"the model scales its logits ({scale})"
    return None


class HeadBypass:
    """Context manager: the model's forward returns final hidden states in ``.logits`` instead of logits.

    ``bypassed`` tells, after a forward, whether the head really was skipped (False: the model
    computed logits without calling its head module, and ``.logits`` are logits). ``project(hidden)``
    applies the real head to the rows the caller kept.
    """

    def __init__(self, model: torch.nn.Module):
        self.head = output_head(model)
        self.enabled = head_unsupported_reason(model) is None
        self.bypassed = False

    def __enter__(self):
        if not self.enabled:
            return self
        head = self.head
        self._saved = head.__dict__.get("forward")  # an instance-level forward (TRL's fp32 cast) is kept
        self._original = self._saved if self._saved is not None else type(head).forward.__get__(head)

        def identity(hidden, *args, **kwargs):
            self.bypassed = True
            return hidden

        head.forward = identity
        return self

    def __exit__(self, *exc):
        if self.enabled:
            if self._saved is not None:
                self.head.forward = self._saved
            else:
                del self.head.forward
        return False

    def reset(self):
        self.bypassed = False

    def to_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits for rows taken from ``output.logits``: projected through the real head when the forward was
        bypassed (ZeRO-3 gathers the head's weight for the call), as they are otherwise."""
        if not self.bypassed:
            return rows
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        with maybe_gather_lm_head_ctx(self.head.weight, getattr(self.head, "bias", None)):
            return self._original(rows)


def accepts_kwarg(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(base_module(model).forward).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def full_forward(model, inputs: torch.Tensor, kwargs: dict, read_from: torch.Tensor, piece_rows: int | None,
                 cache=None) -> torch.Tensor:
    """``[B, n, ...]``: the model's outputs (``.logits``) at columns ``read_from`` [B, n] of a full forward over
    ``inputs`` [B, T], ``piece_rows`` rows at a time (rows never attend to each other, so the pieces give
    the one forward's outputs); a block cache (``hf_grpo.diffusion.block_cache.BlockKVCache``, or None) keeps each
    piece's keys/values in its rows. The samplers of both families run their forwards through it."""
    total = inputs.size(0)
    piece_rows = piece_rows or total
    picked = []
    for begin in range(0, total, piece_rows):
        rows = slice(begin, begin + piece_rows)
        piece_kwargs = {name: value[rows] if torch.is_tensor(value) and value.dim() and value.size(0) == total
                        else value for name, value in kwargs.items()}
        if cache is not None:
            cache.rows = rows
        output = model(input_ids=inputs[rows], **piece_kwargs)
        states = output.logits if hasattr(output, "logits") else output[0]
        index = read_from[rows]
        picked.append(states.gather(1, index.unsqueeze(-1).expand(-1, -1, states.size(-1))))
        del output, states  # before the next piece's forward
    return picked[0] if len(picked) == 1 else torch.cat(picked)
