"""Tests for hf_grpo.recipe_support.tasks: generated Countdown data, local GSM8K loading, chat wrapping."""

from __future__ import annotations

import json

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_grpo.recipe_support.rewards import (
    GSM8K_FORMAT_REWARD,
    countdown_reward,
    gsm8k_correctness_reward,
    gsm8k_format_reward,
    parse_countdown_equation,
)
from hf_grpo.recipe_support.tasks import (
    GSM8K_INSTRUCTION,
    as_chat,
    countdown_dataset,
    countdown_prompt,
    gsm8k_dataset,
    gsm8k_prompt,
)

# ---------------------------------------------------------------------------------------------
# as_chat
# ---------------------------------------------------------------------------------------------


def test_as_chat():
    assert as_chat("hi") == [{"role": "user", "content": "hi"}]
    assert as_chat("hi", system="be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


# ---------------------------------------------------------------------------------------------
# Countdown
# ---------------------------------------------------------------------------------------------


def test_countdown_prompt_mentions_numbers_target_and_tags():
    p = countdown_prompt([3, 7, 25], 46)
    assert isinstance(p, str)
    assert "[3, 7, 25]" in p and "46" in p
    assert "<answer>" in p and "</answer>" in p
    assert "exactly once" in p


def test_countdown_dataset_columns_and_types():
    ds = countdown_dataset(50, seed=3)
    assert isinstance(ds, datasets.Dataset)
    assert len(ds) == 50
    assert set(ds.column_names) == {"prompt", "nums", "target"}
    for row in ds:
        assert isinstance(row["prompt"], str) and "<answer>" in row["prompt"]
        assert 3 <= len(row["nums"]) <= 4
        assert all(isinstance(x, int) and 1 <= x <= 100 for x in row["nums"])
        assert isinstance(row["target"], int) and 1 <= row["target"] <= 1000
        assert row["prompt"] == countdown_prompt(row["nums"], row["target"])


def test_countdown_dataset_deterministic():
    a = countdown_dataset(40, seed=7, include_solution=True)
    b = countdown_dataset(40, seed=7, include_solution=True)
    c = countdown_dataset(40, seed=8, include_solution=True)
    assert a.to_dict() == b.to_dict()
    assert a.to_dict() != c.to_dict()
    # include_solution only adds a column, it does not change the instances
    plain = countdown_dataset(40, seed=7)
    assert plain["nums"] == a["nums"] and plain["target"] == a["target"]


def _check_solutions(ds):
    comps = [f"<think>easy</think><answer>{s}</answer>" for s in ds["solution"]]
    rewards = countdown_reward(comps, target=ds["target"], nums=ds["nums"])
    assert rewards == [1.0] * len(ds)
    for sol, nums, target in zip(ds["solution"], ds["nums"], ds["target"]):
        value, used = parse_countdown_equation(sol)
        assert value == target and sorted(used) == sorted(nums)


def test_countdown_every_instance_solved_by_its_solution():
    _check_solutions(countdown_dataset(300, seed=0, include_solution=True))


def test_countdown_solutions_as_chat_completions():
    ds = countdown_dataset(20, seed=11, include_solution=True)
    comps = [[{"role": "assistant", "content": f"<answer>{s}</answer>"}] for s in ds["solution"]]
    assert countdown_reward(comps, target=ds["target"], nums=ds["nums"]) == [1.0] * 20


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    lo=st.integers(2, 6),
    extra=st.integers(0, 2),
    max_number=st.integers(1, 1000),
    max_target=st.one_of(st.none(), st.integers(1, 5000)),
)
def test_countdown_generator_property(seed, lo, extra, max_number, max_target):
    hi = min(lo + extra, 8)
    ds = countdown_dataset(
        8, seed=seed, num_numbers=(lo, hi), max_number=max_number, max_target=max_target, include_solution=True
    )
    assert len(ds) == 8
    for nums, target in zip(ds["nums"], ds["target"]):
        assert lo <= len(nums) <= hi
        assert all(1 <= x <= max_number for x in nums)
        assert target >= 1
    _check_solutions(ds)


def test_countdown_num_numbers_int_and_target_cap():
    ds = countdown_dataset(30, seed=1, num_numbers=4, max_target=100, include_solution=True)
    assert all(len(x) == 4 for x in ds["nums"])
    assert all(1 <= t <= 100 for t in ds["target"])
    _check_solutions(ds)


def test_countdown_dataset_empty_and_invalid_args():
    assert len(countdown_dataset(0)) == 0
    with pytest.raises(ValueError):
        countdown_dataset(-1)
    with pytest.raises(ValueError):
        countdown_dataset(5, num_numbers=(1, 3))
    with pytest.raises(ValueError):
        countdown_dataset(5, num_numbers=(4, 3))
    with pytest.raises(ValueError):
        countdown_dataset(5, num_numbers=(3, 9))
    with pytest.raises(ValueError):
        countdown_dataset(5, num_numbers="abc")
    with pytest.raises(ValueError):
        countdown_dataset(5, max_number=0)
    with pytest.raises(ValueError):
        countdown_dataset(5, max_number=10**7)
    with pytest.raises(ValueError):
        countdown_dataset(5, max_target=0)


def test_countdown_prompts_chat_wrappable():
    ds = countdown_dataset(3, seed=2).map(lambda r: {"prompt": as_chat(r["prompt"])})
    assert ds[0]["prompt"][0]["role"] == "user"


# ---------------------------------------------------------------------------------------------
# GSM8K (local JSON-lines / JSON only: no hub access in tests)
# ---------------------------------------------------------------------------------------------

ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {"question": "What is 1,000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_gsm8k_dataset_local_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", [dict(r, extra="drop me") for r in ROWS])
    ds = gsm8k_dataset(str(path))
    assert isinstance(ds, datasets.Dataset)
    assert set(ds.column_names) == {"prompt", "answer"}
    assert len(ds) == len(ROWS)
    for row, src in zip(ds, ROWS):
        assert row["answer"] == src["answer"]
        assert row["prompt"].startswith(src["question"])
        assert GSM8K_INSTRUCTION in row["prompt"]
        assert row["prompt"] == gsm8k_prompt(src["question"])


def test_gsm8k_dataset_local_json_and_slice(tmp_path):
    path = tmp_path / "gsm8k.json"
    path.write_text(json.dumps(ROWS), encoding="utf-8")
    ds = gsm8k_dataset(path, split="test[:2]")
    assert len(ds) == 2 and set(ds.column_names) == {"prompt", "answer"}


def test_gsm8k_dataset_missing_columns(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "1+1?", "solution": "#### 2"}])
    with pytest.raises(ValueError) as err:
        gsm8k_dataset(str(path))
    msg = str(err.value)
    assert "problem" in msg and "solution" in msg and "question" in msg


def test_gsm8k_dataset_missing_one_column(tmp_path):
    path = _write_jsonl(tmp_path / "half.jsonl", [{"question": "1+1?", "final": "2"}])
    with pytest.raises(ValueError, match="final"):
        gsm8k_dataset(str(path))


def test_gsm8k_dataset_end_to_end_with_rewards(tmp_path):
    ds = gsm8k_dataset(str(_write_jsonl(tmp_path / "g.jsonl", ROWS)))
    comps = ["Half of 48 is 24; 48 + 24 = 72.\n<answer>72</answer>",
             "0.2 per minute times 50.\n<answer>$10</answer>",
             "The total is <answer>1235</answer>"]
    assert gsm8k_correctness_reward(comps, answer=ds["answer"]) == [1.0, 1.0, 0.0]
    assert gsm8k_format_reward(comps) == [GSM8K_FORMAT_REWARD] * 3
