"""The longest prompt of a training set, in tokens, as the trainer tokenizes it.

The ``cuda_graph`` backend sizes its one cache for the run from it, and a token budget is checked against it
before the first step. ``tokenize`` is the trainer's own prompt tokenizer (TRL's, chat template included), passed
in so this module never reads the trainer.
"""

from __future__ import annotations

from typing import Callable

from tqdm.auto import tqdm

# Prompts from which the one scan of the training set shows a progress bar.
PROGRESS_FROM = 20_000
SCAN_CHUNK = 1024


def longest_prompt(dataset, tokenize: Callable, *, quiet: bool, limit: int = 200_000) -> int | None:
    """Tokens in ``dataset``'s longest prompt; None when unknown: no plain "prompt" column, images, or more than
    ``limit`` prompts, where the scan would cost too much. ``tokenize(prompts)`` returns (ids, images, fields)."""
    names = getattr(dataset, "column_names", None) or []
    if dataset is None or "prompt" not in names or len(dataset) > limit:
        return None
    longest = 0
    quiet = quiet or len(dataset) < PROGRESS_FROM
    for start in tqdm(range(0, len(dataset), SCAN_CHUNK), desc="hf-grpo: longest prompt", unit="k prompts",
                      disable=quiet):
        prompt_ids, images, fields = tokenize(dataset[start:start + SCAN_CHUNK]["prompt"])
        if images is not None or fields:
            return None
        longest = max(longest, max((len(ids) for ids in prompt_ids), default=0))
    return longest or None
