"""``true_on_policy``: the sampler's log-probs and the trainer's, the same bits.

hf_grpo samples with its own decoder, on the weights being trained, in the training process. The sampler's log-prob
of a token and the trainer's differ only by rounding: the decoder computes the token in a one-token step over a batch
of rows, the trainer inside a forward over whole sequences, and library kernels (cuBLAS, torch's reductions, SDPA)
choose their tiling and reduction order by the shape of the call. With ``true_on_policy=True`` both run the same
shape-independent ops (``hf_grpo.ops.batch_invariant``): every linear layer (LoRA's included), every RMSNorm, the
attention and the log-softmax of the head. The ratio of the first pass over a rollout is then exactly 1, the sampler's
log-probs stand in for the old-policy pass from the first rollout on (``old_logprobs_source="auto"``) and no
importance-sampling correction has anything to correct.

What it costs (``docs/logprobs.md``: +8% a step at 1.5B on an H100): the invariant GEMM's tiles depend on the weight
only, slower than cuBLAS on the trainer's large matmuls, and the paths that change a token's arithmetic are off:

* the decoder's compiled step, its fused q/k/v projections and the merged-LoRA copy (``compile_generation``,
  ``lora_generation_mirror``): it runs the model's own modules, captured in a CUDA graph;
* the trainer's packed rows, compiled layers, training graphs and fused LoRA forward (``padding_free``,
  ``compile_training``, ``training_cuda_graphs``, ``lora_fused_forward``): its forward runs the rows padded, with
  the decoder's position ids (``cumsum(mask) - 1``).

Settings left at their defaults are turned off with a log line; one asked for explicitly is an error, as are sampling
filters (top-k, top-p, min-p, a repetition penalty: the trainer scores the temperature-scaled softmax, not the
filtered law), an fp32 or Liger head on the trainer's side only, vLLM, ZeRO-3 and FSDP (their decoders read other
copies of the weights), and a diffusion config.
"""

from __future__ import annotations

import logging
import types
import weakref
from dataclasses import dataclass, field

import torch

from ..ops import batch_invariant
from ..runtime import upstream
from ..runtime.model_wrappers import base_model

logger = logging.getLogger("hf_grpo")

FIELD = "true_on_policy"
ATTENTION = "hf_grpo_batch_invariant"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
RMS_NORM_CLASSES = batch_invariant.RMS_NORM_CLASSES

# (field, the value true_on_policy needs, what the setting does that would change a token's arithmetic)
_NEEDS = (
    ("padding_free", False, "packs the rows into one sequence"),
    ("compile_training", "off", "compiles the decoder layers of the training forward"),
    ("training_cuda_graphs", "off", "replays the training forward from CUDA graphs of packed rows"),
    ("lora_fused_forward", False, "computes LoRA projections in one fused addmm"),
    ("compile_generation", "off", "compiles the decoder's step"),
    ("lora_generation_mirror", "off", "decodes from a copy of the weights with the adapters merged"),
    ("cudnn_attention", False, "lets SDPA use cuDNN's attention"),
    ("cast_lm_head_to_fp32", False, "runs the trainer's LM head in fp32, the decoder's in the model's dtype"),
    ("use_liger_kernel", False, "computes the trainer's log-probs in Liger's fused loss"),
)
_SAMPLING_NEUTRAL = (("top_k", (0, None)), ("top_p", (1.0,)), ("min_p", (None, 0.0)), ("repetition_penalty", (1.0,)))


@dataclass
class TrueOnPolicyFields:
    r"""
    ``GRPOConfig``'s field for bitwise-equal sampler and trainer log-probs (``hf_grpo.training.true_on_policy``).

    Parameters:
        true_on_policy (`bool`, *optional*, defaults to `False`):
            Run the decoder and the trainer's forward through the same shape-independent kernels, so the sampler's
            log-prob of every token equals the trainer's bit for bit (the first ratio of a rollout is exactly 1). Costs
            step time (see ``docs/logprobs.md``); needs a Llama, Mistral, Qwen2 or Qwen3 model, no sampling filter.
    """

    true_on_policy: bool = field(default=False, metadata={
        "help": "Run the decoder and the trainer's forward through the same batch-invariant kernels, so the sampler's "
        "log-probs equal the trainer's bit for bit (costs step time; see hf_grpo.training.true_on_policy)."})

    def __post_init__(self):  # GRPOConfig's checks have run; TRL's come next
        settle(self)
        super().__post_init__()


def settle(config) -> None:
    """Check ``config`` for ``true_on_policy`` and turn off, with a log line, the defaults that would change a token's
    arithmetic (``config._explicit_fields``: the fields the caller set)."""
    if not config.true_on_policy:
        return
    if config.true_on_policy is not True:
        raise ValueError(f"{FIELD} must be True or False, got {config.true_on_policy!r}")
    for other in ("use_vllm", "use_transformers_continuous_batching"):
        if getattr(config, other, False):
            raise ValueError(f"{FIELD}=True decodes with hf_grpo's own decoder; it cannot be combined with "
                             f"{other}=True")
    for name, neutral in _SAMPLING_NEUTRAL:
        value = getattr(config, name, neutral[0])
        if value not in neutral:
            raise ValueError(f"{FIELD}=True scores the temperature-scaled softmax the trainer scores, so {name} "
                             f"must be {neutral[0]!r} (no sampling filter), got {value!r}")
    turned_off = []
    for name, needed, why in _NEEDS:
        value = getattr(config, name, needed)
        if value == needed:
            continue
        if name in config._explicit_fields and value not in (None, "auto"):
            raise ValueError(f"{FIELD}=True needs {name}={needed!r} (it {why}, which changes a token's arithmetic "
                             f"between the decoder and the trainer), got {name}={value!r}")
        setattr(config, name, needed)
        turned_off.append(f"{name}={needed!r}")
    if turned_off:
        logger.info("%s: %s (each would change a token's arithmetic between the decoder and the trainer)", FIELD,
                    ", ".join(turned_off))


_INSTALLED: weakref.WeakSet = weakref.WeakSet()  # the models install routed (held weakly)


def installed(model: torch.nn.Module) -> bool:
    """Whether ``install`` has routed ``model``'s (or the model under its wrappers') modules."""
    return base_model(model) in _INSTALLED


def install(model: torch.nn.Module, args, facts) -> None:
    """Where ``args.true_on_policy``: route every linear layer, RMSNorm and attention of ``model`` (the policy,
    PEFT-wrapped or not) through ``batch_invariant``'s ops. ``facts``: the run's (FSDP and ZeRO-3 are refused)."""
    if not args.true_on_policy:
        return
    sharding, zero3 = facts.sharding, facts.zero3
    base = base_model(model)
    config = base.config.get_text_config()
    if zero3 or sharding is not None:
        raise ValueError(f"{FIELD}=True is not supported under {'DeepSpeed ZeRO-3' if zero3 else sharding}: the "
                         "decoder reads a separate copy of the weights there; use ZeRO-1/2, DDP or one process")
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{FIELD}=True supports the model types {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}")
    _check_modules(model)
    norms = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)
        elif type(module).__name__ in RMS_NORM_CLASSES:
            module.forward = types.MethodType(batch_invariant.rms_norm_forward, module)
            norms += 1
    _register_attention()
    upstream.set_attention_internal(base.config, ATTENTION)
    _INSTALLED.add(base)
    logger.info("%s: linear layers, %d RMSNorms, attention and the head's log-softmax run batch-invariant kernels",
                FIELD, norms)


def _check_modules(model: torch.nn.Module) -> None:
    """Refuse, before any module is routed, what would make the two sides differ: dropout, a norm not routed."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            raise ValueError(f"{FIELD}=True: {name} drops out with p={module.p}, which makes the trainer's forward "
                             "random where the decoder's is not (set lora_dropout=0 in the LoRA config)")
        kind = type(module).__name__
        if kind not in RMS_NORM_CLASSES and "norm" in kind.lower() and any(True for _ in module.parameters(False)):
            raise ValueError(f"{FIELD}=True: {name} ({kind}) is not one of the norms it routes "
                             f"({', '.join(RMS_NORM_CLASSES)})")


def _linear_forward(self, x):
    return batch_invariant.linear(x, self.weight, self.bias)


_bounds_of: list = [None, None]  # [weakref to the last mask, its attention_bounds]: one mask serves every layer


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if dropout:
        raise ValueError(f"{FIELD}=True: attention dropout ({dropout}) has no batch-invariant kernel")
    batch, _, sq, dim = query.shape
    mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask == 0
    if mask is not None and _bounds_of[0] is not None and _bounds_of[0]() is attention_mask:
        bounds = _bounds_of[1]
    else:
        bounds = batch_invariant.attention_bounds(mask, batch, sq, key.shape[2], query.device)
        if attention_mask is not None:
            _bounds_of[:] = [weakref.ref(attention_mask), bounds]
    scale = dim**-0.5 if scaling is None else scaling
    return batch_invariant.attention(query, key, value, mask, scale, bounds=bounds), None


def _register_attention() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's position ids for the trainer's rows: ``cumsum(mask) - 1``, 0 on padding (RoPE's angles are
    rounded per position, so the same token must sit at the same position on both sides)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def head_logprobs(head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor, temperature: float,
                  chunk_rows: int | None, return_entropy: bool):
    """Per-token log-probs (and entropies) of ``targets`` [T] from the scored states [T, H], as the decoder computes
    its sampled token's: ``logits = head(h)`` in the model's dtype, ``z = logits.float() / temperature``,
    ``z[target] - logsumexp(z)``. ``chunk_rows`` rows at a time, each chunk recomputed in the backward."""
    rows = states.shape[0]
    step = rows if not chunk_rows else max(1, int(chunk_rows))

    def chunk(h, t):
        z = head(h).float()
        if temperature != 1.0:
            z = z / temperature
        lse = batch_invariant.logsumexp(z)
        logps = z.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse
        if not return_entropy:
            return logps, None
        probs = torch.exp(z.detach() - lse.detach().unsqueeze(-1))
        return logps, lse.detach() - (probs * z.detach()).sum(-1)

    outs = []
    for i in range(0, rows, step):
        h, t = states[i:i + step], targets[i:i + step]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(torch.utils.checkpoint.checkpoint(chunk, h, t, use_reentrant=False))
        else:
            outs.append(chunk(h, t))
    logps = torch.cat([o[0] for o in outs]) if outs else states.new_zeros((0,), dtype=torch.float32)
    if not return_entropy:
        return logps
    return logps, (torch.cat([o[1] for o in outs]) if outs else logps.detach().clone())
