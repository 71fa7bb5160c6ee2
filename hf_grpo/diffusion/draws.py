"""What a diffusion step draws and commits: Gumbel-max tokens with their confidence, the top-k commit, the
schedule of commits. Shared by LLaDA's block sampler (``sampler``) and Dream's (``dream_sampler``); torch only."""

from __future__ import annotations

import torch

from .gumbel_max import gumbel_max
from .gumbel_max import usable as gumbel_max_usable


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens committed at each of a block's ``steps`` steps: ``block_length`` spread evenly, earlier steps first."""
    if steps < 1 or block_length < 1:
        raise ValueError(f"block_length and steps must be >= 1, got {block_length} and {steps}")
    base, extra = divmod(block_length, steps)
    return [base + (1 if step < extra else 0) for step in range(steps)]


# float64 elements of one vocabulary slice of the sampling noise: 16 MiB (e.g. 128 positions x 16,384 columns)
NOISE_ELEMENTS = 1 << 21
# block positions projected through the LM head at once: a bf16 [128, V] is 31 MiB at LLaDA's vocabulary,
# and each piece reads the head's weight again (1 GiB at LLaDA's shape), so pieces stay few
HEAD_POSITIONS = 128


def gumbel_noise(shape, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard Gumbel noise in float64: ``-log(E)`` with ``E ~ Exp(1)`` (computed in place)."""
    exponential = torch.empty(shape, dtype=torch.float64, device=device).exponential_(generator=generator)
    return exponential.clamp_min_(torch.finfo(torch.float64).tiny).log_().neg_()


def sample_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None):
    """``(tokens, log_confidence)`` for logits ``[..., V]``: Gumbel-max sampling at ``temperature`` (argmax at 0).

    ``log_confidence`` is ``log softmax(logits)[token]`` (untempered, as the remasking rule ranks it), in
    float32. On CUDA one kernel does it (``hf_grpo.diffusion.gumbel_max``). Elsewhere the vocabulary is
    taken ``NOISE_ELEMENTS // positions`` columns at a time, each slice in float64 with its own noise: a
    running maximum (ties to the lower token id, as ``argmax``) and a running log-sum-exp give what one
    pass over ``[..., V]`` would, without its float64 copies.
    """
    flat = logits.reshape(-1, logits.size(-1))
    if gumbel_max_usable(flat):  # CUDA: one kernel, no float64 tensors (its own Philox noise)
        tokens, log_confidence = gumbel_max(flat, temperature, generator)
        return tokens.view(logits.shape[:-1]), log_confidence.view(logits.shape[:-1])
    positions, vocab = flat.shape
    width = max(1, NOISE_ELEMENTS // max(positions, 1))
    best = tokens = None
    normalisers = []
    for begin in range(0, vocab, width):
        piece = flat[:, begin:begin + width].to(torch.float64, copy=True)  # copy: the ops below are in place
        normalisers.append(piece.logsumexp(dim=-1))
        if temperature > 0:
            piece.div_(temperature).add_(gumbel_noise(piece.shape, piece.device, generator))
        value, index = piece.max(dim=-1)
        index += begin
        if best is None:
            best, tokens = value, index
        else:
            better = value > best  # strictly: an equal value in a later slice has the higher token id
            best, tokens = torch.where(better, value, best), torch.where(better, index, tokens)
        del piece
    normaliser = normalisers[0] if len(normalisers) == 1 else torch.stack(normalisers, dim=-1).logsumexp(dim=-1)
    log_confidence = (flat.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double() - normaliser).float()
    return tokens.view(logits.shape[:-1]), log_confidence.view(logits.shape[:-1])


def commit_topk(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, n]``: the ``k[b]`` highest ``scores[b]`` of each row (ties to the lower index), no host sync."""
    order = scores.argsort(dim=1, descending=True, stable=True)
    positions = torch.arange(scores.size(1), device=scores.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(1, order, positions)
    return ranks < k.unsqueeze(1)
