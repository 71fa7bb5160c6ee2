"""``first_equal_row``: the rows of a batch that repeat an earlier one (prompt sharing, prompt groups, the FLOP
count rely on it), found by hashing instead of sorting. It must agree with ``torch.unique``'s grouping on every
batch, and a hash collision must never pair rows that differ."""

from __future__ import annotations

import pytest
import torch

from hf_grpo.ops import equal_rows
from hf_grpo.ops.equal_rows import first_equal_row


def _by_unique(rows: torch.Tensor) -> torch.Tensor:
    """The first equal row through torch.unique's sort: the definition the hash must meet."""
    _, group = torch.unique(rows, dim=0, return_inverse=True)
    index = torch.arange(rows.shape[0])
    return torch.full_like(index, rows.shape[0]).scatter_reduce(0, group, index, "amin")[group]


def _prompt_batch(seed: int, prompts: int, copies: int, width: int) -> torch.Tensor:
    """Rows as TRL lays out a rollout's prompts: each prompt repeated, left-padded (-1) to the longest."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(prompts):
        length = int(torch.randint(1, width + 1, (1,), generator=g))
        row = torch.full((width,), -1, dtype=torch.long)
        row[width - length:] = torch.randint(0, 50, (length,), generator=g)
        rows += [row] * copies
    batch = torch.stack(rows)
    return batch[torch.randperm(len(batch), generator=g)]


@pytest.mark.parametrize("seed,prompts,copies,width", [(0, 4, 8, 37), (1, 16, 2, 5), (2, 1, 6, 300), (3, 9, 1, 12)])
def test_first_equal_row_agrees_with_torch_unique(seed, prompts, copies, width):
    rows = _prompt_batch(seed, prompts, copies, width)
    assert torch.equal(first_equal_row(rows), _by_unique(rows))


def test_rows_differing_in_one_token_or_by_a_swap_are_apart():
    base = torch.arange(10)
    swapped = base.clone()
    swapped[[2, 7]] = swapped[[7, 2]]  # a weighted sum must tell a permutation apart
    changed = base.clone()
    changed[9] += 1
    rows = torch.stack([base, swapped, changed, base, swapped])
    assert first_equal_row(rows).tolist() == [0, 1, 2, 0, 1]


def test_edge_shapes_and_a_clear_error():
    assert first_equal_row(torch.zeros(1, 4, dtype=torch.long)).tolist() == [0]
    assert first_equal_row(torch.zeros(3, 0, dtype=torch.long)).tolist() == [0, 0, 0]  # empty rows are all equal
    with pytest.raises(ValueError, match=r"rows must be \[B, L\], got shape \(4,\)"):
        first_equal_row(torch.zeros(4, dtype=torch.long))


def test_a_hash_collision_loses_sharing_but_never_pairs_different_rows(monkeypatch):
    monkeypatch.setattr(equal_rows, "_column_weights", lambda width, device: torch.zeros(width, dtype=torch.int64))
    rows = _prompt_batch(5, 5, 3, 9)  # every hash collides
    got = first_equal_row(rows)
    assert all(torch.equal(rows[i], rows[j]) and j <= i for i, j in enumerate(got.tolist()))


def test_prompts_compare_their_tokens_and_padding_not_the_pad_id():
    ids = torch.tensor([[0, 5, 6], [9, 5, 6], [5, 5, 6], [7, 8, 9]])  # rows 0 and 1: other pad ids, same prompt
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    assert equal_rows.first_equal_prompt(ids, mask).tolist() == [0, 0, 2, 3]  # row 2: 3 tokens, not the same
    assert equal_rows.first_equal_prompt(ids, mask.bool()).tolist() == [0, 0, 2, 3]
