"""The ``"cuda_graph"`` backend: a static KV cache and one CUDA graph per decode step.

Why: ``model.generate`` spends most of a rollout launching kernels from Python, one
token at a time: a 0.5B model at batch 32 keeps the GPU busy for well under a
millisecond per token but takes tens of milliseconds to launch the step. This backend
runs the prompt (the prefill) eagerly, then captures ONE decode step -- the model's
forward for one token against a ``transformers.StaticCache`` plus the logits
processing and sampling -- as a ``torch.cuda.CUDAGraph`` and replays it once per token.

How a chunk is decoded:

* Prompts are left-padded exactly as the ``"hf"`` backend pads them (``left_pad``), the
  position ids are ``cumsum(mask) - 1`` (pads at 0) and the 2D attention mask is the
  prompt's mask followed by ones, which is what ``model.generate`` feeds the model, so
  greedy decoding gives the same tokens as ``model.generate`` with the same padding.
  After a row emits EOS it keeps emitting ``pad_token_id``, as ``generate`` does.
* The cache holds ``chunk_size x cache_len`` positions. ``cache_len`` only grows, along a
  ladder of lengths (``cache_len_ladder``: 256, 384, 512, 768, 1024, 1536, ...): a call whose
  longest padded prompt plus new tokens fits the cache in hand reuses it and its graph, and
  one that does not moves up to the smallest rung that fits. On real data every rollout has
  another prompt length; keyed by the exact length, each would compile and capture anew
  (20-30 s each). Along the ladder a run compiles at most a handful of times, whatever its
  prompt lengths (``num_compiles``, ``num_captures``). Positions past a chunk's own length are
  masked by causality, so a larger cache changes no token. A last chunk with fewer prompts is
  filled up to ``chunk_size`` with copies of its first prompt; those rows are decoded and
  dropped, and the graph is not captured again.
* Sampling stays on the device: repetition penalty, ``min_new_tokens``/``min_length``,
  temperature, top-k, top-p and min-p are applied to float32 logits as the matching
  ``transformers`` logits processors do (in place, to keep the step's peak memory low),
  then a token is drawn with the Gumbel-max trick (``argmax(log p - log E)``,
  ``E ~ Exp(1)``), which samples exactly from ``p``. The
  random numbers come from torch's default CUDA generator, which ``torch.cuda.graph``
  registers with the graph, so every replay draws fresh numbers.
* No host synchronisation per token: whether every row has finished is read back only
  every ``check_every`` steps.
* By default the one-token forward is compiled with ``torch.compile`` before it is captured
  (inductor fuses each layer's dozens of small kernels; ~2x faster steps at 0.5B), with a
  packed grouped-query attention for the decode step (``_gqa_decode``) because transformers'
  sdpa path repeats the KV heads while being traced. Compiling costs ~20-30 s once per
  (model, batch, cache length); ``compile=False`` captures the eager forward instead.

Weights change every optimizer step. A CUDA graph stores the *addresses* of the tensors
it reads, not their values, so replaying it reads whatever the parameters hold now:
in-place updates (``optimizer.step()``, ``p.data.add_``, ``p.copy_``, PEFT
merging a LoRA delta into the base weight) are followed without capturing again. What a
graph cannot follow is a parameter that moved to another address (ZeRO-3 gathers into
fresh buffers, a module or parameter replaced, ``model.to(...)``) or a change of the
Python path of the forward (PEFT ``merge_adapter``/``unmerge_adapter`` and
``disable_adapter`` flip flags that decide whether the LoRA branch runs, ``train``/``eval``).
So captured graphs are kept per (model, chunk size, dtype, sampling settings), each with
the cache length it was captured for, and each entry remembers the ``data_ptr`` of every parameter and buffer and
those flags; when any of them differs at the next call, the entry is dropped and the step
is captured again (about as long as one prefill plus a few decode steps).

The model itself is not modified: the cache, the masks and the graphs live in this
backend, and ``model.generate`` can be called on the same model between calls.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from .base import GenerationBackend, cut_after_eos, iter_chunks, left_pad, model_device, padded_length
from .hf import HFGenerateBackend

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
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager"})
# RoPE variants that read the largest position id on the host (a sync, and a value baked into the graph).
UNSUPPORTED_ROPE_TYPES = frozenset({"dynamic", "longrope"})

# Generation settings this backend implements. Anything else set to a non-default value sends
# the call to the "hf" backend (see `_unsupported_generation_setting`).
_UNSUPPORTED_SETTINGS = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "bad_words_ids": lambda v: v is not None,
    "suppress_tokens": lambda v: v is not None,
    "begin_suppress_tokens": lambda v: v is not None,
    "sequence_bias": lambda v: v is not None,
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "top_h": lambda v: v is not None,
    "guidance_scale": lambda v: v is not None and v != 1,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "watermarking_config": lambda v: v is not None,
    "renormalize_logits": lambda v: bool(v),
    "remove_invalid_values": lambda v: bool(v),
    "stop_strings": lambda v: v is not None,
    "max_time": lambda v: v is not None,
    "prefill_chunk_size": lambda v: v is not None,
    "assistant_model": lambda v: v is not None,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "output_scores": lambda v: bool(v),
    "output_logits": lambda v: bool(v),
    "return_dict_in_generate": lambda v: bool(v),
}


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT (or DDP-style ``.module``) wrappers."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and not hasattr(model, "config"):
        model = model.module
    return model


def _unsupported_generation_setting(gc: GenerationConfig) -> str | None:
    for name, is_set in _UNSUPPORTED_SETTINGS.items():
        value = getattr(gc, name, None)
        if is_set(value):
            return f"generation setting {name}={value!r}"
    return None


def _last_logits(model, input_ids, attention_mask, position_ids, cache, cache_kw: str, logits_to_keep: bool):
    """One forward against the static cache; the last position's logits as float32 [B, V]."""
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        cache_kw: cache,
        "use_cache": True,
    }
    if logits_to_keep:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1, :].float()


# While the decode step is traced by torch.compile, transformers' sdpa path cannot use its
# eager "pack GQA" trick (it checks is_torchdynamo_compiling) and materialises every KV head
# num_key_value_groups times (repeat_kv): 7x the KV-cache traffic for Qwen2-0.5B, per layer
# and per token. This attention does the pack instead: the one query token of the
# num_key_value_groups query heads sharing a KV head become the "query length" of one SDPA
# call on the un-repeated cache. Head h maps to KV head h // groups, as in repeat_kv, and the
# [B, 1, 1, L] mask broadcasts over both, so the result equals sdpa's.
_GQA_DECODE_ATTENTION = {"sdpa": "hf_grpo_gqa_decode_sdpa", "matmul": "hf_grpo_gqa_decode_matmul"}


def _gqa_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """variant "sdpa": one torch SDPA call on the packed query (cuDNN/efficient kernels)."""
    return _gqa_decode(module, query, key, value, attention_mask, dropout, scaling, is_causal, False, **kwargs)


def _gqa_decode_attention_matmul(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """variant "matmul": two batched matmuls and a float32 softmax, which inductor fuses around."""
    return _gqa_decode(module, query, key, value, attention_mask, dropout, scaling, is_causal, True, **kwargs)


def _gqa_decode(module, query, key, value, attention_mask, dropout, scaling, is_causal, matmul, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, head_dim = query.shape
    if q_len != 1 or groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups, head_dim)  # [B, KV heads, groups, D]
    if matmul:
        scale = head_dim**-0.5 if scaling is None else scaling
        scores = torch.matmul(packed, key.transpose(-1, -2)) * scale  # [B, KV heads, groups, L]
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attention_mask, float("-inf"))
            else:
                scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        out = torch.matmul(probs, value)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=attention_mask, scale=scaling
        )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _register_gqa_decode_attention() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for variant, fn in (("sdpa", _gqa_decode_attention), ("matmul", _gqa_decode_attention_matmul)):
        name = _GQA_DECODE_ATTENTION[variant]
        if name not in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.register(name, fn)
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


@contextmanager
def _decode_attention(model: torch.nn.Module, variant: str | None):
    """Route an sdpa model's attention through the packed-GQA decode attention while tracing/capturing.

    The model's config is restored on exit, so `model.generate` and training see it unchanged;
    the captured graph keeps the kernels it recorded.
    """
    config = _base_model(model).config
    original = getattr(config, "_attn_implementation_internal", None)
    if variant is None or original != "sdpa":
        yield
        return
    _register_gqa_decode_attention()
    config._attn_implementation_internal = _GQA_DECODE_ATTENTION[variant]
    try:
        yield
    finally:
        config._attn_implementation_internal = original


def _compile_available() -> str | None:
    """Why the decode forward cannot be compiled here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not hasattr(torch, "compile"):
        return "torch.compile is unavailable"
    return None


@dataclass(frozen=True)
class _Sampling:
    """The generation settings baked into a captured step (part of the graph's key)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float | None
    repetition_penalty: float
    min_new_tokens: int
    min_length: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    @classmethod
    def from_config(cls, gc: GenerationConfig, eos_token_ids: Sequence[int], pad_token_id: int) -> _Sampling:
        eos = list(dict.fromkeys(int(t) for t in eos_token_ids))
        cfg_eos = gc.eos_token_id
        if cfg_eos is not None:  # model.generate stops on the config's EOS too
            for t in [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos):
                if int(t) not in eos:
                    eos.append(int(t))
        do_sample = bool(gc.do_sample)
        temperature = 1.0 if gc.temperature is None else float(gc.temperature)
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be positive when sampling, got {temperature}")
        return cls(
            do_sample=do_sample,
            temperature=temperature,
            top_k=int(gc.top_k or 0),
            top_p=1.0 if gc.top_p is None else float(gc.top_p),
            min_p=None if gc.min_p is None else float(gc.min_p),
            repetition_penalty=1.0 if gc.repetition_penalty is None else float(gc.repetition_penalty),
            min_new_tokens=int(gc.min_new_tokens or 0),
            min_length=int(gc.min_length or 0),
            eos_token_ids=tuple(eos),
            pad_token_id=int(pad_token_id),
        )


def cache_len_ladder(need: int, minimum: int = 256) -> int:
    """The smallest rung of ``minimum x {1, 1.5} x 2^k`` that holds ``need`` positions.

    Rungs 1.5x or 4/3x apart bound the compiles of a run to about 2 log2(longest / minimum) while
    wasting at most a third of the cache on attention over masked positions.
    """
    if need < 1 or minimum < 1:
        raise ValueError(f"cache lengths must be positive, got need={need}, minimum={minimum}")
    rung = minimum
    while True:
        for candidate in (rung, rung * 3 // 2):
            if need <= candidate:
                return candidate
        rung *= 2


def _weights_signature(model: torch.nn.Module) -> tuple:
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
            flags.append((bool(module.merged), bool(module.disable_adapters), repr(getattr(module, "active_adapters", None))))
    return ptrs, tuple(flags), model.training


@dataclass
class _Entry:
    """Static buffers, cache and captured graph for one (model, shape, settings) key."""

    model_ref: weakref.ref
    batch: int
    cache_len: int
    sampling: _Sampling
    cache: object
    vocab_size: int | None = None
    tok: torch.Tensor | None = None  # [B, 1] input token of the next decode step
    pos: torch.Tensor | None = None  # [B, 1] its position id
    mask2d: torch.Tensor | None = None  # [B, cache_len] prompt mask then ones
    out: torch.Tensor | None = None  # [B, cache_len] generated tokens
    step: torch.Tensor | None = None  # [1] index of the token being generated
    min_steps: torch.Tensor | None = None  # [1] EOS is blocked while step < min_steps
    unfinished: torch.Tensor | None = None  # [B] bool
    seen: torch.Tensor | None = None  # [B, V + 1] bool, for the repetition penalty
    eos_vocab_mask: torch.Tensor | None = None  # [V] bool
    graph: torch.cuda.CUDAGraph | None = None
    signature: tuple | None = None
    extra: dict = field(default_factory=dict)


class CudaGraphBackend(GenerationBackend):
    """Static-cache decoding with one captured CUDA graph per decode step (see module doc).

    Args:
        check_every: how many decode steps run between two host reads of "has every row
            finished" (the early exit).
        min_cache_len: the first rung of the cache-length ladder (see ``cache_len_ladder``): the
            cache is never shorter, and grows only to the next rung that fits a call.
        max_cached_graphs: graphs (and their KV caches) kept alive; the least recently used
            beyond this are freed.
        use_cuda_graph: False runs the same step eagerly (for debugging, and on CPU).
        compile: compile the one-token decode forward with ``torch.compile`` (inductor fuses
            the dozens of small element-wise kernels of each layer) before capturing it. The
            prefill and the sampling stay eager. ``None`` (default): on when capturing graphs
            and Triton is available. A failed compile falls back to capturing the eager
            forward, with a warning. Compiling costs tens of seconds once per shape.
        decode_attention: how the compiled step attends for sdpa models with grouped KV heads
            (see `_gqa_decode`): "matmul" (default: explicit matmuls + float32 softmax, as
            transformers' eager attention computes it; 4-7% faster end to end on an H200 for
            Qwen2-0.5B shapes) or "sdpa" (torch SDPA on the packed query, cuDNN kernel).
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
        decode_attention: str = "matmul",
    ) -> None:
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.check_every = check_every
        if min_cache_len < 1:
            raise ValueError(f"min_cache_len must be >= 1, got {min_cache_len}")
        self.min_cache_len = min_cache_len
        self.max_cached_graphs = max(1, max_cached_graphs)
        self.use_cuda_graph = use_cuda_graph
        if compile is None:
            compile = use_cuda_graph and torch.cuda.is_available() and _compile_available() is None
        self.compile = bool(compile)
        if decode_attention not in _GQA_DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {sorted(_GQA_DECODE_ATTENTION)}, got {decode_attention!r}")
        self.decode_attention = decode_attention
        self._compiled_fn = None
        self.compile_error: str | None = None  # why compiling failed, once it has
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._fallback = HFGenerateBackend()
        self._warned: set[str] = set()
        self.num_captures = 0  # how many times a decode step was captured (tests and logs read it)
        self.num_compiles = 0  # how many decode shapes (batch, cache length, dtype) were compiled
        self.reserved_len = 0  # the longest prompt + new tokens the run will need, when known (``reserve``)
        self._compiled_shapes: set[tuple] = set()

    # ------------------------------------------------------------------ support checks
    def unsupported_reason(self, model: torch.nn.Module) -> str | None:
        base = _base_model(model)
        config = getattr(base, "config", None)
        if config is None:
            return f"{type(base).__name__} has no transformers config"
        if getattr(config, "is_encoder_decoder", False):
            return "encoder-decoder models are not supported by the cuda_graph backend"
        device = model_device(model)
        if device.type != "cuda":
            return f"the model is on {device.type}, and the cuda_graph backend needs a CUDA device"
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            # Seen on 2 x H200: the re-capture each rollout needs (gathered weights move) fails with
            # "operation not permitted when stream is capturing" under ZeRO-3's hooks.
            return "DeepSpeed ZeRO-3 re-partitions the weights every rollout, and capture under its hooks fails"
        if getattr(base, "hf_quantizer", None) is not None or getattr(base, "is_quantized", False):
            return "quantized models are not supported by the cuda_graph backend"
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            return (
                f"model type {model_type!r} is not in the cuda_graph backend's supported families "
                f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        if not getattr(base, "_can_compile_fullgraph", False):
            return f"{type(base).__name__} does not support static-cache (fullgraph) decoding"
        attn = getattr(config, "_attn_implementation", None) or "eager"
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
        reason = _unsupported_generation_setting(gc)
        if reason is not None:
            return reason
        config = _base_model(model).config
        layer_types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in layer_types and window is not None and cache_len > window:
            # Past its window a StaticSlidingWindowLayer rolls its buffer with Python-side state.
            return f"cache length {cache_len} exceeds the sliding window {window}"
        return None

    # ------------------------------------------------------------------ public entry point
    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        *,
        generation_config: GenerationConfig,
        chunk_size: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        pad_to_multiple_of: int | None = None,
    ) -> list[list[int]]:
        if len(prompt_ids) == 0:
            return []
        device = model_device(model)
        if self.use_cuda_graph and device.type != "cuda":
            raise ValueError(
                f"the model is on {device.type}, and the cuda_graph backend needs a CUDA device "
                "(resolve_backend falls back to 'hf' for such models)"
            )
        gc = generation_config
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
        cache_len = cache_len_ladder(need, self.min_cache_len)
        reason = self._call_reason(model, gc, cache_len)
        if reason is not None:
            if reason not in self._warned:
                logger.warning("cuda_graph backend: %s; this call uses the hf backend", reason)
                self._warned.add(reason)
            return self._fallback.generate(
                model,
                prompt_ids,
                generation_config=gc,
                chunk_size=chunk_size,
                pad_token_id=pad_token_id,
                eos_token_ids=eos_token_ids,
                pad_to_multiple_of=pad_to_multiple_of,
            )

        sampling = _Sampling.from_config(gc, eos_token_ids, pad_token_id)
        completions: list[list[int]] = []
        with torch.no_grad():
            entry = self._get_entry(model, batch, need, sampling)
            for chunk, _, steps in plan:
                n_real = len(chunk)
                rows = list(chunk) + [chunk[0]] * (batch - n_real)  # dummy rows, dropped below
                input_ids, attention_mask = left_pad(rows, pad_token_id, device, pad_to_multiple_of)
                generated = self._run_chunk(model, entry, input_ids, attention_mask, steps)
                completions.extend(cut_after_eos(generated[:n_real], sampling.eos_token_ids))
        return completions

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

    def cache_bytes(self) -> int:
        """Device memory held by the KV caches and static buffers of the kept graphs."""
        total = 0
        for entry in self._entries.values():
            for layer in getattr(entry.cache, "layers", []):
                for name in ("keys", "values"):
                    tensor = getattr(layer, name, None)
                    if isinstance(tensor, torch.Tensor):
                        total += tensor.numel() * tensor.element_size()
            for tensor in (entry.tok, entry.pos, entry.mask2d, entry.out, entry.seen):
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
        return total

    # ------------------------------------------------------------------ entries and capture
    def _get_entry(self, model: torch.nn.Module, batch: int, need: int, sampling: _Sampling) -> _Entry:
        """The kept entry for this key if its cache holds ``need`` positions, else a new one a rung up."""
        dtype = next(model.parameters()).dtype
        key = (id(model), batch, dtype, sampling)
        signature = _weights_signature(model)
        entry = self._entries.get(key)
        cache_len = cache_len_ladder(max(need, self.reserved_len), self.min_cache_len)
        if entry is not None and entry.cache_len < need:
            # Grow, never shrink: the next shorter call reuses this larger cache and its graph.
            del self._entries[key]
            entry = None
        elif entry is not None:
            cache_len = entry.cache_len
        if entry is not None and (entry.model_ref() is not model or entry.signature != signature):
            # The model object was replaced (same id), a tensor moved, or the forward path changed:
            # the captured graph would read stale memory or run the wrong branch. Capture again.
            if entry.model_ref() is model:
                logger.info("cuda_graph backend: parameters moved or adapter state changed; capturing again")
            del self._entries[key]
            entry = None
        if entry is None:
            entry = self._new_entry(model, batch, cache_len, sampling)
            entry.signature = signature
            self._entries[key] = entry
            while len(self._entries) > self.max_cached_graphs:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return entry

    def _new_entry(self, model: torch.nn.Module, batch: int, cache_len: int, sampling: _Sampling) -> _Entry:
        from transformers import StaticCache

        device = model_device(model)
        config = _base_model(model).config
        cache = StaticCache(config=config, max_cache_len=cache_len)
        entry = _Entry(model_ref=weakref.ref(model), batch=batch, cache_len=cache_len, sampling=sampling, cache=cache)
        entry.tok = torch.zeros((batch, 1), dtype=torch.long, device=device)
        entry.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        entry.mask2d = torch.ones((batch, cache_len), dtype=torch.long, device=device)
        entry.out = torch.full((batch, cache_len), sampling.pad_token_id, dtype=torch.long, device=device)
        entry.step = torch.zeros((1,), dtype=torch.long, device=device)
        entry.min_steps = torch.zeros((1,), dtype=torch.long, device=device)
        entry.unfinished = torch.ones((batch,), dtype=torch.bool, device=device)
        # transformers 5.24 names the cache argument `cache` (`past_key_values` is deprecated).
        if self.compile and self.use_cuda_graph and self.compile_error is None:
            if self._compiled_fn is None:
                # Shapes are fixed per entry (batch, cache length), so no dynamic shapes; the ladder
                # keeps the number of shapes, and so of recompiles, small.
                self._compiled_fn = torch.compile(_last_logits, dynamic=False)
            entry.extra["compiled"] = self._compiled_fn
            shape = (batch, cache_len, next(model.parameters()).dtype)
            if shape not in self._compiled_shapes:
                self._compiled_shapes.add(shape)
                self.num_compiles += 1
                self._warn_past_recompile_limit()
        params = inspect.signature(_base_model(model).forward).parameters
        entry.extra["cache_kw"] = "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"
        entry.extra["logits_to_keep"] = "logits_to_keep" in params
        return entry

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

    def _forward(self, model: torch.nn.Module, entry: _Entry, input_ids, position_ids, *, decode: bool = False):
        """Last-position logits as float32 [B, V]; the one-token decode forward may be compiled."""
        fn = _last_logits
        if decode and entry.extra.get("compiled") is not None:
            fn = entry.extra["compiled"]
        return fn(
            model,
            input_ids,
            entry.mask2d,
            position_ids,
            entry.cache,
            entry.extra["cache_kw"],
            entry.extra["logits_to_keep"],
        )

    def _prefill(self, model, entry: _Entry, input_ids, attention_mask, steps: int) -> None:
        """Reset the cache and buffers for a new chunk, run the prompt and pick the first token."""
        s = entry.sampling
        prompt_len = input_ids.size(1)
        entry.cache.reset()
        for layer in entry.cache.layers:  # sliding layers also keep a Python-side length
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = 0
        entry.mask2d.fill_(1)
        entry.mask2d[:, :prompt_len].copy_(attention_mask)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        entry.out.fill_(s.pad_token_id)
        entry.step.zero_()
        # EOS is blocked for the first min_new_tokens tokens, and while prompt + generated < min_length.
        entry.min_steps.fill_(max(s.min_new_tokens, s.min_length - prompt_len, 0))
        entry.unfinished.fill_(True)
        logits = self._forward(model, entry, input_ids, position_ids)
        vocab = logits.size(-1)
        if entry.vocab_size is None:
            entry.vocab_size = vocab
            mask = torch.zeros((vocab,), dtype=torch.bool, device=logits.device)
            valid = [t for t in s.eos_token_ids if 0 <= t < vocab]
            if valid:
                mask[torch.tensor(valid, device=logits.device)] = True
            entry.eos_vocab_mask = mask
            if s.repetition_penalty != 1.0:
                entry.seen = torch.zeros((entry.batch, vocab + 1), dtype=torch.bool, device=logits.device)
        if entry.seen is not None:
            # Prompt tokens count for the penalty, left padding does not (index V is a sink).
            entry.seen.zero_()
            entry.seen.scatter_(1, input_ids.masked_fill(attention_mask == 0, vocab), True)
        entry.pos.copy_(position_ids[:, -1:])
        self._advance(entry, logits)

    def _advance(self, entry: _Entry, logits: torch.Tensor) -> None:
        """Logits [B, V] float32 -> next token, written into the static buffers (capturable).

        ``logits`` is this step's own float32 copy and is filtered in place: every extra [B, V]
        float32 buffer is another 19 MB at 32 rows of a 152k vocabulary, at the peak of the step.
        """
        s = entry.sampling
        scores = logits
        if s.repetition_penalty != 1.0:
            seen = entry.seen[:, : scores.size(-1)]
            penalised = torch.where(scores < 0, scores * s.repetition_penalty, scores / s.repetition_penalty)
            scores = torch.where(seen, penalised, scores)
        if s.min_new_tokens > 0 or s.min_length > 0:
            block = entry.eos_vocab_mask & (entry.step < entry.min_steps)
            scores.masked_fill_(block, float("-inf"))
        if s.do_sample:
            if s.temperature != 1.0:
                scores.div_(s.temperature)
            if s.top_k > 0:
                k = min(s.top_k, scores.size(-1))
                kth = torch.topk(scores, k, dim=-1).values[:, -1:]
                scores.masked_fill_(scores < kth, float("-inf"))
            if s.top_p < 1.0:
                sorted_scores, sorted_idx = torch.sort(scores, descending=False)
                cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
                remove_sorted = cum <= (1 - s.top_p)
                remove_sorted[:, -1:] = False  # keep at least one token
                remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
                scores.masked_fill_(remove, float("-inf"))
            if s.min_p is not None:
                probs = scores.softmax(dim=-1)
                threshold = s.min_p * probs.amax(dim=-1, keepdim=True)
                remove = probs < threshold
                remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
                del probs
                scores.masked_fill_(remove, float("-inf"))
            # Gumbel-max: argmax_i (log p_i - log E_i), E_i ~ Exp(1), picks i with probability p_i, and
            # log p_i differs from scores_i by a per-row constant, so no softmax is needed. One noise
            # buffer, turned into scores - log E in place; the clamp keeps log(0) from winning.
            noise = torch.empty_like(scores).exponential_().clamp_min_(1e-20).log_()
            next_tokens = noise.neg_().add_(scores).argmax(dim=-1)
        else:
            next_tokens = scores.argmax(dim=-1)
        next_tokens = torch.where(entry.unfinished, next_tokens, torch.full_like(next_tokens, s.pad_token_id))
        entry.out.scatter_(1, entry.step.view(1, 1).expand(entry.batch, 1), next_tokens.unsqueeze(1))
        entry.unfinished &= ~entry.eos_vocab_mask[next_tokens]
        entry.tok.copy_(next_tokens.unsqueeze(1))
        entry.pos.add_(1)
        entry.step.add_(1)
        if entry.seen is not None:
            entry.seen.scatter_(1, next_tokens.unsqueeze(1), True)

    def _decode_step(self, model, entry: _Entry) -> None:
        logits = self._forward(model, entry, entry.tok, entry.pos, decode=True)
        self._advance(entry, logits)

    def _capture(self, model, entry: _Entry) -> None:
        """Warm up the decode step on a side stream, then capture it (the state it leaves is reset after)."""
        compiled = entry.extra.get("compiled") is not None
        with _decode_attention(model, self.decode_attention if compiled else None):
            if compiled:
                try:  # the first call compiles; do it outside the capture
                    self._decode_step(model, entry)
                except Exception as err:  # noqa: BLE001 - any compiler failure: capture the eager forward
                    self.compile_error = f"{type(err).__name__}: {err}"
                    logger.warning(
                        "cuda_graph backend: torch.compile failed (%s); capturing the eager forward", self.compile_error
                    )
                    entry.extra["compiled"] = None
                torch.cuda.synchronize()
        with _decode_attention(model, self.decode_attention if entry.extra.get("compiled") is not None else None):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._decode_step(model, entry)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._decode_step(model, entry)
        entry.graph = graph
        self.num_captures += 1

    def _run_chunk(self, model, entry: _Entry, input_ids, attention_mask, steps: int) -> torch.Tensor:
        if steps == 0:
            return torch.empty((entry.batch, 0), dtype=torch.long)
        if self.use_cuda_graph and entry.graph is None and steps > 1:
            # The warm-up and capture advance the cache; prefill once to give them valid state,
            # capture, then prefill again for real.
            self._prefill(model, entry, input_ids, attention_mask, steps)
            self._capture(model, entry)
        self._prefill(model, entry, input_ids, attention_mask, steps)
        done = 1
        while done < steps:
            if self.use_cuda_graph:
                entry.graph.replay()
            else:
                self._decode_step(model, entry)
            done += 1
            if done % self.check_every == 0 and not bool(entry.unfinished.any()):
                break
        return entry.out[:, :done].cpu()
