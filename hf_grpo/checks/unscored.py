"""Completions no reward function scored (every function returned ``None`` or NaN for them).

TRL 1.16 keeps such a completion out of its group's mean and standard deviation and out of the logged ``reward``,
and sets its advantage to 0: it neither pulls nor pushes the policy. A completion that only some functions score
gets, from each that did not, 0 in the weighted sum (``nansum``). What TRL does not do is say how many completions
went unscored, or stop when none was scored: a step then trains at loss 0 and the run goes on saving models.
Here that step is an error, and the count is logged as ``rewards/unscored``.

TRL does nothing for an infinite reward (``inf``, ``-inf``, or a float beyond float32's range such as ``1e300``, which
TRL's ``torch.tensor(..., dtype=float32)`` makes ``inf``): the group's mean and standard deviation become inf, the
logged ``reward`` inf, and every advantage of the group NaN, which TRL's ``nan_to_num`` zeroes -- a group that silently
stops learning -- or, under ``scale_rewards="none"``, -inf, which ``nan_to_num`` makes -3.4e38. A finite reward so
large that the squares in the standard deviation overflow does the same. ``unscore_out_of_range`` turns such a reward
into NaN before TRL's statistics, so it counts as that function's ``None``; they are counted per function as
``rewards/<name>/non_finite``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

METRIC = "rewards/unscored"
NON_FINITE_METRIC = "rewards/{name}/non_finite"
logger = logging.getLogger("hf_grpo")


class UnscoredRolloutError(ValueError):
    """No reward function scored any completion of a rollout."""


def reward_bound(completions: int, weights: torch.Tensor) -> float:
    """The largest reward magnitude TRL's float32 statistics of a rollout of ``completions`` take without overflow.

    With every reward within R and W = sum|weights| (at least 1: a function's own statistics are logged unweighted),
    a weighted sum is within W * R and its distance to a mean within 2 * W * R; the standard deviation sums the squares
    of ``completions`` such distances (``trl.trainer.utils.nanstd``, over the whole rollout under
    ``scale_rewards="batch"``): completions * (2 * W * R)**2 must stay below float32's largest value. For 8
    completions and weights of 1 that is R of 3.3e18, far beyond any reward's meaning; past it the standard deviation
    is inf and the group's advantages 0 or NaN."""
    scale = max(1.0, float(weights.abs().sum()))
    return math.sqrt(torch.finfo(torch.float32).max / max(completions, 2)) / (2 * scale)


def unscore_out_of_range(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Set every reward that is infinite, or beyond ``reward_bound``, to NaN in place, as TRL sets a ``None``.

    Returns the count of such rewards per function (a tensor, one per column) and the bound. Every process makes
    the same change: TRL gathers the rewards before its statistics."""
    bound = reward_bound(rewards_per_func.shape[0], weights)
    out = ~torch.isnan(rewards_per_func) & ~(rewards_per_func.abs() <= bound)  # inf, -inf and past the bound
    rewards_per_func[out] = math.nan
    return out.sum(dim=0), bound


def out_of_range_warning(name: str, count: int, completions: int, bound: float) -> str:
    """The warning for a reward function's first rollout with rewards ``unscore_out_of_range`` set aside."""
    return (f"reward function {name!r} returned {count} of this rollout's {completions} rewards infinite (inf, "
            f"-inf, or past float32's range, such as 1e300) or beyond +-{bound:.2g}, where TRL's float32 group "
            f"statistics overflow; they count as None (unscored: no advantage unless another function scores the "
            f"completion). Return a finite penalty for a bad completion, or None for no opinion. Later ones are "
            f"counted in {NON_FINITE_METRIC.format(name=name)}, without this warning")


def count_unscored(rewards_per_func: torch.Tensor, names: Sequence[str], out_of_range: int = 0) -> int:
    """Completions of the rollout (every process's: TRL gathers the rewards first) that no reward function scored.

    Raises ``UnscoredRolloutError`` naming the functions when that is every completion: the step would train at
    loss 0 with every advantage 0. ``out_of_range``: how many rewards ``unscore_out_of_range`` set to NaN."""
    unscored = torch.isnan(rewards_per_func).all(dim=1)
    if bool(unscored.all()):
        infinite = (f" ({out_of_range} of the rewards were infinite or too large and count as None)"
                    if out_of_range else "")
        raise UnscoredRolloutError(
            f"every reward function ({', '.join(names)}) returned None (or NaN) for all {unscored.numel()} "
            f"completions of this rollout{infinite}, so the step would train at loss 0. A reward function must "
            f"return one float per completion; None means 'no opinion' on that completion and needs another "
            f"function, or another completion of the rollout, to be scored")
    return int(unscored.sum())


def check_rollout(rewards_per_func: torch.Tensor, names: Sequence[str], weights: torch.Tensor,
                  warned: set[str] | None) -> dict[str, float]:
    """A rollout's gathered rewards made fit for TRL's statistics: those out of range set to NaN (in place), a warning
    for each function's first such rollout (``warned``: the functions warned about so far; None on the processes
    that do not log), and an error if nothing is left scored. Returns the rollout's metrics."""
    out_of_range, bound = unscore_out_of_range(rewards_per_func, weights)
    metrics = {}
    for name, count in zip(names, out_of_range.tolist(), strict=True):
        metrics[NON_FINITE_METRIC.format(name=name)] = float(count)
        if count and warned is not None and name not in warned:
            warned.add(name)
            logger.warning(out_of_range_warning(name, count, rewards_per_func.shape[0], bound))
    metrics[METRIC] = float(count_unscored(rewards_per_func, names, int(out_of_range.sum())))
    return metrics
