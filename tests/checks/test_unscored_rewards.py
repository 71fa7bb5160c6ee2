"""Reward functions that return None (or NaN) for completions: counted in the logs, an error when nothing is scored.
Infinite rewards (and those too large for TRL's float32 statistics) count as None, counted and warned about once.

What a user reads: ``metrics.jsonl`` (the recipes' ``MetricsFileCallback``) and the error of a run that cannot learn.
"""

import json
import logging
import math
import os
import types

import pytest
import torch

from hf_grpo.checks.unscored import UnscoredRolloutError
from hf_grpo.recipe_support.reporting import METRICS_FILE, MetricsFileCallback, read_metrics
from tests.test_trainer import make_trainer


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


def strict_json(line):
    """json.loads refusing what Python writes for non-finite floats (NaN, Infinity): not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


# of each group of 4: two rewards TRL's float32 statistics cannot take (inf and -inf; 1e300, float32's inf, and
# 1e30, whose square overflows the group's standard deviation), and two it can
OUT_OF_RANGE = {0: math.inf, 1: -math.inf, 4: 1e300, 5: 1e30}


def partly_infinite(completions, **kwargs):
    return [OUT_OF_RANGE.get(i, float(len(text))) for i, text in enumerate(completions)]


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_infinite_rewards_count_as_unscored_and_metrics_jsonl_stays_json(tmp_path, caplog, scale_rewards):
    trainer = make_trainer(tmp_path, max_steps=2, reward_funcs=partly_infinite, scale_rewards=scale_rewards)
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        trainer.train()
    with open(os.path.join(trainer.args.output_dir, METRICS_FILE)) as handle:
        rows = [strict_json(line) for line in handle]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rewards/partly_infinite/non_finite"] == 4 and row["rewards/unscored"] == 4
        # the logged reward is the mean of the scored ones, finite; the loss too
        assert math.isfinite(row["reward"]) and math.isfinite(row["reward_std"]) and math.isfinite(row["loss"])
    # the completions scored still move the policy, and nothing became inf or NaN (under scale_rewards="none",
    # TRL's nan_to_num would have made the advantages -3.4e38)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    warnings = [r.getMessage() for r in caplog.records if "partly_infinite" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per function; later ones counted in the metric
    assert "returned 4 of this rollout's 8 rewards infinite" in warnings[0]
    assert "rewards/partly_infinite/non_finite" in warnings[0]


def test_a_rollout_of_infinite_rewards_alone_is_an_error_saying_so(tmp_path):
    def always_inf(completions, **kwargs):
        return [math.inf] * len(completions)

    trainer = make_trainer(tmp_path, reward_funcs=always_inf)
    with pytest.raises(UnscoredRolloutError, match=r"returned None \(or NaN\) for all 8 completions of this rollout "
                                                   r"\(8 of the rewards were infinite or too large"):
        trainer.train()


def test_a_metrics_row_with_non_finite_values_is_written_as_standard_json(tmp_path):
    callback = MetricsFileCallback(str(tmp_path))
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=3)
    callback.on_log(None, state, None, logs={"loss": math.nan, "grad_norm": math.inf, "reward": -math.inf,
                                             "learning_rate": 0.5})
    with open(tmp_path / METRICS_FILE) as handle:
        assert [strict_json(line) for line in handle] == [
            {"step": 3, "loss": None, "grad_norm": None, "reward": None, "learning_rate": 0.5}]
