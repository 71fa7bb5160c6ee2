"""Task datasets for the recipes, built locally (no hub access needed except for GSM8K by name).

* :func:`countdown_dataset` -- generated, always-solvable Countdown instances
  (columns ``prompt``, ``nums``, ``target`` and optionally ``solution``), scored by
  :func:`hf_grpo.recipe_support.rewards.countdown_reward`.
* :func:`gsm8k_dataset` -- GSM8K from the hub or a local JSON/JSON-lines file
  (columns ``prompt``, ``answer``), scored by :func:`hf_grpo.recipe_support.rewards.gsm8k_correctness_reward`
  and :func:`hf_grpo.recipe_support.rewards.gsm8k_format_reward`.
* :func:`as_chat` -- wraps a plain prompt as a chat message list.

Prompts are plain text; recipes that use a chat model map them through :func:`as_chat` and let
the tokenizer's chat template render them.
"""

from __future__ import annotations

import os
import random

import datasets

from .answer_parsing import MAX_INTERMEDIATE, MAX_LITERAL

__all__ = [
    "GSM8K_INSTRUCTION",
    "as_chat",
    "countdown_prompt",
    "countdown_dataset",
    "gsm8k_prompt",
    "gsm8k_dataset",
]

GSM8K_INSTRUCTION = (
    "Solve the problem step by step. After your reasoning, give only the final number inside "
    "<answer></answer> tags at the very end, for example <answer>42</answer>."
)


def as_chat(prompt: str, system: str | None = None) -> list[dict]:
    """``[{"role": "system", ...}, {"role": "user", "content": prompt}]`` (system only if given)."""
    messages: list[dict] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return messages


# ---------------------------------------------------------------------------------------------
# Countdown
# ---------------------------------------------------------------------------------------------


def countdown_prompt(nums, target) -> str:
    """Plain-text Countdown instruction asking for the equation inside ``<answer></answer>``."""
    numbers = ", ".join(str(int(x)) for x in nums)
    return (
        f"Using the numbers [{numbers}], create an equation that equals {int(target)}. "
        "You may use +, -, *, / and parentheses, and you must use every number exactly once. "
        "Think step by step, then give only the final equation (without '= result') inside "
        "<answer></answer> tags, for example <answer>(1 + 2) / 3</answer>."
    )


def _num_range(num_numbers) -> tuple[int, int]:
    if isinstance(num_numbers, int) and not isinstance(num_numbers, bool):
        lo = hi = num_numbers
    else:
        try:
            lo, hi = (int(x) for x in num_numbers)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"num_numbers must be an int or a (min, max) pair, got {num_numbers!r}") from exc
    if not 2 <= lo <= hi <= 8:
        raise ValueError(f"num_numbers must satisfy 2 <= min <= max <= 8, got {num_numbers!r}")
    return lo, hi


_OPS = ("+", "-", "*", "/")


def _random_solution(rng: random.Random, nums: list[int], max_target: int | None):
    """Combine all of ``nums`` into one expression whose intermediate values are all positive
    integers; ``(value, expression)`` or ``None`` if this random attempt got stuck."""
    pool: list[tuple[int, str, bool]] = [(x, str(x), False) for x in nums]  # (value, expr, compound)
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        candidates = []
        for op in _OPS:
            if op == "+":
                value = a[0] + b[0]
            elif op == "-":
                if a[0] <= b[0]:
                    continue
                value = a[0] - b[0]
            elif op == "*":
                value = a[0] * b[0]
            else:
                if b[0] <= 1 or a[0] % b[0]:
                    continue
                value = a[0] // b[0]
            if value <= MAX_INTERMEDIATE:  # the reward refuses larger values: the solution must score
                candidates.append((op, value))
        if not candidates:
            return None
        op, value = rng.choice(candidates)
        left = f"({a[1]})" if a[2] else a[1]
        right = f"({b[1]})" if b[2] else b[1]
        merged = (value, f"{left} {op} {right}", True)
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [merged]
    value, expr, _ = pool[0]
    if value <= 0 or (max_target is not None and value > max_target):
        return None
    return value, expr


def countdown_dataset(
    n: int,
    *,
    seed: int = 0,
    num_numbers=(3, 4),
    max_number: int = 100,
    max_target: int | None = 1000,
    include_solution: bool = False,
) -> datasets.Dataset:
    """``n`` solvable Countdown instances, deterministic given ``seed``.

    For each instance: draw ``k`` numbers in ``[1, max_number]`` (``k`` uniform in the inclusive
    range ``num_numbers``, an int or ``(min, max)`` pair within 2..8), then combine all of them
    in random order with random operators into one expression whose intermediate results are
    positive integers (subtraction only when it stays positive, division only when exact). Its
    value is the ``target``; draws with a target above ``max_target`` (``None``: no cap) are
    redrawn (after 1000 failed draws -- only with a very small ``max_target`` -- the sum of the
    numbers is used even if above the cap). The classic rule of
    :func:`hf_grpo.recipe_support.rewards.countdown_reward` (every number exactly once) therefore always has a
    solution.

    Columns: ``prompt`` (plain text, :func:`countdown_prompt`), ``nums`` (``list[int]``, shuffled
    so the order does not reveal the solution), ``target`` (``int``) and, with
    ``include_solution=True``, ``solution`` (the generator's expression, ``str``).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    lo, hi = _num_range(num_numbers)
    if not 1 <= max_number <= MAX_LITERAL:
        raise ValueError(f"max_number must be in [1, {MAX_LITERAL}], got {max_number}")
    if max_target is not None and max_target < 1:
        raise ValueError(f"max_target must be >= 1 or None, got {max_target}")

    rng = random.Random(seed)
    rows: dict[str, list] = {"prompt": [], "nums": [], "target": []}
    if include_solution:
        rows["solution"] = []
    for _ in range(n):
        found = None
        k = rng.randint(lo, hi)  # drawn once per instance so k stays uniform despite redraws
        for _attempt in range(1000):
            nums = [rng.randint(1, max_number) for _ in range(k)]
            found = _random_solution(rng, nums, max_target)
            if found is not None:
                break
        if found is None:  # pathological settings (e.g. a tiny max_target): fall back to a sum
            nums = [rng.randint(1, max_number) for _ in range(k)]
            found = (sum(nums), " + ".join(map(str, nums)))
        target, solution = found
        shown = list(nums)
        rng.shuffle(shown)
        rows["prompt"].append(countdown_prompt(shown, target))
        rows["nums"].append(shown)
        rows["target"].append(int(target))
        if include_solution:
            rows["solution"].append(solution)

    features = {
        "prompt": datasets.Value("string"),
        "nums": datasets.Sequence(datasets.Value("int64")),
        "target": datasets.Value("int64"),
    }
    if include_solution:
        features["solution"] = datasets.Value("string")
    return datasets.Dataset.from_dict(rows, features=datasets.Features(features))


# ---------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------


def gsm8k_prompt(question: str) -> str:
    """The question followed by :data:`GSM8K_INSTRUCTION` (the format
    :func:`hf_grpo.recipe_support.rewards.gsm8k_format_reward` rewards)."""
    return f"{question.strip()}\n\n{GSM8K_INSTRUCTION}"


def _has_content(path: str) -> bool:
    with open(path) as handle:
        return any(line.strip() for line in handle)


def gsm8k_dataset(name_or_path: str = "openai/gsm8k", split: str = "train") -> datasets.Dataset:
    """GSM8K mapped to columns ``prompt`` (question + answer-format instruction) and ``answer``
    (the full reference: reasoning then ``#### N``); all other columns are dropped.

    If ``name_or_path`` is an existing local ``.jsonl``/``.json`` file it is loaded with the
    ``json`` builder; the whole file is one split, so ``split`` only contributes an optional
    slice (``"train[:100]"`` -> the first 100 rows). Otherwise it is loaded from the hub as
    ``load_dataset(name_or_path, "main", split=split)``.

    Raises ``ValueError`` naming the columns found when ``question`` or ``answer`` is missing.
    """
    path = os.fspath(name_or_path)
    if os.path.isfile(path) and path.lower().endswith((".jsonl", ".json")):
        local_split = "train" + (split[split.index("[") :] if "[" in split else "")
        if not _has_content(path):  # the json builder would raise a bare StopIteration
            raise ValueError(f"GSM8K data file {path!r} is empty; it needs one JSON object per line with "
                             f"'question' and 'answer'")
        ds = datasets.load_dataset("json", data_files=path, split=local_split)
    else:
        ds = datasets.load_dataset(path, "main", split=split)

    columns = list(ds.column_names)
    missing = [c for c in ("question", "answer") if c not in columns]
    if missing:
        raise ValueError(
            f"GSM8K data needs columns 'question' and 'answer'; missing {missing}, found {columns}"
        )

    def _map(example):
        return {"prompt": gsm8k_prompt(str(example["question"])), "answer": str(example["answer"])}

    drop = [c for c in columns if c != "answer"]
    return ds.map(_map, remove_columns=drop)


# ---- quickstart: repeat the prompt's letter ----------------------------------------------------
QUICKSTART_LETTERS = "abcdefgh"


def repeat_letter_prompt(letter: str) -> str:
    return f"{letter}>"


def repeat_letter_dataset(n: int, *, seed: int = 0, letters: str = QUICKSTART_LETTERS) -> datasets.Dataset:
    """Prompts ``"c>"`` asking for the letter ``c`` repeated; column ``letter`` feeds the reward.

    A randomly initialised model of a few thousand parameters learns it from reward alone in a
    couple of minutes on a CPU: the reward is dense (a share of correct characters) and needs
    the model to read its prompt.
    """
    if n < 1:
        raise ValueError(f"n must be a positive integer, got {n}")
    rng = random.Random(seed)
    chosen = [rng.choice(letters) for _ in range(n)]
    return datasets.Dataset.from_dict({"prompt": [repeat_letter_prompt(c) for c in chosen], "letter": chosen})
