"""Whether eager training micro-batches run packed (``padding_free=None``): where the GPU is the bound, not the host.

Micro-batches replayed from CUDA graphs always pack (``graphs``). Eager ones - several processes, DeepSpeed, FSDP,
graphs off - pay the host's time per layer call whatever the rows hold, and packing adds host work of its own
(the packed layout, a gather of the scored states). Where the host is the bound that extra work is the step's
time, and packing loses; where the GPU is, packing's fewer tokens (no padding, a prompt run once for its rows) are
the step's time, and packing wins.

What decides it is one layer's work on one micro-batch against the host's roughly fixed cost of a layer call:
``2 x (one layer's parameters) x (the micro-batch's padded tokens)`` FLOPs, the forward of one decoder layer.
It grows with the model's width and with the rows' length, and does not depend on the number of layers (each adds
host and device time alike) or on the launch.

The border rests on measurements of the eager step on one H200 (``docs/performance.md``, "packed rows, eager"):

* 0.5B (Qwen2-0.5B's shape, 15M parameters a layer), 8 rows of up to 384 + 256 tokens: 1.5e11 FLOPs a layer call;
  packed was slower, a later step 1.68 s against 1.43 s padded;
* 1.5B with LoRA (47M a layer), 8 rows of up to 1024 + 512 tokens: 1.2e12; packed and padded equal (3.94 s, 3.93 s);
* 7B (233M a layer), 2048-4096-token completions: the step was bound by the GPU (most of it in the GPU's kernels).

``PACK_FROM_LAYER_FLOPS`` sits above the 1.5B point, where packing measured no gain, so that 0.5B and 1.5B stay
padded and a 3B model (Qwen2.5-3B: 77M a layer; 1.9e12 at the 1.5B run's lengths) or larger packs. It is a border
drawn from two sizes: a measurement of eager packed against padded at 3B or 7B should set it where they cross.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..run_state import RunFacts

# FLOPs of one decoder layer's forward over one micro-batch from which eager micro-batches are packed (see above)
PACK_FROM_LAYER_FLOPS = 1.5e12
# ... and from which training_cuda_graphs="auto" leaves them eager (training.graphs): the GPU is the bound, a replay
# saves no host time, while each new packed shape costs a capture or a replay in a longer captured one. Measured on
# one H100 (docs/performance.md, "The GPU-bound step"): 7B with LoRA, 8 rows of up to 1024 + 2048 tokens (1.2e13),
# the training half 10.1 s eager against 12.5 s replayed; 1.5B with LoRA at 1024 + 512 (1.2e12) gains from the
# graphs, and stays below.
REPLAY_BELOW_LAYER_FLOPS = 5e12


@dataclasses.dataclass(frozen=True)
class Choice:
    packed: bool
    reason: str
    layer_flops: float | None = None  # one decoder layer's forward over a padded micro-batch, where it was weighed

    def __str__(self) -> str:
        return f"rows {'packed' if self.packed else 'padded'} ({self.reason})"


def choose(*, layer_parameters: int, micro_batch_tokens: int, device_type: str) -> Choice:
    """Packed or padded eager micro-batches for ``padding_free=None``, from plain values: one decoder layer's
    parameters, the tokens of a padded micro-batch (rows x (longest prompt + max_completion_length)) and the
    device type ("cuda", "cpu", ...)."""
    if device_type != "cuda":
        return Choice(False, f"padding_free=None packs eager micro-batches on CUDA only (device {device_type})")
    if layer_parameters <= 0 or micro_batch_tokens <= 0:
        raise ValueError(f"layer_parameters and micro_batch_tokens must be positive, got {layer_parameters} and "
                         f"{micro_batch_tokens}")
    flops = 2 * layer_parameters * micro_batch_tokens
    if flops >= PACK_FROM_LAYER_FLOPS:
        return Choice(True, f"padding_free=None: bound by the GPU, {flops:.1e} FLOPs a layer a micro-batch >= "
                      f"{PACK_FROM_LAYER_FLOPS:.1e}", flops)
    return Choice(False, f"padding_free=None: bound by the host, {flops:.1e} FLOPs a layer a micro-batch < "
                  f"{PACK_FROM_LAYER_FLOPS:.1e}; padding_free=True packs anyway", flops)


def gpu_bound_reason(choice: Choice | None) -> str | None:
    """Why micro-batches weighed as ``choice`` are not worth replaying from CUDA graphs, or None (not weighed, or
    below ``REPLAY_BELOW_LAYER_FLOPS``)."""
    flops = getattr(choice, "layer_flops", None)
    if flops is None or flops < REPLAY_BELOW_LAYER_FLOPS:
        return None
    return (f"bound by the GPU ({flops:.1e} FLOPs a layer a micro-batch >= {REPLAY_BELOW_LAYER_FLOPS:.1e}): a "
            "replay saves no host time there, and new shapes cost captures")


def layer_parameters(model: torch.nn.Module) -> int:
    """Parameters of one decoder layer: all but the token embeddings and the LM head, over the layers. Counts
    the whole of a parameter ZeRO-3 has partitioned (``ds_numel``), and a LoRA model's frozen base weights, which
    its forward runs through."""
    config = model.config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None) or 1
    outside = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
               for p in m.parameters()}
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if id(p) not in outside)
    return max(total // layers, 1)


def for_run(setting: bool | None, model: torch.nn.Module, facts: RunFacts, chunked_head: bool, rows: int,
            longest_prompt: Callable[[], int | None]) -> Choice:
    """The eager micro-batches' layout for this run: the user's ``padding_free`` (``setting``) where set, else
    ``choose``; padded wherever the model cannot pack (``padding_free.unsupported_reason``) or keeps TRL's fused head
    (not ``chunked_head``), which scores rows padded. ``rows`` is the micro-batch; ``longest_prompt`` is asked only
    where the choice needs it (it may scan the training set)."""
    from . import padding_free

    unsupported = padding_free.unsupported_reason(model)
    if setting is False:
        return Choice(False, "padding_free=False")
    if unsupported is not None:
        return Choice(False, unsupported)
    if not chunked_head:
        return Choice(False, "the model keeps TRL's fused head, which scores rows padded")
    if setting is True:
        return Choice(True, "padding_free=True")
    device_type = facts.device_type
    # the longest prompt may scan the whole training set: asked only on CUDA, where choose reads the tokens
    tokens = rows * ((longest_prompt() or 0) + facts.max_completion_length) if device_type == "cuda" else rows
    return choose(layer_parameters=layer_parameters(model), micro_batch_tokens=tokens, device_type=device_type)
