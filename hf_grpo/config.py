"""GRPOConfig: TRL's config plus per-device generation and log-prob chunk sizes.

Order of precedence for the batch fields: environment variables > explicit values > preset > defaults. Everything is
resolved and checked in ``__post_init__``, before TRL's own checks, so a bad combination fails with this package's
message (fields, values, nearest valid values) before any model is loaded. A config is data: building one starts no
thread and leaves ``os.environ`` as it was; ``hf_grpo.prepare_process`` (the trainer's first step) does the rest.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import trl

from . import checkpointing
from .batch_fields import (  # noqa: F401 (re-exported: names of hf_grpo.config too)
    _EXPLICIT_FIELDS, BATCH_FIELDS, ENV_OVERRIDES, _bf16_available,
    check_generation_choices,
    cuda_probe,
    current_world_size,
    device_defaults,
    device_fields_left_out,
    env_override,
    explicit_fields,
    preset_factory,
    resolve_batch_fields,
)
from .distributed import launch_precision
from .distributed.zero3_leaves import validate_setting as validate_leaf_setting
from .generation import BACKEND_NAMES
from .generation.decode_compile import DecodeCompileFields, validate_setting as validate_decode_compile
from .generation.dense_mirror import validate_setting as validate_mirror_setting
from .memory.token_budget import check_config as check_token_budget
from .plan import BatchPlan
from .training.compiled_layers import validate_setting as validate_compile_setting
from .training.graphs import validate_setting as validate_graphs_setting
from .training.rollout_logprobs import RolloutLogprobFields, validate as validate_logprob_fields
from .training.true_on_policy import TrueOnPolicyFields

logger = logging.getLogger("hf_grpo")

def batch_field_defaults() -> dict[str, Any]:
    """The dataclass defaults of ``BATCH_FIELDS``."""
    return {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in BATCH_FIELDS}


@dataclass
class GRPOConfig(TrueOnPolicyFields, RolloutLogprobFields, DecodeCompileFields, trl.GRPOConfig):  # a module's each
    r"""
    ``trl.GRPOConfig`` with per-device chunk sizes for generation and log-probs.

    Every batch size is **per device**. See ``BatchPlan`` (``config.batch_plan()``) for the
    derived global figures, and the README's "Batch sizes: all per device" section for
    the contract.

    Parameters:
        per_device_generation_batch_size (`int`, *optional*):
            Sequences generated at the same time on each device. The rollout of
            ``per_device_train_batch_size x steps_per_generation`` completions is generated in
            chunks of this size. Defaults to the whole rollout (no chunking). Not to be confused
            with TRL's ``generation_batch_size``, the global rollout size. Env: ``DIFFU_BATCH_SIZE``.
            ``"auto"`` (also for ``per_device_train_batch_size`` and ``tensor_batch_size``): on CUDA, probed
            once at train start on the real model (``hf_grpo.memory.autosize``); on CPU, the whole rollout, P = 8 and
            t = 1024. An out-of-memory in a generation or log-prob chunk halves that size on every rank
            (``hf_grpo.memory.oom``).
        auto_memory_fraction (`float`, *optional*, defaults to `0.9`):
            The share of device memory a probed ``"auto"`` size may peak at.
        tensor_batch_size (`int` or `None`, *optional*, defaults to `1024`):
            Token rows per log-softmax / cross-entropy chunk on each device; the logits held at
            once are one ``tensor_batch_size x 32768`` fp32 tile (the vocabulary is walked in
            tiles). ``None`` computes all rows at once.
            Env: ``DIFFU_TENSOR_BATCH_SIZE``.
        preset (`str`, *optional*):
            ``"memory"``, ``"speed"`` or ``"balanced"``: fills the fields still at their defaults.
        generation_backend (`str`, *optional*, defaults to `"auto"`):
            ``"hf"`` (chunked ``model.generate``), ``"cuda_graph"``, ``"vllm"`` (TRL's vLLM mode) or
            ``"auto"`` (``"cuda_graph"`` on CUDA where the model is supported, else ``"hf"``).
        max_tokens_per_micro_batch (`int`, *optional*):
            Tokens per forward/backward pass on each device. Each micro-batch of
            ``per_device_train_batch_size`` completions is packed into passes of at most this many
            padded tokens (every rank running the same number of passes); the loss is rescaled so the
            gradient is the one-pass gradient for every supported ``loss_type``. ``None``: one pass.
        release_generation_memory (`bool`, *optional*, defaults to `True`):
            Free the generation backend's KV cache and captured graph after each rollout (the
            decode step's compile is kept), and under ZeRO-3 the dense mirror's copy of the weights
            (``zero3_generation_mirror``) of a model that trains all its weights, so they do not sit in
            memory through the backward. A LoRA run keeps the copy: it peaks in its rollouts anyway.
        padding_free (`bool`, *optional*, defaults to `None`):
            Score micro-batches with their rows packed into one sequence (each row keeps its own
            positions and attends only to itself), so no layer computes over padding. Applies to the
            reference, old-policy and training forwards; models it cannot serve exactly keep padding.
            ``None``: packed where the micro-batches replay from CUDA graphs (``training_cuda_graphs``); where
            they run eagerly (ZeRO-3, FSDP, graphs off), packed where the GPU is the bound
            and padded where the host is: on CUDA, packed from ``2 x`` one decoder layer's parameters ``x`` a
            padded micro-batch's tokens of 1.5e12 FLOPs (about 3B parameters at 8 rows of 1.5k tokens; 0.5B and
            1.5B stay padded, where packing measured slower or equal), padded off CUDA
            (``hf_grpo.training.eager_packing``). The log's "training micro-batches" line says which and why.
        cudnn_attention (`bool`, *optional*, defaults to `False`):
            Let PyTorch's SDPA use cuDNN's attention kernel during ``train()``. Off by default: cuDNN builds
            a kernel for each new sequence shape (0.07 to 1.2 s each on an H100), and varied prompt lengths
            bring new shapes all run long; the memory-efficient kernel is used instead
            (``hf_grpo.training.cudnn_attention``).
        zero3_generation_mirror (`str`, *optional*, defaults to `"auto"`):
            Under DeepSpeed ZeRO-3: ``"on"`` decodes from a dense copy of the weights, refreshed in place
            layer by layer each rollout, so the ``cuda_graph`` backend can serve ZeRO-3 (cost: one model copy
            per device in the generation dtype, during rollouts only for a model that trains all its weights
            with ``release_generation_memory``, else the whole run); ``"off"`` gathers the full model each rollout
            and generates with ``"hf"``; ``"auto"`` is ``"on"`` when the ``cuda_graph`` backend would serve the
            model and free memory holds the copy twice over. With one process the partitions hold the whole
            weights: ``"on"`` then decodes from them in place, with no copy. No effect without ZeRO-3.
        zero3_leaf_modules (`str`, *optional*, defaults to `"auto"`):
            Under DeepSpeed ZeRO-3: module classes made DeepSpeed "leaf modules", each instance's parameters
            gathered by one hook instead of one per submodule (less host overhead a step, same values).
            ``"auto"``: the model's decoder-layer classes (its ``_no_split_modules``); ``"off"``: none; else
            comma-separated class names, e.g. ``"Qwen2DecoderLayer"``. No effect without ZeRO-3.
        lora_generation_mirror (`str`, *optional*, defaults to `"auto"`):
            For a LoRA policy outside ZeRO-3: ``"on"`` decodes from the policy's own weights with the
            adapters merged into them in place for the rollout and restored after from a host copy of the
            adapted base weights (no GPU memory; one host copy per process), so LoRA rollouts run at the
            plain model's speed; ``"auto"``: so when the ``cuda_graph`` backend serves it; ``"off"``: the
            decoder runs the adapters.
        compile_training (`str`, *optional*, defaults to `"auto"`):
            ``"on"``: the decoder layers of the scoring and training forwards run through one
            ``torch.compile`` per layer class (dynamic shapes: a few compiles a run, counted as
            ``perf/train_compiles``); ``"auto"``: so on CUDA outside ZeRO-3 and FSDP, for runs of 50
            optimizer steps or more (the compile takes 20-30 s once, a few seconds from a warm compile cache),
            going on eagerly with a warning if torch cannot compile the layers; ``"cpp_wrapper"``: as "on", with
            the graphs' launch code in C++ (inductor's ``cpp_wrapper``): about a quarter off a host-bound
            training half, for a first compile more than a minute longer from a cold cache; ``"off"``: eager.
            Under ZeRO-3 on a GPU no setting compiles (there the compiled layers did not train as eager ones; on
            the CPU ``"on"`` compiles where the decoder layers are leaf modules). Under FSDP no setting compiles:
            its hooks would be bypassed. The log's "training forward" line says which.
            Compiled, prompts and completions are padded to multiples of 8 (TRL's ``pad_to_multiple_of``,
            unless set), so that rollouts of any length share one compiled variant.
        training_cuda_graphs (`str`, *optional*, defaults to `"auto"`):
            ``"on"``: each training micro-batch's forward and backward are replayed from CUDA graphs captured per
            shape bucket (``hf_grpo.training.graphs``; rows packed into one sequence, ``padding_free``, or padded,
            to a few lengths an octave, positions kept), on one CUDA process, under DeepSpeed ZeRO-1/2 or DDP, the
            reductions running after the replay; not under ZeRO-3, FSDP or a token budget; for dense models with
            sdpa or eager attention;
            ``"auto"``: so where the run allows it, activation checkpointing is on (without it the graphs' pool
            would keep a micro-batch's activations through the rollout) and the host is the bound (eager where one
            layer's forward over a micro-batch passes 5e12 FLOPs: a 7B model at 8 rows of 3k tokens), going on
            eagerly with a warning if a capture fails; ``"off"``: eager launches.
            The graphs' memory pool and the parameters' gradients stay allocated between steps (through the
            rollout; see ``docs/performance.md``).
    """

    # `int | str | None` (not `int | str`) so that HfArgumentParser reads the flag as text and "auto" gets through;
    # plan.coerce_size turns the text back into an int and rejects anything else.
    per_device_train_batch_size: int | str | None = field(
        default=8,
        metadata={
            "help": "Completions per forward/backward micro-batch per device, or 'auto' (probed at train start "
            "with gradient_accumulation_steps adjusted; see hf_grpo.memory.autosize). Env: DIFFU_TRAIN_BATCH_SIZE."
        },
    )
    per_device_generation_batch_size: int | str | None = field(
        default=None,
        metadata={
            "help": "Sequences generated simultaneously per device (a chunk of the rollout), or 'auto'. Default: the "
            "whole per-device rollout, per_device_train_batch_size x steps_per_generation. Env: DIFFU_BATCH_SIZE."
        },
    )
    tensor_batch_size: int | str | None = field(
        default=1024,
        metadata={
            "help": "Token rows per log-softmax / cross-entropy chunk per device, 'auto', or None for no chunking. "
            "Env: DIFFU_TENSOR_BATCH_SIZE."
        },
    )
    auto_memory_fraction: float = field(
        default=0.9,
        metadata={
            "help": "For 'auto' sizes on CUDA: the share of device memory (of the per-process cap, if set) a probed "
            "size may peak at; the rest is headroom for lengths and fragmentation the probe did not see."
        },
    )
    preset: str | None = field(
        default=None,
        metadata={"help": "memory, speed or balanced: fills the batch fields left at their defaults."},
    )
    generation_backend: str = field(
        default="auto",
        metadata={"help": f"Generation backend, one of {BACKEND_NAMES}."},
    )
    release_generation_memory: bool = field(
        default=True,
        metadata={
            "help": "Free the cuda_graph backend's KV cache and captured graph after each rollout, and ZeRO-3's dense "
            "mirror of the weights unless the policy trains LoRA adapters (a LoRA run peaks in its rollouts), so the "
            "training step gets that memory; the next rollout captures again (its compile is kept) and refills the "
            "mirror. False keeps them between rollouts (no capture per rollout; perf stats report the cache's size "
            "as generation_cache_gib)."
        },
    )
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Score each micro-batch (reference, old and policy log-probs, and the training forward) with its "
            "rows packed into one sequence, so no layer runs over padding (hf_grpo.training.padding_free). "
            "None (default): "
            "packed where the micro-batches replay from CUDA graphs (training_cuda_graphs); where they run eagerly "
            "(ZeRO-3, FSDP, graphs off), packed on CUDA where the GPU is the bound (one layer's FLOPs on a "
            "micro-batch from 1.5e12: about 3B parameters at 8 rows of 1.5k tokens), padded where the host is (0.5B, "
            "1.5B, CPU runs), as the log says (hf_grpo.training.eager_packing). Models it cannot serve exactly (no "
            "rotary positions, soft-capped or non-causal attention, vision inputs) stay padded, warned if asked for."
        },
    )
    cudnn_attention: bool = field(
        default=False,
        metadata={
            "help": "Let SDPA use cuDNN's attention during train(). Off by default: cuDNN builds a kernel per new "
            "sequence shape (0.07-1.2 s on H100), which varied prompt lengths pay all run long "
            "(hf_grpo.training.cudnn_attention)."
        },
    )
    zero3_generation_mirror: str = field(
        default="auto",
        metadata={
            "help": "ZeRO-3 only: auto, on or off. 'on' generates from a dense copy of the weights refreshed layer by "
            "layer each rollout (one model copy per device), so the cuda_graph backend serves ZeRO-3; 'auto' does so "
            "when that backend applies and memory allows; with one process, from the partitions in place, no copy "
            "(see hf_grpo.generation.dense_mirror)."
        },
    )
    zero3_leaf_modules: str = field(
        default="auto",
        metadata={
            "help": "ZeRO-3 only: auto, off, or comma-separated module class names made DeepSpeed leaf modules (one "
            "parameter gather per instance, no hooks on its children). 'auto': the decoder layers (the model's "
            "_no_split_modules). See hf_grpo.distributed.zero3_leaves."
        },
    )
    lora_generation_mirror: str = field(
        default="auto",
        metadata={
            "help": "LoRA policies outside ZeRO-3: auto, on or off. 'on' decodes from a copy of the weights with the "
            "adapters merged, refreshed each rollout (one model copy per device), so a LoRA rollout runs at the "
            "plain model's speed; 'auto' does so for the cuda_graph backend when memory allows (see "
            "hf_grpo.generation.dense_mirror)."
        },
    )
    lora_fused_forward: bool = field(
        default=True,
        metadata={
            "help": "LoRA policies outside ZeRO-3 and FSDP: compute each adapted projection as base + scaling * "
            "B(A(x)) with the add inside one addmm, without PEFT's float32 round trip of the input (same sums, "
            "one rounding fewer). False keeps PEFT's forward. See hf_grpo.training.lora_forward."
        },
    )
    compile_training: str = field(
        default="auto",
        metadata={
            "help": "auto, on, cpp_wrapper or off. 'on' runs the decoder layers of the scoring and training forwards "
            "(and the backward's recompute) through one torch.compile per layer class with dynamic shapes, so a run "
            "compiles a few graphs (perf/train_compiles); 'auto' does so on CUDA outside ZeRO-3 and FSDP for runs "
            "of 50 optimizer steps or more, where the compile (20-30 s once) pays for itself; 'cpp_wrapper' compiles "
            "as 'on' with the launch code in C++ (about a quarter off a host-bound training half; the first compile "
            "takes more than a minute longer from a cold cache). Never under ZeRO-3 on a GPU (there the compiled "
            "layers did not train as eager ones) or under FSDP (the log says so). See "
            "hf_grpo.training.compiled_layers."
        },
    )
    training_cuda_graphs: str = field(
        default="auto",
        metadata={
            "help": "off, auto or on. 'on' replays each training micro-batch's forward and backward from CUDA graphs "
            "captured per shape bucket, rows packed unless padding_free=False (one CUDA process, DeepSpeed "
            "ZeRO-1/2, DDP; not ZeRO-3, FSDP or a token budget; dense models, sdpa or eager attention); 'auto' "
            "does so where the run allows, activation checkpointing is on and the host is the bound, eagerly after "
            "a failed capture. See hf_grpo.training.graphs."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Let a fresh run start in an output_dir that holds another run's checkpoint-N directories, "
            "deleting them first. Without it such a run is refused (resume it with --resume_from_checkpoint). "
            "See docs/output_dirs.md."
        },
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={
            "help": "Token budget per forward/backward pass on each device (veRL's ppo_max_token_len_per_gpu): each "
            "micro-batch's completions are packed into passes of at most this many padded tokens, with the same "
            "gradient as one pass (see hf_grpo.memory.token_budget). None: one pass per micro-batch."
        },
    )

    # TRL 1.16 turns checkpointing on through this deprecated alias (default True), which transformers >= 5.23 then
    # warns about on every config: None here, and __post_init__ turns it on under the current name where neither is
    # given (hf_grpo.checkpointing). Still accepted: transformers takes it when activation_checkpointing is unset.
    gradient_checkpointing: bool | None = field(default=None, metadata={
        "help": "Deprecated alias of activation_checkpointing (transformers 5.23), still accepted.", "nargs": "?",
        "const": True})

    def __new__(cls, *args: Any, **kwargs: Any):
        # Remember which fields the caller set, so a preset never overrides one, whatever its value.
        config = super().__new__(cls)
        given = _EXPLICIT_FIELDS.get()
        if given is None:
            init_fields = [f.name for f in dataclasses.fields(cls) if f.init]
            given = frozenset(kwargs) | frozenset(init_fields[: len(args)])
        config._explicit_fields = given
        return config

    def __post_init__(self):
        if self.generation_backend not in BACKEND_NAMES:
            raise ValueError(
                f"generation_backend must be one of {BACKEND_NAMES}, got {self.generation_backend!r}"
            )
        check_generation_choices(self.generation_backend, self.use_vllm, self.use_transformers_continuous_batching,
                                 use_vllm_given="use_vllm" in self._explicit_fields)
        if self.generation_backend == "vllm":
            self.use_vllm = True
        validate_mirror_setting(self.zero3_generation_mirror)
        validate_mirror_setting(self.lora_generation_mirror, "lora_generation_mirror")
        validate_leaf_setting(self.zero3_leaf_modules)
        validate_compile_setting(self.compile_training)
        validate_decode_compile(self.compile_generation)
        validate_graphs_setting(self.training_cuda_graphs)
        validate_logprob_fields(self.old_logprobs_source, self.old_logprobs_tolerance,
                                self.sampler_importance_sampling_correction, self.use_vllm)
        cuda = cuda_probe()  # the machine, asked at most once: for use_cpu and bf16 left out, a launcher's bf16
        for name, value in device_fields_left_out(self._explicit_fields, self.fp16, cuda).items():
            setattr(self, name, value)
        fraction = self.auto_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"auto_memory_fraction must be a number in (0, 1], e.g. 0.9, got {fraction!r}")
        resolved = resolve_batch_fields({name: getattr(self, name) for name in BATCH_FIELDS},
                                        checkpointing.explicit_fields(self._explicit_fields), current_world_size())
        for name, value in resolved.items():
            setattr(self, name, value)
        checkpointing.fill_default(self)
        # a launcher's bf16 that this fp32 run on a CPU turns off: transformers sees "no" (distributed.launch_precision)
        self._launch_precision_dropped = launch_precision.decide(not (self.bf16 or self.fp16), cuda)
        with launch_precision.read_as("no" if self._launch_precision_dropped else None):
            super().__post_init__()
        check_token_budget(self)  # after TRL's checks: reads loss_type and the entropy settings

    # ---- the batch-size guide's API (hf_grpo's seed guide: "Batch Size Configuration Guide for DeepSpeed Training")
    @property
    def optimization(self) -> OptimizationView:
        """The guide's ``config.optimization.<field>`` view onto the flat fields (reads and writes them)."""
        return OptimizationView(self)

    def revalidate(self, world_size: int | None = None) -> None:
        """Re-derive and re-check the batch fields after writes through ``optimization`` (the trainer calls it)."""
        world_size = current_world_size() if world_size is None else world_size
        values = {name: getattr(self, name) for name in BATCH_FIELDS}
        values.update(preset=None, generation_batch_size=None)  # S stays; TRL's global rollout is re-derived
        resolved = resolve_batch_fields(values, set(BATCH_FIELDS), world_size)
        for name, value in resolved.items():
            if name not in ("preset", "generation_batch_size"):
                setattr(self, name, value)
        # TRL's meaning: the global rollout, per_device_train_batch_size x world size x steps_per_generation
        self.generation_batch_size = self.per_device_train_batch_size * world_size * self.steps_per_generation
        self._batch_fields_changed = False

    def batch_plan(self, world_size: int | None = None) -> BatchPlan:
        """The batch plan for ``world_size`` processes (default: this launch's)."""
        return BatchPlan.from_fields(vars(self), current_world_size() if world_size is None else world_size)


# ``config.optimization.<name>``: the guide's names for the flat fields (a field only some configs have, such as
# DiffuGRPOConfig's enable_profiling, is offered where the config has it).
OPTIMIZATION_FIELDS = {
    "per_device_train_batch_size": "per_device_train_batch_size",
    # the per-device chunk, as in the guide; not TRL's generation_batch_size (the global rollout, its meaning kept)
    "generation_batch_size": "per_device_generation_batch_size",
    "tensor_batch_size": "tensor_batch_size",
    "enable_gradient_checkpointing": "activation_checkpointing",
    "enable_mixed_precision": "bf16",
    "enable_profiling": "enable_profiling",
}


class OptimizationView:
    """``config.optimization``: the guide's names for the flat fields of a ``GRPOConfig`` (or a subclass).

    A write checks its own value at once (a positive integer, a bool); rules that tie several fields together are
    checked again when a trainer is built from the config (``GRPOConfig.revalidate``), since the guide sets the
    fields one at a time."""

    __slots__ = ("_config",)

    def __init__(self, config: GRPOConfig):
        object.__setattr__(self, "_config", config)

    def _fields(self) -> dict[str, str]:
        config = object.__getattribute__(self, "_config")
        return {name: flat for name, flat in OPTIMIZATION_FIELDS.items() if hasattr(config, flat)}

    def _flat(self, name: str) -> str:
        fields = self._fields()
        if name not in fields:
            raise AttributeError(f"config.optimization has no field {name!r}; it has {sorted(fields)}")
        return fields[name]

    def __dir__(self):
        return sorted(self._fields())

    def __repr__(self):
        return "OptimizationView(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self._fields()) + ")"

    def __getattr__(self, name: str) -> Any:
        flat = self._flat(name)
        config = object.__getattribute__(self, "_config")
        if name == "enable_mixed_precision":
            return bool(config.bf16 or config.fp16)
        return getattr(config, flat)

    def __setattr__(self, name: str, value: Any) -> None:
        flat = self._flat(name)
        config = object.__getattribute__(self, "_config")
        if name.startswith("enable_"):
            if not isinstance(value, bool):
                raise ValueError(f"config.optimization.{name} must be True or False, got {value!r}")
            if name == "enable_mixed_precision":
                if value and not _bf16_available():
                    logger.warning("enable_mixed_precision=True: no bf16-capable GPU here, training stays in fp32")
                config.bf16 = bool(value and _bf16_available())
                if not value:
                    config.fp16 = False
                return
            if name == "enable_gradient_checkpointing":
                checkpointing.set_checkpointing(config, value)
                return
            setattr(config, flat, value)
            return
        allow_none = name == "tensor_batch_size"
        if (value is None and not allow_none) or (value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1)):
            none = " or None (no chunking)" if allow_none else ""
            raise ValueError(f"config.optimization.{name} ({flat}) must be a positive integer{none}, got {value!r}")
        setattr(config, flat, value)
        config._batch_fields_changed = True


# The batch-size guide's factories; hf_grpo.diffusion builds the same three for DiffuGRPOConfig.
create_memory_optimized_config = preset_factory("memory", GRPOConfig)
create_balanced_config = preset_factory("balanced", GRPOConfig)
create_speed_optimized_config = preset_factory("speed", GRPOConfig)
