"""Reward functions for the GRPO recipes.

Every reward function follows TRL's reward-function signature::

    fn(completions, **kwargs) -> list[float | None]

``completions`` is either a list of plain strings (standard datasets) or a list of chat message
lists such as ``[{"role": "assistant", "content": "..."}]`` (conversational datasets); both are
accepted, and message ``content`` may also be a list of ``{"type": "text", "text": ...}`` parts.
Dataset columns arrive as keyword lists aligned with ``completions`` (``target=[...]``,
``nums=[...]``, ``answer=[...]``); other keyword arguments TRL passes (``prompts``,
``completion_ids``, ``trainer_state``, ...) are ignored.

The functions never raise on model output: any malformed, hostile or oversized completion scores
``0.0``. They never call ``eval``/``exec``. A reference column they read that the dataset lacks
(``target`` / ``nums`` / ``answer`` / ``letter``) raises ``MissingColumnError`` at the first
rollout, naming it: scoring every completion 0.0 would train on no signal without a word.

Reward values
-------------
Countdown (:func:`countdown_reward`):
    * ``1.0``  -- the last ``<answer>...</answer>`` holds an equation that uses every number in
      ``nums`` exactly once and evaluates exactly to ``target``;
    * ``0.1``  (:data:`COUNTDOWN_FORMAT_REWARD`) -- the tag is present and its content parses
      under the restricted grammar and evaluates, but the value is wrong or the numbers used are
      not exactly ``nums`` (a number used twice, one missing, an extra one);
    * ``0.0``  -- no complete answer tag, content that does not parse under the restricted
      grammar, division by zero, or a guard limit exceeded.

GSM8K:
    * :func:`gsm8k_correctness_reward` -- ``1.0`` when the completion's final answer equals the
      reference's (the ``#### N`` line of the GSM8K answer), else ``0.0``; compared by math-verify
      with the ``math`` extra, else as plain numbers (:mod:`.math_answers`);
    * :func:`gsm8k_format_reward` -- ``0.2`` (:data:`GSM8K_FORMAT_REWARD`) when the completion is
      reasoning followed by one final ``<answer>NUMBER</answer>`` tag and nothing after it,
      else ``0.0``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

from .answer_parsing import (
    CLOSE_TAG,
    MAX_AST_DEPTH,
    MAX_EQUATION_CHARS,
    MAX_GSM8K_CHARS,
    MAX_INTERMEDIATE,
    MAX_LITERAL,
    OPEN_TAG,
    UNICODE_NUMERIC,
    as_fraction,
    as_int_list,
    extract_answer_tag,
    extract_final_number,
    parse_countdown_equation,
    parse_with_claim,
)
from .math_answers import answers_match

__all__ = [
    "COUNTDOWN_FORMAT_REWARD",
    "GSM8K_FORMAT_REWARD",
    "MissingColumnError",
    "MAX_EQUATION_CHARS",
    "MAX_AST_DEPTH",
    "MAX_LITERAL",
    "MAX_INTERMEDIATE",
    "completion_to_text",
    "extract_answer_tag",
    "parse_countdown_equation",
    "countdown_reward",
    "countdown_format_reward",
    "extract_final_number",
    "gsm8k_correctness_reward",
    "gsm8k_format_reward",
    "repeat_letter_reward",
    "require_columns",
]

#: Score for a Countdown answer that parses but is wrong.
COUNTDOWN_FORMAT_REWARD = 0.1
#: Score for a GSM8K completion in the expected ``reasoning ... <answer>N</answer>`` format.
GSM8K_FORMAT_REWARD = 0.2


# ---------------------------------------------------------------------------------------------
# Completion handling
# ---------------------------------------------------------------------------------------------


def _content_to_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # multimodal-style content parts
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return ""


def completion_to_text(completion: Any) -> str:
    """Plain text of one completion.

    A string is returned as is. A chat completion (list of message dicts, or one message dict)
    gives the concatenated content of its ``assistant`` messages (all messages when none has
    that role). Anything else (``None``, numbers, ...) gives ``""``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_to_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        assistant = [m for m in messages if m.get("role") == "assistant"]
        chosen = assistant or messages
        return "\n".join(_content_to_text(m.get("content")) for m in chosen)
    return ""


def _column(values: Sequence[Any] | None, n: int) -> list[Any]:
    """A kwargs column aligned with ``n`` completions (missing/short columns pad with None)."""
    if values is None:
        return [None] * n
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        return [values] * n  # a scalar broadcast to every completion
    values = list(values)
    return values[:n] + [None] * (n - len(values))


class MissingColumnError(ValueError):
    """A reward reads a dataset column the training dataset does not have."""


def require_columns(reward: str, **columns: Any) -> None:
    """Raise when a column a reward reads was not passed: it would score every completion 0, silently."""
    missing = [name for name, values in columns.items() if values is None]
    if missing:
        names = ", ".join(repr(name) for name in missing)
        raise MissingColumnError(
            f"{reward} reads the dataset column(s) {names}, which the training dataset does not have "
            f"(TRL passes each dataset column to the reward by name): add {names} to the dataset, one value "
            f"per prompt, or use a reward that does not need {'it' if len(missing) == 1 else 'them'}"
        )


def _score_each(completions, score, *columns) -> list[float]:
    """``score(text, *column values)`` per completion, as a float; any exception scores 0.0.

    ``columns`` are the dataset's keyword lists, aligned with the completions by ``_column``;
    the caller checks first that none is missing (``require_columns``).
    """
    completions = list(completions) if completions is not None else []
    aligned = [_column(values, len(completions)) for values in columns]
    rewards: list[float] = []
    for completion, *row in zip(completions, *aligned):
        try:
            rewards.append(float(score(completion_to_text(completion), *row)))
        except Exception:  # a reward function must never raise on model output
            rewards.append(0.0)
    return rewards


# ---------------------------------------------------------------------------------------------
# Countdown (the equation's grammar and guards: answer_parsing)
# ---------------------------------------------------------------------------------------------


def _score_countdown(text: str, target: Any, nums: Any) -> float:
    content = extract_answer_tag(text)
    if content is None:
        return 0.0  # format failure: no complete answer tag
    parsed = parse_with_claim(content)
    if parsed is None:
        return 0.0  # does not parse under the restricted grammar / guard exceeded / x/0
    value, literals, claim = parsed
    want = as_fraction(target)
    numbers = as_int_list(nums)
    if want is None or numbers is None:
        return 0.0  # unusable reference data: no credit
    if Counter(literals) != Counter(numbers):
        return COUNTDOWN_FORMAT_REWARD
    if value != want:
        return COUNTDOWN_FORMAT_REWARD
    if claim is not None and Fraction(claim) != want:
        return COUNTDOWN_FORMAT_REWARD
    return 1.0


def countdown_reward(completions, target=None, nums=None, **kwargs) -> list[float]:
    """Countdown game reward.

    Rule (classic): the equation must use **every** number in ``nums`` exactly once (as a
    multiset: a number listed twice must be used twice) and reach ``target`` with ``+ - * /``
    and parentheses; division is exact (rational) arithmetic, so ``(6/3)*12`` is ``24`` and
    ``7/2*2`` is ``7``. Unary minus is accepted; numbers may not be concatenated (``1 2``
    is a syntax error) and no other literals (``2.0``, ``0x10`` -- rejected by the character
    whitelist -- names, calls, ``**``, ``//``, ``%``, strings, ...) are accepted.

    The equation is the content of the **last** ``<answer>...</answer>`` pair. It may end with
    ``= N``; then ``N`` must also equal ``target``, else it counts as a wrong answer.

    Returns per completion ``1.0`` (correct), :data:`COUNTDOWN_FORMAT_REWARD` = ``0.1`` (tag
    present, parses and evaluates, but wrong value or wrong numbers) or ``0.0`` (no tag, not
    parseable, division by zero, over a guard limit: ``MAX_EQUATION_CHARS`` = 200 characters,
    ``MAX_AST_DEPTH`` = 64, literals ``<= MAX_LITERAL`` = 10**6, intermediate numerators and
    denominators ``<= MAX_INTERMEDIATE`` = 10**15).
    """
    require_columns("countdown_reward", target=target, nums=nums)
    return _score_each(completions, _score_countdown, target, nums)


def countdown_format_reward(completions, **kwargs) -> list[float]:
    """:data:`COUNTDOWN_FORMAT_REWARD` (0.1) when the last ``<answer>`` tag holds an equation
    that parses and evaluates under the restricted grammar (right or wrong), else ``0.0``.

    Useful as a separately logged format metric; note :func:`countdown_reward` already includes
    this format credit, so summing both double counts it.
    """

    def score(text: str) -> float:
        content = extract_answer_tag(text)
        ok = content is not None and parse_with_claim(content) is not None
        return COUNTDOWN_FORMAT_REWARD if ok else 0.0

    return _score_each(completions, score)


# ---------------------------------------------------------------------------------------------
# GSM8K (the final answer: math_answers, math-verify or answer_parsing.extract_final_number)
# ---------------------------------------------------------------------------------------------


def gsm8k_correctness_reward(completions, answer=None, **kwargs) -> list[float]:
    """``1.0`` when the completion's final answer equals the reference ``answer``'s (GSM8K style: reasoning
    then ``#### 72``; a bare number works too), else ``0.0`` (also ``0.0`` when either side has none).

    The answer is the last ``<answer>`` tag's content, else the ``####`` line, else what math-verify finds
    (``\\boxed{}``, "the answer is", the last number). With the ``math`` extra, math-verify reads and compares
    the values (``\\frac{3}{4}`` = ``0.75``, ``1,000`` = ``1000``, ``3.50`` = ``3.5``); without it,
    :func:`extract_final_number` compares plain numbers (:mod:`hf_grpo.recipe_support.math_answers`)."""
    require_columns("gsm8k_correctness_reward", answer=answer)
    return _score_each(completions, lambda text, reference: float(answers_match(text, reference)), answer)


# Expected GSM8K completion format: some reasoning (at least one non-space character), then a
# single <answer>NUMBER</answer> at the very end (only whitespace may follow it).
_GSM8K_ANSWER_CONTENT_RE = re.compile(
    r"\s*(?:[-+]\\?\$?|\\?\$[-+]?)?\s?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?\s*"
)


def _gsm8k_well_formatted(text: str) -> bool:
    if text.count(OPEN_TAG) != 1 or text.count(CLOSE_TAG) != 1:
        return False
    start = text.find(OPEN_TAG)
    end = text.find(CLOSE_TAG)
    if end < start:
        return False
    reasoning = text[:start]
    content = text[start + len(OPEN_TAG) : end]
    tail = text[end + len(CLOSE_TAG) :]
    return (
        bool(reasoning.strip())
        and not tail.strip()
        and _GSM8K_ANSWER_CONTENT_RE.fullmatch(content.translate(UNICODE_NUMERIC)) is not None
    )


def gsm8k_format_reward(completions, **kwargs) -> list[float]:
    """:data:`GSM8K_FORMAT_REWARD` (0.2) when the completion is reasoning followed by exactly one
    ``<answer>NUMBER</answer>`` tag at the end (NUMBER: one number, optional sign, ``$`` and
    thousands commas; only whitespace after the closing tag), else ``0.0``.

    Example of the expected format::

        Natalia sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 in total.
        <answer>72</answer>
    """

    def score(text: str) -> float:
        return GSM8K_FORMAT_REWARD if len(text) <= MAX_GSM8K_CHARS and _gsm8k_well_formatted(text) else 0.0

    return _score_each(completions, score)


# ---- quickstart: repeat the prompt's letter ----------------------------------------------------
def repeat_letter_reward(completions, letter=None, length: int = 8, **kwargs) -> list[float]:
    """Share of the first ``length`` completion characters that equal the prompt's letter.

    An early end of the completion counts as wrong characters, so the best answer is the
    letter ``length`` times.
    """
    require_columns("repeat_letter_reward", letter=letter)
    rewards = []
    for completion, wanted in zip(completions, letter):
        text = completion_to_text(completion)[:length]
        rewards.append(0.0 if not wanted else sum(ch == wanted for ch in text) / length)
    return rewards
