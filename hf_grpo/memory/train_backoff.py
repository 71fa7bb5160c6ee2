"""Out-of-memory back-off for a training micro-batch: its forward/backward re-run in token-budget passes.

What the user gets: an out-of-memory anywhere in a micro-batch's forward or backward (the backbone, the
activations kept for the backward, the backward itself) halves ``max_tokens_per_micro_batch`` (from the
micro-batch's own padded size when no budget was set), and the optimizer step goes on at the smaller
size, which is kept for the rest of the run (and in checkpoints) like the other chunk sizes. The update
is the one that budget would have given from the start, to rounding (the passes are exact per loss type:
``hf_grpo.memory.token_budget``).

How, without copying gradients: a failed backward has added part of a gradient to some parameters, and
the earlier micro-batches of the same optimizer step (gradient accumulation) have added theirs. So the
gradients are dropped (``zero_grad(set_to_none=True)``) and the step's earlier micro-batches, whose inputs
TRL keeps in its rollout buffer anyway, are run again at the new budget before the failed one: compute
that only an out-of-memory costs, no memory at all. Their losses were already reported; the metrics TRL
appends while they run again are cut off, so each micro-batch is logged once.

Where: one process, without DeepSpeed or FSDP (``reason_unavailable`` says why not otherwise). With
several processes the backward all-reduces gradients as it goes (DDP buckets, ZeRO's reductions), and
TRL's loss gathers its metrics across ranks during the forward: a rank that runs out of memory half-way
leaves the others waiting inside one of those collectives, where no agreement can reach them. Those runs
keep the up-front bound, ``max_tokens_per_micro_batch``.

The micro-batch's backward therefore happens here, inside ``compute_loss``; the Trainer's own backward
then receives a detached copy of the loss (a leaf: its backward reaches no parameter).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate.utils import DistributedType

from ..run_state import RunFacts
from . import token_budget
from .oom import SizeKnob

_DISTRIBUTED = (DistributedType.DEEPSPEED.value, DistributedType.FSDP.value)


def reason_unavailable(args, facts: RunFacts) -> str | None:
    """Why a training micro-batch cannot be retried after an out-of-memory in this run (``args`` its config);
    None when it can."""
    if facts.num_processes > 1:
        return (f"{facts.num_processes} processes: the backward all-reduces gradients as it runs, so one "
                f"rank's out-of-memory would leave the others waiting")
    if facts.distributed_type in _DISTRIBUTED:
        return f"{facts.distributed_type} manages the gradients itself"
    if facts.n_gpu > 1:
        return f"torch.nn.DataParallel over {facts.n_gpu} GPUs"
    if "lomo" in str(args.optim).lower():
        return f"optim={args.optim} updates the weights inside the backward"
    if args.use_adaptive_entropy:
        return "use_adaptive_entropy: its controller counts each micro-batch's backward"
    # The retry runs the micro-batch in token-budget passes: what those cannot run exactly, it cannot retry.
    probe = copy.copy(args)  # a copy to check: the run's config is not written
    budget = probe.max_tokens_per_micro_batch = args.max_tokens_per_micro_batch or args.max_completion_length + 1
    problems = token_budget.config_problems(probe) + token_budget.run_problems(facts, budget)
    if not problems:
        return None
    # The problem without its fix ("; set ..."), and without a budget the user never set.
    problem = problems[0].split("; ")[0]
    if args.max_tokens_per_micro_batch is None:
        problem = problem.replace(f"{token_budget.FIELD}={budget}", token_budget.FIELD)
    return f"its token-budget passes would not be exact: {problem}"


def _metric_lengths(metrics: Mapping[str, list]) -> dict[str, int]:
    return {name: len(values) for name, values in metrics.items()}


def _cut_metrics(metrics: dict[str, list], lengths: dict[str, int]) -> None:
    """Drop what was appended to each metric list since ``lengths`` was taken (new lists go entirely)."""
    for name in list(metrics):
        del metrics[name][lengths.get(name, 0):]


class MicroBatchBackoff:
    """A training micro-batch's forward and backward, retried at half the token budget after an out-of-memory.

    ``knob`` holds ``max_tokens_per_micro_batch`` in the run's sizes; ``accelerator`` backpropagates, as the Trainer
    would; ``zero_grad()`` drops the model's gradients; ``metrics()`` is TRL's dict of training metric lists.
    ``floor(inputs)`` is the smallest budget every row to come fits in (longest prompt +
    ``max_completion_length``): halving below it ends the run with the out-of-memory error instead.
    """

    def __init__(self, knob: SizeKnob, loss_type: str, accelerator, zero_grad: Callable[[], None],
                 metrics: Callable[[], dict[str, list]], floor: Callable[[Mapping[str, Any]], int]):
        self.knob, self.loss_type, self.accelerator = knob, loss_type, accelerator
        self.zero_grad, self.metrics, self.floor = zero_grad, metrics, floor
        self.window: list[Mapping[str, Any]] = []  # this optimizer step's micro-batches, already backpropagated
        self.replays = 0  # micro-batches run again after an out-of-memory, over the run

    def forward_backward(self, model, compute: Callable[[Mapping[str, Any]], torch.Tensor],
                         inputs: Mapping[str, Any], budget: int | None) -> torch.Tensor:
        """The micro-batch's loss (detached) with its gradient accumulated: in one pass, or in budget passes."""
        if budget is None:
            loss = compute(inputs)
        else:  # every pass but the last backpropagated inside
            loss = token_budget.packed_loss(self.accelerator, model, inputs, budget, self.loss_type, compute)
        self.accelerator.backward(loss)
        return loss.detach()

    def step(self, model, compute: Callable[[Mapping[str, Any]], torch.Tensor], inputs: Mapping[str, Any],
             last_of_step: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; ``compute(inputs)`` is TRL's ``compute_loss`` bound to the
        model, ``last_of_step`` says the optimizer steps after this micro-batch."""
        logged = _metric_lengths(self.metrics())
        redo = False

        def attempt(budget: int | None) -> torch.Tensor:
            nonlocal redo
            if redo:  # the failed attempt left part of a gradient: start the optimizer step's gradient again
                self.zero_grad()
                for earlier in self.window:
                    self.forward_backward(model, compute, earlier, budget)
                    self.replays += 1
            _cut_metrics(self.metrics(), logged)  # each micro-batch's metrics once, from its last run
            return self.forward_backward(model, compute, inputs, budget)

        def on_retry() -> None:
            nonlocal redo
            redo = True

        loss = self.knob.run(attempt, full=lambda: _padded_tokens(inputs), on_retry=on_retry,
                             floor=lambda: self.floor(inputs))
        if last_of_step:
            self.window.clear()
        else:
            self.window.append(inputs)
        return loss


def _padded_tokens(inputs: Mapping[str, Any]) -> int:
    """Tokens of the micro-batch as one pass: rows x (prompt + completion width) after cutting unused padding."""
    ext = token_budget.extents(inputs)
    return token_budget.pass_tokens(list(range(len(ext.prompt))), ext)
