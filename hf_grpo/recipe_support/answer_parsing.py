"""Reading answers out of model completions, never raising and never calling ``eval``: the last
``<answer>`` tag, a Countdown equation under a restricted grammar (exact rational arithmetic, guard limits),
and a GSM8K-style final number. ``rewards`` scores what these return. The final number is what GSM8K answers are
compared by when math-verify (the ``math`` extra) is not installed, or cannot be used (``math_answers`` says when).

May import: the standard library only.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Any


#: Countdown guards: longest accepted equation (characters, after stripping), deepest AST,
#: largest integer literal, largest |numerator| / denominator of any intermediate value.
MAX_EQUATION_CHARS = 200
MAX_AST_DEPTH = 64
MAX_LITERAL = 10**6
MAX_INTERMEDIATE = 10**15

OPEN_TAG = "<answer>"
CLOSE_TAG = "</answer>"


def extract_answer_tag(text: str) -> str | None:
    """Content of the *last* complete ``<answer>...</answer>`` pair in ``text`` (not stripped).

    "Last" means the last ``</answer>`` and the nearest ``<answer>`` before it. Returns ``None``
    when there is no complete pair. Linear time (no regex backtracking on hostile input).
    """
    if not isinstance(text, str):
        return None
    end = text.rfind(CLOSE_TAG)
    if end < 0:
        return None
    start = text.rfind(OPEN_TAG, 0, end)
    if start < 0:
        return None
    return text[start + len(OPEN_TAG) : end]


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
    result = parse_with_claim(equation)
    if result is None:
        return None
    value, literals, _claim = result
    return value, literals


def parse_with_claim(equation: Any) -> tuple[Fraction, list[int], int | None] | None:
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


def as_int_list(nums: Any) -> list[int] | None:
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


def as_fraction(x: Any) -> Fraction | None:
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


# ---------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------

# Full-width digits / signs and the unicode minus are mapped to ASCII before extraction. (No
# NFKC: it would turn superscripts like "5²" into "52".)
UNICODE_NUMERIC = str.maketrans(
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
MAX_GSM8K_CHARS = 100_000  # only the last 100k characters of a completion are examined


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
        if len(text) > MAX_GSM8K_CHARS:
            text = text[-MAX_GSM8K_CHARS:]
        text = text.translate(UNICODE_NUMERIC)

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
