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
    * :func:`gsm8k_correctness_reward` -- ``1.0`` when the number extracted from the completion
      equals the reference final number (the ``#### N`` line of the GSM8K answer), else ``0.0``;
    * :func:`gsm8k_format_reward` -- ``0.2`` (:data:`GSM8K_FORMAT_REWARD`) when the completion is
      reasoning followed by one final ``<answer>NUMBER</answer>`` tag and nothing after it,
      else ``0.0``.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

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

#: Countdown guards: longest accepted equation (characters, after stripping), deepest AST,
#: largest integer literal, largest |numerator| / denominator of any intermediate value.
MAX_EQUATION_CHARS = 200
MAX_AST_DEPTH = 64
MAX_LITERAL = 10**6
MAX_INTERMEDIATE = 10**15

_OPEN_TAG = "<answer>"
_CLOSE_TAG = "</answer>"


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


def extract_answer_tag(text: str) -> str | None:
    """Content of the *last* complete ``<answer>...</answer>`` pair in ``text`` (not stripped).

    "Last" means the last ``</answer>`` and the nearest ``<answer>`` before it. Returns ``None``
    when there is no complete pair. Linear time (no regex backtracking on hostile input).
    """
    if not isinstance(text, str):
        return None
    end = text.rfind(_CLOSE_TAG)
    if end < 0:
        return None
    start = text.rfind(_OPEN_TAG, 0, end)
    if start < 0:
        return None
    return text[start + len(_OPEN_TAG) : end]


# ---------------------------------------------------------------------------------------------
# Countdown
# ---------------------------------------------------------------------------------------------

# Characters allowed in a Countdown equation (checked before ast.parse): ASCII digits, the four
# operators, parentheses and spaces. Rejects names, strings, unicode digits, '.', '_', ...
_EQUATION_CHARS_RE = re.compile(r"[0-9+\-*/() ]*")
_INT_RE = re.compile(r"[+-]?[0-9]{1,16}")


class _Reject(Exception):
    """The equation is outside the restricted grammar or exceeds a guard (scores 0.0)."""


def _check(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_INTERMEDIATE or value.denominator > MAX_INTERMEDIATE:
        raise _Reject("intermediate value too large")
    return value


def _evaluate(node: ast.AST, depth: int, literals: list[int]) -> Fraction:
    if depth > MAX_AST_DEPTH:
        raise _Reject("expression nested too deeply")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1, literals)
    if isinstance(node, ast.Constant):
        value = node.value
        # type() check: bool is a subclass of int and must not pass.
        if type(value) is not int or value < 0 or value > MAX_LITERAL:
            raise _Reject("only non-negative integer literals <= MAX_LITERAL are allowed")
        literals.append(value)
        return Fraction(value)
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, ast.USub):
            raise _Reject("only unary minus is allowed")
        return -_evaluate(node.operand, depth + 1, literals)
    if isinstance(node, ast.BinOp):
        left = _evaluate(node.left, depth + 1, literals)
        right = _evaluate(node.right, depth + 1, literals)
        op = node.op
        if isinstance(op, ast.Add):
            return _check(left + right)
        if isinstance(op, ast.Sub):
            return _check(left - right)
        if isinstance(op, ast.Mult):
            return _check(left * right)
        if isinstance(op, ast.Div):
            if right == 0:
                raise ZeroDivisionError("division by zero")
            return _check(left / right)
        raise _Reject("only + - * / are allowed")
    raise _Reject(f"node {type(node).__name__} is not allowed")


def parse_countdown_equation(equation: str) -> tuple[Fraction, list[int]] | None:
    """Safely evaluate a Countdown equation; ``(value, integer literals used)`` or ``None``.

    Grammar: non-negative integer literals (ASCII decimal digits only, each ``<= MAX_LITERAL``),
    binary ``+ - * /`` (true division, exact via :class:`fractions.Fraction`), unary ``-`` and
    parentheses; whitespace (newlines included) between tokens is allowed. An optional trailing
    ``= N`` (an integer) is accepted and not part of the returned value
    (:func:`countdown_reward` checks ``N`` against the target).

    Returns ``None`` for anything outside the grammar, too long (``MAX_EQUATION_CHARS``), too
    deep (``MAX_AST_DEPTH``), with a too-large intermediate value (``MAX_INTERMEDIATE``), or
    dividing by zero. Uses ``ast.parse`` plus a node whitelist -- never ``eval``. Never raises.
    """
    result = _parse_with_claim(equation)
    if result is None:
        return None
    value, literals, _claim = result
    return value, literals


def _parse_with_claim(equation: Any) -> tuple[Fraction, list[int], int | None] | None:
    """Like :func:`parse_countdown_equation` but also returns the ``= N`` claim, if any."""
    try:
        if not isinstance(equation, str):
            return None
        equation = equation.strip()
        if not equation or len(equation) > MAX_EQUATION_CHARS:
            return None
        claim: int | None = None
        if "=" in equation:
            lhs, sep, rhs = equation.partition("=")
            rhs = rhs.strip()
            if "=" in rhs or not _INT_RE.fullmatch(rhs):
                return None
            claim = int(rhs)
            equation = lhs.strip()
            if not equation:
                return None
        equation = " ".join(equation.split())  # newlines/tabs -> single spaces
        if not _EQUATION_CHARS_RE.fullmatch(equation):
            return None
        tree = ast.parse(equation, mode="eval")
        literals: list[int] = []
        value = _evaluate(tree, 0, literals)
        return value, literals, claim
    except (_Reject, ZeroDivisionError, SyntaxError, ValueError, TypeError, OverflowError,
            RecursionError, MemoryError):
        return None
    except Exception:  # pragma: no cover - belt and braces: a reward function must not raise
        return None


def _as_int_list(nums: Any) -> list[int] | None:
    if nums is None or isinstance(nums, (str, bytes)):
        return None
    try:
        out = []
        for x in nums:
            if isinstance(x, bool):
                return None
            xi = int(x)
            if xi != x:
                return None
            out.append(xi)
        return out
    except (TypeError, ValueError, OverflowError):
        return None


def _as_fraction(x: Any) -> Fraction | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        if isinstance(x, str):
            x = x.strip()
            if len(x) > 64:
                return None
        return Fraction(x)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None


def _score_countdown(text: str, target: Any, nums: Any) -> float:
    content = extract_answer_tag(text)
    if content is None:
        return 0.0  # format failure: no complete answer tag
    parsed = _parse_with_claim(content)
    if parsed is None:
        return 0.0  # does not parse under the restricted grammar / guard exceeded / x/0
    value, literals, claim = parsed
    want = _as_fraction(target)
    numbers = _as_int_list(nums)
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
        ok = content is not None and _parse_with_claim(content) is not None
        return COUNTDOWN_FORMAT_REWARD if ok else 0.0

    return _score_each(completions, score)


# ---------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------

# Full-width digits / signs and the unicode minus are mapped to ASCII before extraction. (No
# NFKC: it would turn superscripts like "5²" into "52".)
_UNICODE_NUMERIC = str.maketrans(
    {**{chr(0xFF10 + i): str(i) for i in range(10)},
     "\uff0c": ",", "\uff0e": ".", "\uff0d": "-", "\uff0b": "+", "\uff04": "$",
     "\u2212": "-", "\u2013": "-", "\u00a0": " "}
)

# A number: optional sign (only when not glued to a preceding word/closing bracket, so "10-3"
# yields 3, not -3), optional "$" (either side of the sign, optionally escaped "\$"), then either
# comma-grouped thousands or plain digits, with an optional decimal part. A trailing period
# ("72.") is not part of the number.
_NUM_RE = re.compile(
    r"(?<![\w.,])"
    r"(?:(?P<s1>[-+])\\?\$?\s?|\\?\$\s?(?P<s2>[-+])?)?"
    r"(?P<num>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?)"
    r"(?![0-9])"
)
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)
_MAX_GSM8K_CHARS = 100_000  # only the last 100k characters of a completion are examined


def _normalize_number(sign: str | None, num: str) -> str:
    """Canonical string: no commas, no leading zeros, no trailing fractional zeros; "-0" -> "0"."""
    num = num.replace(",", "")
    whole, _, frac = num.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    if sign == "-" and out != "0":
        out = "-" + out
    return out


def _matched_number(m: re.Match) -> str:
    return _normalize_number(m.group("s1") or m.group("s2"), m.group("num"))


def _numbers(text: str) -> list[str]:
    return [_matched_number(m) for m in _NUM_RE.finditer(text)]


def _first_number(text: str) -> str | None:
    m = _NUM_RE.search(text)
    return _matched_number(m) if m else None


def _last_number(text: str) -> str | None:
    nums = _numbers(text)
    return nums[-1] if nums else None


def _boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces, at most 200 chars scanned)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    end = min(len(text), i + 200)
    j = i
    while j < end:
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
        j += 1
    return None


def extract_final_number(text: Any) -> str | None:
    """Final numeric answer of a (GSM8K-style) text as a canonical string, or ``None``.

    Sources, in priority order (the first that yields a number wins):

    1. the last ``<answer>...</answer>`` tag -- the last number inside it;
    2. the last ``####`` marker -- the first number after it (GSM8K reference format);
    3. the last ``\\boxed{...}`` -- the last number inside it;
    4. the last "answer is" / "answer:" phrase -- the first number within 80 characters after it;
    5. fallback: the last number anywhere in the text.

    Normalisation: thousands commas and ``$`` are dropped, a sign is kept (``-3.5``), a trailing
    period is not part of the number, leading zeros and trailing fractional zeros are removed
    (``"1,234.50" -> "1234.5"``, ``"72.00" -> "72"``). Full-width digits and the unicode minus are
    read as ASCII. Never raises.
    """
    try:
        if not isinstance(text, str) or not text:
            return None
        if len(text) > _MAX_GSM8K_CHARS:
            text = text[-_MAX_GSM8K_CHARS:]
        text = text.translate(_UNICODE_NUMERIC)

        tag = extract_answer_tag(text)
        if tag is not None:
            found = _last_number(tag)
            if found is not None:
                return found

        pos = text.rfind("####")
        if pos >= 0:
            line = text[pos + 4 :].split("\n", 1)[0]
            found = _first_number(line)
            if found is not None:
                return found

        boxed = _boxed_content(text)
        if boxed is not None:
            found = _last_number(boxed)
            if found is not None:
                return found

        matches = list(_ANSWER_IS_RE.finditer(text))
        if matches:
            window = text[matches[-1].end() : matches[-1].end() + 80]
            found = _first_number(window)
            if found is not None:
                return found

        return _last_number(text)
    except Exception:  # pragma: no cover - never raise on model output
        return None


def gsm8k_correctness_reward(completions, answer=None, **kwargs) -> list[float]:
    """``1.0`` when :func:`extract_final_number` of the completion equals that of the reference
    ``answer`` (GSM8K style: reasoning then ``#### 72``; a bare number works too), else ``0.0``
    (also ``0.0`` when either side has no number)."""

    def score(text: str, reference: Any) -> float:
        if isinstance(reference, (int, float)) and not isinstance(reference, bool):
            reference = str(reference)
        want = extract_final_number(reference)
        return 1.0 if want is not None and extract_final_number(text) == want else 0.0

    require_columns("gsm8k_correctness_reward", answer=answer)
    return _score_each(completions, score, answer)


# Expected GSM8K completion format: some reasoning (at least one non-space character), then a
# single <answer>NUMBER</answer> at the very end (only whitespace may follow it).
_GSM8K_ANSWER_CONTENT_RE = re.compile(
    r"\s*(?:[-+]\\?\$?|\\?\$[-+]?)?\s?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?\s*"
)


def _gsm8k_well_formatted(text: str) -> bool:
    if text.count(_OPEN_TAG) != 1 or text.count(_CLOSE_TAG) != 1:
        return False
    start = text.find(_OPEN_TAG)
    end = text.find(_CLOSE_TAG)
    if end < start:
        return False
    reasoning = text[:start]
    content = text[start + len(_OPEN_TAG) : end]
    tail = text[end + len(_CLOSE_TAG) :]
    return (
        bool(reasoning.strip())
        and not tail.strip()
        and _GSM8K_ANSWER_CONTENT_RE.fullmatch(content.translate(_UNICODE_NUMERIC)) is not None
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
        return GSM8K_FORMAT_REWARD if len(text) <= _MAX_GSM8K_CHARS and _gsm8k_well_formatted(text) else 0.0

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
