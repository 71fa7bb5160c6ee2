"""A training forward replayed from CUDA graphs (``hf_grpo.training.graphs``) announced to DistributedDataParallel
as if it had run through ``DistributedDataParallel.forward``, which it does not: the graph runs the module itself.

DDP reduces gradients in hooks on each parameter's gradient accumulation, and its reducer acts on them only after
its forward prepared it. Read from torch 2.13's ``torch/nn/parallel/distributed.py``, ``forward`` is
``_pre_forward`` (outside ``no_sync()``: ``reducer.prepare_for_forward``; the buckets rebuilt once; the buffers
broadcast from rank 0), the module, then ``_post_forward`` (outside ``no_sync()``: ``reducer.prepare_for_backward``,
given the outputs with ``find_unused_parameters`` to find the parameters the backward will not reach; under
``no_sync()`` nothing, so the gradients accumulate locally; with ``find_unused_parameters`` the outputs wrapped in
``_DDPSink``). The replay's node hands its gradients to the parameters' accumulation (``Replay`` in
``hf_grpo/training/graph_buckets.py``, handed over), so the hooks run after the replay as after an eager backward;
here the two halves run around the replay instead of the module, with the replay's outputs, whose autograd graph
reaches the same parameters as the module's would.

Not honoured, so refused (``unsupported_reason``): settings whose work sits elsewhere than in those two halves or
that were not checked against eager training (static graph, delayed all-reduce, DDP's own mixed precision, the
compiled-autograd reducer). Left out on purpose: ``forward`` runs the module inside ``_inside_ddp_forward()``, which
only tells torch.compile to split compiled graphs at the gradient buckets; a replay's gradients reach the hooks
after its whole backward, so there is nothing to overlap.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from . import deepspeed_replay


def is_ddp_of(model, module: torch.nn.Module) -> bool:
    """Whether ``model`` is the DistributedDataParallel wrapping ``module`` (TRL scores training micro-batches
    through it)."""
    return isinstance(model, DistributedDataParallel) and model.module is module


def around_replay(model, module: torch.nn.Module):
    """What runs a replay of ``module``'s forward where TRL calls ``model``: ``forward_as_engine`` where ``model``
    is the DeepSpeed engine wrapping ``module``, ``forward_as_ddp`` where it is DDP's; else None."""
    if deepspeed_replay.is_engine_of(model, module):
        return deepspeed_replay.forward_as_engine
    return forward_as_ddp if is_ddp_of(model, module) else None


def unsupported_reason(wrapper) -> str | None:
    """Why micro-batches scored through ``wrapper`` (the run's wrapped model) cannot be replayed as if through its
    forward; None when they can."""
    if not isinstance(wrapper, DistributedDataParallel):
        return (f"several processes without DeepSpeed, FSDP or DistributedDataParallel (the model is wrapped in "
                f"{type(wrapper).__name__})")
    if not (hasattr(wrapper, "_pre_forward") and hasattr(wrapper, "_post_forward")):
        return f"DDP: torch {torch.__version__} has no DistributedDataParallel._pre_forward/_post_forward"
    if getattr(wrapper, "_use_python_reducer", False):
        return "DDP: the compiled-autograd reducer (torch._dynamo.config.optimize_ddp='python_reducer')"
    if wrapper.static_graph:
        return "DDP: static_graph (ddp_static_graph=True), whose first backward's delayed all-reduce is not replayed"
    if getattr(wrapper, "_delay_all_reduce_params", None):
        return "DDP: parameters whose all-reduce is delayed (delay_all_reduce_named_params)"
    if getattr(wrapper, "mixed_precision", None) is not None:
        return "DDP: its own mixed_precision casts the inputs and parameters in its forward"
    return None


def forward_as_ddp(wrapper: DistributedDataParallel, run):
    """``run()`` (a replayed forward: ``(logps, entropies)`` or None) between ``wrapper``'s ``_pre_forward`` and
    ``_post_forward``. None (a failed capture): the micro-batch then runs eagerly through DDP's forward, which
    begins again (the reducer counts one more forward, which only a static graph, refused, would mind)."""
    # One placeholder input: with device_ids (on a GPU) DDP moves its inputs there and reads the first moved one,
    # and none would fail; the replay's own are static and on the device already.
    wrapper._pre_forward(None)
    result = run()
    return None if result is None else tuple(wrapper._post_forward(tuple(result)))
