"""One captured shape of ``hf_grpo.training.graphs``: its static buffers, and its replay as an autograd node (two
kinds: gradients into ``.grad``, or handed over to autograd); and the rollout's scoring in row chunks."""

from __future__ import annotations

from collections.abc import Callable

import torch


def chunked_scoring(score_rows: Callable, input_ids, attention_mask, completion_width: int, rows: int):
    """``score_rows(input_ids, attention_mask, completion_width) -> (logps, entropies or None)`` (as
    ``TrainingGraphs.scorer``) over the batch ``rows`` rows at a time, concatenated."""
    logps, entropies = [], []
    for start in range(0, input_ids.shape[0], rows):
        chunk_logps, chunk_entropies = score_rows(input_ids[start:start + rows], attention_mask[start:start + rows],
                                                  completion_width)
        logps.append(chunk_logps)
        entropies.append(chunk_entropies)
    return torch.cat(logps), (None if entropies[0] is None else torch.cat(entropies))


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
    """The forward graph's log-probs as an autograd node whose backward replays the backward graph.

    ``inputs`` say where the gradients go. ``(anchor,)``: the backward graph accumulates straight into the
    parameters' ``.grad``. Handed over (DeepSpeed ZeRO-1/2 holds ``.grad``), the parameters the backward reaches:
    the graph writes their gradients into its own buffers and the node returns those as the inputs' gradients, so
    autograd accumulates them into ``.grad`` (a copy: the buffers are kept) and DeepSpeed's hooks on that
    accumulation bucket, reduce and partition them as after an eager backward, outside the replayed graph."""

    @staticmethod
    def forward(ctx, graphs, entry, *inputs):
        entry.replay_forward()
        ctx.graphs, ctx.entry = graphs, entry
        entropy = entry.entropy.clone() if entry.entropy is not None else None
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return entry.logps.clone(), entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        entry, graphs = ctx.entry, ctx.graphs
        if grad_logps is None:
            entry.grad_logps.zero_()
        else:
            entry.grad_logps.copy_(grad_logps)
        if not graphs.hand_over:
            graphs.adopt_gradients()
        entry.replay_backward()
        return (None, None, *(graphs.handed_over_buffers() if graphs.hand_over else [None]))
