"""The prompts as the model sees them: a tokenizer that can end completions and pad prompts, no prompt of zero
tokens, and no prompt that with a full-length completion runs past the model's positions.

Each is refused with an error naming what was found, instead of a ``TypeError`` from ``torch.full`` (no pad
token), an ``IndexError`` inside transformers' ``generate`` (an empty prompt) or a run that trains on positions the
model never learned, with only transformers' "friendly reminder" in the log (a prompt too long).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

PROMPT_COLUMN = "prompt"
# Rows named in an error; the count says how many more there are.
NAMED_ROWS = 10
# A map-style training set is scanned for empty prompts at construction up to this many rows (as the longest-prompt
# scan is, ``hf_grpo.memory.prompt_lengths``); a larger or streamed one is checked as each rollout is tokenized.
SCAN_LIMIT = 200_000


def check_special_tokens(tokenizer) -> None:
    """Refuse a tokenizer without an EOS token.

    TRL stops each completion at the tokenizer's ``eos_token`` (it is always among the stop tokens) and left-pads
    prompts with its ``pad_token``, which it sets to the ``eos_token`` where the tokenizer has none. Without an EOS
    token the first rollout fails (``torch.full`` of a ``None`` pad id, or ``torch.tensor`` of a ``None`` stop
    token)."""
    if tokenizer is None or getattr(tokenizer, "eos_token_id", None) is not None:
        return
    name = type(tokenizer).__name__
    pad = getattr(tokenizer, "pad_token", None)
    found = ("neither a pad_token nor an eos_token" if pad is None else
             f"no eos_token (its pad_token is {pad!r})")
    raise ValueError(
        f"the tokenizer (processing_class, {name}) has {found}: GRPO ends each completion at the eos_token and "
        f"left-pads prompts with the pad_token (the eos_token where pad_token is unset). Set them before building "
        f"the trainer to tokens the model was trained with, e.g. tokenizer.eos_token = '</s>' (the pad token then "
        f"defaults to it), or tokenizer.add_special_tokens({{'eos_token': '</s>', 'pad_token': '<pad>'}}) followed "
        f"by model.resize_token_embeddings(len(tokenizer))"
    )


def _rows(indexes: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:NAMED_ROWS])
    return shown + (f" and {len(indexes) - NAMED_ROWS} more" if len(indexes) > NAMED_ROWS else "")


FILTER_HINT = "dataset = dataset.filter(lambda row: row['prompt'].strip() != '')"


def check_empty_prompts(dataset, tokenize: Callable) -> None:
    """Refuse a training set holding prompts that tokenize to no token, naming their row indexes.

    Only plain-text prompts that are empty or white space can (a chat template adds tokens of its own), so only
    those are tokenized. A streamed set, or one of more than ``SCAN_LIMIT`` rows, is left to the check of each
    rollout's prompts (``check_rollout_prompts``). ``tokenize(prompts)`` returns (ids, images, fields), as TRL's
    ``_tokenize_prompts``."""
    columns = getattr(dataset, "column_names", None) or []
    if dataset is None or PROMPT_COLUMN not in columns:
        return
    try:
        rows = len(dataset)
    except TypeError:  # an IterableDataset
        return
    if rows == 0 or rows > SCAN_LIMIT or not isinstance(dataset[0][PROMPT_COLUMN], str):
        return  # (a conversational set's first row tells: a column holds one type)
    blank = [i for i, prompt in enumerate(dataset[PROMPT_COLUMN]) if isinstance(prompt, str) and not prompt.strip()]
    if not blank:
        return
    ids, _, _ = tokenize([dataset[i][PROMPT_COLUMN] for i in blank])
    empty = [row for row, tokens in zip(blank, ids) if len(tokens) == 0]
    if empty:
        raise ValueError(
            f"train_dataset has {len(empty)} prompt(s) that tokenize to no token (rows {_rows(empty)}: "
            f"{dataset[empty[0]][PROMPT_COLUMN]!r}); generation needs at least one prompt token. Drop them, e.g. "
            f"{FILTER_HINT}"
        )


def position_limit(model) -> tuple[int, str] | None:
    """The positions the model was trained for, and how they were found; None where its config does not say.

    ``max_position_embeddings``, or, with RoPE scaling (YaRN, linear, dynamic, Llama 3's), the scaled length:
    ``factor`` x ``original_max_position_embeddings`` (else x ``max_position_embeddings``), where larger."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0:
        return None
    described = f"max_position_embeddings={positions}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        factor = rope.get("factor")
        if isinstance(factor, (int, float)) and factor > 1:
            scaled = int(factor * rope.get("original_max_position_embeddings", positions))
            if scaled > positions:
                return scaled, f"{described} scaled by its RoPE factor {factor:g} to {scaled}"
    return positions, described


def check_completion_fits(max_completion_length: int, limit: tuple[int, str] | None) -> None:
    """Refuse a ``max_completion_length`` that leaves no position for a prompt (at construction)."""
    if limit is not None and max_completion_length >= limit[0]:
        raise ValueError(
            f"max_completion_length={max_completion_length} leaves no room for a prompt in the model's "
            f"{limit[0]} positions ({limit[1]}): a prompt and its completion must fit in them together; set "
            f"max_completion_length below {limit[0]} minus the longest prompt's tokens"
        )


def check_rollout_prompts(prompt_ids: Sequence[Sequence[int]], prompts: Sequence, max_completion_length: int,
                          limit: tuple[int, str] | None) -> None:
    """Refuse prompts, as tokenized for generation, of no token or too long for the model's positions.

    ``prompts`` are the prompts as given (text or messages), named in the error: where the set is streamed (or
    scanned at train start, ``hf_grpo.memory.prompt_lengths``) their row index is not known here."""
    empty = [i for i, ids in enumerate(prompt_ids) if len(ids) == 0]
    if empty:
        raise ValueError(
            f"{len(empty)} prompt(s) of this rollout tokenize to no token (the first: {prompts[empty[0]]!r}); "
            f"generation needs at least one prompt token. Drop empty prompts from the training set, e.g. "
            f"{FILTER_HINT}"
        )
    if limit is None or not prompt_ids:
        return
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    tokens = len(prompt_ids[longest])
    if tokens + max_completion_length > limit[0]:
        room = limit[0] - max_completion_length
        raise ValueError(
            f"a prompt of {tokens} tokens ({str(prompts[longest])[:60]!r}...) with a completion of "
            f"max_completion_length={max_completion_length} tokens needs {tokens + max_completion_length} "
            f"positions, more than the model's {limit[0]} ({limit[1]}): positions past them were never trained "
            f"(and are out of range for learned position embeddings). A prompt and its completion must fit "
            f"together: drop or shorten the prompts longer than {room} tokens (TRL 1.16 has no "
            f"max_prompt_length to truncate them), or set max_completion_length <= {limit[0] - tokens}"
        )


def check_loaded(tokenizer, model, max_completion_length: int, dataset,
                 tokenize: Callable | None) -> tuple[int, str] | None:
    """The checks once the trainer has loaded the tokenizer and the model: the tokenizer's special tokens, room for a
    prompt beside a full-length completion, and (with ``tokenize``, TRL's own) no empty prompt in ``dataset``.
    Returns the model's position limit (``position_limit``), which each rollout's prompts are checked against."""
    check_special_tokens(tokenizer)
    limit = position_limit(model)
    check_completion_fits(max_completion_length, limit)
    if tokenize is not None:
        check_empty_prompts(dataset, tokenize)
    return limit


def checked(tokenized: tuple, prompts: Sequence, max_completion_length: int, limit: tuple[int, str] | None) -> tuple:
    """``tokenized`` (TRL's ``_tokenize_prompts`` of ``prompts``: ids, images, fields), after
    ``check_rollout_prompts``."""
    check_rollout_prompts(tokenized[0], prompts, max_completion_length, limit)
    return tokenized
