"""DeepSpeed ZeRO-1/2's search for a non-finite gradient, left to the global gradient norm that already finds one.

Under bf16 (``bf16.check_grad_overflow``, on by default) and fp16, DeepSpeed 0.19 looks for a non-finite gradient
twice before each optimizer step, and skips the step if either finds one. First gradient by gradient
(``has_overflow_partitioned_grads_serial``: an ``amax``, an ``amin``, two ``isfinite``, a ``logical_and``, a
``logical_not`` and an ``add_`` each, every one a kernel launch), then through the global norm it computes anyway for
clipping and the log, a norm that is not finite counting as an overflow. That norm is the square root of a sum of
each gradient's own norm, taken in float64: a NaN or an infinity in any gradient makes it NaN or infinite. So the
second search flags every step the first does, and the first adds none. With LoRA r16 on every linear layer of Qwen2.5-7B (392 gradients, 2,744 launches) the first
took 125 ms of the host's time at the end of each step on an H100 host under the profiler (which makes each launch
dearer), the GPU idle behind it; 6.8 of a 12.6 ms step on a CPU (``bench/zero_overflow.py``, docs/performance.md).

``install`` has the optimizer skip the first search where the second covers it: the engine's ZeRO-1/2 optimizer
with the check on, the norm computed, and no CPU offload (its own overflow tracking), mixture of experts (norms
kept apart) or model parallelism (norms of shared parameters on one rank only). Skipped steps, the loss scale and
the logged norm (infinite on such a step) come out as before.
"""

from __future__ import annotations

import logging

from ..runtime import upstream

logger = logging.getLogger("hf_grpo")


def covered_by_the_norm(optimizer) -> str | None:
    """Why DeepSpeed's gradient-by-gradient search must stay on ``optimizer``, or None where its global norm's check
    finds every overflow the search would."""
    facts = upstream.zero_overflow_facts(optimizer)
    if facts is None:
        return "not a DeepSpeed ZeRO-1/2 optimizer"
    reasons = {"check_grad_overflow": "no overflow check to shorten", "compute_grad_norm": "no global norm computed",
               "cpu_offload": "CPU offload tracks overflows as the gradients are copied",
               "has_moe_layers": "experts' norms are kept apart", "model_parallel": "model parallelism",
               "zenflow": "ZenFlow"}
    wanted = {"check_grad_overflow": True, "compute_grad_norm": True}
    for key, why in reasons.items():
        if bool(facts[key]) != wanted.get(key, False):
            return why
    return None


def install(engine, main: bool) -> bool:
    """The search left to the norm on ``engine``'s optimizer where that covers it (``covered_by_the_norm``); whether
    it was. Logged once on ``main``."""
    if type(engine).__name__ != "DeepSpeedEngine":
        return False
    optimizer = getattr(engine, "optimizer", None)
    why = covered_by_the_norm(optimizer) if optimizer is not None else "no optimizer"
    if why is None:
        upstream.set_zero_overflow_search(optimizer, lambda partition_gradients=True: None)
    if main:
        logger.info("non-finite gradients: %s", "found by DeepSpeed's global gradient norm alone" if why is None
                    else f"DeepSpeed's own search, gradient by gradient ({why})")
    return why is None
