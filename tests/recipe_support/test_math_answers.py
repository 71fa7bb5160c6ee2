"""GSM8K correctness through math-verify (the ``math`` extra) and through the built-in parser it falls back to.

The math-verify tests skip when it is not installed (``pip install "hf-grpo[math]"``); the fallback tests run
everywhere, with math-verify hidden where it is installed.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import pytest

from hf_grpo.recipe_support import math_answers
from hf_grpo.recipe_support.rewards import gsm8k_correctness_reward

GSM_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def score(completion, reference) -> float:
    out = gsm8k_correctness_reward([completion], answer=[reference])
    assert len(out) == 1 and isinstance(out[0], float)
    return out[0]


@pytest.fixture
def fresh_checker(monkeypatch):
    """math_answers as on its first call of a process: the module not looked up yet, nothing said in the log."""
    monkeypatch.setattr(math_answers, "_math_verify", math_answers._NOT_LOADED)
    monkeypatch.setattr(math_answers, "_said", set())


@pytest.fixture
def without_math_verify(monkeypatch, fresh_checker):
    """As where the extra is not installed: ``import math_verify`` raises ImportError."""
    monkeypatch.setitem(sys.modules, "math_verify", None)


@pytest.fixture
def with_math_verify(fresh_checker):
    pytest.importorskip("math_verify")


# ---- GSM8K-style answers, both checkers --------------------------------------------------------------------------

# (completion, reference, score): what every checker gets right.
COMMON = [
    ("48/2 = 24, 48 + 24 = 72.\n<answer>72</answer>", GSM_REF, 1.0),
    ("so\n#### 42", "#### 42", 1.0),
    (r"Thus \boxed{42}.", "#### 42", 1.0),
    ("<answer>1,000</answer>", "#### 1000", 1.0),
    ("<answer>1000</answer>", "#### 1,000", 1.0),
    ("<answer>3.50</answer>", "#### 3.5", 1.0),
    ("The answer is $3.5.", "#### 3.50", 1.0),
    ("<answer>-7</answer>", "#### -7", 1.0),
    ("The answer is -3.5.", "#### -3.5", 1.0),
    ("<answer>$1,234.50</answer>", "#### 1234.5", 1.0),
    ("Total: ７２", "#### 72", 1.0),  # full-width digits
    ("Total: \u22123", "#### -3", 1.0),  # unicode minus
    ("#### 72\n\nThe answer is 5", "#### 72", 1.0),  # the #### line wins over a later "answer is"
    ("<answer>72</answer> <answer>73</answer>", GSM_REF, 0.0),  # the last tag counts
    ("<answer>73</answer> <answer>72</answer>", GSM_REF, 1.0),
    ("<answer>7</answer>", "#### -7", 0.0),  # wrong sign
    ("<answer>71</answer>", GSM_REF, 0.0),
    ("<answer>72.5</answer>", GSM_REF, 0.0),
    ("<answer>7200</answer>", GSM_REF, 0.0),
    ("no number", GSM_REF, 0.0),
    ("", GSM_REF, 0.0),
    ("<answer>7</answer>", 7, 1.0),  # a bare number as the reference
    ("<answer>7</answer>", None, 0.0),  # no reference answer: no credit
    ("no number", "no number", 0.0),
    (None, "#### 5", 0.0),
    ("x" * 200_000, "#### 5", 0.0),
]


@pytest.mark.parametrize("completion,reference,expected", COMMON)
def test_math_verify_scores_gsm8k_answers(with_math_verify, completion, reference, expected):
    assert math_answers.checker() == "math-verify"
    assert score(completion, reference) == expected


@pytest.mark.parametrize("completion,reference,expected", COMMON)
def test_the_built_in_parser_scores_gsm8k_answers(without_math_verify, completion, reference, expected):
    assert score(completion, reference) == expected


# What only math-verify reads right: values written as fractions, LaTeX or expressions. The built-in parser takes
# the last number it sees (the 4 of \frac{3}{4}, the 2 of 1/2), so these score 0 without the extra.
BEYOND_NUMBERS = [
    (r"The answer is \boxed{\frac{3}{4}}", "#### 0.75", 1.0),
    ("<answer>1/2</answer>", "#### 0.5", 1.0),
    (r"<answer>$\frac{1}{2}$</answer>", "#### 0.5", 1.0),
    (r"\boxed{-\frac{7}{2}}", "#### -3.5", 1.0),
    ("<answer>50%</answer>", "#### 0.5", 1.0),
    (r"\boxed{\frac{3}{5}}", "#### 0.75", 0.0),  # a wrong fraction is still wrong
    (r"\boxed{\frac{-1}{2}}", "#### 0.5", 0.0),
    (r"\boxed{18 \times 4 = 72}", GSM_REF, 1.0),
]


@pytest.mark.parametrize("completion,reference,expected", BEYOND_NUMBERS)
def test_math_verify_reads_fractions_and_latex(with_math_verify, completion, reference, expected):
    assert score(completion, reference) == expected


def test_without_the_extra_fractions_score_zero_and_that_is_said_once(without_math_verify, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        assert gsm8k_correctness_reward([r"\boxed{\frac{3}{4}}", "<answer>0.75</answer>"],
                                        answer=["#### 0.75"] * 2) == [0.0, 1.0]
        assert gsm8k_correctness_reward(["<answer>72</answer>"], answer=[GSM_REF]) == [1.0]
    said = [r.getMessage() for r in caplog.records if "math-verify is not installed" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert 'pip install "hf-grpo[math]"' in said[0] and "built-in GSM8K number parser" in said[0]
    assert math_answers.checker() == "built-in"


# ---- math-verify's SIGALRM time limits -------------------------------------------------------------------------


def test_a_reward_called_from_another_thread_still_scores(with_math_verify, caplog):
    """math-verify's limits need the main thread; elsewhere (an async reward's loop, a thread pool) the built-in
    parser scores instead of math-verify raising, which the reward would turn into a silent 0 for every answer."""
    out = {}

    def work():
        out["rewards"] = gsm8k_correctness_reward(["<answer>1,000</answer>", "<answer>999</answer>"],
                                                  answer=["#### 1000"] * 2)
        out["checker"] = math_answers.checker()

    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    assert out == {"rewards": [1.0, 0.0], "checker": "built-in"}
    assert "outside the main thread use the built-in GSM8K number parser" in caplog.text


def test_a_pending_alarm_of_the_caller_is_left_alone(with_math_verify):
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        assert math_answers.checker() == "built-in"
        assert score("<answer>72</answer>", GSM_REF) == 1.0
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 25 < remaining <= 30  # neither cancelled nor replaced by math-verify's alarm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert math_answers.checker() == "math-verify"
    assert fired == []


def test_a_hostile_answer_stops_at_the_time_limit_and_scores_zero(with_math_verify):
    """A power tower would keep sympy busy for ever; math-verify's limit stops it and the completion scores 0."""
    handler = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    out = gsm8k_correctness_reward([r"\boxed{9^{9^{9^{9}}}}", "<answer>72</answer>"], answer=[GSM_REF] * 2)
    elapsed = time.monotonic() - start
    assert out == [0.0, 1.0]
    assert elapsed < math_answers.PARSE_TIMEOUT_S + math_answers.VERIFY_TIMEOUT_S + 2, elapsed
    assert signal.getsignal(signal.SIGALRM) is handler  # the caller's handler is back
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0  # no alarm left behind
