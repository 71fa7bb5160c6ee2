"""DeepSpeed's throughput timer measuring without waiting for the device.

A DeepSpeed engine starts its throughput timer in the forward pre-hook it puts on the model it wraps, and stops it
at each optimizer step. From the engine's third step on, with ``timers.throughput.synchronized`` (DeepSpeed's
default), both call ``torch.cuda.synchronize()`` so that the samples/s it reports are exact. Under accelerate it
reports nothing (accelerate sets ``steps_per_print`` to infinity), but the waits remain: before every micro-batch's
forward the host waits for the device to finish the last backward instead of queueing the next launches, and a CUDA
graph captured in that forward ends ("operation not permitted when stream is capturing": the training captures lift
the engine's hooks for that, ``runtime.graph_capture.deepspeed_engine_hooks_lifted``). DeepSpeed's own
documentation of the field says the wait costs speed and the host clock is often accurate enough.

``unsynchronized`` turns the wait off in the DeepSpeed config accelerate builds the engines from, unless the user's
config sets the throughput timer itself.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_grpo")

SETTING = {"enabled": True, "synchronized": False}


def unsynchronized(config: dict | None, is_main_process: bool = True) -> bool:
    """Set ``config``'s throughput timer (``timers.throughput``) to measure without device waits, where the config
    leaves it unset; True where it was set here (said in the log by the main process alone: every rank sets it).
    ``config``: the DeepSpeed config dict of accelerate's plugin, None without DeepSpeed."""
    if config is None:
        return False
    timers = config.get("timers")
    if timers is None:
        timers = config["timers"] = {}
    if not isinstance(timers, dict) or "throughput" in timers:
        return False  # the user's own choice
    timers["throughput"] = dict(SETTING)
    if is_main_process:
        logger.info("DeepSpeed's throughput timer set to measure without device waits (timers.throughput: %s); "
                    "set timers.throughput in the DeepSpeed config to choose otherwise", SETTING)
    return True
