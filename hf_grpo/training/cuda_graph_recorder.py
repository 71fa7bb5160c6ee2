"""What capturing the training step asks of the device (``hf_grpo.training.graphs``): record a function once
as a CUDA graph and replay it, on one stream, and get torch's generator back after a capture that failed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from ..runtime.graph_capture import collection_paused, deepspeed_engine_hooks_lifted

logger = logging.getLogger("hf_grpo.training.graphs")
T = TypeVar("T")


def end_broken_capture() -> None:
    """After a capture that failed half-way, an empty capture: torch's CUDA generator is still marked as
    capturing by the failed one (every later random draw would raise), and an ended capture clears the mark."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with collection_paused(), torch.cuda.graph(graph):
            pass
    except Exception as err:  # noqa: BLE001 - the generator's state is what matters; say so if it stays wrong
        logger.debug("an empty capture after a failed one raised %s", err)
    del graph


def capture_twice(capture: Callable[[bool], T], recover: Callable[[], None],
                  failed: Callable[[Exception], None]) -> T | None:
    """``capture(warm)``, and after a failure ``recover()`` and once more with an eager pass first (``warm``); where
    that fails too, ``failed(error)`` (which gives graphs up, or raises) and None.

    Why: given up for good, a run's training half doubles for every later step (a 1.5B run under ZeRO-2 on an H100),
    while a cause that does not repeat (a kernel first loaded inside the capture, another thread's call that a
    capture forbids) is gone at a second attempt. It costs one eager pass, and the graphs captured so far, let go by
    ``recover``, are captured again when next met. (The failure that prompted it was repeatable, DeepSpeed's timer
    waiting for the device in its forward hook: ``record`` now lifts that hook.)"""
    try:
        return capture(False)
    except Exception as err:  # noqa: BLE001 - whatever the cause, one more attempt
        logger.info("training_cuda_graphs: a capture failed (%s); trying once more", err, exc_info=err)
        recover()
    try:
        return capture(True)
    except Exception as err:  # noqa: BLE001 - the caller decides: eager from now on ("auto"), or raised ("on")
        failed(err)
        return None


def first_of_each_shape(params: list[torch.Tensor], most: int = 1 << 27) -> list[int]:
    """The index of the first of ``params`` of each shape and dtype, none over ``most`` elements (an embedding's or
    a head's gradient would be a second copy of a large table); the last where none is that small.

    A warm-up mid-step (a compiled layer's later bucket, a capture's second attempt) asks for these gradients only:
    every weight-gradient product's shape then runs once at the bucket's size before the capture, without a second
    set of gradients. A kernel first launched inside a capture (cuBLAS picks kernels by size) is first loaded there."""
    firsts: dict[tuple, int] = {}
    for index, param in enumerate(params):
        if param.numel() <= most:
            firsts.setdefault((tuple(param.shape), param.dtype), index)
    return sorted(firsts.values()) or [len(params) - 1]


class CudaGraphRecorder:
    """What ``TrainingGraphs`` asks of the device: record a function once, replay it. (A test stands in an eager
    recorder with the same interface, to run the rest on a CPU.)"""

    def __init__(self):
        self._stream: torch.cuda.Stream | None = None

    @staticmethod
    def device_reason(device: torch.device) -> str | None:
        """Why graphs cannot be recorded on ``device``; None when they can."""
        return None if device.type == "cuda" else f"CUDA graphs need a CUDA device (device {device.type})"

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def stream(self) -> torch.cuda.Stream:
        """The one stream every warm-up and capture runs on: cuBLAS keeps a workspace for each stream it has run
        on, for the life of the process (a new stream per capture held 64 MiB more each, measured)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        stream = self.stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream().wait_stream(stream)

    def record(self, fn: Callable, pool, model: torch.nn.Module | None = None) -> tuple[Callable[[], None], object]:
        """``(replay, outputs)``: ``fn`` captured once; ``replay()`` runs it again, writing into ``outputs``.

        ``model``, the module ``fn`` runs, is captured without the forward hooks of a DeepSpeed engine that wraps it:
        from its third optimizer step on, the engine's throughput timer synchronizes the device in them, which ends
        any capture ("operation not permitted when stream is capturing"). A replay runs no Python hook anyway."""
        # torch.cuda.graph waits for the device and empties the allocator's cache before each capture. Capturing
        # without both (capture_begin/capture_end) was timed on an H200: no faster over a run, 0.5 GiB more reserved
        # (docs/performance.md, "The capture's own cost").
        graph = torch.cuda.CUDAGraph()
        with deepspeed_engine_hooks_lifted(model), collection_paused():  # (graph_capture's why)
            with torch.cuda.graph(graph, pool=pool, stream=self.stream()):
                outputs = fn()
        return graph.replay, outputs

    def random_state(self):
        return torch.cuda.get_rng_state()

    def set_random_state(self, state) -> None:
        torch.cuda.set_rng_state(state)

    def recover(self) -> None:
        end_broken_capture()
        torch.cuda.empty_cache()
