"""The longest completion a run's sizes fit on a device: an estimate of peak memory, term by term, from the model's
dimensions alone.

A GRPO step peaks in one of three phases; each is the memory resident through the step plus the phase's own:

* resident: the weights (and a reference model's copy where full fine-tuning has ``beta != 0``), the optimizer's two
  moments per trainable parameter (LoRA adapters train in fp32, as PEFT casts them; full fine-tuning keeps torch
  AdamW's state in the parameters' dtype), and in the training half the trainable parameters' gradients;
* rollout: the KV cache of ``per_device_generation_batch_size`` rows over the decoder's cache length (the cuda_graph
  backend's static cache, ``memory.decode_sizes.cache_positions``; the hf backend's cache as long as the rows,
  plus one layer's copy while it grows), the decoder's fused q/k/v weights and static buffers, the largest prefill
  piece's scores and activations (``memory.decode_sizes.prefill_pieces``: the scores stay near
  ``PREFILL_SCORE_BYTES`` whatever the prompt) and the float32 logits of a decode step;
* training: one forward/backward pass over ``per_device_train_batch_size`` rows of longest prompt + completion (at
  most ``max_tokens_per_micro_batch`` tokens, never less than one row): with activation checkpointing every layer's
  input, plus one layer's saved tensors and its backward's gradients while that layer is recomputed (without it,
  every layer's saved tensors); the final hidden states and their gradient; the chunked log-prob head's tile; a
  padded (not packed) pass's boolean attention mask and its additive copy;
* scoring: TRL's no-grad log-probs (reference, old policy), twice the training rows a chunk, one layer's
  activations at a time.

A layer's saved tensors per token, in bytes at activation width ``a``: its two RMSNorm inputs in float32 (8H), their
outputs (2aH), the attention's queries, keys, values, output and the output's copy for o_proj ((3 heads + 2 KV
heads) x head_dim x a), and the MLP's four I-wide tensors (gate, up, act(gate), their product: 4aI). Its backward
holds three more I-wide gradients and two float32 H-wide ones (3aI + 8H). These are upper bounds read off the
modelling code (Qwen2 / Llama); LoRA dropout (p > 0) adds a copy of each adapted projection's input, not counted.
What no term holds: the CUDA context and library workspaces (``CONTEXT_BYTES`` is kept free for them) and the
caching allocator's fragmentation (reserved memory above allocated; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
narrows it). The terms and their measured check are in docs/performance.md, "How long a completion fits".

May import: ``hf_grpo.generation.static_cache`` (the cache length rule), no trainer.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import decode_sizes

GIB = 2**30
# Kept free of the estimate: the CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers (about 0.5-1 GiB on an H100).
CONTEXT_BYTES = 1 * GIB
# The log-prob head walks the vocabulary in tiles this wide (``hf_grpo.ops.logprobs._VOCAB_BLOCK``).
VOCAB_TILE = 32768
# Projections a LoRA adapter is put on when none are named: every linear layer of a decoder block (an upper bound).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
SKIP_VARIABLE = "HF_GRPO_FIT_CHECK"  # "off": train even where the estimate says the run cannot fit


@dataclass(frozen=True)
class ModelDims:
    """What the estimate reads of a decoder-only model: its config's dimensions and its weights' dtype width."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    attention_bias: bool = True  # Qwen2's q/k/v biases (Llama: attention_bias, default False)
    weight_bytes: int = 2
    parameters: int | None = None  # the model's own count where it is at hand, else computed from the dimensions

    @classmethod
    def from_config(cls, config: Any, weight_bytes: int | None = None, parameters: int | None = None) -> ModelDims:
        """From a transformers config, its ``to_dict()`` or a ``config.json``'s mapping; the dtype from its
        ``dtype``/``torch_dtype`` unless ``weight_bytes`` is given (bfloat16 where neither says)."""
        get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
        missing = [key for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                   "vocab_size") if not get(key)]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}: the memory estimate needs a decoder-only "
                             f"config (num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, "
                             f"vocab_size)")
        heads = int(get("num_attention_heads"))
        if weight_bytes is None:
            dtype = str(get("dtype", None) or get("torch_dtype", None) or "bfloat16").replace("torch.", "")
            weight_bytes = DTYPE_BYTES.get(dtype, 2)
        bias = get("attention_bias", None)
        return cls(layers=int(get("num_hidden_layers")), hidden=int(get("hidden_size")),
                   intermediate=int(get("intermediate_size")), heads=heads,
                   kv_heads=int(get("num_key_value_heads", None) or heads),
                   head_dim=int(get("head_dim", None) or int(get("hidden_size")) // heads),
                   vocab=int(get("vocab_size")), tied=bool(get("tie_word_embeddings", False)),
                   attention_bias=(get("model_type", None) == "qwen2") if bias is None else bool(bias),
                   weight_bytes=int(weight_bytes), parameters=parameters)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder block."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}

    def parameter_count(self) -> int:
        if self.parameters is not None:
            return self.parameters
        block = sum(a * b for a, b in self.projections().values()) + 2 * self.hidden  # and two RMSNorms
        if self.attention_bias:
            block += (self.heads + 2 * self.kv_heads) * self.head_dim
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * block + embeddings + self.hidden  # the final norm

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        return self.layers * sum(rank * (a + b) for name, (a, b) in self.projections().items() if name in targets)

    def kv_bytes_per_position(self) -> int:
        """One position of one row in the KV cache: every layer's keys and values, in the weights' dtype."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.weight_bytes


@dataclass(frozen=True)
class RunShape:
    """The sizes and settings of a run that set its memory (the per-device batch fields and the model's training)."""

    prompt: int  # the longest prompt, tokens
    generation_rows: int  # per_device_generation_batch_size
    train_rows: int = 1  # per_device_train_batch_size
    tensor_rows: int | None = 1024  # tensor_batch_size (None: every row of a pass in one chunk)
    token_budget: int | None = None  # max_tokens_per_micro_batch
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = LORA_TARGETS
    checkpointing: bool = True  # activation_checkpointing
    reference_copy: bool = False  # full fine-tuning with beta != 0 keeps a second model
    packed: bool = True  # training rows packed (padding_free): no attention mask
    backend: str = "cuda_graph"  # the generation backend ("cuda_graph" or "hf")
    min_cache_len: int = 256  # the cuda_graph backend's first cache rung
    fused_qkv: bool = True  # the cuda_graph backend's fused q/k/v weights (fuse_projections "qkv")
    trainable: int | None = None  # trainable parameters where the model is at hand (else from lora_rank)
    trainable_bytes: int | None = None  # their width (else 4 for LoRA adapters, the weights' for full fine-tuning)


def cache_positions(shape: RunShape, need: int) -> int:
    """Positions of the rollout's KV cache for rows of ``need`` tokens (the longest prompt + completion)."""
    if shape.backend != "cuda_graph":
        return need
    return decode_sizes.cache_positions(need, need, shape.min_cache_len)


def _gib(count: float) -> float:
    return round(count / GIB, 2)


def resident_bytes(dims: ModelDims, shape: RunShape, with_gradients: bool) -> dict[str, int]:
    """Memory held through the step: weights, a reference copy, optimizer state, and gradients while training."""
    params = dims.parameter_count()
    terms = {"weights": params * dims.weight_bytes}
    if shape.reference_copy:
        terms["reference model"] = params * dims.weight_bytes
    lora = bool(shape.lora_rank)
    trainable = shape.trainable if shape.trainable is not None else (
        dims.lora_parameters(shape.lora_rank, shape.lora_targets) if lora else params)
    width = shape.trainable_bytes or (4 if lora else dims.weight_bytes)
    if lora:
        terms["LoRA adapters"] = trainable * width
    terms["optimizer state (2 moments)"] = trainable * 2 * width
    if with_gradients:
        terms["gradients"] = trainable * width
    return terms


def rollout_bytes(dims: ModelDims, shape: RunShape, completion: int) -> dict[str, int]:
    """The rollout's own memory: KV cache and the decoder's workspace (``PREFILL_SCORE_BYTES`` mirrored here)."""
    g, a, need = shape.generation_rows, dims.weight_bytes, shape.prompt + completion
    positions = cache_positions(shape, need)
    per_layer = g * positions * 2 * dims.kv_heads * dims.head_dim * a
    terms = {"KV cache": dims.layers * per_layer}
    if shape.backend != "cuda_graph":
        terms["KV cache growth (one layer copied)"] = per_layer
    else:
        # generated ids and the attention mask (int64), the sampled tokens' log-probs (float32)
        terms["decoder buffers"] = g * positions * (8 + 8 + 4)
        if shape.fused_qkv:
            terms["fused q/k/v weights"] = dims.layers * dims.hidden * (dims.heads + 2 * dims.kv_heads) * \
                dims.head_dim * a
    terms["prefill piece"] = prefill_piece_bytes(dims, shape)
    terms["decode logits (fp32)"] = 3 * g * dims.vocab * 4
    return terms


def prefill_piece_bytes(dims: ModelDims, shape: RunShape) -> int:
    """The largest prefill forward's scores and activations (the decoder's own pieces, ``prefill_pieces``)."""
    g, score_bytes = shape.generation_rows, shape.generation_rows * dims.heads * 4
    positions = cache_positions(shape, shape.prompt + 1)
    return max((score_bytes * (end - start) * end + g * (end - start) * (3 * dims.intermediate + 4 * dims.hidden) *
                dims.weight_bytes
                for start, end in decode_sizes.prefill_pieces(shape.prompt, score_bytes, positions, True)),
               default=0)


def layer_saved_per_token(dims: ModelDims, a: int) -> int:
    """Bytes one decoder layer saves for its backward, per token (module doc)."""
    return 8 * dims.hidden + 2 * a * dims.hidden + (3 * dims.heads + 2 * dims.kv_heads) * dims.head_dim * a + \
        4 * a * dims.intermediate


def layer_backward_per_token(dims: ModelDims, a: int) -> int:
    return 3 * a * dims.intermediate + 8 * dims.hidden


def pass_tokens(shape: RunShape, completion: int) -> int:
    row = shape.prompt + completion
    tokens = shape.train_rows * row
    return tokens if shape.token_budget is None else max(row, min(tokens, shape.token_budget))


def head_bytes(dims: ModelDims, shape: RunShape, tokens: int, a: int) -> int:
    rows = tokens if shape.tensor_rows is None else min(shape.tensor_rows, tokens)
    tile = rows * min(dims.vocab, VOCAB_TILE) * 4 * 2  # fp32 logits tile and its gradient
    return tile + min(dims.vocab, VOCAB_TILE) * dims.hidden * 4 + tokens * 16  # the fp32 weight-gradient block


def training_bytes(dims: ModelDims, shape: RunShape, completion: int) -> dict[str, int]:
    a, tokens = dims.weight_bytes, pass_tokens(shape, completion)
    saved, backward = layer_saved_per_token(dims, a), layer_backward_per_token(dims, a)
    if shape.checkpointing:
        terms = {"layer inputs (checkpointed)": dims.layers * tokens * dims.hidden * a,
                 "one layer recomputed and its backward": tokens * (saved + backward)}
    else:
        terms = {"every layer's saved tensors": dims.layers * tokens * saved,
                 "one layer's backward": tokens * backward}
    terms["final hidden states and their gradient"] = 2 * tokens * dims.hidden * a
    terms["log-prob head"] = head_bytes(dims, shape, tokens, a)
    if not shape.packed:
        row = shape.prompt + completion
        rows = max(1, tokens // row)
        terms["attention mask (padded rows)"] = rows * row * row * 3
    return terms


def scoring_bytes(dims: ModelDims, shape: RunShape, completion: int) -> dict[str, int]:
    a = dims.weight_bytes
    tokens = 2 * pass_tokens(shape, completion)
    terms = {"one layer's activations (no grad)": tokens * layer_saved_per_token(dims, a),
             "log-prob head": head_bytes(dims, shape, tokens, a)}
    if not shape.packed:
        row = shape.prompt + completion
        terms["attention mask (padded rows)"] = max(1, tokens // row) * row * row * 3
    return terms


@dataclass(frozen=True)
class Estimate:
    completion: int
    phases: dict[str, dict[str, int]]  # phase -> term -> bytes, resident terms included

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    def describe(self) -> str:
        parts = []
        for phase, terms in self.phases.items():
            listed = ", ".join(f"{name} {_gib(n)}" for name, n in terms.items())
            parts.append(f"{phase} {_gib(self.total(phase))} GiB ({listed})")
        return "; ".join(parts)


def estimate(dims: ModelDims, shape: RunShape, completion: int) -> Estimate:
    """Each phase's peak memory, term by term (bytes), for completions of ``completion`` tokens."""
    if completion < 1 or shape.prompt < 0:
        raise ValueError(f"completion must be >= 1 and prompt >= 0 tokens, got {completion} and {shape.prompt}")
    without, with_grads = resident_bytes(dims, shape, False), resident_bytes(dims, shape, True)
    return Estimate(completion, {
        "rollout": {**without, **rollout_bytes(dims, shape, completion)},
        "training": {**with_grads, **training_bytes(dims, shape, completion)},
        "scoring": {**without, **scoring_bytes(dims, shape, completion)},
    })


def usable_bytes(device_bytes: int) -> int:
    return device_bytes - CONTEXT_BYTES


def longest_completion(dims: ModelDims, shape: RunShape, device_bytes: int, upper: int = 1 << 24) -> int:
    """The longest completion (tokens) whose estimated peak fits ``device_bytes`` less ``CONTEXT_BYTES``; 0: none.
    Every term grows with the length, so the search bisects."""
    usable = usable_bytes(device_bytes)
    if estimate(dims, shape, 1).peak > usable:
        return 0
    good, bad = 1, upper + 1
    while bad - good > 1:
        middle = (good + bad) // 2
        if estimate(dims, shape, middle).peak <= usable:
            good = middle
        else:
            bad = middle
    return good


def advice(est: Estimate, shape: RunShape) -> list[str]:
    """What lowers the phase that peaks, as field=value suggestions."""
    phase = est.peak_phase
    found = []
    if phase == "rollout" and shape.generation_rows > 1:
        found.append(f"per_device_generation_batch_size={shape.generation_rows} (the KV cache is "
                     f"{_gib(est.phases['rollout']['KV cache'])} GiB; half the rows, half of it)")
    if phase != "rollout":
        if not shape.checkpointing:
            found.append("activation_checkpointing=False (True keeps one layer's activations, not every layer's)")
        if shape.train_rows > 1 and shape.token_budget is None:
            found.append(f"per_device_train_batch_size={shape.train_rows} (1 row a pass, or max_tokens_per_micro_batch)")
        if shape.tensor_rows is None or shape.tensor_rows > 1024:
            found.append(f"tensor_batch_size={shape.tensor_rows} (1024 or fewer rows a log-prob chunk)")
        if not shape.packed:
            found.append("padding_free=False (packed rows need no attention mask)")
    return found


def summary(dims: ModelDims, shape: RunShape, device_bytes: int, max_completion_length: int) -> tuple[str, bool]:
    """One paragraph for ``hf-grpo plan`` and the log at train start, and whether ``max_completion_length`` fits."""
    longest = longest_completion(dims, shape, device_bytes)
    est = estimate(dims, shape, max_completion_length)
    fits = est.peak <= usable_bytes(device_bytes)
    text = (f"memory: the longest completion these sizes fit on {_gib(device_bytes)} GiB is {longest:,} tokens "
            f"(estimated, prompt {shape.prompt:,} tokens, {shape.generation_rows} rows generated at once); at "
            f"max_completion_length={max_completion_length:,} the peak is {_gib(est.peak)} GiB in the "
            f"{est.peak_phase} of {_gib(usable_bytes(device_bytes))} GiB usable: {est.describe()}")
    return text, fits


def refusal(dims: ModelDims, shape: RunShape, device_bytes: int, max_completion_length: int) -> str | None:
    """The error for a run whose ``max_completion_length`` cannot fit, or None where it fits."""
    est = estimate(dims, shape, max_completion_length)
    if est.peak <= usable_bytes(device_bytes):
        return None
    longest = longest_completion(dims, shape, device_bytes)
    changes = [f"lower max_completion_length to {longest:,} or less" if longest else
               "no completion length fits these sizes"] + [f"lower {item}" for item in advice(est, shape)]
    return (f"max_completion_length={max_completion_length:,} does not fit on this device: the estimated peak is "
            f"{_gib(est.peak)} GiB in the {est.peak_phase} against {_gib(usable_bytes(device_bytes))} GiB usable "
            f"({_gib(device_bytes)} GiB less {_gib(CONTEXT_BYTES)} GiB for the CUDA context); the longest completion "
            f"these sizes fit is {longest:,} tokens. Change: " + "; ".join(changes) + f". The estimate's terms: "
            f"{est.describe()}. It is conservative (docs/performance.md, \"How long a completion fits\"); "
            f"{SKIP_VARIABLE}=off trains anyway")


def check_enabled() -> bool:
    value = os.environ.get(SKIP_VARIABLE, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{SKIP_VARIABLE} must be 'on' or 'off', got {value!r}")
    return value == "on"


def read_model_config(source: str) -> dict:
    """A ``config.json`` (or a directory holding one) as a mapping; a multimodal config's ``text_config``."""
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    try:
        with open(path) as handle:
            loaded = json.load(handle)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--model_config {source!r}: not a readable config.json ({err})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"--model_config {source!r}: a config.json holds a mapping, got {type(loaded).__name__}")
    return loaded.get("text_config", loaded) if "num_hidden_layers" not in loaded else loaded


# ---- the run side: the trainer's model and sizes, at train begin --------------------------------------------------
def run_inputs(model, sizes, facts, *, prompt: int, packed: bool, reference: bool, backend: str
               ) -> tuple[ModelDims, RunShape]:
    """``ModelDims`` and ``RunShape`` of a built run: the model's own parameter counts and dtypes (LoRA adapters
    are its trainable parameters), the run's sizes (``RunSizes``) and facts (``RunFacts``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lora = hasattr(model, "peft_config")
    frozen = [p for p in model.parameters() if not (lora and p.requires_grad)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    dims = ModelDims.from_config(base.config.get_text_config(), weight_bytes=frozen[0].element_size(),
                                 parameters=sum(p.numel() for p in frozen))
    rollout = sizes.per_device_train_batch_size * sizes.steps_per_generation
    shape = RunShape(prompt=prompt, generation_rows=sizes.per_device_generation_batch_size or rollout,
                     train_rows=sizes.per_device_train_batch_size, tensor_rows=sizes.tensor_batch_size,
                     token_budget=sizes.max_tokens_per_micro_batch,
                     lora_rank=getattr(next(iter(model.peft_config.values())), "r", 1) if lora else 0,
                     checkpointing=facts.activation_checkpointing, reference_copy=reference, packed=packed,
                     backend="hf" if backend == "hf" else "cuda_graph",
                     trainable=sum(p.numel() for p in trainable),
                     trainable_bytes=trainable[0].element_size() if trainable else 4)
    return dims, shape


def check_run(model, sizes, facts, *, prompt: Callable[[], int], packed: bool, reference: bool, backend: str,
              device, main: bool, device_bytes: int | None = None) -> None:
    """At train begin, before the first rollout: log the longest completion the run's sizes fit, and refuse one
    whose ``max_completion_length`` cannot fit (``refusal``). On one GPU or under DDP; ``device_bytes`` defaults
    to the device's memory (its per-process cap where one is set). Not estimated on CPU, under DeepSpeed or FSDP
    (they partition what the terms count whole), or with ``HF_GRPO_FIT_CHECK=off``. ``prompt`` gives the longest
    prompt, asked only where the check runs (it may scan the training set)."""
    enabled = check_enabled()
    if device_bytes is None:
        if facts.device_type != "cuda" or facts.engine is not None or not enabled:
            return
        from .autosize import memory_cap_bytes

        device_bytes = memory_cap_bytes(device, 1.0)
    dims, shape = run_inputs(model, sizes, facts, prompt=prompt(), packed=packed, reference=reference,
                             backend=backend)
    text, fits = summary(dims, shape, device_bytes, facts.max_completion_length)
    if main:
        logging.getLogger("hf_grpo").info("%s", text)
    if not fits and enabled:
        raise ValueError(refusal(dims, shape, device_bytes, facts.max_completion_length))
