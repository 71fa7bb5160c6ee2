"""One captured shape of ``hf_grpo.training.graphs``: its static buffers, and its replay as an autograd node."""

from __future__ import annotations

import torch


class Bucket:
    """The static inputs and outputs, and the two replays, of one shape (``shape_reuse.Shape``)."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        self.inputs = {name: value.clone() for name, value in inputs.items()}  # (graph_inputs)
        self.replay_forward = self.replay_backward = None
        self.logps = self.entropy = self.grad_logps = None

    def load(self, inputs: dict[str, torch.Tensor]) -> None:
        """A micro-batch of this bucket into the static inputs the graphs read."""
        for name, value in inputs.items():
            self.inputs[name].copy_(value)


class Replay(torch.autograd.Function):
    """The forward graph's log-probs as an autograd node whose backward replays the backward graph."""

    @staticmethod
    def forward(ctx, anchor, graphs, entry):
        entry.replay_forward()
        ctx.graphs, ctx.entry = graphs, entry
        entropy = entry.entropy.clone() if entry.entropy is not None else None
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return entry.logps.clone(), entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        entry = ctx.entry
        if grad_logps is None:
            entry.grad_logps.zero_()
        else:
            entry.grad_logps.copy_(grad_logps)
        ctx.graphs.adopt_gradients()
        entry.replay_backward()
        return None, None, None
