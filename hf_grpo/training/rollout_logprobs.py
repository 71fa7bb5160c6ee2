"""The sampler's log-probs against the trainer's: measured, and used as the old policy's where they stand in for it.

hf_grpo's decoder samples on the weights being trained, in the same process, and records each token's log-prob
under the law it drew from (``generation.Completions``); TRL receives them as ``sampling_per_token_logps``.

* **Measured** (``mismatch``), at no extra forward, on a pass TRL runs anyway at the rollout's weights: the
  old-policy pass where TRL runs one, else the training forward of the micro-batches before the first optimizer
  step after the rollout. Per token: |sampler - trainer| (mean, p99, max) and the share of tokens whose ratio
  exp(trainer - sampler) leaves TRL's clip band [1 - epsilon_low, 1 + epsilon_high]. Reduced over the processes
  once per rollout and at each log (every rank calls ``flush`` at the same points), logged as ``rollout_logprobs/*``
  and TRL's ``sampling/sampling_logp_difference/mean|max``.
* **Used** (``old_logprobs_source``): where TRL would run its no-grad old-policy forward (``num_iterations`` > 1,
  or steps not aligned with rollouts), "sampler" returns the sampler's log-probs instead of running it;
  "recompute" runs it as TRL does; "auto" uses the sampler's where they are the trainer's law (no top-k, top-p,
  min-p or repetition penalty) and the last measured rollout was within ``old_logprobs_tolerance`` (p99) with no
  token outside the clip band, else recomputes. Each choice is logged with its reason when it changes.

The old-policy pass is recognised by TRL 1.16's order: after a rollout, its first no-grad scoring of the policy
(``_get_per_token_logps_and_entropies(self.model, ..., batch_size=...)``) is the old-policy pass, which runs before
the reference's (that one scores the policy too under PEFT, with the adapters off). A pass is only "armed" on the
steps where TRL's own condition runs it (``old_pass_runs``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("hf_grpo")

SOURCES = ("auto", "sampler", "recompute")
SOURCE_FIELD = "old_logprobs_source"
TOLERANCE_FIELD = "old_logprobs_tolerance"
CORRECTION_FIELD = "sampler_importance_sampling_correction"


@dataclass
class RolloutLogprobFields:
    r"""
    ``GRPOConfig``'s fields for the sampler's log-probs (see ``docs/logprobs.md``).

    Parameters:
        old_logprobs_source (`str`, *optional*, defaults to `"auto"`):
            Where TRL would run its no-grad old-policy forward (``num_iterations`` > 1, or steps not aligned with
            rollouts): ``"sampler"`` uses the log-probs hf_grpo's decoder recorded while sampling instead (no
            forward); ``"recompute"`` runs the forward as TRL does; ``"auto"`` uses the sampler's where they are the
            trainer's law (no top-k, top-p, min-p, repetition penalty) and the last measured rollout's p99
            |sampler - trainer| is within ``old_logprobs_tolerance`` with no token outside the clip band, else
            recomputes. Where TRL runs no old-policy pass (its defaults) no setting adds one.
        old_logprobs_tolerance (`float`, *optional*, defaults to `0.01`):
            For ``"auto"``: the largest p99 |sampler - trainer| log-prob difference a rollout may show for the next
            rollout's old-policy pass to be skipped (0.01: the ratio off by 1% or less for 99% of tokens, a
            twentieth of TRL's default clip band).
        sampler_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            TRL's vLLM importance-sampling correction for hf_grpo's own backends, with TRL's fields
            (``vllm_importance_sampling_mode``, ``_clip_min``, ``_clip_max``); as under vLLM it needs the
            trainer's log-probs of each rollout, so the old-policy forward runs every rollout.
    """

    old_logprobs_source: str = field(default="auto", metadata={
        "help": f"One of {SOURCES}: where TRL runs its old-policy forward (num_iterations > 1), 'sampler' uses the "
        "decoder's recorded log-probs instead, 'recompute' runs it, 'auto' uses the sampler's where measured within "
        "old_logprobs_tolerance. See docs/logprobs.md."})
    old_logprobs_tolerance: float = field(default=0.01, metadata={
        "help": "For old_logprobs_source='auto': the largest p99 |sampler - trainer| log-prob difference measured on "
        "a rollout for the next one to use the sampler's log-probs."})
    sampler_importance_sampling_correction: bool = field(default=False, metadata={
        "help": "Apply TRL's vLLM importance-sampling correction (vllm_importance_sampling_mode, _clip_min, "
        "_clip_max) to hf_grpo's own backends; runs the old-policy forward every rollout, as under vLLM."})


def validate(source: object, tolerance: object, correction: object, use_vllm: bool) -> None:
    """The three fields, each refused with its name, value and what would be valid."""
    if source not in SOURCES:
        raise ValueError(f"{SOURCE_FIELD} must be one of {SOURCES}, got {source!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise ValueError(f"{TOLERANCE_FIELD} must be a number >= 0 (a log-prob difference, e.g. 0.01), "
                         f"got {tolerance!r}")
    if not isinstance(correction, bool):
        raise ValueError(f"{CORRECTION_FIELD} must be true or false, got {correction!r}")
    if source == "sampler" and use_vllm:
        raise ValueError(f"{SOURCE_FIELD}='sampler' uses hf_grpo's own decoder's log-probs; with use_vllm=True TRL "
                         f"recomputes them (vllm_importance_sampling_correction): set {SOURCE_FIELD} to 'auto' or "
                         f"'recompute'")
    if source == "sampler" and correction:
        raise ValueError(f"{CORRECTION_FIELD}=True needs the trainer's own log-probs of the rollout, which "
                         f"{SOURCE_FIELD}='sampler' skips (the ratio would be 1): set {SOURCE_FIELD} to 'auto' or "
                         f"'recompute', or {CORRECTION_FIELD}=False")


def filtered_law(gc) -> str | None:
    """Why the sampler's law is not the trainer's softmax(logits / temperature) (a filter or penalty), or None."""
    if not gc.do_sample:
        return "greedy decoding (do_sample=False)"
    for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", None), ("repetition_penalty", 1.0)):
        value = getattr(gc, name, None)
        if value is not None and value != neutral:
            return f"the sampler draws from a filtered law ({name}={value}) that the trainer's ratio does not model"
    return None


def padded(logprobs: Sequence[Sequence[float]], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of per-token log-probs as [B, width] values (0 past each row) and the mask of real tokens."""
    values = torch.zeros((len(logprobs), width), dtype=torch.float32)
    mask = torch.zeros((len(logprobs), width), dtype=torch.bool)
    for row, lp in enumerate(logprobs):
        values[row, : len(lp)] = torch.as_tensor(lp[:width], dtype=torch.float32)
        mask[row, : len(lp)] = True
    return values.to(device), mask.to(device)


@dataclass(frozen=True)
class Mismatch:
    """|sampler - trainer| over a rollout's tokens (all processes), and the share whose ratio leaves the clip band."""

    mean: float
    p99: float
    max: float
    outside_clip: float
    tokens: int

    def metrics(self) -> dict[str, float]:
        return {"rollout_logprobs/abs_diff_mean": self.mean, "rollout_logprobs/abs_diff_p99": self.p99,
                "rollout_logprobs/abs_diff_max": self.max, "rollout_logprobs/outside_clip_share": self.outside_clip,
                "sampling/sampling_logp_difference/mean": self.mean,
                "sampling/sampling_logp_difference/max": self.max}


def token_diffs(sampler: torch.Tensor, scored: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scored - sampler at the real tokens (1-D, float32, detached); ``scored``: the trainer's forward's."""
    return (scored.detach().float() - sampler.float())[mask.bool()]


def reduce(diffs: Sequence[torch.Tensor], eps_low: float, eps_high: float, gather: Callable, device) -> Mismatch | None:
    """The ``Mismatch`` of the differences this process measured, over every process (``gather``: Accelerate's,
    called once on every rank). p99 is the largest process's (exact in one process)."""
    flat = torch.cat([d.to(device) for d in diffs]) if diffs else torch.zeros(0, device=device)
    absolute = flat.abs()
    outside = ((flat < math.log1p(-eps_low)) | (flat > math.log1p(eps_high))).sum() if eps_low < 1 else (
        (flat > math.log1p(eps_high)).sum())
    n = absolute.numel()
    p99 = absolute.kthvalue(max(1, math.ceil(0.99 * n))).values if n else absolute.new_zeros(())
    local = torch.stack([absolute.sum(), absolute.new_tensor(float(n)), absolute.max() if n else absolute.new_zeros(()),
                         outside.float(), p99])
    total = gather(local[None]).view(-1, 5)
    count = float(total[:, 1].sum())
    if count == 0:
        return None
    return Mismatch(mean=float(total[:, 0].sum()) / count, p99=float(total[:, 4].max()), max=float(total[:, 2].max()),
                    outside_clip=float(total[:, 3].sum()) / count, tokens=int(count))


class RolloutLogprobs:
    """One run's bookkeeping: the last rollout's sampler log-probs, the choice of the old policy's log-probs, and the
    measured differences waiting for the next reduction (see the module doc)."""

    def __init__(self, source: str, tolerance: float, unavailable: str | None, law: str | None,
                 eps_low: float, eps_high: float, bitwise: bool = False) -> None:
        self.source, self.tolerance, self.unavailable, self.law = source, tolerance, unavailable, law
        self.bitwise = bitwise  # true_on_policy: the sampler's log-probs are the trainer's, nothing to measure first
        self.eps_low, self.eps_high = eps_low, eps_high
        self.last: Mismatch | None = None  # the last reduced rollout's
        self.use_sampler = False  # for the current rollout
        self.logprobs: list[list[float]] | None = None  # the current rollout's, while its old pass is armed
        self.rollout_step: int | None = None  # the optimizer step the current rollout was sampled at
        self.inputs: dict | None = None  # the micro-batch (or token-budget pass) whose loss is being computed
        self._measure_training = False  # the current rollout is measured on its first training forwards
        self._pending: list[torch.Tensor] = []
        self._said: str | None = None

    @classmethod
    def for_run(cls, args, generation_config, tool_calls) -> RolloutLogprobs:
        """From the config (``RolloutLogprobFields``; TRL's clip band, read as TRL reads it) and the generation
        settings; ``tool_calls``: the run's tools or environments (truthy where it has any)."""
        eps_low = args.epsilon
        eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        law = filtered_law(generation_config) or (
            "the importance-sampling correction needs the trainer's own log-probs"
            if args.sampler_importance_sampling_correction else None)
        return cls(args.old_logprobs_source, args.old_logprobs_tolerance, "tool calls" if tool_calls else None, law,
                   eps_low, eps_high, bool(getattr(args, "true_on_policy", False)))

    def on_rollout(self, logprobs, training: bool, state, args, accelerator, train_metrics) -> None:
        """A rollout was sampled: in training, the previous one's measurement reduced (appended to TRL's training
        metrics, ``train_metrics``), the old policy's log-probs for this one chosen, and logged when the choice changes."""
        if not training or self.unavailable is not None:
            return  # tool calls: a rollout is several calls, and not as many on every rank
        for key, value in self.flush(accelerator.gather, accelerator.device).items():
            train_metrics[key].append(value)
        # TRL 1.16's condition for its old-policy pass (without vLLM)
        old_pass_runs = args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0
        self.rollout_step = state.global_step if logprobs is not None else None
        self.use_sampler, reason = self._choose(logprobs is not None)
        self.logprobs = logprobs if old_pass_runs and logprobs is not None else None
        self._measure_training = not (old_pass_runs and not self.use_sampler)  # else the old pass measures it
        said = f"old-policy log-probs: {'the sampler' if self.use_sampler else 'recomputed'} ({reason})"
        if old_pass_runs and said != self._said and accelerator.is_main_process:
            logger.info(said)
        self._said = said if old_pass_runs else self._said

    def _choose(self, recorded: bool) -> tuple[bool, str]:
        if not recorded:
            return False, "the backend recorded no log-probs for this rollout"
        if self.source == "recompute":
            return False, f"{SOURCE_FIELD}='recompute'"
        if self.source == "sampler":
            return True, f"{SOURCE_FIELD}='sampler'"
        if self.unavailable is not None:
            return False, self.unavailable
        if self.law is not None:
            return False, self.law
        if self.bitwise:
            return True, "true_on_policy: the sampler's log-probs are the trainer's, bit for bit"
        if self.last is None:
            return False, "no rollout measured yet"
        if self.last.p99 > self.tolerance or self.last.outside_clip > 0:
            return False, (f"measured p99 |sampler - trainer| {self.last.p99:.2e} (tolerance {self.tolerance:g}), "
                           f"{self.last.outside_clip:.2%} of tokens outside the clip band")
        return True, (f"measured p99 |sampler - trainer| {self.last.p99:.2e} <= {self.tolerance:g}, none outside "
                      "the clip band")

    def old_pass(self, width: int, rows: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The armed rollout's sampler log-probs and mask [rows, width] for TRL's old-policy pass (disarmed), or
        None where nothing is armed (a pass that is not the old policy's)."""
        logprobs, self.logprobs = self.logprobs, None
        if logprobs is None:
            return None
        if len(logprobs) != rows or max((len(lp) for lp in logprobs), default=0) > width:
            raise RuntimeError(f"the sampler's log-probs ({len(logprobs)} rows) do not match TRL's old-policy pass "
                               f"({rows} rows of {width} tokens): TRL's order of passes changed; set "
                               f"{SOURCE_FIELD}='recompute'")
        return padded(logprobs, width, device)

    def measure(self, sampler: torch.Tensor, scored: torch.Tensor, mask: torch.Tensor) -> None:
        self._pending.append(token_diffs(sampler, scored, mask))

    def scored(self, compute: Callable[[], tuple], policy: bool, no_grad: bool, input_ids: torch.Tensor, args: tuple,
               kwargs: dict, global_step: int) -> tuple:
        """A call of ``_get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)`` (``compute`` runs it;
        ``policy``: the model is the policy): TRL's old-policy pass answered with the sampler's log-probs or measured
        against them; a training forward at the rollout's weights measured; any other as it is."""
        grad = not no_grad
        armed = None
        if policy and no_grad and kwargs.get("batch_size") is not None and self.logprobs is not None:
            width = args[1] if len(args) > 1 else kwargs["logits_to_keep"]
            armed = self.old_pass(width, input_ids.shape[0], input_ids.device)
        if armed is not None and self.use_sampler:
            return armed[0], None, None  # TRL's (logps, entropies, aux_loss): the old pass asks no entropy
        result = compute()
        inputs = self.inputs
        if armed is not None:
            self.measure(armed[0], result[0], armed[1])
        elif (grad and inputs is not None and self._measure_training and global_step == self.rollout_step
              and inputs.get("sampling_per_token_logps") is not None
              and inputs["sampling_per_token_logps"].shape == result[0].shape):
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            self.measure(inputs["sampling_per_token_logps"], result[0], mask)
        return result

    def watching(self, compute: Callable) -> Callable:
        """``compute(inputs)`` (a micro-batch's loss) with ``inputs`` kept for ``scored`` while it runs."""
        def run(inputs, *args, **kwargs):
            self.inputs = inputs
            try:
                return compute(inputs, *args, **kwargs)
            finally:
                self.inputs = None
        return run

    def flush(self, gather: Callable, device) -> dict[str, float]:
        """Reduce what was measured since the last flush (every rank calls it at the same points); its metrics."""
        pending, self._pending = self._pending, []
        mismatch = reduce(pending, self.eps_low, self.eps_high, gather, device)
        if mismatch is None:
            return {}
        self.last = mismatch
        return mismatch.metrics()


def importance_ratio(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, mode: str,
                     clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio (``_generate_and_score_completions``) for any sampler: exp(old -
    sampler) per token [B, T] ("token_*") or per sequence [B, 1] ("sequence_*"), clamped ("*_truncate") or zeroed
    outside [clip_min, clip_max] ("*_mask")."""
    diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode must be one of 'token_truncate', 'token_mask', "
                     f"'sequence_truncate', 'sequence_mask', got {mode!r}")


def corrected(output: dict, args, loss_type: str, score: Callable) -> dict:
    """TRL's rollout ``output`` with the correction (``sampler_importance_sampling_correction``) as TRL's loss applies
    it under vLLM: the trainer's log-probs of the rollout (``score(ids, mask, logits_to_keep)``: the old-policy pass,
    where TRL ran none), ``importance_sampling_ratio`` (read by vespo), and the advantages scaled by the ratio, which
    for every other loss type equals TRL's ``per_token_loss * importance_sampling_ratio`` (the ratio is >= 0 and each
    policy term is linear in the advantage: -min(c1 A, c2 A) r = -min(c1 A r, c2 A r)); the KL term, added after,
    is left as TRL leaves it."""
    if not args.sampler_importance_sampling_correction or output.get("sampling_per_token_logps") is None:
        return output
    if output.get("old_per_token_logps") is None:
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            output["old_per_token_logps"] = score(ids, mask, output["completion_ids"].size(1))[0]
    mask = output["completion_mask"] * output.get("tool_mask", 1)
    ratio = importance_ratio(output["old_per_token_logps"], output["sampling_per_token_logps"], mask,
                             args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_min,
                             args.vllm_importance_sampling_clip_max)
    output = {**output, "importance_sampling_ratio": ratio}
    if loss_type != "vespo":
        advantages = output["advantages"]
        output["advantages"] = (advantages[:, None] if advantages.dim() == 1 else advantages) * ratio
    return output
