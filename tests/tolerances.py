"""Tolerances for float32 results that two code paths compute with their sums taken in different orders.

A float32 sum of n terms, in any order, lies within (n - 1) * eps/2 * sum|terms| of the exact sum (Higham, Accuracy
and Stability of Numerical Algorithms, 2nd ed., section 4.2), so two orders differ by at most n * eps * sum|terms|.
The difference follows the size of the terms, not of the result: an element near zero that cancels terms of the
tensor's scale is rounded as they are. So a fixed absolute tolerance (1e-6) is too tight for a tensor of large
elements and too loose for one of small ones, and how close it comes to failing depends on how a machine's kernels
block their sums (SIMD width, threads): asserts that held on one 2-core machine failed on another.

``reordered`` bounds every element by n * eps * max|expected|, the tensor's largest magnitude standing in for
sum|terms|. Where terms cancel, sum|terms| exceeds the result (by about sqrt(n) for terms of random sign); the rounding
errors, of random sign too, grow like sqrt(n) rather than n (Higham's rule of thumb, same section): the two factors of
sqrt(n) make up n. ``backward_terms`` counts n for a parameter's gradient in a decoder as the sums it went through
one after another, each adding its own rounding. On the tiny models of these tests (n of 470 to 900) the differences
measured are at most 12 * eps * max|expected|, 2% of the bound, and an error of 1.1e-4 of the largest element fails.
"""

from __future__ import annotations

import torch

FP32_EPS = torch.finfo(torch.float32).eps


def reordered(expected: torch.Tensor, terms: int) -> dict[str, float]:
    """``rtol`` and ``atol`` for ``torch.testing.assert_close`` (or ``torch.allclose``) comparing a float32 result
    with ``expected``, the same sums of about ``terms`` terms each taken in another order."""
    if terms * FP32_EPS >= 1e-3:
        raise ValueError(f"terms={terms}: a bound of terms * eps would not catch an error of 1e-3 of the largest "
                         f"element; compare in float64, or a smaller computation")
    return {"rtol": 0.0, "atol": terms * FP32_EPS * float(expected.abs().max())}


def backward_terms(config, tokens: int) -> int:
    """The terms summed on the way to a decoder parameter's gradient: the backward's sums over the vocabulary (the
    LM head) and, per layer, over the hidden and MLP widths, then the weight gradient's own sum over ``tokens``."""
    return config.vocab_size + config.num_hidden_layers * (config.hidden_size + config.intermediate_size) + tokens
