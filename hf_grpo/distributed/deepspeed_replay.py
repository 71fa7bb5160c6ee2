"""A training forward replayed from a CUDA graph (``hf_grpo.training.graphs``) announced to DeepSpeed as if it had
run through ``DeepSpeedEngine.forward``, which it does not: the graph runs the module itself.

Since DeepSpeed 0.18.5 the engine's forward puts hooks on its outputs that start the backward (ZeRO's count of
the gradient hooks to expect, the accumulation boundary, the division by the accumulation steps of a direct
``tensor.backward()``); ``engine.backward`` relies on them. Before, ``engine.backward`` did all of it itself, and
there is nothing to announce. (DeepSpeed 0.19.8 reaches the same gradients without them, tested on a CPU in
``tests/distributed/test_packed_launch.py``: they keep what else its forward starts, e.g. its timers, as an eager
pass does.)
"""

from __future__ import annotations

import torch

from ..runtime import upstream


def is_engine_of(model, module: torch.nn.Module) -> bool:
    """Whether ``model`` is the DeepSpeed engine wrapping ``module`` (TRL scores training micro-batches through it)."""
    return type(model).__name__ == "DeepSpeedEngine" and getattr(model, "module", None) is module


def forward_as_engine(engine, run):
    """``run()`` (a replayed forward: ``(logps, entropies)`` or None) between what ``DeepSpeedEngine.forward`` does
    before and after the module."""
    begin_forward(engine)
    result = run()
    if result is not None:
        end_forward(engine, result[0])
    return result


def begin_forward(engine) -> None:
    """What ``DeepSpeedEngine.forward`` does before the module runs that the backward depends on."""
    upstream.reset_backward_seen(engine)


def end_forward(engine, outputs) -> None:
    """The hooks ``DeepSpeedEngine.forward`` puts on its outputs, on the replay's (where this DeepSpeed has them)."""
    upstream.hook_engine_outputs(engine, outputs)
