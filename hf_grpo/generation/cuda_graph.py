"""The ``"cuda_graph"`` backend: a static KV cache and one CUDA graph per decode step.

Why: ``model.generate`` spends most of a rollout launching kernels from Python, one
token at a time: a 0.5B model at batch 32 keeps the GPU busy for well under a
millisecond per token but takes tens of milliseconds to launch the step. This backend
runs the prompt (the prefill) eagerly, then replays ONE captured decode step per token.

The work is split in three modules:

* ``sampling``: the logits processing and the token draw, as pure functions (the same law as
  transformers' logits processors);
* ``static_decoder``: one ``StaticDecoder`` per (model, chunk size, cache length, settings):
  cache, static buffers, prefill, compile, capture and replay;
* this module: which models and calls the backend serves, and which decoders it keeps.

Keeping decoders, so that compiles and captures are paid a bounded number of times:

* The cache holds ``chunk_size x cache_len`` positions. ``cache_len`` only grows, along a
  ladder of lengths (``cache_len_ladder``: 256, 384, 512, 768, 1024, 1536, ...): a call whose
  longest padded prompt plus new tokens fits the cache in hand reuses it and its graph, and
  one that does not moves up to the smallest rung that fits. ``reserve(n)`` (the trainer
  calls it with the dataset's longest prompt plus ``max_completion_length``) sizes the first
  cache for the whole run: one compile per run, and a cache of n positions rounded up to 256
  where that is shorter than a rung (``cache_positions``: at long completions a rung would
  waste up to a third of the memory). On real data every rollout has another prompt
  length; keyed by the exact length, each would compile and capture anew (20-30 s each).
  Positions past a chunk's own length are masked by causality, so a larger cache changes no
  token. A last chunk with fewer prompts is filled up to ``chunk_size`` with copies of its
  first prompt; those rows are decoded and dropped, and the graph is not captured again.
* ``num_compiles`` and ``num_captures`` count what was paid; a run past torch's recompile
  limit (where the step would silently run uncompiled) is warned about once.
* ``release()`` frees the caches and graphs (the trainer calls it after each rollout, so they
  do not sit through the backward); the compiled forward is kept, and the next rollout only
  captures again (about one prefill plus a few decode steps).

Weights change every optimizer step. A CUDA graph stores the *addresses* of the tensors
it reads, not their values, so replaying it reads whatever the parameters hold now:
in-place updates (``optimizer.step()``, ``p.data.add_``, ``p.copy_``, PEFT
merging a LoRA delta into the base weight) are followed without capturing again. What a
graph cannot follow is a parameter that moved to another address (a module or parameter
replaced, ``model.to(...)``) or a change of the Python path of the forward (PEFT
``merge_adapter``/``unmerge_adapter`` and ``disable_adapter`` flip flags that decide whether
the LoRA branch runs, ``train``/``eval``). So each decoder remembers the ``data_ptr`` of every
parameter and buffer and those flags (``weights_signature``); when any of them differs at the
next call, the decoder is dropped and the step is captured again. Parameters partitioned by
DeepSpeed ZeRO-3 are re-gathered into fresh buffers every rollout and are refused; a dense
copy of the weights refreshed in place (``hf_grpo.generation.dense_mirror``) serves instead.

The model itself is not modified: the cache, the masks and the graphs live in the decoders,
and ``model.generate`` can be called on the same model between calls.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from ..runtime import upstream
from ..runtime.graph_capture import weights_signature
from ..runtime.model_wrappers import base_model
from ..runtime.regional_compile import CompiledLayers
from ..training import true_on_policy
from .base import (
    Completions,
    GenerationBackend,
    cut_after_eos,
    cut_like,
    fsdp_sharding,
    ids_of_sample,
    is_zero3_partitioned,
    iter_chunks,
    left_pad,
    model_device,
    padded_length,
)
from .fused_projections import validate_parts
from .hf import HFGenerateBackend
from . import launch_overlap
from .sampling import SamplingSettings, effective_generation_config, unsupported_generation_setting
from .attention_routing import GQA_DECODE_ATTENTION
from ..memory.decode_sizes import cache_len_ladder, cache_positions
from .static_cache import last_logits, sliding_windows
from .static_decoder import StaticDecoder, take_next_tokens

logger = logging.getLogger(__name__)

# Decoder-only families whose modelling code runs a one-token forward against a StaticCache
# without host synchronisation (so it can be captured). Others may work, but are not accepted
# blindly: a family with data-dependent Python control flow would be captured wrongly.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "granite",
    }
)
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager", true_on_policy.ATTENTION})
# RoPE variants that read the largest position id on the host (a sync, and a value baked into the graph).
UNSUPPORTED_ROPE_TYPES = frozenset({"dynamic", "longrope"})

COMPILE_SCOPES = ("layers", "model")

__all__ = ["CudaGraphBackend", "cache_len_ladder"]


def _compile_available() -> str | None:
    """Why the decode forward cannot be compiled here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not hasattr(torch, "compile"):
        return "torch.compile is unavailable"
    return None


class CudaGraphBackend(GenerationBackend):
    """Static-cache decoding with one captured CUDA graph per decode step (see module doc).

    Args:
        check_every: how many decode steps run between two host reads of "has every row
            finished" (the early exit).
        min_cache_len: the first rung of the cache-length ladder (see ``cache_len_ladder``): the
            cache is never shorter, and grows only to the next rung that fits a call.
        max_cached_graphs: decoders (graphs and their KV caches) kept alive; the least recently
            used beyond this are freed.
        use_cuda_graph: False runs the same step eagerly (for debugging, and on CPU).
        compile: compile the one-token decode forward with ``torch.compile`` (inductor fuses
            the dozens of small element-wise kernels of each layer) before capturing it. The
            prefill and the sampling stay eager. ``None`` (default): on when capturing graphs
            and Triton is available. A failed compile falls back to capturing the eager
            forward, with a warning. Compiling costs seconds once per shape (one layer; tens of
            seconds for the whole model), less when torch's compile cache
            (``TORCHINDUCTOR_CACHE_DIR``) holds it from an earlier run.
        compile_scope: what is compiled: "layers" (default: one decoder layer, whose compiled code
            every layer runs, see ``runtime.regional_compile``; a few seconds to compile instead of tens)
            or "model" (the whole one-token forward: one fusion more per layer boundary, and a
            compile that grows with the depth). A model without a recognisable list of decoder
            layers is compiled whole.
        decode_attention: how the compiled step attends for sdpa models (see ``attention_routing._gqa_decode``):
            "filled" (default: one Triton kernel that reads only the cache blocks the mask admits, the prompt
            and the tokens so far, see ``filled_attention``; "matmul" where Triton or CUDA is missing),
            "matmul" (explicit matmuls + float32 softmax over the whole cache, as transformers' eager
            attention computes it) or "sdpa" (torch SDPA on the packed query, cuDNN kernel).
        fuse_projections: which projections the captured step runs as one GEMM on fused copies of
            their weights (``fused_projections``): "qkv" (default; about the q/k/v weights' memory
            while a decoder lives) and "gate_up" (about two thirds of the MLP weights' memory), or ().
            Unless it is (), groups whose weights lie side by side (a LoRA policy's, ``packed_weights``)
            are fused too, as views at no cost.
        overlap_launches: compile the decode step's kernels with programmatic dependent launch where the GPU and
            torch have it (Hopper; ``launch_overlap``): each small kernel starts while the one before it ends.
    """

    name = "cuda_graph"

    def __init__(
        self,
        *,
        check_every: int = 16,
        min_cache_len: int = 256,
        max_cached_graphs: int = 2,
        use_cuda_graph: bool = True,
        compile: bool | None = None,
        compile_scope: str = "layers",
        decode_attention: str = "filled",
        fuse_projections: tuple[str, ...] = ("qkv",),
        overlap_launches: bool = True,
    ) -> None:
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.check_every = check_every
        if min_cache_len < 1:
            raise ValueError(f"min_cache_len must be >= 1, got {min_cache_len}")
        self.min_cache_len = min_cache_len
        if max_cached_graphs < 1:
            raise ValueError(f"max_cached_graphs must be >= 1, got {max_cached_graphs}")
        self.max_cached_graphs = max_cached_graphs
        self.use_cuda_graph = use_cuda_graph
        if compile is None:
            compile = use_cuda_graph and torch.cuda.is_available() and _compile_available() is None
        self.compile = bool(compile)
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {list(COMPILE_SCOPES)}, got {compile_scope!r}")
        self.compile_scope = compile_scope
        self._compiled_layers = CompiledLayers()
        if decode_attention not in GQA_DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention must be one of {sorted(GQA_DECODE_ATTENTION)}, got {decode_attention!r}"
            )
        self.decode_attention = decode_attention
        self.fuse_projections = validate_parts(fuse_projections)
        self.overlap_launches = overlap_launches
        self._compiled_fn = None
        self._compiled_select = None
        self._compile_options: dict | None = None  # torch.compile's, set at the first compile (launch_overlap)
        self.compile_error: str | None = None  # why compiling failed, once it has
        self._entries: OrderedDict[tuple, StaticDecoder] = OrderedDict()
        self._fallback = HFGenerateBackend()
        self._warned: set[str] = set()
        self.num_captures = 0  # how many times a decode step was captured (tests and logs read it)
        self.num_compiles = 0  # how many decode shapes (batch, cache length, dtype) were compiled
        self.decode_seconds = 0.0  # the device time of the decode loops, prefills and captures left out (CUDA)
        self.reserved_len = 0  # the longest prompt + new tokens the run will need, when known (``reserve``)
        self._compiled_shapes: set[tuple] = set()

    # ------------------------------------------------------------------ support checks
    def unsupported_reason(self, model: torch.nn.Module) -> str | None:
        base = base_model(model)
        config = getattr(base, "config", None)
        if config is None:
            return f"{type(base).__name__} has no transformers config"
        if getattr(config, "is_encoder_decoder", False):
            return "encoder-decoder models are not supported by the cuda_graph backend"
        if (sharding := fsdp_sharding(model)) is not None:
            # Seen on 2 x H200: the fused projections mix DTensors with plain tensors, or read a rank's flat shard.
            return f"{sharding}, which the decoder's fused projections read whole (no mirror serves FSDP yet)"
        device = model_device(model)
        if device.type != "cuda":
            return f"the model is on {device.type}, and the cuda_graph backend needs a CUDA device"
        if is_zero3_partitioned(model):
            # Gathered weights move every rollout, and capture under ZeRO-3's hooks fails ("operation
            # not permitted when stream is capturing", seen on 2 x H200): decode from a dense mirror.
            return "DeepSpeed ZeRO-3 re-partitions the weights every rollout (a dense mirror of them serves instead)"
        if getattr(base, "hf_quantizer", None) is not None or getattr(base, "is_quantized", False):
            return "quantized models are not supported by the cuda_graph backend"
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            return (
                f"model type {model_type!r} is not in the cuda_graph backend's supported families "
                f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        if not upstream.can_compile_fullgraph(base):
            return f"{type(base).__name__} does not support static-cache (fullgraph) decoding"
        attn = upstream.attention_implementation(config) or "eager"
        if attn not in SUPPORTED_ATTENTION:
            return f"attention implementation {attn!r} is not supported (use 'sdpa' or 'eager')"
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            return f"RoPE type {rope_type!r} reads positions on the host and cannot be captured"
        layer_types = getattr(config, "layer_types", None) or []
        odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if odd:
            return f"layer types {odd} are not supported by the cuda_graph backend"
        return None

    def _call_reason(self, model: torch.nn.Module, gc: GenerationConfig, cache_len: int) -> str | None:
        """Why this particular call goes to the "hf" backend, or None."""
        reason = unsupported_generation_setting(gc)
        if reason is not None:
            return reason
        windows = [w for w in sliding_windows(base_model(model).config) if w is not None]
        if windows and cache_len > min(windows):
            # Past its window a StaticSlidingWindowLayer rolls its buffer with Python-side state.
            return f"cache length {cache_len} exceeds the sliding window {min(windows)}"
        return None

    # ------------------------------------------------------------------ public entry point
    generate = ids_of_sample("CudaGraphBackend")

    def _sample(
        self,
        model: torch.nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        *,
        generation_config: GenerationConfig,
        chunk_size: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        pad_to_multiple_of: int | None = None,
    ) -> Completions:
        if len(prompt_ids) == 0:
            return Completions([], [])
        device = model_device(model)
        if self.use_cuda_graph and device.type != "cuda":
            raise ValueError(
                f"the model is on {device.type}, and the cuda_graph backend needs a CUDA device "
                "(resolve_backend falls back to 'hf' for such models)"
            )
        # What model.generate honours (the "hf" backend, TRL's path) includes the model's own generation settings.
        gc = effective_generation_config(base_model(model), generation_config)
        batch = min(chunk_size, len(prompt_ids))
        chunks = list(iter_chunks(prompt_ids, batch))  # raises for a chunk size below 1

        # Per-chunk padded prompt length and number of new tokens (max_new_tokens, or what
        # max_length leaves, as model.generate computes it from the padded input length).
        plan = []
        for chunk in chunks:
            p = padded_length(chunk, pad_to_multiple_of)
            steps = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - p
            plan.append((chunk, p, max(0, int(steps))))
        need = max(p + s for _, p, s in plan)
        reason = self._call_reason(model, gc, cache_len_ladder(need, self.min_cache_len))
        if reason is not None:
            if reason not in self._warned:
                logger.warning("cuda_graph backend: %s; this call uses the hf backend", reason)
                self._warned.add(reason)
            return self._fallback.sample(
                model,
                prompt_ids,
                generation_config=generation_config,
                chunk_size=chunk_size,
                pad_token_id=pad_token_id,
                eos_token_ids=eos_token_ids,
                pad_to_multiple_of=pad_to_multiple_of,
            )

        sampling = SamplingSettings.from_config(gc, eos_token_ids, pad_token_id)
        if true_on_policy.installed(model):  # the trainer's log-sum-exp for the recorded log-probs
            sampling = dataclasses.replace(sampling, invariant_logprobs=True)
        completions: list[list[int]] = []
        logprobs: list[list[float]] = []
        with torch.no_grad():
            decoder = self._decoder(model, batch, need, sampling)
            for chunk, _, steps in plan:
                n_real = len(chunk)
                rows = list(chunk) + [chunk[0]] * (batch - n_real)  # dummy rows, dropped below
                input_ids, attention_mask = left_pad(rows, pad_token_id, device, pad_to_multiple_of)
                captured = decoder.graph is not None
                generated = decoder.run(
                    model, input_ids, attention_mask, steps, use_graph=self.use_cuda_graph, check_every=self.check_every
                )
                self.num_captures += int(not captured and decoder.graph is not None)
                if decoder.compile_error is not None and self.compile_error is None:
                    self.compile_error = decoder.compile_error  # later decoders capture the eager forward
                ids = cut_after_eos(generated[:n_real], sampling.eos_token_ids)
                completions.extend(ids)
                logprobs.extend(cut_like(decoder.last_logps[:n_real], ids))
            self.decode_seconds += decoder.pop_decode_seconds()
        return Completions(completions, logprobs)

    def release(self, empty_cache: bool = True) -> None:
        """Free every captured graph and KV cache (the compiled decode step is kept).

        ``empty_cache=False`` leaves the freed blocks in torch's caching allocator, where the
        training step that follows a rollout reuses them without a new cudaMalloc.
        """
        self._entries.clear()
        if empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reserve(self, positions: int) -> None:
        """Size every cache from now on for ``positions`` (the run's longest prompt plus its new tokens), so
        that the run compiles its decode step once instead of once per ladder rung it climbs."""
        if positions < 1:
            raise ValueError(f"reserve() needs a positive number of positions, got {positions}")
        self.reserved_len = max(self.reserved_len, positions)

    def for_memory_probe(self) -> CudaGraphBackend:
        """An eager backend with this one's cache size: compiling and capturing a decode step per probed size would
        cost minutes, and the cache is what takes the memory (``memory.autosize``)."""
        eager = CudaGraphBackend(use_cuda_graph=False, compile=False)
        eager.reserved_len = self.reserved_len
        return eager

    def cache_bytes(self) -> int:
        """Device memory held by the KV caches and static buffers of the kept decoders."""
        return sum(decoder.nbytes() for decoder in self._entries.values())

    # ------------------------------------------------------------------ kept decoders
    def _decoder(self, model: torch.nn.Module, batch: int, need: int, sampling: SamplingSettings) -> StaticDecoder:
        """The kept decoder for this key if its cache holds ``need`` positions, else a new one a rung up."""
        dtype = next(model.parameters()).dtype
        key = (id(model), batch, dtype, sampling)
        signature = weights_signature(model)
        decoder = self._entries.get(key)
        if decoder is not None and decoder.cache_len < need:
            # Grow, never shrink: the next shorter call reuses this larger cache and its graph.
            del self._entries[key]
            decoder = None
        if decoder is not None and (decoder.model_ref() is not model or decoder.signature != signature):
            # The model object was replaced (same id), a tensor moved, or the forward path changed:
            # the captured graph would read stale memory or run the wrong branch. Capture again.
            if decoder.model_ref() is model:
                logger.info("cuda_graph backend: parameters moved or adapter state changed; capturing again")
            del self._entries[key]
            decoder = None
        if decoder is None:
            invariant = sampling.invariant_logprobs  # true_on_policy: the model's own modules, uncompiled, unfused
            cache_len = cache_positions(need, self.reserved_len, self.min_cache_len)
            decoder = StaticDecoder(
                model,
                batch=batch,
                cache_len=cache_len,
                sampling=sampling,
                **({} if invariant else self._compiled_step(model, batch, cache_len, dtype)),
                decode_attention=self.decode_attention,
                fuse_projections=self.fuse_projections if self.use_cuda_graph and not invariant else (),
            )
            decoder.signature = signature
            self._entries[key] = decoder
            while len(self._entries) > self.max_cached_graphs:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return decoder

    def _compiled_step(self, model: torch.nn.Module, batch: int, cache_len: int, dtype: torch.dtype) -> dict:
        """What a new decoder compiles (``compiled_forward`` or ``compiled_layers``; neither: eager), counting new
        shapes."""
        if not (self.compile and self.use_cuda_graph and self.compile_error is None):
            return {}
        shape = (batch, cache_len, dtype)
        if shape not in self._compiled_shapes:
            self._compiled_shapes.add(shape)
            self.num_compiles += 1
            self._warn_past_recompile_limit()
        if self._compiled_select is None:
            backend = self._compiled_layers.backend
            self._compile_options = launch_overlap.compile_options(backend, model_device(model)) if (
                self.overlap_launches) else None
            self._compiled_layers.options = self._compile_options
            self._compiled_select = torch.compile(take_next_tokens, dynamic=False, backend=backend,
                                                  options=self._compile_options)
        step = {"compiled_select": self._compiled_select, "pdl_codegen": self._compile_options is not None}
        if self.compile_scope == "layers":
            reason = CompiledLayers.unavailable_reason(base_model(model))
            if reason is None:
                return {**step, "compiled_layers": self._compiled_layers}
            if "compile_scope" not in self._warned:
                self._warned.add("compile_scope")
                logger.info("cuda_graph backend: %s; compiling the whole decode step instead", reason)
        if self._compiled_fn is None:
            # Shapes are fixed per decoder (batch, cache length), so no dynamic shapes; the ladder
            # (or one reserved length) keeps the number of shapes, and so of recompiles, small.
            self._compiled_fn = torch.compile(last_logits, dynamic=False, options=self._compile_options)
        return {**step, "compiled_forward": self._compiled_fn}

    def _warn_past_recompile_limit(self) -> None:
        # Past dynamo's limit the decode step silently runs uncompiled (still captured, ~2x slower).
        limit = getattr(torch._dynamo.config, "recompile_limit", None) or getattr(
            torch._dynamo.config, "cache_size_limit", None)
        if limit is not None and self.num_compiles > limit and "recompile_limit" not in self._warned:
            self._warned.add("recompile_limit")
            logger.warning(
                "cuda_graph backend: %d decode shapes compiled, past torch._dynamo's recompile limit (%d): "
                "new shapes now run uncompiled, about 2x slower per token. Use fewer chunk sizes, or raise "
                "torch._dynamo.config.recompile_limit.", self.num_compiles, limit)
