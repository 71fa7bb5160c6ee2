"""Token selection on the device, as pure functions of float32 logits: what a captured decode step samples with.

``process_logits_`` applies repetition penalty, ``min_new_tokens``/``min_length``, temperature,
top-k, top-p and min-p exactly as the matching ``transformers`` logits processors do, in that
order, but in place: at 32 rows of a 152k vocabulary every extra float32 [B, V] buffer is
another 19 MB at the peak of the decode step. ``select_tokens`` then picks a token with the
Gumbel-max trick (``argmax(log p - log E)``, ``E ~ Exp(1)``), which samples exactly from ``p``
with no softmax and no host synchronisation; the noise (``exponential_noise``) comes from torch's
default generator, which ``torch.cuda.graph`` registers with a captured graph, so every replay
draws fresh numbers. The noise is drawn eagerly even where the rest is compiled
(``select_tokens_from_copies``), so a seed gives the same tokens compiled or not.

``unsupported_generation_setting`` names the first setting of a ``GenerationConfig`` these
functions do not implement; a backend sends such a call to ``model.generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

# Generation settings implemented here; anything else set to a non-default value is unsupported.
_UNSUPPORTED_SETTINGS = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "bad_words_ids": lambda v: v is not None,
    "suppress_tokens": lambda v: v is not None,
    "begin_suppress_tokens": lambda v: v is not None,
    "sequence_bias": lambda v: v is not None,
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "top_h": lambda v: v is not None,
    "guidance_scale": lambda v: v is not None and v != 1,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "watermarking_config": lambda v: v is not None,
    "renormalize_logits": lambda v: bool(v),
    "remove_invalid_values": lambda v: bool(v),
    "stop_strings": lambda v: v is not None,
    "max_time": lambda v: v is not None,
    "prefill_chunk_size": lambda v: v is not None,
    "assistant_model": lambda v: v is not None,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "output_scores": lambda v: bool(v),
    "output_logits": lambda v: bool(v),
    "return_dict_in_generate": lambda v: bool(v),
}


def unsupported_generation_setting(gc: GenerationConfig) -> str | None:
    """``"generation setting NAME=VALUE"`` for the first setting not implemented here, or None."""
    for name, is_set in _UNSUPPORTED_SETTINGS.items():
        value = getattr(gc, name, None)
        if is_set(value):
            return f"generation setting {name}={value!r}"
    return None


@dataclass(frozen=True)
class SamplingSettings:
    """The generation settings a captured decode step bakes in (hashable: part of a graph's key)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float | None
    repetition_penalty: float
    min_new_tokens: int
    min_length: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    @classmethod
    def from_config(cls, gc: GenerationConfig, eos_token_ids: Sequence[int], pad_token_id: int) -> SamplingSettings:
        eos = list(dict.fromkeys(int(t) for t in eos_token_ids))
        cfg_eos = gc.eos_token_id
        if cfg_eos is not None:  # model.generate stops on the config's EOS too
            for t in [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos):
                if int(t) not in eos:
                    eos.append(int(t))
        do_sample = bool(gc.do_sample)
        temperature = 1.0 if gc.temperature is None else float(gc.temperature)
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be positive when sampling, got {temperature}")
        return cls(
            do_sample=do_sample,
            temperature=temperature,
            top_k=int(gc.top_k or 0),
            top_p=1.0 if gc.top_p is None else float(gc.top_p),
            min_p=None if gc.min_p is None else float(gc.min_p),
            repetition_penalty=1.0 if gc.repetition_penalty is None else float(gc.repetition_penalty),
            min_new_tokens=int(gc.min_new_tokens or 0),
            min_length=int(gc.min_length or 0),
            eos_token_ids=tuple(eos),
            pad_token_id=int(pad_token_id),
        )

    @property
    def blocks_early_eos(self) -> bool:
        return self.min_new_tokens > 0 or self.min_length > 0


def process_logits_(
    scores: torch.Tensor,
    s: SamplingSettings,
    *,
    seen: torch.Tensor | None = None,
    eos_blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """Filter float32 ``scores`` [B, V] for ``s``, in place where possible; returns the filtered scores.

    ``seen`` [B, >=V] bool marks the tokens the repetition penalty applies to (prompt and
    generated so far); ``eos_blocked`` [V] bool marks the tokens to forbid now (the EOS tokens
    while ``min_new_tokens``/``min_length`` are not reached, all False after). Greedy decoding
    uses only the penalty and the EOS block, as ``model.generate`` does.
    """
    if s.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("process_logits_: repetition_penalty != 1 needs the `seen` token mask")
        seen = seen[:, : scores.size(-1)]
        penalised = torch.where(scores < 0, scores * s.repetition_penalty, scores / s.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if eos_blocked is not None:
        scores.masked_fill_(eos_blocked, float("-inf"))
    if not s.do_sample:
        return scores
    if s.temperature != 1.0:
        scores.div_(s.temperature)
    if s.top_k > 0:
        k = min(s.top_k, scores.size(-1))
        kth = torch.topk(scores, k, dim=-1).values[:, -1:]
        scores.masked_fill_(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - s.top_p)
        remove_sorted[:, -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores.masked_fill_(remove, float("-inf"))
    if s.min_p is not None:
        probs = scores.softmax(dim=-1)
        threshold = s.min_p * probs.amax(dim=-1, keepdim=True)
        remove = probs < threshold
        remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        del probs
        scores.masked_fill_(remove, float("-inf"))
    return scores


def exponential_noise(scores: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws shaped like ``scores`` (float32), from torch's default generator: the Gumbel-max noise."""
    return torch.empty(scores.shape, dtype=torch.float32, device=scores.device).exponential_()


def select_tokens(
    scores: torch.Tensor,
    s: SamplingSettings,
    *,
    noise: torch.Tensor | None,
    seen: torch.Tensor | None = None,
    eos_blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """``process_logits_`` then one token per row: a sample from softmax(filtered scores), or the argmax.

    Gumbel-max: argmax_i (log p_i - log E_i) with E_i ~ Exp(1) picks i with probability p_i, and log p_i
    differs from the filtered score_i by a per-row constant, so no softmax is needed; the clamp keeps
    log(0) from winning. ``scores`` (float32) and ``noise`` (``exponential_noise``, None for greedy
    decoding) are overwritten.
    """
    scores = process_logits_(scores, s, seen=seen, eos_blocked=eos_blocked)
    if not s.do_sample:
        return scores.argmax(dim=-1)
    return noise.clamp_min_(1e-20).log_().neg_().add_(scores).argmax(dim=-1)


def select_tokens_from_copies(logits, s, noise, seen, eos_blocked) -> torch.Tensor:
    """``select_tokens`` on float32 copies of ``logits`` and ``noise``, leaving both as they were.

    The form the decode step compiles: the copies are never written out (inductor fuses them into the
    reads), and the filters, the noise transform and the argmax become a few kernels instead of one
    pass over [B, V] float32 each (seven at TRL's default settings: 0.4 ms of a 2.7 ms step at
    0.5B x 128 rows on an H100).
    """
    scores = logits.to(torch.float32, copy=True)
    noise = None if noise is None else noise.clone()
    return select_tokens(scores, s, noise=noise, seen=seen, eos_blocked=eos_blocked)
