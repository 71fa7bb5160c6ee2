"""Reward functions that return None (or NaN) for completions: counted in the logs, an error when nothing is scored.

What a user reads: ``metrics.jsonl`` (the recipes' ``MetricsFileCallback``) and the error of a run that cannot learn.
"""

import math
import os

import pytest

from hf_grpo.checks.unscored import UnscoredRolloutError
from hf_grpo.recipe_support.reporting import METRICS_FILE, MetricsFileCallback, read_metrics
from test_trainer import make_trainer


def never_scores(completions, **kwargs):
    return [None] * len(completions)


def nan_scores(completions, **kwargs):
    return [math.nan] * len(completions)


def test_a_rollout_no_function_scores_is_an_error_naming_them(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1,
                           reward_funcs=[never_scores, nan_scores])
    with pytest.raises(UnscoredRolloutError, match=r"every reward function \(never_scores, nan_scores\) returned "
                                                   r"None \(or NaN\) for all 8 completions") as err:
        trainer.train()
    assert "must return one float per completion" in str(err.value)
    # nothing trained at loss 0 was saved
    saved = os.listdir(trainer.args.output_dir) if os.path.isdir(trainer.args.output_dir) else []
    assert not [name for name in saved if name.startswith("checkpoint-")], saved


def test_unscored_completions_are_counted_in_metrics_jsonl(tmp_path):
    returned = []

    def scores_one_in_four(completions, **kwargs):
        values = [float(len(text)) if i % 4 == 0 else None for i, text in enumerate(completions)]
        returned.append(values)
        return values

    def length_or_nan(completions, **kwargs):  # a second function, scoring every completion
        return [float(len(text)) for text in completions]

    trainer = make_trainer(tmp_path, max_steps=2, reward_funcs=scores_one_in_four)
    trainer.add_callback(MetricsFileCallback(trainer.args.output_dir))
    trainer.train()
    rows = read_metrics(os.path.join(trainer.args.output_dir, METRICS_FILE))
    assert [row["step"] for row in rows] == [1, 2]
    for row, values in zip(rows, returned, strict=True):
        assert row["rewards/unscored"] == 6  # of the rollout's 8 completions, 2 scored
        scored = [v for v in values if v is not None]
        # the logged reward is the mean over the scored completions (TRL 1.16); the unscored ones are left out
        assert row["reward"] == pytest.approx(sum(scored) / len(scored), rel=1e-6)

    # with a second function scoring every completion, none is unscored: the None counts 0 in the weighted sum
    returned.clear()
    trainer = make_trainer(tmp_path / "two", max_steps=1, reward_funcs=[scores_one_in_four, length_or_nan])
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["rewards/unscored"] == 0
    values = returned[0]
    lengths = [v for v in values if v is not None]
    assert logged["rewards/scores_one_in_four/mean"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-6)
