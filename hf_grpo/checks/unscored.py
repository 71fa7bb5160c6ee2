"""Completions no reward function scored (every function returned ``None`` or NaN for them).

TRL 1.16 keeps such a completion out of its group's mean and standard deviation and out of the logged ``reward``,
and sets its advantage to 0: it neither pulls nor pushes the policy. A completion that only some functions score
gets, from each that did not, 0 in the weighted sum (``nansum``). What TRL does not do is say how many completions
went unscored, or stop when none was scored: a step then trains at loss 0 and the run goes on saving models.
Here that step is an error, and the count is logged as ``rewards/unscored``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

METRIC = "rewards/unscored"


class UnscoredRolloutError(ValueError):
    """No reward function scored any completion of a rollout."""


def count_unscored(rewards_per_func: torch.Tensor, names: Sequence[str]) -> int:
    """Completions of the rollout (every process's: TRL gathers the rewards first) that no reward function scored.

    Raises ``UnscoredRolloutError`` naming the functions when that is every completion: the step would train at
    loss 0 with every advantage 0."""
    unscored = torch.isnan(rewards_per_func).all(dim=1)
    if bool(unscored.all()):
        raise UnscoredRolloutError(
            f"every reward function ({', '.join(names)}) returned None (or NaN) for all {unscored.numel()} "
            f"completions of this rollout, so the step would train at loss 0. A reward function must return one "
            f"float per completion; None means 'no opinion' on that completion and needs another function, or "
            f"another completion of the rollout, to be scored")
    return int(unscored.sum())
