"""One static-shape decoder: a KV cache, its buffers, the prefill, and the captured one-token step.

A ``StaticDecoder`` decodes chunks of ``batch`` left-padded prompts against a
``transformers.StaticCache`` of ``cache_len`` positions:

* The prefill runs the prompts eagerly, in pieces sized so that one piece's attention scores stay near
  ``memory.decode_sizes.PREFILL_SCORE_BYTES`` whatever the prompt length; a piece attends to the cache positions
  up to its end only (``prefill_keys``). Position ids are
  ``cumsum(mask) - 1`` (pads at 0) and the 2D attention mask is the prompt's mask followed by ones, which is what
  ``model.generate`` feeds the model, so greedy decoding gives the same tokens as
  ``model.generate`` with the same padding. After a row emits EOS it keeps emitting
  ``pad_token_id``, as ``generate`` does.
* The one-token decode step (the forward, then ``sampling.select_tokens``) reads and writes only
  static buffers, so it can be captured once as a ``torch.cuda.CUDAGraph`` and replayed for every
  token. No host synchronisation per token: whether every row has finished is read back only every
  ``check_every`` steps.
* The step's forward may be compiled with ``torch.compile`` before it is captured (inductor
  fuses each layer's dozens of small kernels; ~2x faster steps at 0.5B), with a packed
  grouped-query attention for the one-token query (``attention_routing``), because transformers'
  sdpa path repeats the KV heads while being traced; with a program per SM (rows x KV heads), a
  Triton kernel that reads only the cache blocks the mask admits (``filled_attention``), a prompt that several
  rows share from one of them (``prompt_source``, set at each prefill). Where the
  forward is compiled, the token selection and the buffer updates are compiled with it (``compiled_select``,
  ``take_next_tokens``). In the
  captured step the q/k/v (and, if asked, gate/up) projections run as one GEMM each on fused copies
  of their weights (``fused_projections``).

A graph stores the *addresses* of the tensors it reads, not their values: in-place weight
updates are followed without capturing again, moved tensors are not (``weights_signature``
is what the backend compares before reusing a decoder).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..memory.decode_sizes import prefill_pieces
from ..runtime.graph_capture import capture_graph
from ..runtime.model_wrappers import base_model
from ..runtime.regional_compile import CompiledLayers
from . import filled_attention, fused_norms, launch_overlap, shared_prefill
from .attention_routing import PROMPT_END, PROMPT_SOURCE, decode_attention, is_sdpa, prefill_keys
from .base import model_device
from .fused_projections import FusedProjections
from .sampling import SamplingSettings, row_uniforms, select_tokens, select_tokens_from_copies
from .static_cache import kv_heads, last_logits, static_cache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeBuffers:
    """The static buffers the decode step's tail reads and writes (a ``StaticDecoder``'s, same names)."""

    out: torch.Tensor  # [B, cache_len] long: the generated tokens
    tok: torch.Tensor  # [B, 1] long: the next step's input token
    pos: torch.Tensor  # [B, 1] long: its position id
    step: torch.Tensor  # [1] long: index of the token being generated
    min_steps: torch.Tensor  # [1] long: EOS is blocked while step < min_steps
    unfinished: torch.Tensor  # [B] bool: rows that have not emitted EOS
    eos_vocab_mask: torch.Tensor  # [V] bool: the EOS token ids
    seen: torch.Tensor | None = None  # [B, V + 1] bool, for the repetition penalty
    logps: torch.Tensor | None = None  # [B, cache_len] float32: each generated token's log-prob (0 after EOS)


def take_next_tokens(logits, s: SamplingSettings, noise, buffers: DecodeBuffers, copies: bool = True) -> None:
    """The decode step's tail: pick each row's next token and write it into the decoder's static buffers.

    ``out[:, step]`` gets the token (``pad_token_id`` for a row that has finished), ``unfinished`` drops the rows
    that emitted EOS, ``tok`` and ``pos`` become the next step's input, ``step`` moves on, ``seen`` (repetition
    penalty) marks the token, ``logps[:, step]`` its log-prob under the law it was drawn from (after temperature,
    top-k, top-p, min-p: ``sampling.chosen_logprobs``). EOS is blocked while ``step < min_steps``. ``noise``:
    ``sampling.row_uniforms`` when sampling, else None. With ``copies`` the selection works on a float32 copy of ``logits`` (the compiled form: the
    decode step compiles this whole function, a few kernels instead of a dozen eager ones); without, on them in
    place (they must be float32 and disposable).
    """
    out, tok, pos, step, unfinished = buffers.out, buffers.tok, buffers.pos, buffers.step, buffers.unfinished
    seen, eos_vocab_mask, min_steps = buffers.seen, buffers.eos_vocab_mask, buffers.min_steps
    eos_blocked = eos_vocab_mask & (step < min_steps) if s.blocks_early_eos else None
    if copies:
        next_tokens, logps = select_tokens_from_copies(logits, s, noise, seen, eos_blocked, with_logprobs=True)
    else:
        next_tokens, logps = select_tokens(logits, s, noise=noise, seen=seen, eos_blocked=eos_blocked,
                                           with_logprobs=True)
    next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, s.pad_token_id))
    at = step.view(1, 1).expand(out.size(0), 1)
    out.scatter_(1, at, next_tokens.unsqueeze(1))
    if buffers.logps is not None:
        buffers.logps.scatter_(1, at, torch.where(unfinished, logps, torch.zeros_like(logps)).unsqueeze(1))
    unfinished &= ~eos_vocab_mask[next_tokens]
    tok.copy_(next_tokens.unsqueeze(1))
    pos.add_(1)
    step.add_(1)
    if seen is not None:
        seen.scatter_(1, next_tokens.unsqueeze(1), True)


class StaticDecoder:
    """Static cache, buffers and (once captured) the decode-step graph for one (model, batch, cache length).

    Args:
        model: the model to decode with (held weakly: a replaced model is noticed, not kept alive).
        batch: rows per chunk; shorter chunks are filled up by the caller.
        cache_len: positions in the cache: the longest padded prompt plus new tokens it can serve.
        sampling: the settings the captured step bakes in.
        compiled_forward: ``torch.compile(last_logits)`` to run the one-token forward with, or None (eager).
        compiled_layers: instead of ``compiled_forward``, one compiled decoder layer that every layer
            runs while the step is compiled and captured (``runtime.regional_compile``); the rest stays eager.
        decode_attention: the packed-GQA variant used while the compiled forward is traced/captured; "filled"
            becomes "matmul" where ``filled_attention.serves`` says the kernel would not pay (few rows over a
            short cache, no Triton).
        compiled_select: ``torch.compile(take_next_tokens)`` for the decode step's token selection and buffer
            updates, or None (eager, in place).
        fuse_projections: parts of ``fused_projections.PARTS`` to fuse in the captured step ("qkv",
            "gate_up"); the fused copies cost about that share of the weights' memory while the decoder lives.
            Unless it is empty, groups already side by side (``packed_weights``) are fused as views, at no cost.
        pdl_codegen: the compiled functions were made with PDL (``launch_overlap``): their compile, at the first
            capture, runs under ``launch_overlap.codegen_waits_first``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        batch: int,
        cache_len: int,
        sampling: SamplingSettings,
        compiled_forward: Callable | None = None,
        compiled_layers: CompiledLayers | None = None,
        decode_attention: str | None = None,
        compiled_select: Callable | None = None,
        fuse_projections: tuple[str, ...] = (),
        pdl_codegen: bool = False,
    ) -> None:
        device = model_device(model)
        base = base_model(model)
        self.model_ref = weakref.ref(model)
        self.batch = batch
        self.cache_len = cache_len
        self.sampling = sampling
        self.compiled_forward = compiled_forward
        self.compiled_layers = compiled_layers
        self.pdl_codegen = pdl_codegen
        self.compile_error: str | None = None  # why compiling failed, once it has
        if decode_attention == "filled" and not filled_attention.serves(batch, kv_heads(base.config), device, cache_len):
            decode_attention = "matmul"  # too few rows and too short a cache to fill the GPU with the kernel's programs
        self.decode_attention = decode_attention
        self.compiled_select = compiled_select
        self.fuse_projections = tuple(fuse_projections)
        self.fused: FusedProjections | None = None  # made at the first capture
        self._advance_cache: Callable[[int], None] | None = None  # set while the layers are routed (regional_compile)
        self.signature: tuple | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.cache = static_cache(base.config, cache_len)
        self.tok = torch.zeros((batch, 1), dtype=torch.long, device=device)  # input token of the next step
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)  # its position id
        self.mask2d = torch.ones((batch, cache_len), dtype=torch.long, device=device)  # prompt mask, then ones
        self.out = torch.full((batch, cache_len), sampling.pad_token_id, dtype=torch.long, device=device)
        self.logps = torch.zeros((batch, cache_len), dtype=torch.float32, device=device)  # of the tokens in out
        self.last_logps: torch.Tensor | None = None  # [batch, <=steps]: the last run's, beside its tokens
        self.step = torch.zeros((1,), dtype=torch.long, device=device)  # index of the token being generated
        self.min_steps = torch.zeros((1,), dtype=torch.long, device=device)  # EOS blocked while step < min_steps
        self.unfinished = torch.ones((batch,), dtype=torch.bool, device=device)
        # The row whose cache holds each row's prompt, and where the prompts end: the "filled" attention reads a
        # prompt that several rows share from one of them (``filled_attention``; set at each prefill).
        self.prompt_source = torch.arange(batch, dtype=torch.int32, device=device)
        self.prompt_end = torch.zeros((1,), dtype=torch.int32, device=device)
        self.seen: torch.Tensor | None = None  # [B, V + 1] bool, for the repetition penalty
        self.eos_vocab_mask: torch.Tensor | None = None  # [V] bool
        self.vocab_size: int | None = None
        # transformers 5.24 names the cache argument `cache` (`past_key_values` is deprecated).
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"
        self._logits_to_keep = "logits_to_keep" in params
        # a forward without **kwargs could not take (nor hand down) the prompt source
        self._takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.decode_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # each run's decode loop (CUDA)

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> int:
        """Device memory held by the KV cache and the static buffers."""
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        for tensor in (self.tok, self.pos, self.mask2d, self.out, self.logps, self.seen):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total + (self.fused.nbytes() if self.fused is not None else 0)

    # ------------------------------------------------------------------ decoding
    def run(self, model, input_ids, attention_mask, steps: int, *, use_graph: bool, check_every: int) -> torch.Tensor:
        """Decode ``steps`` tokens for one chunk of ``batch`` left-padded prompts; [batch, <=steps], a copy on the
        model's device (``cut_after_eos`` searches it there)."""
        if steps == 0:
            self.last_logps = torch.empty((self.batch, 0), dtype=torch.float32, device=self.out.device)
            return torch.empty((self.batch, 0), dtype=torch.long, device=self.out.device)
        if self.fused is not None:
            self.fused.refresh()  # the weights changed since the last chunk (an optimizer step, say)
        self._prefill(model, input_ids, attention_mask)
        if use_graph and self.graph is None and steps > 1:
            # The warm-up and capture decode a few tokens from the prefilled state. They write the cache only
            # past the prompt, where the real steps write again before attending, so putting back the small
            # state they advanced is exact. Other caches (sliding windows that may roll over the prompt,
            # recurrent states) are prefilled again: one more eager forward over the prompts.
            state = self._decode_state() if self._capture_is_rewindable() else None
            self._capture(model)
            if state is None:
                self._prefill(model, input_ids, attention_mask)
            else:
                self._rewind(state)
        timing = None
        if self.out.is_cuda:  # the decode loop alone, without the prefill and capture (efficiency: decode_gbps)
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        done = 1
        while done < steps:
            if use_graph:
                self.graph.replay()
            else:
                self._decode_step(model)
            done += 1
            if done % check_every == 0 and not bool(self.unfinished.any()):
                break
        if timing is not None:
            timing[1].record()
            self.decode_timings.append(timing)
        self.last_logps = self.logps[:, :done].clone()
        return self.out[:, :done].clone()

    def pop_decode_seconds(self) -> float:
        """Seconds the decode loops since the last call took on the device (waits for the last to end)."""
        seconds = 0.0
        for start, end in self.decode_timings:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self.decode_timings.clear()
        return seconds

    def _capture_is_rewindable(self) -> bool:
        """True for a cache of plain static layers, whose only state besides K/V is where the next K/V goes."""
        from transformers.cache_utils import StaticLayer

        return all(type(layer) is StaticLayer for layer in self.cache.layers)

    def _decode_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of what a decode step advances, besides the cache past the prompt: (tensor, copy) pairs."""
        tensors = [self.tok, self.pos, self.out, self.logps, self.step, self.unfinished]
        tensors += [layer.cumulative_length for layer in self.cache.layers]  # where the next K/V goes
        if self.seen is not None:
            tensors.append(self.seen)
        return [(tensor, tensor.clone()) for tensor in tensors]

    @staticmethod
    def _rewind(state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for tensor, saved in state:
            tensor.copy_(saved)  # in place: the captured graph reads these addresses

    def _forward(self, model, input_ids, position_ids, *, decode: bool = False) -> torch.Tensor:
        """Last-position logits [B, V]; the one-token decode forward may be compiled.

        Float32, except for a decode step whose compiled token selection makes its own float32 copy
        (fused into its reads rather than written out).
        """
        fn = self.compiled_forward if decode and self.compiled_forward is not None else last_logits
        float32 = not (decode and self.compiled_select is not None)
        shared = decode and self.compiles and self.decode_attention == "filled" and self._takes_kwargs
        extra = {PROMPT_SOURCE: self.prompt_source, PROMPT_END: self.prompt_end} if shared else None
        return fn(model, input_ids, self.mask2d, position_ids, self.cache, self._cache_kw, self._logits_to_keep,
                  float32, extra)

    def _prefill(self, model, input_ids, attention_mask) -> None:
        """Reset the cache and buffers for a new chunk, run the prompt and pick the first token."""
        s = self.sampling
        prompt_len = input_ids.size(1)
        self.cache.reset()
        for layer in self.cache.layers:  # sliding layers also keep a Python-side length
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = 0
        self.mask2d.fill_(1)
        self.mask2d[:, :prompt_len].copy_(attention_mask)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        self.out.fill_(s.pad_token_id)
        self.logps.zero_()
        self.step.zero_()
        # EOS is blocked for the first min_new_tokens tokens, and while prompt + generated < min_length.
        self.min_steps.fill_(max(s.min_new_tokens, s.min_length - prompt_len, 0))
        self.unfinished.fill_(True)
        # The prompt goes through in pieces: a piece's attention scores (batch x heads x piece x keys, float32
        # where SDPA falls back to its math kernel for a padding mask) stay near PREFILL_SCORE_BYTES instead of
        # growing with the prompt and setting the rollout's peak. A cache of plain static layers lets a piece
        # attend to the positions up to its end only (prefill_keys), so short prompts take one piece.
        sliced = self._capture_is_rewindable() and is_sdpa(model)
        # rows repeating a prompt (GRPO's num_generations): each prompt runs once (shared_prefill)
        shared = shared_prefill.shared_rows(input_ids, attention_mask) if shared_prefill.cache_shareable(
            self.cache) else None
        self.prompt_end.fill_(prompt_len)
        if shared is not None:
            self.prompt_source.copy_(shared.leaders.index_select(0, shared.place))
            logits = self._shared_prefill(model, input_ids, attention_mask, position_ids, shared)
        else:
            self.prompt_source.copy_(torch.arange(self.batch, device=self.prompt_source.device))
            for start, end in self.prefill_pieces(model, prompt_len, sliced):
                with prefill_keys(model, end) if sliced else contextlib.nullcontext():
                    logits = self._forward(model, input_ids[:, start:end], position_ids[:, start:end])
        vocab = logits.size(-1)
        if self.vocab_size is None:
            self.vocab_size = vocab
            mask = torch.zeros((vocab,), dtype=torch.bool, device=logits.device)
            valid = [t for t in s.eos_token_ids if 0 <= t < vocab]
            if valid:
                mask[torch.tensor(valid, device=logits.device)] = True
            self.eos_vocab_mask = mask
            if s.repetition_penalty != 1.0:
                self.seen = torch.zeros((self.batch, vocab + 1), dtype=torch.bool, device=logits.device)
        if self.seen is not None:
            # Prompt tokens count for the penalty, left padding does not (index V is a sink).
            self.seen.zero_()
            self.seen.scatter_(1, input_ids.masked_fill(attention_mask == 0, vocab), True)
        self.pos.copy_(position_ids[:, -1:])
        self._advance(logits)

    def _shared_prefill(self, model, input_ids, attention_mask, position_ids, shared) -> torch.Tensor:
        """The distinct prompts through the model once, against a cache of their own; every row's prompt keys and
        values then written into the static cache from its prompt's; the rows' last logits [B, V]."""
        from transformers import DynamicCache

        ids, mask, positions = (t.index_select(0, shared.leaders) for t in (input_ids, attention_mask, position_ids))
        prompts_cache = DynamicCache()
        for start, end in self.prefill_pieces(model, ids.size(1), True, rows=shared.count):  # keys up to the end
            logits = last_logits(model, ids[:, start:end], mask[:, :end], positions[:, start:end], prompts_cache,
                                 self._cache_kw, self._logits_to_keep)
        shared_prefill.fill(self.cache, prompts_cache, shared)
        return logits.index_select(0, shared.place)

    def prefill_pieces(self, model, prompt_len: int, sliced: bool, rows: int | None = None) -> list[tuple[int, int]]:
        """The ``(start, end)`` prompt positions of each prefill forward (``prefill_pieces`` of this decoder) over
        ``rows`` rows (default: the whole chunk)."""
        heads = getattr(base_model(model).config, "num_attention_heads", 1) or 1
        return prefill_pieces(prompt_len, (rows or self.batch) * heads * 4, self.cache_len, sliced)

    def _advance(self, logits: torch.Tensor, compiled: Callable | None = None) -> None:
        """Logits [B, V] -> next token, written into the static buffers (``take_next_tokens``).

        Without ``compiled`` the logits are float32 and this step's own copy (filtered in place); ``compiled``
        (the compiled ``take_next_tokens``) leaves them as they are.
        """
        noise = row_uniforms(logits) if self.sampling.do_sample else None
        step = compiled or functools.partial(take_next_tokens, copies=False)
        buffers = DecodeBuffers(out=self.out, tok=self.tok, pos=self.pos, step=self.step, min_steps=self.min_steps,
                                unfinished=self.unfinished, eos_vocab_mask=self.eos_vocab_mask, seen=self.seen,
                                logps=self.logps)
        step(logits, self.sampling, noise, buffers)

    def _decode_step(self, model) -> None:
        logits = self._forward(model, self.tok, self.pos, decode=True)
        if self._advance_cache is not None:
            self._advance_cache(1)  # the routed layers left the cache lengths to move once, here
        self._advance(logits, self.compiled_select)

    @property
    def compiles(self) -> bool:
        return self.compiled_forward is not None or self.compiled_layers is not None

    @contextmanager
    def _compiled_step(self, model):
        """The decode step as it is compiled and captured: packed-GQA attention, fused projections if
        asked, layers routed if regional."""
        if self.fuse_projections and self.fused is None:
            self.fused = FusedProjections(base_model(model), self.fuse_projections)
        with ExitStack() as stack:
            stack.enter_context(decode_attention(model, self.decode_attention if self.compiles else None))
            if not self.compiles:  # eager: each RMSNorm one kernel, not eight (inductor fuses the compiled step's)
                stack.enter_context(fused_norms.routed(base_model(model), self.tok.device))
            if self.fused:
                stack.enter_context(self.fused.route())
            if self.compiled_layers is not None:
                self._advance_cache = stack.enter_context(self.compiled_layers.route(base_model(model), self.cache))
                stack.callback(setattr, self, "_advance_cache", None)
            yield

    def _capture(self, model) -> None:
        """Compile and warm up the decode step, then capture it (the state it leaves is reset after)."""
        with launch_overlap.codegen_waits_first() if self.pdl_codegen else contextlib.nullcontext():
            self._compile_and_capture(model)

    def _compile_and_capture(self, model) -> None:
        if self.compiles:
            try:  # the first call compiles; do it outside the capture
                with self._compiled_step(model):
                    self._decode_step(model)
            except Exception as err:  # noqa: BLE001 - any compiler failure: capture the eager forward
                self.compile_error = f"{type(err).__name__}: {err}"
                logger.warning(
                    "cuda_graph backend: torch.compile failed (%s); capturing the eager forward", self.compile_error
                )
                self.compiled_forward = None
                self.compiled_layers = None
                self.compiled_select = None
            torch.cuda.synchronize()
        with self._compiled_step(model):
            self.graph, _ = capture_graph(lambda: self._decode_step(model), model, self.tok.device)
