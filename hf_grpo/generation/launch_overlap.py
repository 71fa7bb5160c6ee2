"""Programmatic dependent launch (PDL) for the compiled decode step, each kernel waiting before it touches memory.

At 32 rows of a 7B model a decode step runs about 16 kernels a layer, of which the GEMMs and the attention read
nearly all the bytes; the other ten or so each do a few kilobytes of work, so their launch and ramp-up are most of
their time. On Hopper (compute capability 9), inductor can launch its Triton kernels with PDL: a kernel is
scheduled while the one before it runs, and waits (``gdc_wait``) inside for that one's writes. In a captured 7B decode
step this took 2.1% off a replay (H100, ``bench/results/decode_launch_overlap_h100_7b.jsonl``).

Inductor's own placement of the wait (``triton.enable_pdl``) is lazy: a kernel waits before its first access to a
buffer the kernel just before it wrote or read, and otherwise only after its first load. A kernel that never loads
never waits. That kernel can then run and end while the one before it still writes, and the kernel after it,
waiting on it alone, could read an older output before it is written. Rather than prove that no decode step has
that pattern, ``codegen_waits_first`` makes every kernel compiled inside it wait before its first load or store:
then a kernel starts only once the one before it has ended, and that one only once its own predecessor had, so no
kernel can read an output before it is written. What is kept is the launch overlap (the next kernel is resident
and waiting when the last one ends), which is where the small kernels' time goes.

The compile's options (``compile_options``) carry a graph pass that does nothing and exists for its ``uuid``: it puts
the waiting rule into inductor's cache keys, so a step compiled elsewhere with inductor's lazy waits is never
loaded from the on-disk cache in its place.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

RULE = "hf_grpo.generation.launch_overlap: every PDL kernel waits before its first access (1)"
OFF_SWITCH = "HF_GRPO_DECODE_PDL"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the decode step on ``device`` cannot be compiled with PDL here, or None. ``HF_GRPO_DECODE_PDL=0`` turns it
    off (to rule it out when a decode step misbehaves; a step about 2% slower)."""
    if os.environ.get(OFF_SWITCH, "").strip() == "0":
        return f"{OFF_SWITCH}=0"
    if device.type != "cuda" or torch.version.hip:
        return "PDL needs an NVIDIA GPU"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "PDL needs compute capability 9 or above (Hopper)"
    try:
        from torch._inductor import config
        from torch._inductor.codegen.triton import TritonKernel
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
    except ImportError as err:
        return f"this torch's inductor lacks what PDL needs ({err})"
    if not hasattr(config.triton, "enable_pdl") or not hasattr(TritonKernel, "_handle_pdl_before_access"):
        return f"torch {torch.__version__}'s inductor has no PDL code generation to make wait first"
    if config.post_grad_custom_pre_pass is not None:
        return ("a post-grad custom pass is set (torch._inductor.config.post_grad_custom_pre_pass): the waiting rule's "
                "cache key takes its place")
    return None


def compile_options(backend, device: torch.device) -> dict | None:
    """``torch.compile``'s options for a decode step compiled by ``backend`` on ``device``: PDL on, the waiting rule
    in the cache key; None where PDL is unavailable or the backend is not inductor (tests' counting backends)."""
    if backend != "inductor" or unavailable_reason(device) is not None:
        return None
    return {"triton.enable_pdl": True, "post_grad_custom_pre_pass": _rule_in_cache_key()}


def _rule_in_cache_key():
    """A graph pass that changes nothing; its ``uuid`` keys the compiled step by the waiting rule. Built here, not
    at import: importing this module never imports inductor."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RuleInCacheKey(CustomGraphPass):
        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return RULE

    return RuleInCacheKey()


@contextmanager
def codegen_waits_first() -> Iterator[None]:
    """Inside: every Triton kernel inductor generates with PDL waits before its first load or store.

    Inductor decides where a kernel waits in ``TritonKernel._handle_pdl_before_access``, which waits wherever it sees
    no previous node; inside, it is called with none, so it always does (and still hoists the wait above a
    reduction's loop). Everything else about the code generation is inductor's."""
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.virtualized import V

    original = TritonKernel._handle_pdl_before_access

    def waiting(self, *args, **kwargs):
        scheduler = V.graph.scheduler
        if scheduler is None:  # inductor waits where it has no scheduler
            return original(self, *args, **kwargs)
        previous = scheduler.previous_node
        scheduler.previous_node = None
        try:
            return original(self, *args, **kwargs)
        finally:
            scheduler.previous_node = previous

    TritonKernel._handle_pdl_before_access = waiting
    try:
        yield
    finally:
        TritonKernel._handle_pdl_before_access = original
