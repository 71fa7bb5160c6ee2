"""Token-budget micro-batches: ``max_tokens_per_micro_batch`` packs each micro-batch into forward/backward passes.

What the user gets (veRL's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``): the ``per_device_train_batch_size``
completions of one ``training_step`` are run in as many forward/backward passes as it takes to keep each pass
at most ``max_tokens_per_micro_batch`` tokens, instead of all at once. Peak activation memory follows the
budget, not the longest completion times the batch size, and short completions share a pass.

Design (read against trl 1.16.0 / transformers 5.24):

* Where the packing happens. The Trainer runs exactly ``gradient_accumulation_steps`` (A) ``training_step``
  calls per optimizer step, and TRL's ``_prepare_inputs`` hands each call one micro-batch of P completions.
  Packing stays inside that call: ``compute_loss`` splits its P rows into passes, backpropagates all but the
  last itself (``accelerator.backward``, gradient sync deferred) and returns the last pass's loss for the
  Trainer's own backward. The rollout, the buffers, the optimizer-step boundary and A are TRL's, unchanged.
  So P x A x W stays the optimizer batch, and P becomes "completions per accumulation step" (set it large,
  and let the budget bound memory, as veRL users set ppo_mini_batch_size and the token budget).

* The fixed-size gradient. TRL's loss for one micro-batch of P rows (B below) is, per loss type
  (``_compute_loss``; ``loss_is_scaled_for_ga = True``, so the Trainer does not rescale it):

  =====================  ==============================================================  ====================
  loss_type              loss of one micro-batch m of B rows                             scale of a pass b
  =====================  ==============================================================  ====================
  grpo, sapo             (1/B) sum_i [ sum_t l_it / n_i ] / A      (per-sequence mean)   rows(b) / B
  luspo                  (1/B) sum_i sum_t l_it / A                                       rows(b) / B
  dr_grpo                sum_it l_it / (B * max_completion_length) / A                    rows(b) / B
  bnpo                   sum_it l_it / max(T_m, 1) / A             (token mean over m)    max(T_b,1)/max(T_m,1)
  dapo, cispo, vespo     sum_it l_it / (N / W * A / S)  (N: the rollout's tokens, global)  1
  =====================  ==============================================================  ====================

  (l_it masked by the completion and tool masks, n_i the row's tokens, T the masked tokens.) Each is a sum
  of per-row terms times a constant of the whole micro-batch: TRL's loss over a pass b has the same
  per-row terms with the pass's own constant, so multiplying it by the "scale" column makes the sum over
  passes equal to the micro-batch's loss, term by term, for every loss type. Types normalised by a global
  count (dapo, cispo, vespo) are packing-invariant as they stand; the others are made so by the scale.
  Because the partition of the rollout into micro-batches is TRL's own, even bnpo's per-micro-batch token
  mean is reproduced exactly. The loss returned to the Trainer (and logged) is the micro-batch's loss too.

* What cannot be kept exact with one scale per pass, and is refused (``config_problems``, trainer init):
  the entropy bonus (``entropy_coef`` / ``use_adaptive_entropy``) is a token mean over the micro-batch added
  to the policy loss; it takes the same scale as the policy term only for ``bnpo`` (both are token means
  over the same mask), so other loss types refuse it (with bnpo, ``use_adaptive_entropy`` stays exact too:
  passes before the last run with ``sync_gradients`` off, so TRL's controller still closes its window once,
  on the optimizer step's last pass). ``top_entropy_quantile < 1`` takes a quantile of the
  micro-batch's entropies across ranks: it depends on which rows share a pass, refused. A MoE router's
  auxiliary loss (``router_aux_loss_coef`` with ``output_router_logits``) is a statistic of each forward,
  refused. Multimodal inputs and subclasses that replace ``_compute_loss`` (the diffusion trainer) are refused.

* Packing. A pass is one padded tensor of rows x (longest prompt + longest completion among them): that
  rectangle, after cutting the padding its rows do not use, is what the budget bounds (the memory the
  forward sees, not the count of real tokens). Rows are sorted longest first and packed first-fit
  (first-fit-decreasing) to find how many passes this rank needs; the ranks agree on the largest count K
  (one all-gather of an int), and each rank then spreads its rows over exactly K passes, each row to the
  pass with the least cost that still fits (balanced passes, lower peak). If that greedy fails where
  first-fit did not, first-fit's passes are used and padded to K. A rank with fewer rows than K runs
  zero-weight passes: one real row with its completion mask zeroed, loss times 0, so the forward/backward
  still happens (DDP's and ZeRO's collectives, and TRL's metric all-reduces inside ``_compute_loss``, line
  up on every rank) and adds exactly zero gradient and nothing to the masked metrics. TRL also gathers one
  value per row for two clip-ratio metrics; passes of unequal rows are padded with NaN for that gather
  (``uneven_row_gathers``), which TRL's nanmin/nanmax skip.

* Groups. No TRL 1.16 loss type needs a prompt group inside one pass: advantages are computed over the whole
  rollout before it is split, and TRL itself shuffles the rollout before cutting micro-batches. So rows are
  packed freely.

* Ranks. Rows stay on the rank that generated them (moving them would be an all-to-all of ids, masks and
  log-probs); only the number of passes is made equal across ranks.

* Padding and positions. Cutting the right padding of completions is exact (a causal model's earlier
  positions do not see later ones). Cutting a pass's common left padding of prompts shifts every position
  of its rows by the same amount: with RoPE (every current LM) attention depends only on position
  differences, so the result is the same up to rounding; transformers computes RoPE angles in float32 even
  for a float64 model, so that rounding is about 1e-7 relative (the tests compute the angles in float64 and
  get 1e-12). TRL's own micro-batches already carry the padding of the whole rollout, so a row's absolute
  positions depend on its batch there too.

* Logged metrics. TRL appends its metrics (entropy, KL, clip ratios) once per ``_compute_loss`` call, so with
  a budget they are averaged over passes instead of micro-batches: close, not equal. The logged loss is
  the micro-batch's loss, exactly.

* TRL's no-grad scoring of the rollout (old-policy log-probs when ``num_iterations > 1`` or
  ``steps_per_generation > gradient_accumulation_steps``, reference log-probs when ``beta != 0``) runs
  ``per_device_train_batch_size`` rows of the rollout's full padded width at a time; the trainer runs twice
  those rows a chunk (no activations are kept for backward), and with a budget ``2 x budget // width``
  (``scoring_rows``).

* A row longer than the budget cannot be run in any pass: a ``ValueError`` names ``max_tokens_per_micro_batch``,
  the budget and the row's tokens (no silent pass over budget, which is the memory the user capped).
  ``config_problems`` refuses a budget below ``max_completion_length + 1`` up front, and ``check_longest_row``
  (at train start) one below the training set's longest prompt + ``max_completion_length``.

Which rows go into which pass, and each pass's loss scale, are planned in ``hf_grpo.memory.packing``; this
module checks the settings and runs the passes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from accelerate.utils import DistributedType

from ..run_state import RunFacts
from ..runtime import upstream
from ..runtime.collectives import min_over_ranks
from .packing import (  # noqa: F401 (re-exported: the planning names are token_budget's too)
    FIELD,
    LOSS_TYPES,
    TOKEN_MEAN_LOSSES,
    Extents,
    Pass,
    build_passes,
    extents,
    first_fit_decreasing,
    pass_scale,
    pass_tokens,
    plan_passes,
)

# ---- configuration --------------------------------------------------------------------------
def config_problems(config: Any) -> list[str]:
    """Why ``config`` cannot run token-budget micro-batches exactly (empty when it can, or when unset)."""
    budget = getattr(config, FIELD, None)
    if budget is None:
        return []
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        return [(f"{FIELD} must be a positive integer (tokens per forward/backward pass on each device) or None "
                 f"to run each micro-batch in one pass, got {budget!r}")]
    found = []
    loss_type = config.loss_type
    if loss_type not in LOSS_TYPES:
        found.append(f"{FIELD} supports loss_type in {LOSS_TYPES}, got loss_type={loss_type!r}")
    if budget < config.max_completion_length + 1:
        found.append(
            f"{FIELD} ({budget}) must be at least max_completion_length ({config.max_completion_length}) + 1 "
            f"= {config.max_completion_length + 1}: one completion of full length, with a one-token prompt, must "
            f"fit in a pass; set {FIELD} >= your longest prompt + max_completion_length"
        )
    if config.top_entropy_quantile < 1.0:
        found.append(
            f"{FIELD} cannot be combined with top_entropy_quantile={config.top_entropy_quantile}: the entropy "
            f"quantile is taken over the tokens of each forward pass, so splitting a micro-batch would change "
            f"which tokens train; set top_entropy_quantile=1.0 or {FIELD}=None"
        )
    entropy_bonus = config.entropy_coef != 0.0 or config.use_adaptive_entropy
    if entropy_bonus and loss_type not in TOKEN_MEAN_LOSSES:
        found.append(
            f"{FIELD} with an entropy bonus (entropy_coef={config.entropy_coef}, use_adaptive_entropy="
            f"{config.use_adaptive_entropy}) is exact only for loss_type='bnpo' (the bonus is a token mean over the "
            f"micro-batch, which only bnpo's policy term shares), got loss_type={loss_type!r}; use loss_type='bnpo', "
            f"entropy_coef=0.0 and use_adaptive_entropy=False, or {FIELD}=None"
        )
    return found


def check_config(config: Any) -> None:
    found = config_problems(config)
    if found:
        raise ValueError("Invalid token-budget settings:\n  - " + "\n  - ".join(found))


# ---- TRL's no-grad scoring ------------------------------------------------------------------------
# A no-grad forward keeps nothing for backward: at any moment it holds one layer's activations, about 4 x hidden
# + 4 x intermediate values a token, where a training row holds every layer's input (activation checkpointing)
# plus one layer's activations and their gradients: counting those values, 2.3x as much for Qwen2-0.5B, 2.5x
# for Qwen2-7B, 3.3x for Llama-3-8B (more without checkpointing), the parameters' gradients on top. So a
# scoring chunk of twice the micro-batch's rows stays within the memory of the micro-batch's backward, and the
# rollout is scored in half the forwards (each a layer-by-layer series of launches: the host's time).
SCORING_ROWS_PER_TRAINING_ROW = 2
# Attention that materialises its scores (transformers' "eager") holds rows x heads x width^2 values in the
# scoring forward as in the training one: no room there for twice the rows.
_SCORES_MATERIALISED = ("eager",)


def scoring_rows(rows: int, width: int, budget: int | None, attention: str | None, dropout: str | None = None) -> int:
    """Rows per chunk of TRL's no-grad log-prob scoring (old policy, reference).

    TRL scores the rollout at its full padded ``width``, ``rows`` (P) at a time; rows are independent, so without
    active dropout any chunking gives the same log-probs. The chunk is ``SCORING_ROWS_PER_TRAINING_ROW`` x P rows,
    or P where the model's ``attention`` materialises its scores or where ``dropout`` is active (``active_dropout``:
    each chunking draws other masks from the random stream, so only TRL's own P gives TRL's numbers); with a token
    ``budget`` it holds at most that many times the budget's tokens. At least one row, even if the padded width
    exceeds the budget.
    """
    factor = 1 if attention in _SCORES_MATERIALISED or dropout else SCORING_ROWS_PER_TRAINING_ROW
    if budget is None:
        return factor * rows
    return max(1, min(factor * rows, factor * budget // width))


def active_dropout(model: torch.nn.Module) -> str | None:
    """Where ``model``'s forward draws dropout masks (a module in train mode with a probability above 0), or None.

    ``disable_dropout=True`` sets every ``nn.Dropout`` to 0; a model in eval mode (TRL's reference) draws none.
    Attention dropout given as a number (``attention_dropout``, read by the attention function) counts too."""
    for name, module in model.named_modules():
        if not module.training:
            continue
        # read without getattr, whose miss on a module raises inside torch (most of this walk's time, 2,333 modules
        # at 28 layers with LoRA); a float field lives in the instance or on its class
        p = module.p if isinstance(module, torch.nn.modules.dropout._DropoutNd) else vars(module).get(
            "attention_dropout", getattr(type(module), "attention_dropout", None))
        if isinstance(p, float) and p > 0:
            kind = "" if isinstance(module, torch.nn.modules.dropout._DropoutNd) else ", its attention_dropout"
            return f"{name or type(module).__name__} (p={p}{kind})"
    return None


def scoring_chunk_rows(model: torch.nn.Module, rows: int, width: int, budget: int | None) -> tuple[int, str]:
    """``scoring_rows`` for ``model`` (its attention and dropout read off it), and why the chunk is that size."""
    attention = upstream.attention_implementation(getattr(model, "config", None))
    dropout = active_dropout(model)
    chunk = scoring_rows(rows, width, budget, attention, dropout)
    if dropout:
        lift = ("attention_dropout=0 in the model's config lifts this" if "attention_dropout" in dropout
                else "disable_dropout=True lifts this")
        why = (f"TRL's chunks of per_device_train_batch_size rows: dropout is active in train mode ({dropout}) and "
               f"another chunking would draw other masks than TRL's ({lift})")
    elif attention in _SCORES_MATERIALISED:
        why = f"chunks of per_device_train_batch_size rows: attn_implementation={attention!r} materialises its scores"
    else:
        why = f"chunks of {SCORING_ROWS_PER_TRAINING_ROW} x per_device_train_batch_size rows (no-grad forwards)"
    return chunk, why + (" within max_tokens_per_micro_batch" if budget is not None else "")


def scoring_batch_size(model: torch.nn.Module, rows: int, width: int, budget: int | None, logged: set[str],
                       main: bool) -> int:
    """The chunk of TRL's no-grad scoring (``scoring_chunk_rows``), each reason logged once (on ``main``; ``logged``
    holds those already said). The same on every rank where a budget makes widths matter: each chunk's head agrees
    on out-of-memory with the other ranks (``memory.oom``), so unequal chunk counts would leave a rank waiting."""
    chunk, why = scoring_chunk_rows(model, rows, width, budget)
    if why not in logged and main:
        logging.getLogger("hf_grpo").info("old-policy / reference log-probs: %s", why)
    logged.add(why)
    return chunk if budget is None else min_over_ranks(chunk)


# ---- running the passes under Accelerate --------------------------------------------------------
def agree_on_count(accelerator) -> Callable[[int], int]:
    """The largest pass count over the ranks (one all-gather of an int)."""

    def agree(count: int) -> int:
        if accelerator.num_processes == 1:
            return count
        counts = accelerator.gather(torch.tensor([count], device=accelerator.device))
        return int(counts.max())

    return agree


@contextlib.contextmanager
def deferred_sync(accelerator, model) -> Iterator[None]:
    """Accumulate this pass's gradient locally, as the Trainer does for a micro-batch before the last.

    On the optimizer step's last micro-batch the Trainer lets the backward all-reduce (DDP) and DeepSpeed
    step; every pass but the last of that micro-batch must not, so sync is switched off around it.
    """
    state = accelerator.gradient_state
    if not state.sync_gradients:  # not the step's last micro-batch: the Trainer already defers
        yield
        return
    upstream.set_sync_gradients(state, False)  # DeepSpeed: no boundary, no engine.step (accelerate reads this flag)
    try:
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            yield  # the Trainer never uses no_sync under DeepSpeed either
        else:
            with accelerator.no_sync(model):
                yield
    finally:
        upstream.set_sync_gradients(state, True)


@contextlib.contextmanager
def uneven_row_gathers(accelerator) -> Iterator[None]:
    """Let TRL gather per-row tensors of passes whose row counts differ across ranks.

    Inside ``_compute_loss`` TRL gathers one value per row for its clip-ratio metrics (``clip_ratio/low_min``,
    ``high_max``); a collective needs equal shapes on every rank, and passes hold different numbers of rows.
    Floating rows are padded with NaN first (one more small all-gather, of the sizes), which TRL's
    ``nanmin``/``nanmax`` over the gathered values skip.
    """
    if accelerator.num_processes == 1:
        yield
        return
    own = vars(accelerator).get("gather")
    real = accelerator.gather

    def gather(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.ndim >= 1 and tensor.is_floating_point():
            tensor = accelerator.pad_across_processes(tensor, dim=0, pad_index=float("nan"))
        return real(tensor)

    accelerator.gather = gather
    try:
        yield
    finally:
        if own is None:
            del accelerator.gather
        else:
            accelerator.gather = own


def run_passes(passes: list[Pass], compute: Callable[[dict], torch.Tensor], backward: Callable[[torch.Tensor], None],
               defer: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
    """Backpropagate every pass but the last; return the last pass's scaled loss plus the others' (detached).

    The returned value is the micro-batch's loss; its gradient is the last pass's, which the Trainer's own
    backward adds to the ones accumulated here.
    """
    done = None
    for item in passes[:-1]:
        with defer():
            loss = compute(item.inputs) * item.scale
            backward(loss)
        done = loss.detach() if done is None else done + loss.detach()
    last = passes[-1]
    loss = compute(last.inputs) * last.scale
    return loss if done is None else loss + done


def packed_loss(accelerator, model, inputs: Mapping[str, Any], budget: int, loss_type: str,
                compute: Callable[[dict], torch.Tensor]) -> torch.Tensor:
    """One training micro-batch run in token-budget passes; ``compute`` is TRL's ``compute_loss`` bound to ``model``.

    Returns what TRL's ``compute_loss`` would return for the whole micro-batch (value and, with the backward
    already done here, gradient); the Trainer backpropagates it as usual.
    """
    passes = build_passes(inputs, budget, loss_type, agree_on_count(accelerator))
    # Transformers' training_step passes this for DeepSpeed: TRL's loss is already scaled for accumulation.
    kwargs = {"scale_wrt_gas": False} if accelerator.distributed_type == DistributedType.DEEPSPEED else {}
    with uneven_row_gathers(accelerator):
        return run_passes(passes, compute, lambda loss: accelerator.backward(loss, **kwargs),
                          lambda: deferred_sync(accelerator, model))


def check_longest_row(budget: int | None, max_completion_length: int,
                      longest_prompt: Callable[[], int | None]) -> None:
    """Refuse at train start a ``budget`` (the run's ``max_tokens_per_micro_batch``) that the training set's longest
    prompt with a full-length completion exceeds.

    Such a row cannot run in any pass (``_check_rows_fit``); found at the first step that samples it, the error
    would end a run hours in. ``longest_prompt()`` scans the training set, so it is asked only when a budget is
    set; it gives None when the trainer could not scan the prompts.
    """
    if budget is None:
        return
    longest = longest_prompt()
    if longest is None:
        return
    needed = longest + max_completion_length
    if needed > budget:
        raise ValueError(
            f"{FIELD}={budget} cannot hold the training set's longest prompt ({longest} tokens) with a "
            f"completion of max_completion_length={max_completion_length} tokens: {needed} tokens in one "
            f"row; set {FIELD} >= {needed}, lower max_completion_length, or drop the longest prompts"
        )


def run_problems(facts: RunFacts, budget: int) -> list[str]:
    """What only the built trainer knows that ``budget`` cannot run exactly with: a router aux loss, a replaced
    loss."""
    found = []
    if facts.replaced_loss is not None:
        found.append(
            f"{FIELD}={budget} is not supported by {facts.replaced_loss}: it replaces TRL's GRPO loss, whose "
            f"normalisation the token-budget passes reproduce; set {FIELD}=None"
        )
    if facts.aux_loss_enabled:
        found.append(
            f"{FIELD}={budget} cannot be combined with the MoE router's auxiliary loss (router_aux_loss_coef="
            f"{facts.router_aux_loss_coef}): it is a statistic of each forward pass, so splitting a "
            f"micro-batch would change it; set router_aux_loss_coef=0.0 or {FIELD}=None"
        )
    return found


def check_run(facts: RunFacts, budget: int | None) -> None:
    """Refuse, at trainer init, what only the built trainer knows (``run_problems``) for the configured budget."""
    found = [] if budget is None else run_problems(facts, budget)
    if found:
        raise ValueError(found[0])
