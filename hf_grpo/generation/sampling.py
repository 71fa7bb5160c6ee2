"""Token selection on the device, as pure functions of float32 logits: what a captured decode step samples with.

``process_logits_`` applies repetition penalty, ``min_new_tokens``/``min_length``, temperature,
top-k, top-p and min-p exactly as the matching ``transformers`` logits processors do, in that
order, but in place: at 32 rows of a 152k vocabulary every extra float32 [B, V] buffer is
another 19 MB at the peak of the decode step. ``select_tokens`` then draws a token from ``p`` by
inverting its cumulative distribution (``inverse_cdf_pick``) with one uniform number per row,
with no host synchronisation. The uniforms (``row_uniforms``) come from torch's default generator,
which ``torch.cuda.graph`` registers with a captured graph, so every replay draws fresh numbers;
they are drawn eagerly even where the rest is compiled (``select_tokens_from_copies``), so a seed
gives the same tokens compiled or not (but where two sums of the same terms, added in another
order, round to either side of a draw). One number per row, where the Gumbel-max trick needs one
per token: at 128 rows of a 152k vocabulary that noise was 78 MB written and read again every step.

``unsupported_generation_setting`` names the first setting of a ``GenerationConfig`` these
functions do not implement; a backend sends such a call to ``model.generate``. Pass it the config
``model.generate`` would run with (``effective_generation_config``): the call's, completed by the
model's own ``generation_config`` and transformers' defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ..runtime import upstream

# Every field of transformers' GenerationConfig is in exactly one of the three groups below (a test checks it against
# the installed transformers), so that a setting ``model.generate`` honours and this module does not implement sends
# the call to ``model.generate`` instead of being dropped.

# Read by the backend: the sampling law above, and the lengths and stop tokens of the decode loop.
IMPLEMENTED_SETTINGS = frozenset({
    "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "min_new_tokens", "min_length",
    "max_new_tokens", "max_length", "eos_token_id", "pad_token_id",
})

# Fields that do not change the tokens ``model.generate`` returns for a decoder-only model with one sampled or greedy
# sequence per prompt (what the backend runs; every setting that leaves that mode is in the unsupported group).
_ASSISTED = "tunes assisted decoding, which only an unsupported setting (assistant, prompt lookup, MTP) turns on"
_BEAMS = "acts in beam search only (num_beams > 1 is unsupported)"
NO_EFFECT_SETTINGS = {
    "bos_token_id": "starts a prompt only when there are no input ids; prompts are always given",
    "decoder_start_token_id": "encoder-decoder models only, which the backend refuses",
    "use_cache": "whether a KV cache is kept: the same tokens (the backend keeps its own cache)",
    "cache_implementation": "the kind of KV cache: the same tokens",
    "cache_config": "the KV cache's settings: the same tokens",
    "max_cache_len": "the KV cache's size: the same tokens",
    "compile_config": "how generate compiles its forward: the same tokens",
    "disable_compile": "whether generate compiles its forward: the same tokens",
    "output_attentions": "extra outputs, returned only with return_dict_in_generate (unsupported)",
    "output_hidden_states": "extra outputs, returned only with return_dict_in_generate (unsupported)",
    "length_penalty": _BEAMS,
    "early_stopping": _BEAMS,
    "low_memory": "beam and contrastive search only, both unsupported",
    "num_assistant_tokens": _ASSISTED,
    "num_assistant_tokens_schedule": _ASSISTED,
    "assistant_confidence_threshold": _ASSISTED,
    "assistant_lookbehind": _ASSISTED,
    "target_lookbehind": _ASSISTED,
    "max_matching_ngram_size": _ASSISTED,
    "assistant_ensemble_weight": _ASSISTED,
    "is_assistant": _ASSISTED,
    "continuous_batching_config": "read by continuous batching (generate_batch), not by generate",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
}

# Fields that change the tokens when set to anything but their neutral value: such a call goes to model.generate.
_UNSUPPORTED_SETTINGS = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_beam_groups": lambda v: v is not None and v > 1,
    "diversity_penalty": lambda v: v is not None and v != 0,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "constraints": lambda v: v is not None,
    "force_words_ids": lambda v: v is not None,
    "penalty_alpha": lambda v: v is not None and v > 0,
    "dola_layers": lambda v: v is not None,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    # decoder-only models: model.generate applies these two to the prompt (its "encoder input")
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
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
    "token_healing": lambda v: bool(v),
    "stop_strings": lambda v: v is not None,
    "max_time": lambda v: v is not None,
    "prefill_chunk_size": lambda v: v is not None,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "assistant_early_exit": lambda v: v is not None,
    "use_mtp": lambda v: bool(v),
    "speculation_type": lambda v: v is not None,
    "output_scores": lambda v: bool(v),
    "output_logits": lambda v: bool(v),
    "return_dict_in_generate": lambda v: bool(v),
}
UNSUPPORTED_SETTINGS = frozenset(_UNSUPPORTED_SETTINGS)


def unsupported_generation_setting(gc: GenerationConfig) -> str | None:
    """``"generation setting NAME=VALUE"`` for the first setting not implemented here, or None."""
    for name, is_set in _UNSUPPORTED_SETTINGS.items():
        value = getattr(gc, name, None)
        if is_set(value):
            return f"generation setting {name}={value!r}"
    return None


def effective_generation_config(model: torch.nn.Module, gc: GenerationConfig) -> GenerationConfig:
    """The config ``model.generate(generation_config=gc)`` runs with: the fields ``gc`` leaves unset (None) taken
    from the model's own ``generation_config`` (a checkpoint's ``generation_config.json``), then from transformers'
    defaults. Without transformers' merge (a model that is not a ``GenerationMixin``, or has no generation config of
    its own), ``gc`` itself."""
    prepare = upstream.generation_config_preparer(model)
    if prepare is None or getattr(model, "generation_config", None) is None:
        return gc
    return prepare(gc)[0]


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
    invariant_logprobs: bool = False  # true_on_policy: the log-sum-exp the trainer's head runs (ops.batch_invariant)

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


def row_uniforms(scores: torch.Tensor) -> torch.Tensor:
    """One U[0, 1) draw per row of ``scores`` (float32), from torch's default generator: what a sampled pick uses."""
    return torch.rand(scores.shape[:-1], dtype=torch.float32, device=scores.device)


# Tokens per block of the inverse-CDF pick: a block's mass is one reduction, and only the chosen block of a row
# is summed token by token.
PICK_BLOCK = 1024


def inverse_cdf_pick(scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 ``scores`` [B, V], drawn from softmax(scores) by inverting its CDF at ``uniforms``.

    The vocabulary is cut into blocks of ``PICK_BLOCK``: each block's mass (its exponentials summed, relative to
    the row's largest score), a running sum over the blocks, the block where it passes ``u`` times the total, and
    in that block a running sum token by token. A block whose scores are all -inf weighs nothing, and a token at
    -inf is never picked (the running sums must pass the target strictly, and the picks are clamped to the last
    block and token of non-zero mass, where rounding would step past the end). The law is softmax's up to
    float32 rounding, as ``torch.multinomial``'s inversion; no [B, V] buffer is written beside the scores.
    """
    rows, vocab = scores.shape
    blocks = -(-vocab // PICK_BLOCK)
    padded = torch.nn.functional.pad(scores, (0, blocks * PICK_BLOCK - vocab), value=float("-inf"))
    padded = padded.view(rows, blocks, PICK_BLOCK)
    tops = padded.amax(dim=-1)  # [B, blocks]
    peak = tops.amax(dim=-1, keepdim=True)  # [B, 1]: the row's largest score (finite: a filter keeps one token)
    tops = torch.where(tops == float("-inf"), peak, tops)  # a block cut whole: mass 0, not NaN
    mass = torch.exp(padded - tops[..., None]).sum(dim=-1) * torch.exp(tops - peak)  # relative to exp(peak)
    running = mass.cumsum(dim=-1)
    target = uniforms * running[:, -1]
    block_ids = torch.arange(blocks, device=scores.device)
    last_block = torch.where(mass > 0, block_ids, -1).amax(dim=-1)
    block = torch.minimum((running <= target[:, None]).sum(dim=-1), last_block)  # [B]
    before = (running - mass).gather(1, block[:, None]).squeeze(1)  # the mass of the blocks before it
    inside = padded.gather(1, block[:, None, None].expand(rows, 1, PICK_BLOCK)).squeeze(1)  # [B, PICK_BLOCK]
    token_mass = torch.exp(inside - peak)
    token_ids = torch.arange(PICK_BLOCK, device=scores.device)
    last_token = torch.where(token_mass > 0, token_ids, -1).amax(dim=-1)
    token = torch.minimum((token_mass.cumsum(dim=-1) <= (target - before)[:, None]).sum(dim=-1), last_token)
    return block * PICK_BLOCK + token


def chosen_logprobs(scores: torch.Tensor, tokens: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """[B]: each row's ``token`` log-prob under softmax(``scores``), the law it was drawn from (``scores``: the
    filtered float32 scores [B, V] the pick read). One reduction over the vocabulary, no [B, V] buffer kept;
    ``invariant``: the trainer's own (``true_on_policy``), the same bits whatever the number of rows."""
    if invariant:
        from ..ops import batch_invariant

        lse = batch_invariant.logsumexp(scores)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    return scores.gather(1, tokens[:, None]).squeeze(1) - lse


def select_tokens(
    scores: torch.Tensor,
    s: SamplingSettings,
    *,
    noise: torch.Tensor | None,
    seen: torch.Tensor | None = None,
    eos_blocked: torch.Tensor | None = None,
    with_logprobs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``process_logits_`` then one token per row: a sample from softmax(filtered scores), or the argmax.

    ``noise`` is ``row_uniforms(scores)`` when sampling (``inverse_cdf_pick``), None for greedy decoding.
    ``scores`` (float32) are overwritten. ``with_logprobs``: (tokens, their log-probs under the filtered law,
    ``chosen_logprobs``), what the trainer's importance ratio compares with (hf_grpo.training.rollout_logprobs).
    """
    scores = process_logits_(scores, s, seen=seen, eos_blocked=eos_blocked)
    tokens = inverse_cdf_pick(scores, noise) if s.do_sample else scores.argmax(dim=-1)
    return (tokens, chosen_logprobs(scores, tokens, s.invariant_logprobs)) if with_logprobs else tokens


def select_tokens_from_copies(logits, s, noise, seen, eos_blocked, with_logprobs: bool = False):
    """``select_tokens`` on a float32 copy of ``logits``, leaving them as they were.

    The form the decode step compiles: the copy is never written out (inductor fuses it into the
    reads), and the filters and the pick become a few kernels instead of one pass over [B, V]
    float32 each (seven at TRL's default settings: 0.4 ms of a 2.7 ms step at 0.5B x 128 rows on
    an H100).
    """
    scores = logits.to(torch.float32, copy=True)
    return select_tokens(scores, s, noise=noise, seen=seen, eos_blocked=eos_blocked, with_logprobs=with_logprobs)
