"""What the exact sampler tests (LLaDA's and Dream's) share: the tiny diffusion model in float64, so that no
near-tie decides a commit, and prompts of four rows, of equal or ragged lengths (left-padded by the callers)."""

import pytest
import torch

from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

TOKENIZER = build_diffusion_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_diffusion_model(TOKENIZER, seed=3, dtype=torch.float64).eval()


def prompts(padded: bool):
    lengths = (3, 6, 1, 4) if padded else (4, 4, 4, 4)
    return [[3 + (7 * row + 5 * j) % 40 for j in range(n)] for row, n in enumerate(lengths)]
