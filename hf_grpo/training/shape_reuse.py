"""A packed micro-batch whose shape has no graph yet, replayed in a captured larger shape instead.

A capture costs about what an eager micro-batch does (``docs/performance.md``), so a graph pays from its shape's
second micro-batch on. Over a short run with prompts of varied length most packed shapes are first sightings
(prompts of 64-1024 tokens: some 19 shapes in the first 6 steps' 36 micro-batches and scoring chunks). A packed
micro-batch fits any graph of the same rows whose packed length and scored width are at least its own: the extra
length is one more padding row, the extra width unscored slots (``hf_grpo.training.graph_inputs``). So a shape's
first ``sightings`` micro-batches replay the cheapest captured shape that costs at most ``max_extra_work`` more,
and the shape is captured only if it comes again after that.

The work of a shape is counted as its layer tokens plus ``head_share`` times its scored width: the LM head's
multiply-adds per scored position as a share of the layers' per token (``head_share``; about 0.38 for
Qwen2.5-0.5B, 0.18 for 1.5B).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import NamedTuple

import torch

# A shape is replayed in a larger one for its first three micro-batches and captured at its fourth; a larger shape
# fits where it costs at most half again the micro-batch's own work (the next two packed-length buckets up). Over
# the benchmark's lengths (bench/graph_shapes.py, seeds 0-3) that captures 40% fewer shapes in 6 or 20 steps and
# 30% fewer in 100, for 3-8% more work in the first 20 steps and 1.2-1.5% over 100; a capture costs about two
# replayed micro-batches, which the saved captures repay several times over (docs/performance.md).
SIGHTINGS = 3
MAX_EXTRA_WORK = 0.5


class Shape(NamedTuple):
    """What a graph replays: its rows, layout ("packed" or "padded"), length, scored width, entropies or not."""

    rows: int
    layout: str
    length: int  # packed: the sequence's length; padded: the prompt part's width
    window: int
    entropy: bool


def head_share(model: torch.nn.Module) -> float:
    """The LM head's weights as a share of the other weights the layers multiply by (embeddings left out)."""
    if not hasattr(model, "get_output_embeddings"):  # not a transformers model: no head to weigh
        return 0.0
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    skip = {id(p) for module in (head, embeddings) if module is not None for p in module.parameters()}
    body = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    if head is None or body == 0:
        return 0.0
    return head.weight.numel() / body


class ShapeReuse:
    """Chooses the shape a micro-batch replays in: its own, or a captured larger one while its own is new."""

    def __init__(self, head_share: float, sightings: int | None = None, max_extra_work: float | None = None):
        sightings = SIGHTINGS if sightings is None else sightings  # (the module's, read when the graphs start)
        max_extra_work = MAX_EXTRA_WORK if max_extra_work is None else max_extra_work
        for name, value in (("head_share", head_share), ("sightings", sightings), ("max_extra_work", max_extra_work)):
            if value < 0:
                raise ValueError(f"{name} must be at least 0, got {value!r}")
        self.head_share = head_share
        self.sightings = sightings
        self.max_extra_work = max_extra_work
        self._seen: Counter = Counter()
        self.reused = 0  # micro-batches replayed in a larger shape than their own

    def work(self, shape: Shape) -> float:
        return shape.length + self.head_share * shape.window

    def fits(self, captured: Shape, shape: Shape) -> bool:
        """Whether ``shape``'s micro-batch can replay ``captured``'s graph at no more than the extra work allowed."""
        return (captured.layout == shape.layout == "packed"
                and (captured.rows, captured.entropy) == (shape.rows, shape.entropy)
                and captured.length >= shape.length and captured.window >= shape.window
                and self.work(captured) <= (1 + self.max_extra_work) * self.work(shape))

    def choose(self, owner: Hashable, shape: Shape, captured: Iterable[Shape]) -> Shape:
        """The shape to replay ``shape``'s micro-batch in, among ``owner``'s ``captured`` shapes: ``shape`` itself
        when it is captured, or is to be captured now (nothing fits, or it has been seen ``sightings`` times)."""
        captured = list(captured)
        if shape in captured:
            return shape
        self._seen[owner, shape] += 1
        if self._seen[owner, shape] > self.sightings:
            return shape
        larger = min((c for c in captured if self.fits(c, shape)), key=self.work, default=None)
        if larger is None:
            return shape
        self.reused += 1
        return larger
