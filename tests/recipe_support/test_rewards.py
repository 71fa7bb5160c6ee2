"""Tests for hf_grpo.recipe_support.rewards: correctness on hand-checked cases and robustness to hostile input."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_grpo.recipe_support.rewards import (
    COUNTDOWN_FORMAT_REWARD,
    MissingColumnError,
    GSM8K_FORMAT_REWARD,
    completion_to_text,
    countdown_format_reward,
    countdown_reward,
    extract_answer_tag,
    extract_final_number,
    gsm8k_correctness_reward,
    gsm8k_format_reward,
    parse_countdown_equation,
    repeat_letter_reward,
)

FMT = COUNTDOWN_FORMAT_REWARD


def cd(text, target, nums):
    """Score a single Countdown completion."""
    out = countdown_reward([text], target=[target], nums=[nums])
    assert len(out) == 1 and isinstance(out[0], float)
    return out[0]


def ans(eq: str) -> str:
    return f"<think>working...</think>\n<answer>{eq}</answer>"


# ---------------------------------------------------------------------------------------------
# Countdown: correct answers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "equation,target,nums",
    [
        ("(6/3)*12", 24, [6, 3, 12]),  # exact division inside
        ("12 * (6 / 3)", 24, [3, 6, 12]),
        ("7/2*2", 7, [7, 2, 2]),  # fractional intermediate, exact result; 2 used twice as listed
        ("55 + 36 - 7 - 19", 65, [19, 36, 55, 7]),
        ("(100 - 4) / (2 * 3)", 16, [100, 4, 2, 3]),
        ("-3 + 10 * 1", 7, [3, 10, 1]),  # unary minus
        ("((((1 + 2))))", 3, [1, 2]),  # redundant parentheses
        ("  8 *\n 5 ", 40, [5, 8]),  # whitespace / newlines inside the tag
        ("(25 - 5) * 3 = 60", 60, [25, 5, 3]),  # trailing "= target" accepted
        ("1 / 3 * 3 * 9", 9, [1, 3, 3, 9]),  # rational arithmetic, no float error
    ],
)
def test_countdown_correct(equation, target, nums):
    assert cd(ans(equation), target, nums) == 1.0


def test_countdown_target_as_string_and_float():
    assert cd(ans("2*3"), "6", [2, 3]) == 1.0
    assert cd(ans("2*3"), 6.0, [2, 3]) == 1.0
    assert cd(ans("(6/3)*12"), 24, (6.0, 3.0, 12.0)) == 1.0


# ---------------------------------------------------------------------------------------------
# Countdown: wrong but parseable -> format reward only
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "equation,target,nums",
    [
        ("6 * 4", 24, [6, 3, 12]),  # numbers missing
        ("12 + 12", 24, [12, 6, 3]),  # 12 used twice
        ("(6/3)*12 + 0", 24, [6, 3, 12]),  # extra number
        ("6 + 3 + 12", 24, [6, 3, 12]),  # wrong value
        ("6 + 3 + 12", 21.5, [6, 3, 12]),
        ("(6/3)*12 = 25", 24, [6, 3, 12]),  # right value, wrong claimed result
        ("2 * 2", 4, [2]),  # a number used more often than listed
        ("2", 4, [2, 2]),
    ],
)
def test_countdown_wrong_gets_format_reward(equation, target, nums):
    assert cd(ans(equation), target, nums) == FMT


# ---------------------------------------------------------------------------------------------
# Countdown: invalid / hostile -> 0.0
# ---------------------------------------------------------------------------------------------

HOSTILE = [
    "(" * 1000,
    "(" * 1000 + "1" + ")" * 1000,
    "-(" * 66 + "1" + ")" * 66,  # within the length cap, but over the AST depth cap
    "-" * 150 + "1",  # deep unary chain
    "__import__('os').system('x')",
    "__import__(\"os\").system(\"touch /tmp/pwned\")",
    "().__class__.__bases__[0].__subclasses__()",
    "10**10**10",
    "9**9**9",
    "pow(9, pow(9, 9))",
    "2 ** 3",
    "7 // 2",
    "7 % 2",
    "1 << 5",
    "1 if 1 else 2",
    "[1, 2][0]",
    "x + 1",
    "abs(-3)",
    "'6' * 4",
    "f'{6*4}'",
    "[i for i in range(3)]",
    "lambda: 24",
    "(x := 24)",
    "1.5 * 16",
    "2.0 * 12",
    "1e3",
    "0x18",
    "0b11000",
    "1_2 * 2",
    "012 * 2",
    "+24",  # unary plus is not in the grammar
    "True + 23",
    "1 2",
    "",
    "   ",
    "6/(3-3)",  # division by zero
    "12 / 0",
    "9" * 100000,  # huge literal string (over the length cap)
    "9" * 150,  # huge literal within the length cap (over the literal cap)
    "1000001 - 1",  # literal just over 10**6
    "*".join(["999999"] * 25),  # intermediate value over the cap
    "１２ * 2",  # full-width digits
    "12 × 2",  # unicode multiplication sign
    "12 ÷ 2",
    "😀 + 24",
    "24\x00",
    "1 = 2 = 3",
    "= 24",
    "6 * 4 = x",
]


@pytest.mark.parametrize("equation", HOSTILE, ids=lambda s: repr(s[:30]))
def test_countdown_hostile_scores_zero(equation):
    assert cd(ans(equation), 24, [6, 3, 12]) == 0.0
    assert cd(ans(equation), 24, [12, 2]) == 0.0
    assert parse_countdown_equation(equation) is None


def test_countdown_literal_cap_boundary():
    assert cd(ans("1000000 - 999999"), 1, [1000000, 999999]) == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "(6/3)*12",  # correct equation but no tag: format failure
        "<answer>(6/3)*12",  # unclosed tag
        "(6/3)*12</answer>",
        "</answer>(6/3)*12<answer>",  # tags in the wrong order
        "<ANSWER>(6/3)*12</ANSWER>",
        "<answer>" * 50000,  # many opening tags, no closing one (must stay fast)
        "</answer>" * 50000,
    ],
)
def test_countdown_missing_tag_scores_zero(text):
    assert cd(text, 24, [6, 3, 12]) == 0.0


def test_countdown_multiple_tags_last_one_counts():
    right, wrong = "(6/3)*12", "6+3+12"
    assert cd(f"<answer>{wrong}</answer> hmm <answer>{right}</answer>", 24, [6, 3, 12]) == 1.0
    assert cd(f"<answer>{right}</answer> hmm <answer>{wrong}</answer>", 24, [6, 3, 12]) == FMT
    assert cd(f"<answer>{right}</answer> <answer>__import__('os')</answer>", 24, [6, 3, 12]) == 0.0
    # Nested opening tags: the nearest <answer> before the last </answer> starts the equation.
    assert cd(f"<answer>junk <answer>{right}</answer>", 24, [6, 3, 12]) == 1.0
    assert extract_answer_tag("<answer>a</answer><answer>b</answer>") == "b"


@pytest.mark.parametrize("completion", [None, 42, 3.5, b"<answer>(6/3)*12</answer>", object(), [], [None], {}])
def test_countdown_non_string_completions_score_zero(completion):
    assert cd(completion, 24, [6, 3, 12]) == 0.0


def test_countdown_bad_reference_data_scores_zero():
    good = ans("(6/3)*12")
    assert cd(good, None, [6, 3, 12]) == 0.0
    assert cd(good, 24, None) == 0.0
    assert cd(good, 24, "6 3 12") == 0.0
    assert cd(good, "x" * 1000, [6, 3, 12]) == 0.0
    assert cd(good, 24, [6.5, 3, 12]) == 0.0


@pytest.mark.parametrize(
    "reward, present, missing",
    [
        (countdown_reward, {"nums": [[6, 3, 12]]}, "'target'"),
        (countdown_reward, {}, "'target', 'nums'"),
        (gsm8k_correctness_reward, {}, "'answer'"),
        (repeat_letter_reward, {}, "'letter'"),
    ],
)
def test_a_missing_dataset_column_is_an_error_not_a_silent_zero(reward, present, missing):
    with pytest.raises(MissingColumnError, match=rf"{reward.__name__} reads the dataset column\(s\) {missing}"):
        reward([ans("(6/3)*12")], prompts=["p"], **present)


def test_countdown_chat_format():
    msgs = [[{"role": "assistant", "content": ans("(6/3)*12")}],
            [{"role": "assistant", "content": ans("6+3+12")}],
            [{"role": "assistant", "content": None}],
            [{"role": "assistant", "content": [{"type": "text", "text": ans("(6/3)*12")}]}],
            [{"role": "user", "content": ans("6*4")}, {"role": "assistant", "content": "no tag"}]]
    out = countdown_reward(msgs, target=[24] * 5, nums=[[6, 3, 12]] * 5)
    assert out == [1.0, FMT, 0.0, 1.0, 0.0]


def test_countdown_batch_alignment_and_extra_kwargs():
    comps = [ans("1+2"), ans("2*3"), "nothing", ans("5-5")]
    out = countdown_reward(
        comps,
        target=[3, 6, 1, 1],
        nums=[[1, 2], [2, 3], [1], [5, 5]],
        prompts=["p"] * 4,
        completion_ids=[[1]] * 4,
        trainer_state=None,
    )
    assert out == [1.0, 1.0, 0.0, FMT]
    assert countdown_reward([], target=[], nums=[]) == []


def test_countdown_format_reward():
    comps = [ans("(6/3)*12"), ans("6+3+12"), ans("9**9**9"), "no tag", ans("1/0")]
    assert countdown_format_reward(comps) == [FMT, FMT, 0.0, 0.0, 0.0]


def test_completion_to_text():
    assert completion_to_text("x") == "x"
    assert completion_to_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "a\nb"
    assert completion_to_text({"role": "assistant", "content": "c"}) == "c"
    assert completion_to_text(None) == ""
    assert completion_to_text([{"role": "assistant"}]) == ""


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_countdown_never_raises_on_arbitrary_text(text):
    for completion in (text, f"<answer>{text}</answer>", [{"role": "assistant", "content": text}]):
        out = countdown_reward([completion], target=[24], nums=[[6, 3, 12]])
        assert len(out) == 1 and isinstance(out[0], float) and out[0] in {0.0, FMT, 1.0}


_EXPR_ALPHABET = st.sampled_from(list("0123456789+-*/() ") + ["**", "//", "=", "1e9", "x", "9" * 8])


@settings(max_examples=300, deadline=None)
@given(st.lists(_EXPR_ALPHABET, max_size=60), st.integers(-50, 2000), st.lists(st.integers(0, 100), max_size=5))
def test_countdown_never_raises_on_expression_like_text(tokens, target, nums):
    out = countdown_reward([ans("".join(tokens))], target=[target], nums=[nums])
    assert out[0] in {0.0, FMT, 1.0}


# ---------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("so the total is\n#### 1,234", "1234"),
        ("#### -5", "-5"),
        ("#### $18.", "18"),
        (r"Thus \boxed{42}.", "42"),
        (r"\boxed{\$1,000}", "1000"),
        (r"\boxed{18 \times 4 = 72}", "72"),
        ("The answer is -3.5", "-3.5"),
        ("The answer is -3.5.", "-3.5"),
        ("The answer is: $1,234.", "1234"),
        ("So the final answer is 7 apples, not 9.", "7"),
        ("Reasoning 3 + 4 = 7.\n<answer>7</answer>", "7"),
        ("<answer>18 * 4 = 72</answer>", "72"),
        ("<answer>$-72.00</answer>", "-72"),
        ("I think 3 then 10-3=7.", "7"),  # last-number fallback, '-' in 10-3 is not a sign
        ("It costs $1,234.50 in total", "1234.5"),
        ("007", "7"),
        ("-0", "0"),
        ("Total: ７２", "72"),  # full-width digits
        ("Total: \u22123", "-3"),  # unicode minus
        ("#### 72\n\nThe answer is 5", "72"),  # #### wins over 'answer is'
        ("no digits here", None),
        ("", None),
        ("😀😀😀", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


@pytest.mark.parametrize("bad", [None, 42, [], b"#### 3"])
def test_extract_final_number_non_string(bad):
    assert extract_final_number(bad) is None


def test_extract_final_number_huge_inputs_are_fast():
    assert extract_final_number("9" * 100_000) is not None  # no int() conversion limits hit
    assert extract_final_number("1," * 50_000) == "1"
    assert extract_final_number("\\boxed{" * 30_000) is None
    assert extract_final_number("<answer>" * 30_000 + "</answer>") is None
    assert extract_final_number("answer is " * 20_000) is None


GSM_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def test_gsm8k_correctness():
    comps = [
        "48/2 = 24, 48 + 24 = 72.\n<answer>72</answer>",
        "The answer is 72.",
        "#### 72.00",
        "<answer>71</answer>",
        "no number",
        "",
        r"\boxed{72}",
        "<answer>72</answer> <answer>73</answer>",  # last tag counts
        "<answer>73</answer> <answer>72</answer>",
    ]
    out = gsm8k_correctness_reward(comps, answer=[GSM_REF] * len(comps))
    assert out == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]


def test_gsm8k_correctness_references_and_chat():
    chat = [[{"role": "assistant", "content": "so <answer>1,234</answer>"}],
            [{"role": "assistant", "content": None}],
            [{"role": "assistant", "content": "<answer>-3.5</answer>"}]]
    out = gsm8k_correctness_reward(chat, answer=["... #### 1,234", "#### 5", "#### -3.5"])
    assert out == [1.0, 0.0, 1.0]
    assert gsm8k_correctness_reward(["<answer>7</answer>"], answer=["7"]) == [1.0]
    assert gsm8k_correctness_reward(["<answer>7</answer>"], answer=[7]) == [1.0]
    assert gsm8k_correctness_reward(["<answer>7</answer>"], answer=[None]) == [0.0]
    assert gsm8k_correctness_reward(["no number"], answer=["no number"]) == [0.0]
    assert gsm8k_correctness_reward([None, 5, "x" * 200_000], answer=["#### 5"] * 3) == [0.0, 0.0, 0.0]


def test_gsm8k_format_reward():
    good = [
        "48/2 = 24 and 48 + 24 = 72.\n<answer>72</answer>",
        "Reasoning.\n<answer> $1,234.50 </answer>\n",
        "Reasoning.<answer>-3</answer>",
    ]
    bad = [
        "<answer>72</answer>",  # no reasoning
        "Reasoning.\n<answer>72</answer> trailing text",
        "Reasoning.\n<answer>72</answer><answer>72</answer>",  # two tags
        "Reasoning.\n<answer>seventy-two</answer>",
        "Reasoning.\n<answer>72 apples</answer>",
        "Reasoning.\n<answer></answer>",
        "Reasoning.\n#### 72",
        "Reasoning.</answer>72<answer>",
        "",
        "(" * 1000,
        "Reasoning " * 20_000 + "<answer>1</answer>",  # over the length cap
    ]
    assert gsm8k_format_reward(good) == [GSM8K_FORMAT_REWARD] * len(good)
    assert gsm8k_format_reward(bad) == [0.0] * len(bad)
    assert gsm8k_format_reward([[{"role": "assistant", "content": good[0]}], None, 7]) == [GSM8K_FORMAT_REWARD, 0.0, 0.0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_gsm8k_rewards_never_raise(text):
    found = extract_final_number(text)
    assert found is None or isinstance(found, str)
    for comp in (text, f"x <answer>{text}</answer>", [{"role": "assistant", "content": text}]):
        assert gsm8k_correctness_reward([comp], answer=[f"#### {text}"])[0] in {0.0, 1.0}
        assert gsm8k_format_reward([comp])[0] in {0.0, GSM8K_FORMAT_REWARD}


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12, 10**12))
def test_gsm8k_roundtrip_integers(n):
    assert extract_final_number(f"#### {n:,}") == str(n)
    assert gsm8k_correctness_reward([f"Work.\n<answer>{n}</answer>"], answer=[f"r\n#### {n}"]) == [1.0]
