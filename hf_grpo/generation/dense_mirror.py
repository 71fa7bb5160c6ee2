"""A dense copy of the policy's weights for the CUDA-graph decoder under DeepSpeed ZeRO-3.

Why: a captured CUDA graph reads its weights at fixed addresses. ZeRO-3 keeps each parameter
split across the GPUs and gathers it into a fresh buffer whenever it is used, so a graph
captured on the gathered model would read freed memory at the next rollout. The mirror is a
plain (hook-free) model of the same architecture on this device whose tensors do not move while
it is held: ``refresh`` writes the current weights into them in place (``copy_``), so a graph
captured on the mirror stays valid across rollouts and optimizer steps.

``refresh`` gathers one unit at a time (a decoder layer, or a module outside the layer list
such as the embeddings), so its transient peak is the mirror plus one layer, not the mirror
plus a second gathered copy of the model. Its cost is one dense model copy per device, in the
policy's own dtype (``nbytes``), allocated by the first ``refresh``. Where the decoder captures its
graphs afresh every rollout (``release_generation_memory``, the default) nothing reads the addresses
between rollouts, so for a model that trains all its weights ``release`` frees the copy after each
rollout and the next ``refresh`` allocates it again: the copy is held during rollouts only, and the
training half, where such a run peaks (gradients, optimizer states), no longer carries it. A LoRA
run peaks in its rollouts, which hold the copy anyway: there it is kept (``choose_for_run``).

With PEFT LoRA the mirror holds the merged weights (base + every active adapter's delta, as
``merge_and_unload`` computes them) as a plain model: the decoder runs no adapter branch.
Without ZeRO-3 (a plain or DDP model) ``refresh`` is a plain copy, which is what the tests use.

With one process ZeRO-3 partitions nothing: each parameter's partition holds its whole value, at an address that
does not move. There the decoder reads the partitions in place instead (``lora_merge``, ``partitions_whole``) and
no copy is made: the mirror's memory would put the run's peak above the gathered model's.

A LoRA policy outside ZeRO-3 decodes from merged weights for the same reason of speed (``choose_lora``,
``lora_generation_mirror``), but with no copy: its adapters are merged into its own weights for the rollout
and restored after (``lora_merge``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import resolve_backend
from .base import is_zero3_param, is_zero3_partitioned
from .lora_merge import InPlaceLoraMerge, partitions_whole
from .weight_sources import add_lora_deltas, gathered, is_lora_layer, live_base, skeleton, unsupported_reason, walk

logger = logging.getLogger(__name__)

MIRROR_SETTINGS = ("auto", "on", "off")
# "auto" builds the mirror only when free memory holds it twice over: the second copy's worth is left
# for what a rollout allocates on top (KV cache, one gathered layer, the captured step's buffers).
AUTO_HEADROOM = 2.0


def _materialize(mirror: torch.nn.Module, base: torch.nn.Module, device: torch.device | None) -> int:
    """Give every parameter of the meta ``mirror`` its own tensor (tied ones share one), in the dtype of the
    policy tensor it copies, and copy the buffers; return the bytes. ``device=None`` only counts them. The
    parameters hold no memory yet (their storage is freed as each is made, so building peaks at one tensor): the
    first ``refresh`` allocates and fills them."""
    made: dict[int, torch.nn.Parameter] = {}  # meta parameter id -> its one parameter (tied weights)
    nbytes = 0
    for _, members in walk(mirror, base):
        for mirror_module, source, _, _ in members:
            for name, meta in list(mirror_module.named_parameters(recurse=False)):
                if id(meta) in made:
                    mirror_module._parameters[name] = made[id(meta)]
                    continue
                live = getattr(source, name)
                shape = live.ds_shape if is_zero3_param(live) else live.shape
                if tuple(shape) != tuple(meta.shape):
                    raise ValueError(
                        f"{name} of {type(mirror_module).__name__}: the policy holds {tuple(shape)} but its config "
                        f"builds {tuple(meta.shape)}; the dense mirror needs a config that describes the model")
                tensor = torch.empty(meta.shape, dtype=live.dtype, device=device or "meta")
                nbytes += tensor.numel() * tensor.element_size()
                if device is not None:
                    tensor.untyped_storage().resize_(0)
                made[id(meta)] = torch.nn.Parameter(tensor, requires_grad=False)
                mirror_module._parameters[name] = made[id(meta)]
            for name, _ in list(mirror_module.named_buffers(recurse=False)):
                # Buffers (RoPE frequencies) are never partitioned: copied once, as the policy holds them.
                live = getattr(source, name)
                nbytes += live.numel() * live.element_size()
                if device is not None:
                    mirror_module._buffers[name] = live.detach().to(device, copy=True)
    return nbytes


class DenseMirror:
    """A plain copy of ``model`` on ``device`` whose tensors do not move while held; ``refresh(model)`` updates it
    in place.

    ``model`` is the policy as the trainer holds it: a transformers model or a PEFT (LoRA) model, possibly
    under a DDP/DeepSpeed ``.module`` wrapper, its parameters whole or ZeRO-3 partitioned. Every mirror
    tensor takes the dtype of the tensor it copies (the generation dtype), so the mirror's forward equals
    the policy's. Building reads no weights and holds no parameter memory: ``refresh`` allocates the copy
    (``nbytes``) and fills it, and keeps it until ``release``.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the dense mirror cannot copy this model: {reason}; set zero3_generation_mirror='off'")
        base = live_base(model)
        self.device = torch.device(device) if device is not None else next(base.parameters()).device
        self.module = skeleton(base)
        self.nbytes = _materialize(self.module, base, self.device)
        self.module.eval()
        self.module.generation_config = copy.deepcopy(base.generation_config)
        # what ``refresh`` allocates and ``release`` frees: each parameter's storage (a tied one once); the buffers
        # (RoPE) are small and copied only once, so they stay
        self._params = list(self.module.parameters())
        self.released = True  # nothing held until the first refresh

    @property
    def resident_nbytes(self) -> int:
        """Device memory the mirror's parameters hold now: 0 between ``release`` and the next ``refresh``."""
        return sum(param.untyped_storage().nbytes() for param in self._params)

    def release(self) -> None:
        """Free the parameters' memory until the next ``refresh``, which allocates it again and writes every weight.

        Only for a decoder that captures its graphs afresh each rollout: a graph kept across rollouts reads these
        addresses, and the new allocation may lie elsewhere. The tensors stay the same objects (shapes, dtypes);
        reading one before the refresh is an error, never stale values.
        """
        for param in self._params:
            param.untyped_storage().resize_(0)
        self.released = True

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy ``model``'s current weights into the mirror in place, one unit at a time; return the mirror.

        Under ZeRO-3 every rank must call it (each unit is one all-gather), as with any collective. After
        ``release`` it first allocates the parameters' memory again (uninitialized: every weight is written below).
        """
        if self.released:
            for param in self._params:
                param.untyped_storage().resize_(param.numel() * param.element_size())
            self.released = False
        done: set[int] = set()  # a tied weight is copied once
        for live_params, members in walk(self.module, live_base(model)):
            todo = [(m, s, lora, adapters, name, p) for m, s, lora, adapters in members
                    for name, p in m.named_parameters(recurse=False) if id(p) not in done]
            if not todo:
                continue
            with gathered(live_params):
                for _, source, lora, adapters, name, target in todo:
                    target.copy_(getattr(source, name))
                    if lora is not None:
                        add_lora_deltas(target, lora, name, adapters)
                    done.add(id(target))
        return self.module

    def restore(self, overlap: bool = False) -> None:
        """Nothing to undo: the policy's own weights were only read."""


# ---- deciding -----------------------------------------------------------------------------------------

def validate_setting(value: str, field: str = "zero3_generation_mirror") -> str:
    if value not in MIRROR_SETTINGS:
        serves = "under ZeRO-3" if field == "zero3_generation_mirror" else "with the LoRA adapters merged"
        raise ValueError(
            f"{field} must be one of {MIRROR_SETTINGS}, got {value!r}: 'auto' keeps a dense copy of the weights "
            f"for the cuda_graph decoder {serves} when memory allows, 'on' always, 'off' never"
        )
    return value


def planned_nbytes(model: torch.nn.Module) -> int:
    """Bytes a mirror of ``model`` would hold (one copy of its parameters and buffers, in the policy's dtypes)."""
    base = live_base(model)
    return _materialize(skeleton(base), base, None)


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can use on a CUDA ``device`` (free plus torch's cached blocks); None off CUDA."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def fits(nbytes: int, free: int | None) -> tuple[bool, str]:
    """Whether "auto" builds a mirror of ``nbytes`` with ``free`` bytes available (None: not on CUDA)."""
    need = f"{nbytes / 2**30:.2f} GiB"
    if free is None:
        return False, f"it needs {need} and serves only the CUDA-graph decoder, which runs on CUDA"
    if nbytes * AUTO_HEADROOM > free:
        return False, (f"it needs {need} per device and {free / 2**30:.2f} GiB is free (auto wants {AUTO_HEADROOM:g}x "
                       f"its size free); set zero3_generation_mirror='on' to build it anyway")
    return True, f"{need} per device, {free / 2**30:.2f} GiB was free"


def decide(setting: str, model: torch.nn.Module, generation_backend: str, free: int | None,
           field: str = "zero3_generation_mirror", gpu_copy: bool = True) -> tuple[bool, str]:
    """Whether to build a mirror of ``model``, and why (``free``: bytes free on the tightest rank; ``field``: the
    config field that holds ``setting``; ``gpu_copy``: whether it copies the model on the GPU, else it needs no
    memory, as the in-place LoRA merge)."""
    if setting == "off":
        return False, f"{field}='off'"
    reason = unsupported_reason(model)
    if reason is not None:
        if setting == "on":
            raise ValueError(f"{field}='on', but the dense mirror cannot copy this model: {reason}; "
                             f"set {field} to 'auto' or 'off'")
        return False, reason
    if setting == "on":
        return True, f"{field}='on'"
    if generation_backend not in ("auto", "cuda_graph"):
        return False, f"generation_backend={generation_backend!r} captures no CUDA graph"
    if not gpu_copy:  # no GPU memory to find
        return (True, "the cuda_graph decoder serves it") if free is not None else (
            False, "it serves only the CUDA-graph decoder, which runs on CUDA")
    ok, why = fits(planned_nbytes(model), free)
    return ok, why.replace("zero3_generation_mirror", field)


@dataclass
class MirrorChoice:
    """What was decided for a ZeRO-3 or LoRA run: the mirror or in-place merge (or None), why, and what it costs."""

    mirror: DenseMirror | InPlaceLoraMerge | None
    reason: str

    @property
    def nbytes(self) -> int:
        return 0 if self.mirror is None else self.mirror.nbytes

    @property
    def in_place(self) -> bool:
        """Whether the decoder reads the policy's own tensors (no GPU copy)."""
        return isinstance(self.mirror, InPlaceLoraMerge)

    @property
    def dtype(self) -> str | None:
        if self.mirror is None:
            return None
        return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in self.mirror.module.parameters()}))

    kind: str = "ZeRO-3"  # what the mirror stands in for: "ZeRO-3" (partitioned weights) or "LoRA" (adapters)
    # a dense copy's memory freed after each rollout (``DenseMirror.release``), and what happens to it between
    # rollouts, in words (``choose_for_run``)
    freed_between_rollouts: bool = False
    between_rollouts: str = ""

    def plan_fields(self) -> dict:
        """The batch plan's fields for it (``BatchPlan.generation_mirror*``)."""
        return {"generation_mirror": "off" if self.mirror is None else "on", "generation_mirror_kind": self.kind,
                "generation_mirror_bytes": self.nbytes, "generation_mirror_dtype": self.dtype,
                "generation_mirror_in_place": self.in_place,
                "generation_mirror_freed": self.freed_between_rollouts}

    def __str__(self) -> str:
        if self.mirror is None:
            if self.kind == "LoRA":
                return f"off ({self.reason}): the decoder runs the LoRA adapters as they are"
            return f"off ({self.reason}): the hf backend generates from the ZeRO-3 model (ds3_gather_for_generation)"
        if self.kind == "LoRA":
            packed = (f"; {self.mirror.packed_groups} groups of frozen q/k/v and gate/up weights laid side by side, "
                      f"so the decoder fuses them with no copy" if self.mirror.packed_groups else "")
            return (f"on ({self.reason}): the adapters merged into the policy's own weights for each rollout, "
                    f"then restored from a {self.mirror.host_nbytes / 2**30:.2f} GiB host copy (no GPU copy)"
                    f"{packed}")
        if self.in_place:
            merged = (f", LoRA merged for each rollout and restored from a {self.mirror.host_nbytes / 2**30:.2f} GiB "
                      f"host copy" if self.mirror.host_nbytes else "")
            return (f"on ({self.reason}): one process holds ZeRO-3's partitions whole, so the decoder reads them in "
                    f"place{merged} (no GPU copy)")
        after = f", {self.between_rollouts}" if self.between_rollouts else ""
        return (f"on ({self.reason}): one {self.dtype} copy of the model per device "
                f"({self.nbytes / 2**30:.2f} GiB), refreshed layer by layer each rollout{after}")


def choose(setting: str, model: torch.nn.Module, generation_backend: str, device: torch.device,
           min_over_ranks: Callable[[int], int]) -> MirrorChoice | None:
    """The mirror decision for a run, the same on every rank (the refresh is collective); None without ZeRO-3.

    ``min_over_ranks`` reduces an integer to its minimum over the ranks (the tightest GPU decides "auto").
    """
    if not is_zero3_partitioned(model):
        return None
    return _choose(setting, model, generation_backend, device, min_over_ranks, "zero3_generation_mirror", "ZeRO-3")


def _choose(setting: str, model, generation_backend: str, device: torch.device,
            min_over_ranks: Callable[[int], int], field: str, kind: str) -> MirrorChoice:
    if generation_backend == "vllm":
        return MirrorChoice(None, "vLLM generates from its own copy of the weights", kind)
    free = free_bytes(device)
    if free is not None:
        free = min_over_ranks(free)
    # in place where the policy's weights are whole on the device: a LoRA policy, or ZeRO-3 with one process
    in_place = kind == "LoRA" or bool(min_over_ranks(int(partitions_whole(model, device))))
    on, reason = decide(setting, model, generation_backend, free, field, gpu_copy=not in_place)
    if not on:
        return MirrorChoice(None, reason, kind)
    return _build(setting, model, generation_backend, device, reason, kind, in_place)


def _build(setting: str, model, generation_backend: str, device: torch.device, reason: str, kind: str,
           in_place: bool) -> MirrorChoice:
    mirror = InPlaceLoraMerge(model) if in_place else DenseMirror(model, device)
    backend, why_not = resolve_backend(generation_backend, mirror.module)
    if setting == "auto" and backend.name != "cuda_graph":
        # "auto" keeps the copy only for the decoder it exists for (the model is checked on the copy itself)
        del mirror
        return MirrorChoice(None, f"the cuda_graph backend would not serve it: {why_not}", kind)
    return MirrorChoice(mirror, reason, kind)


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` (under any wrapper) carries PEFT LoRA layers."""
    return any(is_lora_layer(module) for module in live_base(model).modules())


def choose_lora(setting: str, model: torch.nn.Module, generation_backend: str, device: torch.device,
                min_over_ranks: Callable[[int], int]) -> MirrorChoice | None:
    """The merge decision for a LoRA policy whose weights are whole on each device (no ZeRO-3): the decoder reads
    the policy's weights with the adapters merged in place for each rollout (``lora_merge``). None for a model
    without LoRA layers."""
    if not has_lora(model):
        return None
    return _choose(setting, model, generation_backend, device, min_over_ranks, "lora_generation_mirror", "LoRA")


def choose_for_run(settings, model: torch.nn.Module, zero3_configured: bool, device: torch.device,
                   agree: Callable[[int], int], main: bool) -> tuple[bool, MirrorChoice | None]:
    """``(decided, choice)`` for a run: ZeRO-3's mirror where ``model`` is partitioned (``zero3_generation_mirror``),
    else a LoRA policy's merge (``lora_generation_mirror``); ``settings`` is the run's config, ``agree`` the minimum
    over the ranks. Not decided while ZeRO-3 is configured and ``model`` is not partitioned yet (built in code,
    before DeepSpeed wraps it); the choice logged on ``main``."""
    zero3 = is_zero3_partitioned(model)
    if not zero3 and zero3_configured:
        return False, None
    pick, setting = ((choose, settings.zero3_generation_mirror) if zero3 else
                     (choose_lora, settings.lora_generation_mirror))
    choice = pick(setting, model, settings.generation_backend, device, agree)
    if choice is not None and isinstance(choice.mirror, DenseMirror):
        # Freed where that lowers the run's peak: a model that trains all its weights peaks in the training half
        # (gradients, optimizer states), which the copy would sit through. A LoRA run peaks in its rollouts, which
        # hold the copy anyway; freeing it there measured a slower training half (7B on one H200: docs/performance.md).
        # The decoder captures afresh each rollout (release_generation_memory), so nothing reads the old addresses.
        lora = has_lora(model)
        choice.freed_between_rollouts = settings.release_generation_memory and not lora
        choice.between_rollouts = (
            "freed after it (release_generation_memory)" if choice.freed_between_rollouts else
            "kept between rollouts (release_generation_memory=False)" if not settings.release_generation_memory else
            "kept between rollouts: a LoRA run peaks in its rollouts, which hold the copy anyway")
    if choice is not None and main:
        logging.getLogger("hf_grpo").info("%s generation mirror: %s", choice.kind, choice)
    return True, choice
