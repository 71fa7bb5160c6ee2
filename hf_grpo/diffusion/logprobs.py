"""Per-token log-probability estimates of a masked-diffusion policy (diffu-GRPO, d1), chunked and seeded per row.

**mean_field** (d1's one-step estimate): every completion slot is masked, each prompt token is masked
independently with probability ``p_mask_prompt``, and one forward gives
``log pi(o_j | q') = log_softmax(f(q', masks))[j, o_j]`` for every completion token ``o_j``.

**coupled** (coupled-GRPO, lower variance): a ratio ``t ~ U[0.2, 0.8]`` and uniform scores ``u_j`` split
the completion slots into two complementary masks ``{u_j < t}`` and ``{u_j >= t}``; two forwards, each
showing the completion tokens the other one hides, and every token is scored in the forward where it is
masked (so exactly once). Slots past a completion's end stay masked in both forwards. The prompt mask
(``p_mask_prompt``) is shared by the two forwards.

**Randomness.** A row's masks come from a ``torch.Generator`` (CPU, so the draw is the same on any
device) seeded with that row's own seed, never from the global RNG. Seeds are derived
(``mask_seed``) from (base seed, global rollout index, iteration k, global row index), so the estimate of
a row does not depend on how rows are chunked, on the other rows of its micro-batch, or on the number of
processes. Draw order per row: [coupled: t, then L scores], then one score per prompt token.

**Models that ignore the padding mask** (``spec.attends_to_padding``): rows of equal prompt length go
through the model together, ``row_chunk`` at a time, so no forward holds padding and a row gets the
numbers it gets alone, whichever rows share its chunk.

**Memory.** Rows go through the model ``row_chunk`` at a time; the LM head sees only the scored tokens,
``tensor_batch_size`` of them at a time, through ``hf_grpo.ops.chunked_logprobs`` (no ``[B, T, V]``
logits tensor; forward and backward). Models whose forward computes logits without calling their head
module fall back to real logits (still reduced ``tensor_batch_size`` rows at a time).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..ops import chunked_logprobs
from ..runtime.collectives import max_over_ranks
from .model import (
    HeadBypass,
    accepts_kwarg,
    equal_length_groups,
    pack_rows,
    padding_kwargs,
    slot_columns,
)

ESTIMATORS = ("mean_field", "coupled")
COUPLED_RATIO_RANGE = (0.2, 0.8)


def mask_seed(base_seed: int, rollout: int | str, iteration: int, row: int) -> int:
    """A 63-bit seed for one row's masks at one iteration: a hash of (base seed, rollout, iteration, global row)."""
    key = f"hf_grpo.diffusion:{int(base_seed)}:{rollout}:{int(iteration)}:{int(row)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def rollout_mask_seeds(base_seed: int, rollout: int | str, global_rows, iterations: int) -> torch.Tensor:
    """``[rows, iterations]`` int64 (CPU) seeds for the given global row indices of one rollout."""
    return torch.tensor(
        [[mask_seed(base_seed, rollout, k, row) for k in range(iterations)] for row in global_rows], dtype=torch.long
    ).reshape(len(global_rows), iterations)


@dataclass
class EstimatorSpec:
    """Everything the estimator needs besides the model and the batch."""

    mask_token_id: int
    pad_token_id: int
    completion_slots: int  # L: the completion length the sampler generated (max_completion_length)
    p_mask_prompt: float = 0.0
    logits_shift: bool = False
    estimator: str = "mean_field"
    temperature: float = 1.0
    tensor_batch_size: int | None = None
    padding_style: str = "mask2d"
    # the model attends to padding whatever mask it is given (the released LLaDA code): rows of equal prompt
    # length run together, so no row is ever padded
    attends_to_padding: bool = False

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")

    @property
    def seed_independent(self) -> bool:
        """True when no mask is random (mean_field without prompt masking): one seed's estimate serves all."""
        return self.estimator == "mean_field" and self.p_mask_prompt == 0


@dataclass
class _RowDraws:
    prompt_scores: torch.Tensor | None  # [b, T] CPU, uniform scores at prompt columns (2.0 elsewhere)
    slot_first: torch.Tensor | None  # [b, L] CPU bool: coupled, slot masked in the first forward


def _draw(seeds: list[int], lengths: list[int], total: int, spec: EstimatorSpec) -> _RowDraws:
    rows = len(seeds)
    prompt_scores = torch.full((rows, total), 2.0) if spec.p_mask_prompt > 0 else None
    slot_first = torch.zeros((rows, spec.completion_slots), dtype=torch.bool) if spec.estimator == "coupled" else None
    if prompt_scores is None and slot_first is None:
        return _RowDraws(None, None)
    generator = torch.Generator(device="cpu")
    low, high = COUPLED_RATIO_RANGE
    for row, (seed, length) in enumerate(zip(seeds, lengths)):
        generator.manual_seed(int(seed))
        if slot_first is not None:
            ratio = low + (high - low) * torch.rand((), generator=generator)
            slot_first[row] = torch.rand(spec.completion_slots, generator=generator) < ratio
        if prompt_scores is not None and length:
            prompt_scores[row, :length] = torch.rand(length, generator=generator)
    return _RowDraws(prompt_scores, slot_first)


def _views(packed, draws: _RowDraws, completion_ids, completion_mask, spec: EstimatorSpec):
    """``[(input_ids, scored [b, C] bool)]``: one view for mean_field, two complementary ones for coupled."""
    device = packed.input_ids.device
    base = packed.input_ids
    if draws.prompt_scores is not None:
        hide = (draws.prompt_scores.to(device, non_blocking=True) < spec.p_mask_prompt) & packed.prompt_positions
        base = base.masked_fill(hide, spec.mask_token_id)
    scored = completion_mask.bool()
    if spec.estimator == "mean_field":
        return [(base, scored)]
    width = completion_ids.size(1)
    columns = slot_columns(packed.start, 0, width, shift=False)  # [b, C] slots that can hold a completion token
    first = draws.slot_first[:, :width].to(device, non_blocking=True)
    views = []
    for hidden_here in (first, ~first):
        shown = scored & ~hidden_here  # completion tokens this forward sees; the rest stay masked
        tokens = torch.where(shown, completion_ids, torch.full_like(completion_ids, spec.mask_token_id))
        views.append((base.scatter(1, columns, tokens), scored & hidden_here))
    return views


def _score(states, picked_mask, targets, bypass: HeadBypass, spec: EstimatorSpec, return_entropy: bool):
    """Log-probs (and entropies) of ``targets[picked_mask]`` from the picked hidden states / logits."""
    rows = states[picked_mask]  # [N, H] (or [N, V] without a head bypass)
    wanted = targets[picked_mask]
    if bypass.bypassed:
        head = bypass.head
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        gather = lambda: maybe_gather_lm_head_ctx(head.weight, head.bias)  # noqa: E731 (ZeRO-3: the full head)
        with gather():
            return chunked_logprobs(
                rows.to(head.weight.device), head.weight, wanted.to(head.weight.device),
                chunk_rows=spec.tensor_batch_size, temperature=spec.temperature, bias=head.bias,
                return_entropy=return_entropy, param_context=gather,
            )
    # Real logits (the head could not be bypassed): reduce them a chunk of rows at a time.
    step = spec.tensor_batch_size or max(rows.size(0), 1)
    logps, entropies = [], []
    for begin in range(0, rows.size(0), step):
        logits = rows[begin:begin + step].float() / spec.temperature
        log_softmax = logits.log_softmax(dim=-1)
        logps.append(log_softmax.gather(-1, wanted[begin:begin + step, None]).squeeze(-1))
        if return_entropy:
            entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))
    logp = torch.cat(logps) if logps else rows.new_zeros(0, dtype=torch.float32)
    if not return_entropy:
        return logp
    return logp, (torch.cat(entropies) if entropies else rows.new_zeros(0, dtype=torch.float32))


def masked_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    seeds: torch.Tensor,
    spec: EstimatorSpec,
    *,
    row_chunk: int | None = None,
    return_entropy: bool = False,
    unwrapped: torch.nn.Module | None = None,
    autocast=None,
):
    """Estimated ``log pi(o_j | q)`` ``[B, C]`` (and entropies) for left-padded prompts and right-padded completions.

    ``seeds`` ``[B]`` (CPU int64) are the rows' mask seeds for this iteration. ``model`` is what is called
    (a DDP / DeepSpeed / PEFT wrapper is fine); ``unwrapped`` is the module whose head is used (default:
    ``model``). Completion slots number ``spec.completion_slots`` (the generation length), whatever ``C``.
    """
    unwrapped = model if unwrapped is None else unwrapped
    rows = prompt_ids.size(0)
    completion = completion_ids.size(1)
    if completion > spec.completion_slots:
        raise ValueError(f"completions are {completion} tokens long but only {spec.completion_slots} slots were "
                         f"generated (max_completion_length)")
    lengths = prompt_mask.long().sum(dim=1).tolist()  # one host read for the whole batch
    if spec.logits_shift and rows and min(lengths) == 0:
        raise ValueError("a model with shifted logits (Dream) needs at least one prompt token per row")
    seed_list = [int(s) for s in seeds.tolist()]
    extra = {"use_cache": False} if accepts_kwarg(unwrapped, "use_cache") else {}
    bypass = HeadBypass(unwrapped)
    out_logps, out_entropy = [], []
    pieces = _row_pieces(lengths, row_chunk, spec.attends_to_padding)
    # grouped by length, ranks hold different numbers of pieces: agree on the largest BEFORE any forward (where
    # forwards are collective, a rank must not wait in this all-reduce while another waits in a forward)
    idle = max_over_ranks(len(pieces)) - len(pieces) if spec.attends_to_padding else 0
    for rows_here in pieces:
        index = rows_here if isinstance(rows_here, slice) else torch.tensor(rows_here, device=prompt_ids.device)
        logp, entropy = _estimate_rows(
            model, prompt_ids[index], prompt_mask[index], completion_ids[index], completion_mask[index],
            [seed_list[row] for row in _as_list(rows_here)], [lengths[row] for row in _as_list(rows_here)],
            spec, bypass, extra, return_entropy, autocast,
        )
        out_logps.append(logp)
        if return_entropy:
            out_entropy.append(entropy)
    logps = torch.cat(out_logps) if out_logps else completion_ids.new_zeros(completion_ids.shape, dtype=torch.float32)
    entropies = (torch.cat(out_entropy) if out_entropy else torch.zeros_like(logps)) if return_entropy else None
    if spec.attends_to_padding and rows:  # the pieces are in group order: put the rows back in theirs
        order = torch.tensor([row for piece in pieces for row in piece], device=logps.device)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(rows, device=logps.device))
        logps = logps[inverse]
        entropies = entropies[inverse] if return_entropy else None
    for _ in range(idle):
        # as many forwards as the busiest rank: the extra ones score row 0 again, weighted 0 (their backward runs
        # too, so ZeRO-3's per-layer gathers line up), and change nothing
        again = _estimate_rows(model, prompt_ids[:1], prompt_mask[:1], completion_ids[:1], completion_mask[:1],
                               seed_list[:1], lengths[:1], spec, bypass, extra, False, autocast)[0]
        logps = logps + 0.0 * again.sum()
    return (logps, entropies) if return_entropy else logps


def _row_pieces(lengths: list[int], row_chunk: int | None, equal_lengths: bool):
    """Slices of ``row_chunk`` consecutive rows; or, for a model that attends to padding, lists of row indices
    of equal prompt length (``row_chunk`` at most), so that no piece needs padding."""
    if equal_lengths:
        return equal_length_groups(lengths, row_chunk)
    step = row_chunk or max(len(lengths), 1)
    return [slice(begin, min(begin + step, len(lengths))) for begin in range(0, len(lengths), step)]


def _as_list(rows) -> list[int]:
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows


def _estimate_rows(model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds: list[int],
                   lengths: list[int], spec: EstimatorSpec, bypass: HeadBypass, extra: dict, return_entropy: bool,
                   autocast):
    """``(logp, entropy or None)`` ``[b, C]`` of one piece of rows, in one forward per view."""
    width = prompt_ids.size(1)
    completion = completion_ids.size(1)
    longest = max(lengths)
    prompt_chunk = prompt_ids[:, width - longest:]  # drop columns that are padding in every row
    packed = pack_rows(prompt_chunk, prompt_mask[:, width - longest:], spec.completion_slots,
                       spec.mask_token_id, spec.pad_token_id, has_padding=any(length != longest for length in lengths))
    draws = _draw(seeds, lengths, packed.input_ids.size(1), spec)
    read_from = slot_columns(packed.start, 0, completion, shift=spec.logits_shift)  # [b, C]
    logp = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    entropy = torch.zeros_like(logp) if return_entropy else None
    forward_kwargs = {**padding_kwargs(spec.padding_style, packed.valid), **extra}
    for input_ids, scored in _views(packed, draws, completion_ids, completion_mask, spec):
        with bypass, (autocast() if autocast else _null()):
            bypass.reset()
            output = model(input_ids=input_ids, **forward_kwargs)
            states = output.logits if hasattr(output, "logits") else output[0]
            picked = states.gather(1, read_from.unsqueeze(-1).expand(-1, -1, states.size(-1)))  # [b, C, H]
            result = _score(picked, scored, completion_ids, bypass, spec, return_entropy)
        values, ent = result if return_entropy else (result, None)
        # masked_scatter keeps the graph connected even when a view scores no token
        logp = logp + logp.new_zeros(logp.shape).masked_scatter(scored, values.float())
        if return_entropy:
            entropy = entropy + entropy.new_zeros(entropy.shape).masked_scatter(scored, ent.float())
    return logp, entropy


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
