"""Dream's own sampler (its ``diffusion_generate``), behind the same backend as the LLaDA sampler.

No blocks: the whole completion of ``L`` mask tokens is denoised over ``steps`` steps on the schedule
``t = linspace(1, eps, steps + 1)``. At step ``i`` (``t = t_i``, ``s = t_(i+1)``) every still-masked slot
gets a token and a confidence from its logits (shifted: slot ``j`` is read at column ``j - 1``):

    logits / temperature (when temperature > 0), then top_p, then top_k truncation, p = softmax
    token       ~ p (argmax when temperature = 0)
    confidence  maskgit_plus: p[token]     topk_margin: p_top1 - p_top2     entropy: sum(p log(p + 1e-10))

and ``n = int(m * (1 - s / t))`` of them are committed (all that remain at the last step), ``m`` the mean
number of masked slots per row, computed in float32 as Dream computes it: the ``n`` most confident
(``confidence_temperature`` 0) or ``n`` drawn without replacement from ``softmax(confidence /
confidence_temperature)`` (Dream's ``alg_temp``).

Draws: a categorical draw is the Gumbel-max ``argmax(log p + G)`` and a draw of ``n`` positions without
replacement is the Gumbel-top-k ``topk(confidence / alg_temp + G, n)``; the same distributions as Dream's
``Categorical`` / ``multinomial``, with float64 noise (``gumbel_noise``), so a test can hand both this sampler
and the algorithm written out the same noise (``tests/diffusion/test_diffu_dream_sampler.py``).

Differences from Dream's code, all outside what a trained model meets: the slot logits are projected
through the LM head for the completion only (not the prompt), ``NOISE_ELEMENTS`` float64 elements at a time;
confidences are float32/float64, not the model's dtype (fewer ties); a commit is confined to the completion
slots (Dream's top-k over the whole row could re-mask a committed or prompt token when rows hold different
numbers of masks, which only happens if a completion contains the mask token); Dream's ``"origin"`` algorithm
(random unmasking) is not offered. ``forbid_mask_token`` (on by default) sets the mask token's logit to
-inf first; Dream does not.
"""

from __future__ import annotations

import torch

from .model import HeadBypass, accepts_kwarg, full_forward, pack_rows, padding_kwargs, slot_columns
from .sampling_settings import SamplingSettings, settings_from

ENTROPY_EPSILON = 1e-10  # Dream's: log(p + 1e-10)


def dream_timesteps(steps: int, eps: float) -> torch.Tensor:
    """Dream's schedule ``linspace(1, eps, steps + 1)`` (float32, on the CPU: the counts are host figures)."""
    return torch.linspace(1, eps, steps + 1, dtype=torch.float32)


def dream_commit_count(masked: int, rows: int, step: int, timesteps: torch.Tensor) -> int:
    """Slots committed per row at ``step``: ``int(m * (1 - s / t))`` with ``m = masked / rows`` in float32, as
    Dream computes it (all that remain at the last step)."""
    steps = timesteps.numel() - 1
    masked = torch.tensor(masked) / rows  # integer tensor / int: float32, as Dream's mask_index.sum() / B
    if step == steps - 1:
        return int(masked)
    t, s = timesteps[step], timesteps[step + 1]
    return int(masked * (1 - s / t))


def truncate_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus truncation: keep the most probable tokens up to ``top_p`` of the mass (always the first one)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = torch.zeros_like(cumulative, dtype=torch.bool)
    drop_sorted[..., 1:] = cumulative[..., :-1] > top_p  # a token goes once the mass BEFORE it exceeds top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def truncate_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits (and any tied with the k-th)."""
    kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def dream_sample_tokens(logits: torch.Tensor, *, temperature: float, top_p: float | None, top_k: int | None,
                        algorithm: str, generator: torch.Generator | None = None):
    """``(tokens, confidence)`` for logits ``[n, V]``, ``NOISE_ELEMENTS`` float64 elements at a time."""
    from . import draws  # the noise source, looked up at call time (tests replace it)

    rows_per_piece = max(1, draws.NOISE_ELEMENTS // max(logits.size(-1), 1))
    tokens, confidence = [], []
    for begin in range(0, logits.size(0), rows_per_piece):
        piece = logits[begin:begin + rows_per_piece].to(torch.float64)
        if temperature > 0:
            piece = piece / temperature
        if top_p is not None and top_p < 1:
            piece = truncate_top_p(piece, top_p)
        if top_k:  # None or 0: off (TRL's "no top-k" is 0)
            piece = truncate_top_k(piece, top_k)
        log_p = piece.log_softmax(dim=-1)
        del piece
        if temperature > 0:
            drawn = (log_p + draws.gumbel_noise(log_p.shape, log_p.device, generator)).argmax(dim=-1)
        else:
            drawn = log_p.argmax(dim=-1)
        p = log_p.exp()
        if algorithm == "maskgit_plus":
            score = p.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
        elif algorithm == "topk_margin":
            top2 = p.topk(2, dim=-1).values
            score = top2[:, 0] - top2[:, 1]
        else:  # entropy: the negative entropy (peaked distributions first)
            score = (p * torch.log(p + ENTROPY_EPSILON)).sum(dim=-1)
        tokens.append(drawn)
        confidence.append(score)
        del log_p, p
    return torch.cat(tokens), torch.cat(confidence)


def sample_slots(bypass: HeadBypass, hidden: torch.Tensor, mask_token_id: int, forbid_mask_token: bool, **sampling):
    """``(tokens, confidence)`` ``[n]`` from the slots' hidden states (or logits) ``[n, ...]``, projected through the
    head ``HEAD_POSITIONS`` at a time: the completion's logits never exist whole."""
    from .draws import HEAD_POSITIONS

    tokens, confidence = [], []
    for begin in range(0, hidden.size(0), HEAD_POSITIONS):
        logits = bypass.to_logits(hidden[begin:begin + HEAD_POSITIONS])
        if forbid_mask_token and mask_token_id < logits.size(-1):
            logits[:, mask_token_id] = float("-inf")  # never "predict" the mask itself
        piece_tokens, piece_confidence = dream_sample_tokens(logits, **sampling)
        tokens.append(piece_tokens)
        confidence.append(piece_confidence)
        del logits
    return torch.cat(tokens), torch.cat(confidence)


def choose_positions(confidence: torch.Tensor, count: int, confidence_temperature: float,
                     generator: torch.Generator | None) -> torch.Tensor:
    """Boolean ``[B, L]``: ``count`` positions per row, the most confident or drawn from softmax(conf / temp)."""
    from . import draws

    scores = confidence
    if confidence_temperature > 0:
        # Gumbel-top-k: ``count`` draws without replacement from softmax(confidence / temperature)
        scores = (confidence.double() / confidence_temperature).log_softmax(dim=-1)
        scores = scores + draws.gumbel_noise(scores.shape, scores.device, generator)
    counts = torch.full((confidence.size(0),), count, dtype=torch.long, device=confidence.device)
    return draws.commit_topk(scores, counts)


@torch.no_grad()
def dream_generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: SamplingSettings | None = None,
    *,
    gen_length: int,
    mask_token_id: int,
    pad_token_id: int,
    logits_shift: bool = True,
    padding_style: str = "mask4d",
    has_padding: bool | None = None,
    generator: torch.Generator | None = None,
    step_callback=None,
    **sampling,
) -> torch.Tensor:
    """The ``gen_length`` completion tokens ``[B, L]`` for left-padded ``prompt_ids`` ``[B, P]``, by Dream's sampler.

    ``step_callback(step, canvas, slot_columns)``, if given, sees the canvas after every step. The sampling settings
    (``steps``, ``temperature``, ``top_p``, ``top_k``, ``confidence_algorithm``, ``confidence_temperature``,
    ``schedule_eps``, ``forbid_mask_token``) come in ``settings`` or as keyword arguments (``sampling``; Dream's
    names ``algorithm`` and ``eps`` are taken for the confidence algorithm and the schedule's end).
    """
    settings = settings_from("dream_generate", settings, sampling,
                             renamed={"algorithm": "confidence_algorithm", "eps": "schedule_eps"}, sampler="dream")
    steps, temperature, top_p, top_k = settings.steps, settings.temperature, settings.top_p, settings.top_k
    algorithm, confidence_temperature = settings.confidence_algorithm, settings.confidence_temperature
    eps, forbid_mask_token = settings.schedule_eps, settings.forbid_mask_token
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    packed = pack_rows(prompt_ids, prompt_mask, gen_length, mask_token_id, pad_token_id, has_padding=has_padding)
    canvas, rows = packed.input_ids, packed.input_ids.size(0)
    columns = slot_columns(packed.start, 0, gen_length, shift=False)  # [B, L]
    read_from = columns - 1 if logits_shift else columns
    forward_kwargs = padding_kwargs(padding_style, packed.valid)
    if accepts_kwarg(model, "use_cache"):
        forward_kwargs["use_cache"] = False
    timesteps = dream_timesteps(steps, eps)
    bypass = HeadBypass(model)
    with bypass:
        for step in range(steps):
            slots = canvas.gather(1, columns)
            still_masked = slots == mask_token_id
            bypass.reset()
            picked = full_forward(model, canvas, forward_kwargs, read_from, None, None)  # [B, L, H]
            tokens, confidence = sample_slots(bypass, picked.reshape(rows * gen_length, -1), mask_token_id,
                                              forbid_mask_token, temperature=temperature, top_p=top_p, top_k=top_k,
                                              algorithm=algorithm, generator=generator)
            del picked
            tokens, confidence = tokens.view(rows, gen_length), confidence.view(rows, gen_length)
            count = dream_commit_count(int(still_masked.sum()), rows, step, timesteps)  # one host read per step
            if count > 0:
                confidence = confidence.masked_fill(~still_masked, float("-inf"))
                commit = choose_positions(confidence, count, confidence_temperature, generator) & still_masked
                canvas = canvas.scatter(1, columns, torch.where(commit, tokens, slots))
            if step_callback is not None:
                step_callback(step, canvas, columns)
    return canvas.gather(1, columns)
