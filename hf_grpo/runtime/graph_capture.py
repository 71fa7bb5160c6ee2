"""CUDA-graph capture shared by the decoders that replay a captured step (the cuda_graph backend's
``StaticDecoder``, the diffusion sampler's block cache ``hf_grpo.diffusion.block_cache``) and by the training
graphs (``hf_grpo.training.graphs``): the capture itself, and what a captured graph depends on besides shapes
(``weights_signature``).

May import: torch only (no backend, no model class): the callers hand in the step to capture.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch


@contextmanager
def deepspeed_hooks_lifted(model: torch.nn.Module, origin: str = "deepspeed"):
    """Lift DeepSpeed's forward hooks (those defined under the package ``origin``) off ``model`` while a step is
    captured, and put them back after.

    A DeepSpeed engine (ZeRO-1/2) hooks the module it wraps, and its throughput timer calls
    ``torch.cuda.synchronize`` there: illegal while a stream captures ("operation not permitted when
    stream is capturing", seen on 2 x H100 under ZeRO-2). A replay runs no Python hooks anyway, so the
    captured step loses nothing; other hooks (PEFT, accelerate) stay, and every dict keeps its order.
    """
    saved = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            kept = {key: hook for key, hook in hooks.items()
                    if not (getattr(hook, "__module__", None) or "").startswith(origin)}
            if len(kept) != len(hooks):
                saved.append((hooks, dict(hooks)))
                hooks.clear()
                hooks.update(kept)
    try:
        yield
    finally:
        for hooks, original in saved:
            hooks.clear()
            hooks.update(original)


def deepspeed_engine_hooks_lifted(model: torch.nn.Module | None):
    """``deepspeed_hooks_lifted`` for the engine's own forward hooks alone (its timers, ``deepspeed.runtime.engine``),
    for a training capture: the parameter hooks of ZeRO-3, where a run keeps them, stay. No model: nothing lifted."""
    return nullcontext() if model is None else deepspeed_hooks_lifted(model, "deepspeed.runtime.engine")


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (as it was after it): for a CUDA-graph capture.

    Since torch 2.9 ``torch.cuda.graph`` no longer collects before a capture, so a collection that starts inside
    one can destroy an earlier graph left in a reference cycle (a replaced decoder's, a dropped training bucket's)
    or unload a compiled kernel, calls a capture forbids: the capture fails as "operation failed due to a previous
    error during capture", at random (pytorch/pytorch#161037). What becomes garbage meanwhile waits for the next
    collection, outside the capture.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream that warms up and captures every decode step on ``device``.

    cuBLAS gets a workspace (32 MiB and more on Hopper) for each stream it runs on, and torch keeps
    it until the process ends: a fresh stream per capture held one more workspace per rollout, which
    the training step then ran beside (+0.6 GiB at its peak after 20 rollouts on an H100).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


def capture_graph(step: Callable[[], object], model: torch.nn.Module, device: torch.device, warmups: int = 2):
    """``(graph, output)``: ``step()`` run ``warmups`` times on the capture stream, then captured once.

    The warm-ups let cuBLAS and the allocator settle outside the capture; DeepSpeed's hooks are lifted
    for the capture (``deepspeed_hooks_lifted``). ``output`` is what the captured call returned: the
    tensors each replay rewrites.
    """
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with deepspeed_hooks_lifted(model), collection_paused(), torch.cuda.graph(graph, stream=stream):
        output = step()
    return graph, output


def weights_signature(model: torch.nn.Module) -> tuple:
    """What a captured graph depends on besides shapes: tensor addresses and forward-path flags.

    * ``data_ptr`` of every parameter and buffer: a graph reads fixed addresses, so a moved
      tensor (ZeRO-3 gather, replaced module/parameter, ``.to()``) needs a new capture.
    * PEFT tuner flags (``merged``, ``disable_adapters``, active adapters) and ``training``:
      they choose which Python branch the forward takes, which the graph has frozen.
    """
    ptrs = tuple(t.data_ptr() for t in model.parameters()) + tuple(b.data_ptr() for b in model.buffers())
    flags = []
    for module in model.modules():
        if hasattr(module, "merged") and hasattr(module, "disable_adapters"):
            adapters = repr(getattr(module, "active_adapters", None))
            flags.append((bool(module.merged), bool(module.disable_adapters), adapters))
    return ptrs, tuple(flags), model.training
