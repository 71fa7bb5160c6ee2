"""Semi-autoregressive masked-diffusion sampling (LLaDA / Dream), as a generation backend.

A row is ``[prompt | L mask tokens]``, split into ``L / block_length`` blocks decoded left to right with
``diffusion_steps / blocks`` steps each. A step runs one bidirectional forward over the whole row,
projects the hidden states of the current block only through the LM head, draws

    x_hat = argmax(logits / T + Gumbel)        (sampling from softmax(logits / T); argmax when T = 0)

with the Gumbel noise in float64 (bf16/fp32 noise visibly biases low-probability tokens), and commits
the ``k`` still-masked positions of the block with the highest confidence ``softmax(logits)[x_hat]``
("low_confidence") or with uniform random scores ("random"). ``k`` spreads the block's masks evenly over
its steps (the first ``block_length % steps`` steps take one more). With ``cfg_scale = w > 0`` the
logits are ``l_u + (w + 1)(l_c - l_u)``, where ``l_u`` comes from the same row with every prompt token
masked (both in one batched forward).

Everything after the first forward stays on the device: the commit is a per-row top-k by ranking
(``commit_topk``), there is no ``.item()``, no ``empty_cache()`` and no host sync per step. Rows are
packed to the left (``hf_grpo.diffusion.model.pack_rows``), so a padded batch gives each row the
completion it gets alone.

Exact by default. Against the plain published algorithm (full-vocabulary logits at every position, the
Gumbel noise and softmax in float64 over the whole ``[B, T, V]``, a host-synced top-k per row) this
sampler draws the same tokens from the same noise (``tests/diffusion/test_diffu_sampler_exact.py``)
while the LM head, the noise and the softmax cover only the current block, nothing syncs per step,
and an unpadded batch runs SDPA without any mask. (On CUDA the noise is the ``gumbel_max`` kernel's own
Philox stream: the same distribution, other draws; ``tests/diffusion/test_diffu_gumbel_max.py``.)

**Memory.** Beside the model and its forward, a step holds the logits of ``HEAD_POSITIONS`` block
positions at a time in the model's dtype; on CUDA one kernel samples them (``gumbel_max``: the float64
noise never exists as a tensor), elsewhere one vocabulary slice of float64 noise at a time
(``NOISE_ELEMENTS``). A whole ``[B, block, V]`` in float64 and its temporaries were the sampler's peak.

With a block cache and ``tensor_batch_size``, a block's full forward runs ``tensor_batch_size // row
length`` rows at a time (at least one): its activations then stay within that many token rows beside the
cache's buffers, and its outputs are those of one forward over all rows. The exact sampler's forwards stay
whole: each of its steps is one, and in pieces they took 1.55x the time (8B LLaDA shape, 8 rows in pieces
of 2, one H100), for activations that ``per_device_generation_batch_size`` already bounds.

``block_cache="prefix"`` / ``"dual"`` (off by default) reuses keys/values within a block
(``hf_grpo.diffusion.block_cache``). That is an APPROXIMATION: in a bidirectional model the committed
prefix's keys/values depend on the still-masked positions of the current and later blocks, which
change at every step, so no exact prefix cache exists; the module's docstring says more. With it,
``cuda_graph`` captures the cached step once and replays it.

Dream models get Dream's own sampler instead (``hf_grpo.diffusion.dream_sampler``, ``DiffusionSampler(algorithm=
"dream")``): no blocks, its schedule and confidence algorithms, top_p / top_k.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from transformers import GenerationConfig

from ..generation.base import GenerationBackend, cut_after_eos, is_zero3_partitioned, iter_chunks, model_device
from ..runtime.collectives import max_over_ranks
from . import dream_sampler
from .block_cache import BlockKVCache, cache_kwarg, check_block_cache, recomputed_columns
from .draws import HEAD_POSITIONS, commit_topk, sample_tokens, transfer_schedule  # noqa: F401 (re-exported)
from .model import (
    HeadBypass,
    accepts_kwarg,
    base_module,
    equal_length_groups,
    full_forward,
    left_pad_tensors,
    model_family,
    pack_rows,
    padding_kwargs,
    slot_columns,
)
from .sampling_settings import SETTING_NAMES, SamplingSettings, settings_from

logger = logging.getLogger("hf_grpo")


def resolve_sampler(args, model: torch.nn.Module) -> str:
    """``"llada"`` or ``"dream"``: ``args.sampler``, or for ``"auto"`` Dream's sampler for a Dream model (by
    ``model_type``; Dream registers ``AutoModel`` only, so the family is what tells it) and LLaDA's otherwise."""
    choice = args.sampler
    if choice == "auto":
        choice = "dream" if model_family(base_module(model)) == "dream" else "llada"
    if choice == "dream" and (args.block_cache is not None or args.cfg_scale > 0 or args.remasking != "low_confidence"):
        raise ValueError(f"this Dream model samples with Dream's sampler (sampler='auto'), which has no blocks, "
                         f"guidance or remasking choice: block_cache={args.block_cache!r}, cfg_scale={args.cfg_scale!r}"
                         f", remasking={args.remasking!r} need sampler='llada'")
    return choice


def sample_block(bypass: HeadBypass, picked: torch.Tensor, cfg_scale: float, mask_token_id: int,
                 temperature: float, generator: torch.Generator | None, forbid_mask_token: bool = True):
    """``(tokens, log_confidence)`` ``[B, bl]`` from the block's hidden states (or logits) ``picked``
    ``[B, bl, ...]`` (``[2B, ...]`` with CFG: conditional rows first), ``HEAD_POSITIONS // bl`` rows at a time
    (at least one): the block's logits never exist whole."""
    guided = cfg_scale > 0
    rows, block = picked.size(0) // (2 if guided else 1), picked.size(1)
    step = max(1, HEAD_POSITIONS // block)
    tokens, confidence = [], []
    for begin in range(0, rows, step):
        part = slice(begin, min(begin + step, rows))
        if guided:
            conditional, unconditional = bypass.to_logits(
                torch.cat([picked[part], picked[rows + part.start:rows + part.stop]])).float().chunk(2)
            logits = unconditional + (cfg_scale + 1) * (conditional - unconditional)
        else:
            logits = bypass.to_logits(picked[part])
        if forbid_mask_token and mask_token_id < logits.size(-1):
            logits[..., mask_token_id] = float("-inf")  # never "predict" the mask itself (LLaDA's code does)
        piece_tokens, piece_confidence = sample_tokens(logits, temperature, generator)
        tokens.append(piece_tokens)
        confidence.append(piece_confidence)
        del logits
    if len(tokens) == 1:
        return tokens[0], confidence[0]
    return torch.cat(tokens), torch.cat(confidence)


StepCallback = Callable[[int, int, torch.Tensor, torch.Tensor], None]


@torch.no_grad()
def diffusion_generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: SamplingSettings | None = None,
    *,
    gen_length: int,
    mask_token_id: int,
    pad_token_id: int,
    logits_shift: bool = False,
    padding_style: str = "mask2d",
    has_padding: bool | None = None,
    generator: torch.Generator | None = None,
    step_callback: StepCallback | None = None,
    cuda_graph: bool = False,
    tensor_batch_size: int | None = None,
    **sampling,
) -> torch.Tensor:
    """The ``gen_length`` completion tokens ``[B, L]`` for left-padded ``prompt_ids`` ``[B, P]`` (mask ``prompt_mask``).

    ``step_callback(block, step, canvas, block_columns)``, if given, sees the canvas after every step
    (tests use it; it is the only place a caller could sync). ``block_cache`` (None: exact) is the opt-in
    approximate key/value reuse of ``hf_grpo.diffusion.block_cache``; with it, ``cuda_graph`` captures the
    cached step once and replays it (CUDA only; see ``BlockKVCache``). With a cache, ``tensor_batch_size``
    (token rows) bounds a block's full forward: it runs ``tensor_batch_size // row length`` rows at a time,
    at least one. ``forbid_mask_token`` (default on) sets the mask token's logit to -inf before the draw and the
    confidence, so no completion holds the mask token; LLaDA's published sampler does not, and with it off this
    sampler is LLaDA's token for token (a slot that drew the mask token stays a candidate up to the block's end).
    The sampling settings (``steps``, ``block_length``, ``temperature``, ``remasking``, ``cfg_scale``,
    ``block_cache``, ``forbid_mask_token``) come in ``settings`` or as keyword arguments (``sampling``).
    """
    settings = settings_from("diffusion_generate", settings, sampling)
    blocks = _checked_blocks(settings, model, gen_length, tensor_batch_size, logits_shift, padding_style, cuda_graph,
                             prompt_ids.device)
    steps, block_length, temperature, remasking = (settings.steps, settings.block_length, settings.temperature,
                                                   settings.remasking)
    cfg_scale, block_cache, forbid_mask_token = settings.cfg_scale, settings.block_cache, settings.forbid_mask_token
    schedule = transfer_schedule(block_length, steps // blocks)
    packed = pack_rows(prompt_ids, prompt_mask, gen_length, mask_token_id, pad_token_id, has_padding=has_padding)
    canvas, start = packed.input_ids, packed.start
    guided = cfg_scale > 0
    valid = torch.cat([packed.valid] * 2) if guided and packed.valid is not None else packed.valid
    forward_kwargs = {**padding_kwargs(padding_style, valid),
                      **({"use_cache": False} if accepts_kwarg(model, "use_cache") else {})}
    counts = {k: torch.full((canvas.size(0),), k, dtype=torch.long, device=canvas.device) for k in set(schedule)}
    # rows per piece of a block's full forward (None: all); only with a cache (the module docstring says why)
    piece_rows = max(1, tensor_batch_size // canvas.size(1)) if tensor_batch_size and block_cache else None
    bypass = HeadBypass(model)
    # block_cache: the keys/values of the columns each block's later steps do not recompute
    cache = None if block_cache is None else BlockKVCache(model, cache_kwarg(model), cuda_graph=cuda_graph)
    with bypass:
        for block in range(blocks):
            columns, candidates, read_from = _block_slots(
                start, block, block_length, forbid_mask_token or cache is not None, logits_shift, guided)
            started = False  # whether this block's full forward ran (the cached steps follow it)
            for step, k in enumerate(schedule):
                if k == 0:
                    continue
                inputs = (torch.cat([canvas, canvas.masked_fill(packed.prompt_positions, mask_token_id)]) if guided
                          else canvas)  # classifier-free guidance: the rows again with their prompts masked
                bypass.reset()
                if cache is not None and started:
                    # the block's recomputed columns come first
                    picked = cache.forward(model, inputs, bypass)[:, :block_length]
                else:
                    kwargs = forward_kwargs if cache is None else _block_start_kwargs(
                        cache, forward_kwargs, recomputed_columns(block_cache, start, block * block_length,
                                                                  block_length, gen_length), guided, valid, inputs)
                    picked = full_forward(model, inputs, kwargs, read_from, piece_rows, cache)
                    if cache is not None:
                        cache.end_block_start()
                    started = True
                tokens, confidence = sample_block(bypass, picked, cfg_scale, mask_token_id, temperature, generator,
                                                  forbid_mask_token)
                del picked  # the next step's forward need not hold it
                canvas = _commit(canvas, candidates, tokens, confidence, counts[k], remasking, mask_token_id, generator)
                if step_callback is not None:
                    step_callback(block, step, canvas, columns)
    return canvas.gather(1, slot_columns(start, 0, gen_length, shift=False))


def _checked_blocks(settings: SamplingSettings, model, gen_length: int, tensor_batch_size, logits_shift: bool,
                    padding_style: str, cuda_graph: bool, device: torch.device) -> int:
    """The number of blocks ``diffusion_generate`` decodes, once its arguments are checked."""
    if settings.block_length is None:
        raise ValueError("diffusion_generate needs block_length (LLaDA's sampler decodes the completion in blocks)")
    if tensor_batch_size is not None and (isinstance(tensor_batch_size, bool) or not isinstance(tensor_batch_size, int)
                                          or tensor_batch_size < 1):
        raise ValueError(f"tensor_batch_size must be a positive int (token rows) or None, got {tensor_batch_size!r}")
    if gen_length % settings.block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({settings.block_length})")
    blocks = gen_length // settings.block_length
    if settings.steps % blocks:
        raise ValueError(f"steps ({settings.steps}) must be a multiple of the number of blocks ({blocks})")
    check_block_cache(settings.block_cache, model, logits_shift, padding_style)
    if cuda_graph and (settings.block_cache is None or device.type != "cuda" or is_zero3_partitioned(model)):
        raise ValueError(f"cuda_graph=True needs block_cache 'dual' or 'prefix' (got {settings.block_cache!r}), a "
                         f"CUDA device (got {device.type!r}) and weights that stay put (not ZeRO-3)")
    return blocks


def _block_slots(start, block: int, block_length: int, own_block_only: bool, logits_shift: bool, guided: bool):
    """(the block's columns ``[B, bl]``, the columns a step may commit, the columns whose logits predict them).
    LLaDA's code commits any still-masked slot before the block's end: with the mask token allowed, a slot of an
    earlier block that drew it is a candidate again (exact path only: ``own_block_only`` False)."""
    columns = slot_columns(start, block * block_length, block_length, shift=False)
    candidates = columns if own_block_only else slot_columns(start, 0, (block + 1) * block_length, shift=False)
    read_from = candidates - 1 if logits_shift else candidates
    return columns, candidates, torch.cat([read_from, read_from]) if guided else read_from


def _block_start_kwargs(cache, forward_kwargs: dict, recompute, guided: bool, valid, inputs) -> dict:
    """A block's first, full forward with a cache: the cache to fill, for the columns its later steps recompute."""
    recompute = torch.cat([recompute, recompute]) if guided else recompute
    return {**forward_kwargs, "use_cache": True, cache.kwarg: cache.begin_block(recompute, valid, inputs.size(1))}


def _commit(canvas, candidates, tokens, confidence, count, remasking: str, mask_token_id: int, generator):
    """The canvas with the step's ``count`` most confident still-masked candidates committed to their draws."""
    current = canvas.gather(1, candidates)
    still_masked = current == mask_token_id
    if remasking == "random":
        confidence = torch.rand(current.shape, device=canvas.device, generator=generator)
    confidence = confidence.masked_fill(~still_masked, float("-inf"))
    commit = commit_topk(confidence, count) & still_masked
    return canvas.scatter(1, candidates, torch.where(commit, tokens, current))


class DiffusionSampler(GenerationBackend):
    """Generation backend for masked-diffusion models: ``diffusion_generate`` on ``chunk_size`` prompts at a time.

    ``generation_config.max_new_tokens`` is the completion length L; ``temperature`` (0, or
    ``do_sample=False``, for greedy) comes from it too. Each chunk is padded on its own. ``block_cache``
    (default None: exact) turns on the approximate key/value reuse of ``hf_grpo.diffusion.block_cache``;
    ``cuda_graph`` (None: on for ``"dual"`` on CUDA outside ZeRO-3) captures its cached step and replays it.
    ``tensor_batch_size`` (token rows, None: unbounded) bounds a block cache's full forwards (see
    ``diffusion_generate``). ``attends_to_padding`` (a model that ignores the padding mask, as the released
    LLaDA code does): chunks hold prompts of equal length only, so none is padded. The sampling settings come in
    ``settings`` (a ``SamplingSettings``) or as its fields' keyword arguments (``algorithm`` for ``sampler``).
    """

    name = "diffusion"

    def __init__(
        self,
        settings: SamplingSettings | None = None,
        *,
        mask_token_id: int,
        logits_shift: bool = False,
        padding_style: str = "mask2d",
        autocast: Callable[[], object] | None = None,
        cuda_graph: bool | None = None,
        tensor_batch_size: int | None = None,
        attends_to_padding: bool = False,
        **sampling,
    ):
        # ``algorithm`` was this backend's name for the sampler family (a keyword it still takes)
        self.settings = settings_from("DiffusionSampler", settings, sampling, renamed={"algorithm": "sampler"})
        if cuda_graph and self.settings.block_cache is None:
            raise ValueError("cuda_graph=True captures the block cache's steps; it needs block_cache='dual' or "
                             "'prefix' (the exact sampler's steps run the whole row)")
        self.cuda_graph, self.tensor_batch_size = cuda_graph, tensor_batch_size
        self.mask_token_id, self.logits_shift, self.padding_style = mask_token_id, logits_shift, padding_style
        self.autocast = autocast or nullcontext
        self.attends_to_padding = attends_to_padding  # the model ignores the padding mask: never pad a chunk
        self.forwards = 0  # model forwards run so far (a CFG step counts once, with twice the rows)

    @property
    def algorithm(self) -> str:
        return self.settings.sampler

    def __getattr__(self, name: str):
        # the settings read as the backend's own attributes (backend.steps, backend.block_cache, ...)
        if name != "settings" and name in SETTING_NAMES:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        if self.logits_shift and any(len(p) == 0 for p in prompt_ids):
            raise ValueError("a model with shifted logits (Dream) predicts the first completion token from the last "
                             "prompt token: every prompt needs at least one token")
        self._warn_ignored(generation_config)
        temperature = float(generation_config.temperature or 0.0) if generation_config.do_sample else 0.0
        length = generation_config.max_new_tokens
        device = model_device(model)
        completions: list[list[int]] = [[] for _ in prompt_ids]
        # temperature (top_p, top_k for Dream's sampler) come from the generation config, call by call
        settings = dataclasses.replace(self.settings, temperature=temperature)
        cuda_graph = self.cuda_graph
        if cuda_graph is None:
            cuda_graph = self.block_cache == "dual" and device.type == "cuda" and not is_zero3_partitioned(model)
        chunks = self._chunks(prompt_ids, chunk_size)
        real = len(chunks)
        if self.attends_to_padding and is_zero3_partitioned(model) and prompt_ids:
            # ZeRO-3 forwards are collective: as many chunks as the busiest rank (the extra ones resample prompt 0,
            # and their completions are dropped)
            chunks += [[0]] * (max_over_ranks(real) - real)
        for index, rows in enumerate(chunks):
            keep = index < real
            ids, mask, padded = left_pad_tensors([list(prompt_ids[row]) for row in rows], pad_token_id, device)
            if self.algorithm == "dream":
                with self.autocast():
                    canvas = self._dream(model, ids, mask, padded, generation_config, settings, pad_token_id)
                self.forwards += settings.steps
                for row, tokens in zip(rows, cut_after_eos(canvas, eos_token_ids) if keep else []):
                    completions[row] = tokens
                continue
            with self.autocast():
                canvas = diffusion_generate(
                    model, ids, mask, settings, gen_length=length, mask_token_id=self.mask_token_id,
                    pad_token_id=pad_token_id, logits_shift=self.logits_shift, padding_style=self.padding_style,
                    has_padding=padded, cuda_graph=cuda_graph, tensor_batch_size=self.tensor_batch_size,
                )
            blocks = length // settings.block_length
            self.forwards += blocks * sum(1 for k in transfer_schedule(settings.block_length, settings.steps // blocks)
                                          if k)
            for row, tokens in zip(rows, cut_after_eos(canvas, eos_token_ids) if keep else []):
                completions[row] = tokens
        return completions

    def _dream(self, model, ids, mask, padded, generation_config, settings, pad_token_id):
        settings = dataclasses.replace(settings, top_p=generation_config.top_p, top_k=generation_config.top_k)
        return dream_sampler.dream_generate(  # looked up at call time (tests wrap it)
            model, ids, mask, settings, gen_length=generation_config.max_new_tokens, mask_token_id=self.mask_token_id,
            pad_token_id=pad_token_id, logits_shift=self.logits_shift, padding_style=self.padding_style,
            has_padding=padded,
        )

    def _chunks(self, prompt_ids: Sequence[Sequence[int]], chunk_size: int) -> list[list[int]]:
        """Row indices of each chunk: ``chunk_size`` consecutive prompts, or, for a model that attends to padding,
        prompts of equal length (``chunk_size`` at most), so that no chunk is padded."""
        if self.attends_to_padding:
            return equal_length_groups([len(p) for p in prompt_ids], chunk_size)
        return list(iter_chunks(range(len(prompt_ids)), chunk_size))

    def _warn_ignored(self, generation_config: GenerationConfig) -> None:
        if getattr(self, "_warned", False):
            return
        self._warned = True
        names = ("min_p", "repetition_penalty") if self.algorithm == "dream" else ("top_p", "top_k", "min_p",
                                                                                    "repetition_penalty")
        ignored = {name: getattr(generation_config, name, None) for name in names}
        neutral = {"top_p": (None, 1.0), "top_k": (None, 0), "min_p": (None, 0.0), "repetition_penalty": (None, 1.0)}
        set_ = {name: value for name, value in ignored.items() if value not in neutral[name]}
        if set_:
            logger.warning("the diffusion sampler draws from softmax(logits / temperature) and ignores %s", set_)
