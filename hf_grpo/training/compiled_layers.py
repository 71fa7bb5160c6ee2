"""The training forward's decoder layers compiled: one ``torch.compile`` per layer class, dynamic shapes.

Measured on an H200 (``bench/phase_timer.py``, ``docs/performance.md``), a 0.5B model's training half of a GRPO step
is bound by the host, not the GPU: the GPU is busy for about a fifth of it, and the rest is Python and kernel
launches of eager layers (norms, rotary embeddings, activations and residual adds a few kernels each, run again by
activation checkpointing's recompute). Compiled, each layer is a handful of fused kernels and one call.

* One compile serves every layer of a class (parameters are graph inputs, as in the decode step's
  ``runtime.regional_compile``), and ``dynamic=True`` makes one graph serve every micro-batch shape, so
  a run compiles a bounded number of times (``compiles`` counts the graphs; ``perf/train_compiles``).
* Layers are routed through the compiled forward only inside ``route`` - the trainer's ``training_step``
  (scoring, forward and backward) - and lifted again around generation (``suspended``), whose decoders
  compile or capture the layers their own way.
* The packed attention of ``hf_grpo.training.padding_free`` is one custom op inside the graph: its row bounds are read
  on the host within it, so they neither specialize the graph nor break it.
* Where transformers would checkpoint a layer (training, with gradients), the compiler does the activation
  checkpointing: the layer's own forward is compiled with the partitioner's memory budget at 0, so the graph
  keeps for backward little more than the layer's input and recomputes the rest inside the compiled backward
  (``checkpointed_forward``). Nothing in the graph stops torch's compile caches (``TORCHINDUCTOR_CACHE_DIR``)
  from serving a later run.
* Under ZeRO-3 a decoder layer that is a leaf module (``zero3_leaf_modules``) has its parameters gathered by one
  hook around its ``forward``, which is the compiled function: the graph reads them gathered, and the compiled
  backward recomputes from the parameters DeepSpeed gathers again before the layer's backward (``zero3_reason``).
  That trains as eager layers on the CPU, but not on a GPU, where they are refused (``ZERO3_CUDA_REASON``).
  ZeRO-3 with one process has no hooks (``distributed.zero3_one_process``): its layers compile and train as eager
  ones on the CPU; on a GPU they stay eager until that is checked there.
  FSDP's hooks would be bypassed: never compiled there.
* Compiling costs about 22 s once per run from a cold cache (6 graphs at 0.5B), about 7 s from a warm one,
  which a short run does not repay: ``choose``. Where "auto" chose to compile, a layer torch cannot compile
  sends the run on eagerly with a warning; where the user asked ("on", "cpp_wrapper"), the error stands.
* ``"cpp_wrapper"`` compiles as "on" and has inductor write each graph's launch code in C++ rather than Python
  (its ``cpp_wrapper`` option): the kernels are the same, the host's time per layer call is about a quarter
  less, and so is a host-bound training half (0.5B on an H200, ``docs/performance.md``). Building the C++ costs
  more than a minute more of the first compile from a cold cache.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..run_state.facts import RunFacts
from ..runtime.regional_compile import CompiledLayers, decoder_layers
from ..runtime import upstream

logger = logging.getLogger(__name__)


def own_forward(cls: type):
    """The layer's own forward, without transformers' ``forward_with_checkpointing`` wrapper (which calls
    ``torch.utils.checkpoint`` when checkpointing is on). See ``checkpointed_forward``."""
    forward = cls.forward
    code = getattr(forward, "__code__", None)  # functools.wraps copies the name; the code keeps its own
    if code is not None and code.co_name == "forward_with_checkpointing" and hasattr(forward, "__wrapped__"):
        return forward.__wrapped__
    return forward


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


def checkpointed_forward(layer: torch.nn.Module, compiled, recomputing, *args, **kwargs):
    """transformers' checkpointing wrapper, compiled. Where the wrapper would checkpoint (training, with
    gradients), ``recomputing`` runs: the layer compiled with activation checkpointing done by the compiler,
    which saves next to nothing for backward and recomputes inside the compiled backward. (Traced through the
    wrapper instead, the checkpoint becomes a higher-order op that torch's compile caches refuse: every run
    compiled again, 40-60 s at 0.5B on an H200; an eager checkpoint around the compiled forward is cacheable
    but recomputes layer by layer, 25% slower.) A checkpointed call that carries a cache, which the wrapper
    drops with a warning, goes through the wrapper itself, uncompiled. Without ``recomputing`` (a torch whose
    partitioner has no memory budget) the wrapper's checkpoint runs eagerly around the compiled forward."""
    if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
        if any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
            return type(layer).forward(layer, *args, **kwargs)
        if recomputing is None:
            return upstream.checkpoint_function(layer)(functools.partial(compiled, layer, **kwargs), *args)
        return recomputing(layer, *args, **kwargs)
    return compiled(layer, *args, **kwargs)


def compiler_checkpointing_available() -> bool:
    """Whether this torch's partitioner takes a memory budget (``activation_memory_budget``)."""
    return hasattr(torch._functorch.config, "activation_memory_budget")


class CompiledTrainingLayers:
    """The compiled forwards, one per decoder-layer class, and the layers routed through them right now."""

    def __init__(self, backend: str | object = "inductor", eager_on_failure: bool = False,
                 cpp_wrapper: bool = False) -> None:
        if cpp_wrapper and backend != "inductor":
            raise ValueError(f"cpp_wrapper is an option of the inductor backend, not of {backend!r}")
        self.backend = backend  # torch.compile's backend (tests count graphs through their own)
        self.cpp_wrapper = cpp_wrapper
        self.compiles = 0  # graphs compiled, over the run
        # "auto" chose to compile, the user did not ask: a layer torch cannot compile sends the run on eagerly
        # (with a warning) instead of ending it. ``failure`` says why, once it happened.
        self.eager_on_failure = eager_on_failure
        self.failure: str | None = None
        self._compiled: dict[tuple[type, bool], object] = {}
        self._routed: list[torch.nn.Module] = []

    def _counting_backend(self, graph, example_inputs):
        self.compiles += 1
        if self.cpp_wrapper:
            # The patch reaches the backward's compile too (compile_fx applies it to every inner compile).
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(graph, example_inputs, config_patches={"cpp_wrapper": True})
        backend = torch._dynamo.lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        return backend(graph, example_inputs)

    def _recomputing_backend(self, graph, example_inputs):
        # A memory budget of 0 makes the partitioner keep as little as it can for backward and recompute
        # the rest there: activation checkpointing, done inside the graph.
        with torch._functorch.config.patch(activation_memory_budget=0.0):
            return self._counting_backend(graph, example_inputs)

    def _compiled_forward(self, layer: torch.nn.Module, recomputing: bool = False):
        key = (type(layer), recomputing)
        if key not in self._compiled:
            backend = self._recomputing_backend if recomputing else self._counting_backend
            self._compiled[key] = torch.compile(own_forward(type(layer)), backend=backend, dynamic=True)
        return self._compiled[key]

    def _attach(self, layers) -> None:
        for layer in layers:
            compiled = self._compiled_forward(layer)
            if own_forward(type(layer)) is type(layer).forward:  # no checkpointing wrapper
                call = functools.partial(compiled, layer)
            else:
                recomputing = (self._compiled_forward(layer, recomputing=True)
                               if compiler_checkpointing_available() else None)
                call = functools.partial(checkpointed_forward, layer, compiled, recomputing)
            layer.forward = functools.partial(self._eager_if_failing, layer, call) if self.eager_on_failure else call
            self._routed.append(layer)

    def _eager_if_failing(self, layer: torch.nn.Module, call, *args, **kwargs):
        if self.failure is None:
            try:
                return call(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as err:
                cause = getattr(err, "inner_exception", None) or err.__cause__ or err  # the backend's own error
                self.failure = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:300]}"
                logger.warning("compile_training='auto': torch could not compile the %s layers (%s); the run goes on "
                               "with eager layers (compile_training='off' skips the attempt)", type(layer).__name__,
                               self.failure)
        return type(layer).forward(layer, *args, **kwargs)

    def _detach(self) -> None:
        for layer in self._routed:
            del layer.forward  # the instance attribute: the class's forward serves again
        self._routed.clear()

    @contextmanager
    def route(self, *models: torch.nn.Module) -> Iterator[None]:
        """Within the block, the decoder layers of ``models`` run the compiled forward (an inner route, while
        layers are routed, does nothing)."""
        if self._routed or self.failure is not None:
            yield
            return
        self._attach([layer for model in models for layer in decoder_layers(model)])
        try:
            yield
        finally:
            self._detach()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Within the block, the layers routed by an enclosing ``route`` run their own forward again."""
        layers = list(self._routed)
        self._detach()
        try:
            yield
        finally:
            self._attach(layers)


@contextmanager
def routed(layers: CompiledTrainingLayers | None, models: Callable[[], list[torch.nn.Module]],
           count: Callable[[int], None]) -> Iterator[None]:
    """Within the block the decoder layers of ``models()`` run compiled, where ``layers`` were chosen; ``count``
    gets the graphs compiled meanwhile (``perf/train_compiles``)."""
    if layers is None:
        yield
        return
    before = layers.compiles
    try:
        with layers.route(*models()):
            yield
    finally:
        count(layers.compiles - before)


SETTINGS = ("auto", "on", "cpp_wrapper", "off")
# "auto" compiles runs of at least this many optimizer steps. Measured at 0.5B on an H200 (docs/performance.md):
# the compile costs about 22 s once from a cold cache (a bit more than 10 s more on step 1 and one recompile
# of about 10 s when a micro-batch's length first breaks the 8-token alignment of the first), about 7 s from a
# warm one, and saves about 0.48 s a step: it pays after about 45 steps from a cold cache.
AUTO_MIN_STEPS = 50


# Inductor's attention kernels guard on the sequence length being a multiple of 8: with every length aligned,
# rollouts of any length share one compiled variant instead of recompiling (~10 s at 0.5B) when it first flips.
ALIGNMENT = 8


def pad_multiple(compiled: CompiledTrainingLayers | None, pad_to_multiple_of: int | None, explicit: bool) -> int | None:
    """TRL's ``pad_to_multiple_of`` for a run: ``ALIGNMENT`` where the layers are compiled and the user set none
    (pads are masked: the loss is the same), else as it is."""
    if compiled is not None and pad_to_multiple_of is None and not explicit:
        return ALIGNMENT
    return pad_to_multiple_of


def validate_setting(value: str) -> None:
    if value not in SETTINGS:
        raise ValueError(f"compile_training must be one of {list(SETTINGS)}, got {value!r}")


def sharding_reason(sharded: str) -> str:
    """Why layers are not compiled where FSDP holds the parameters."""
    return (f"{sharded} shards the parameters: each layer's are gathered by hooks around its forward, which the "
            "compiled layers (one compiled function for every layer of a class) would bypass; compiled layers run "
            "in one process, under DDP, ZeRO-1/2 and ZeRO-3 with leaf modules")


# Measured on one H200 and one H100 (fp32, tests/distributed/test_packed_launch.py, bench/zero3_compile_probe.py): under
# ZeRO-3 compiled layers trained differently from eager ones - the first step's grad norm 0.157 against 0.190 - the
# same through inductor or without code generation, packed or padded, with either LoRA forward or recompute; on the
# GPU without DeepSpeed, and on the CPU under ZeRO-3, they train as eager ones. Until that is understood they run
# eager on a GPU under ZeRO-3: with several processes, and with one, whose run removes DeepSpeed's hooks
# (distributed.zero3_one_process) and trains compiled layers as eager ones on the CPU, but has not been checked on
# a GPU yet (tests/distributed/test_packed_launch.py, -m gpu -k zero3_with_one_process).
ZERO3_CUDA_REASON = ("ZeRO-3 on a GPU: the compiled layers did not train as eager ones there under DeepSpeed's "
                     "hooks (the first step's grad norm 0.157 against 0.190 in "
                     "tests/distributed/test_packed_launch.py), and without them (one process) they are not checked "
                     "on a GPU yet, so the layers run eager")


def zero3_reason(models: list[torch.nn.Module]) -> str | None:
    """Why the decoder layers cannot run compiled under ZeRO-3, or None. A decoder layer that is a ZeRO-3 leaf
    module (``zero3_leaf_modules``) has its parameters gathered by one hook around its forward, which runs the
    compiled function (the layer's ``forward``); without leaves each submodule's hook would run inside it."""
    from deepspeed.utils import z3_leaf_module  # only under ZeRO-3

    for model in models:
        if not all(z3_leaf_module(layer) for layer in decoder_layers(model)):
            return ("ZeRO-3 without its decoder layers as leaf modules (zero3_leaf_modules='off'): each submodule's "
                    "gathering hook would run inside the compiled layer; zero3_leaf_modules='auto' compiles")
    return None


def choose(setting: str, models: list[torch.nn.Module], device: torch.device, sharded: str | None,
           planned_steps: int, zero3_one_process: bool = False):
    """``(CompiledTrainingLayers or None, why not)`` for the ``compile_training`` setting. ``sharded`` names a
    launch that shards parameters (ZeRO-3, FSDP): FSDP's gathering the compiled layers would bypass, ZeRO-3's
    runs around them where the decoder layers are its leaf modules; ``planned_steps`` is the run's number of
    optimizer steps; ``zero3_one_process``: ZeRO-3 with one process, its hooks removed (nothing sharded, but
    DeepSpeed's parameters, ``distributed.zero3_one_process``)."""
    if setting == "off":
        return None, "compile_training='off'"
    if sharded == "ZeRO-3":  # first: no other setting or run length would make it compile
        reason = zero3_reason(models) or (ZERO3_CUDA_REASON if device.type == "cuda" else None)
        if reason is not None:
            return None, reason
    elif sharded is not None:
        return None, sharding_reason(sharded)
    elif zero3_one_process and device.type == "cuda" and ZERO3_CUDA_REASON is not None:  # (None: lifted)
        return None, ZERO3_CUDA_REASON
    if setting == "auto" and device.type != "cuda":
        return None, f"compile_training='auto' compiles on CUDA only (device {device.type})"
    if setting == "auto" and planned_steps < AUTO_MIN_STEPS:
        return None, (f"compile_training='auto' compiles runs of {AUTO_MIN_STEPS} optimizer steps or more, where the "
                      f"compile (20-30 s once) pays for itself; this run has {planned_steps}: set 'on' to compile")
    for model in models:
        reason = CompiledLayers.unavailable_reason(model)  # the decode step's conditions: one class, forwards intact
        if reason is not None:
            return None, reason
    return CompiledTrainingLayers(eager_on_failure=setting == "auto", cpp_wrapper=setting == "cpp_wrapper"), None


def choose_logged(setting: str, models: list[torch.nn.Module], device: torch.device, facts: RunFacts,
                  planned_steps: int, main: bool) -> CompiledTrainingLayers | None:
    """``choose`` for the run ``facts`` describe, the outcome logged on ``main``: a warning where compile_training
    was asked for and not applied."""
    compiled, reason = choose(setting, models, device, facts.sharding, planned_steps,
                              zero3_one_process=facts.zero3 and facts.zero3_hooks_removed)
    log = logging.getLogger("hf_grpo")
    if main and compiled is None and setting not in ("auto", "off"):
        log.warning("compile_training=%r is not applied: %s", setting, reason)
    elif main:
        log.info("training forward: %s", "decoder layers compiled" if compiled is not None else f"eager ({reason})")
    return compiled
