"""A packed micro-batch whose shape has no graph yet, replayed in a captured larger shape instead.

Over a short run with prompts of varied length most packed shapes are first sightings (prompts of 64-1024
tokens: some 19 shapes in the first 6 steps' 36 micro-batches and scoring chunks), and a capture costs about two
of the micro-batch's own replays (``CAPTURE_COST``). A packed micro-batch fits any graph of the same rows whose
packed length, shared places and scored width are at least its own: the extra length is one more padding row, the
extra shared places more keys for it, the extra width unscored slots (``hf_grpo.training.graph_inputs``). Replaying
there costs the difference in work each time.

Whether a shape will come again is not known when it first does, so the choice is the ski-rental one: a new
shape replays the cheapest captured shape that fits while the extra work it has cost so far, this micro-batch's
included, stays within ``capture_cost`` of its own micro-batches; then it is captured. A shape that never comes
back has cost at most its capture; one that does, at most twice the capture it should have had at once. A shape
whose larger fit is nearly as cheap as itself may never need a graph of its own.

The work of a shape is counted as its layer tokens plus ``head_share`` times its scored width: the LM head's
multiply-adds per scored position as a share of the layers' per token (``head_share``; about 0.38 for
Qwen2.5-0.5B, 0.18 for 1.5B).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import NamedTuple

import torch

# What capturing a shape costs, in replays of its own micro-batch. Measured on an H200 (docs/performance.md): about
# two at 1.5B with LoRA (0.45 s a capture against 0.23 s a replayed micro-batch), four or more at 0.5B (0.28 s
# against some 0.06 s). Two, the lower, captures no later than the cost says at either size. Over the benchmark's
# lengths (bench/graph_shapes.py, seeds 0-9) it captures 40% fewer shapes in steps 2-6 and over 20 steps than
# capturing a shape at its fourth micro-batch did, for 4-5% more work through the first 20 steps, 1% over 500.
CAPTURE_COST = 2.0


class Shape(NamedTuple):
    """What a graph replays: its rows, layout ("packed" or "padded"), length, scored width, entropies or not."""

    rows: int
    layout: str
    length: int  # packed: the sequence's length; padded: the prompt part's width
    shared: int  # packed: the places rows sharing a prompt read again (graph_inputs.packed); padded: 0
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
    """Chooses the shape a micro-batch replays in: its own, or a captured larger one while that costs less in all
    than capturing its own would (``capture_cost`` of its micro-batches; 0: every new shape captured at once)."""

    def __init__(self, head_share: float, capture_cost: float | None = None):
        capture_cost = CAPTURE_COST if capture_cost is None else capture_cost  # (the module's, read at train begin)
        for name, value in (("head_share", head_share), ("capture_cost", capture_cost)):
            if value < 0:
                raise ValueError(f"{name} must be at least 0, got {value!r}")
        self.head_share = head_share
        self.capture_cost = capture_cost
        self._extra: Counter = Counter()  # (owner, shape) -> extra work its replays in larger shapes have cost
        self.reused = 0  # micro-batches replayed in a larger shape than their own

    def work(self, shape: Shape) -> float:
        return shape.length + self.head_share * shape.window

    def fits(self, captured: Shape, shape: Shape) -> bool:
        """Whether ``shape``'s micro-batch can replay ``captured``'s graph."""
        return (captured.layout == shape.layout == "packed"
                and (captured.rows, captured.entropy) == (shape.rows, shape.entropy)
                and captured.length >= shape.length and captured.shared >= shape.shared
                and captured.window >= shape.window)

    def choose(self, owner: Hashable, shape: Shape, captured: Iterable[Shape]) -> Shape:
        """The shape to replay ``shape``'s micro-batch in, among ``owner``'s ``captured`` shapes: ``shape`` itself
        when it is captured, or is to be captured now (nothing fits, or the extra work would pass its capture's)."""
        captured = list(captured)
        if shape in captured:
            return shape
        larger = min((c for c in captured if self.fits(c, shape)), key=self.work, default=None)
        if larger is None:
            return shape
        extra = self._extra[owner, shape] + self.work(larger) / self.work(shape) - 1
        if extra > self.capture_cost:
            return shape
        self._extra[owner, shape] = extra
        self.reused += 1
        return larger
