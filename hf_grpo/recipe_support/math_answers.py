"""Whether a completion's final math answer equals a reference answer.

With the ``math`` extra installed (``pip install "hf-grpo[math]"``) the values are read and compared by HF's
``math-verify``, the checker TRL's and open-r1's accuracy rewards use: LaTeX (``\\frac{3}{4}``, ``\\boxed{}``),
fractions, percentages, thousands separators, ``3.50 == 3.5``, symbolic equality. Without it, the built-in GSM8K
number parser (``answer_parsing.extract_final_number``) compares plain final numbers, and the first call says so
once in the log.

What stays hand-written even with math-verify, because math-verify does not cover it:

* *where* the answer is: the last ``<answer>...</answer>`` tag (the recipes' format) and GSM8K's ``#### N`` line.
  math-verify finds ``\\boxed{}``, "the final answer is" and the last number, not these markers
  (``#### 72 ... the answer is 5`` would read 5). The span found is what math-verify reads;
* full-width digits and the unicode minus, mapped to ASCII first (math-verify reads no number in ``７２`` or ``−3``);
* calls outside the main thread, or while a ``SIGALRM`` timer of the caller's is pending: math-verify's time
  limits are ``signal.alarm``, which only the main thread may set (and which would cancel the caller's timer).
  Without a limit one completion such as ``\\boxed{9^{9^{9^{9}}}}`` can hang the run, so such calls use the
  built-in parser (linear time, needs no limit), said once in the log.

May import: the standard library, ``answer_parsing``, and ``math_verify`` when it is installed.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from .answer_parsing import MAX_GSM8K_CHARS, UNICODE_NUMERIC, extract_answer_tag, extract_final_number

logger = logging.getLogger("hf_grpo")

#: math-verify's limits, whole seconds (``signal.alarm``): reading one span, comparing two values. A GSM8K
#: answer takes milliseconds; a hostile one (a power tower) stops here and scores 0.
PARSE_TIMEOUT_S = 2
VERIFY_TIMEOUT_S = 2

INSTALL_HINT = 'pip install "hf-grpo[math]"'

_NOT_LOADED = object()
_math_verify: Any = _NOT_LOADED  # the math_verify module, None when it is not installed
_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning(message)


def math_verify_module():
    """The ``math_verify`` module, or ``None`` (said once in the log) when the ``math`` extra is not installed."""
    global _math_verify
    if _math_verify is _NOT_LOADED:
        try:
            import math_verify
        except ImportError:
            math_verify = None
            _say_once("missing", (
                f"math-verify is not installed ({INSTALL_HINT}): math answers are compared by the built-in "
                "GSM8K number parser (hf_grpo.recipe_support.answer_parsing), which reads plain final numbers "
                "only (no \\frac{3}{4} = 0.75, no 1/2 = 0.5)"))
        _math_verify = math_verify
    return _math_verify


def _alarm_is_free() -> bool:
    """math-verify may set ``SIGALRM`` here: the main thread, and no timer of the caller's pending."""
    if threading.current_thread() is not threading.main_thread():
        _say_once("thread", (
            "math answers checked outside the main thread use the built-in GSM8K number parser: math-verify's "
            "time limits need SIGALRM, which only the main thread may set"))
        return False
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        _say_once("alarm", (
            "math answers checked while a SIGALRM timer is pending use the built-in GSM8K number parser: "
            "math-verify's time limits would cancel that timer"))
        return False
    return True


def checker() -> str:
    """Which checker :func:`answers_match` uses here and now: ``"math-verify"`` or ``"built-in"``."""
    return "math-verify" if math_verify_module() is not None and _alarm_is_free() else "built-in"


def _as_text(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str) or not value:
        return None
    return value[-MAX_GSM8K_CHARS:].translate(UNICODE_NUMERIC)


def _spans(text: str) -> list[str]:
    """Where the answer may be, most specific first: the last ``<answer>`` tag's content, the line after the
    last ``####``, then the whole text (math-verify's own search: ``\\boxed{}``, "answer is", last number)."""
    spans = []
    tag = extract_answer_tag(text)
    if tag is not None:
        spans.append(tag)
    marker = text.rfind("####")
    if marker >= 0:
        spans.append(text[marker + 4 :].split("\n", 1)[0])
    spans.append(text)
    return spans


def _read(math_verify, text: str) -> list:
    """The values math-verify reads from the first span that has one (``[]`` when none does)."""
    for span in _spans(text):
        parsed = math_verify.parse(span, parsing_timeout=PARSE_TIMEOUT_S)
        if parsed:
            return parsed
    return []


def answers_match(completion: Any, reference: Any) -> bool:
    """Whether the completion's final answer equals the reference's (a GSM8K answer ending in ``#### N``, a bare
    number, or any answer math-verify reads). ``False`` when either side has no answer. Never raises on
    model output (math-verify's own errors and time-outs read as no answer / no match)."""
    completion, reference = _as_text(completion), _as_text(reference)
    if completion is None or reference is None:
        return False
    math_verify = math_verify_module()
    if math_verify is None or not _alarm_is_free():
        want = extract_final_number(reference)
        return want is not None and extract_final_number(completion) == want
    gold = _read(math_verify, reference)
    if not gold:
        return False
    predicted = _read(math_verify, completion)
    return bool(predicted) and bool(math_verify.verify(gold, predicted, timeout_seconds=VERIFY_TIMEOUT_S))
