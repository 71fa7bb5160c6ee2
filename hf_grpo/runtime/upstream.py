"""Every private name of TRL, transformers, accelerate, DeepSpeed and PEFT that hf-grpo reads, writes or calls.

None of these names is part of its library's public API, and any release may rename or drop one. Each is read here,
behind a small function that says the version it was read from, and nowhere else in ``hf_grpo``
(``tests/runtime/test_upstream.py`` enforces it with an ``ast`` scan of the package). ``NAMES`` lists them all, with
where each lives; the same test builds a real trainer, model and DeepSpeed engine and checks that every one still
exists, so that raising a pin fails there, naming the name, and not deep inside a training step.

The trainers' overrides of TRL's and transformers' private methods stay in ``hf_grpo/trainer.py`` and
``hf_grpo/diffusion/trainer.py`` (an override is the point of a subclass); ``OVERRIDDEN`` lists them, and
``tests/runtime/test_trl_signatures.py`` pins their signatures.

torch's own private names (``torch._dynamo``, ``Module._parameters``, DDP's ``_pre_forward``) are outside this
module: torch is pinned by the wheels it ships with, not by a range the trainer subclasses.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# The versions the names below were read from (pyproject.toml pins the ranges).
TRL = "trl 1.16.0"
TRANSFORMERS = "transformers 5.25.0"
ACCELERATE = "accelerate 1.16.0"
DEEPSPEED = "deepspeed 0.19.8"
PEFT = "peft 0.21.2"


class Name(NamedTuple):
    """One private name: the library version it was read from, the object that carries it, the name."""

    version: str
    owner: str  # what tests/runtime/test_upstream.py checks it on
    name: str


NAMES: tuple[Name, ...] = (
    # trl.GRPOTrainer's instance attributes and methods
    Name(TRL, "trainer", "_tokenizer"),
    Name(TRL, "trainer", "_step"),
    Name(TRL, "trainer", "_buffered_inputs"),
    Name(TRL, "trainer", "_metrics"),
    Name(TRL, "trainer", "_dist"),
    Name(TRL, "trainer", "_entropy_bonus_enabled"),
    Name(TRL, "trl.GRPOTrainer", "_tokenize_prompts"),
    Name(TRL, "trl.GRPOTrainer", "_compute_loss"),
    # transformers' Trainer
    Name(TRANSFORMERS, "trainer", "_train_batch_size"),
    Name(TRANSFORMERS, "trainer", "_get_output_dir"),
    Name(TRANSFORMERS, "trainer", "_load_from_checkpoint"),
    Name(TRANSFORMERS, "trainer", "_load_optimizer_and_scheduler"),
    Name(TRANSFORMERS, "trainer", "_load_scaler"),
    # transformers' models and configs
    Name(TRANSFORMERS, "config", "_attn_implementation"),
    Name(TRANSFORMERS, "config", "_attn_implementation_internal"),
    Name(TRANSFORMERS, "config", "_name_or_path"),
    Name(TRANSFORMERS, "model", "_can_compile_fullgraph"),
    Name(TRANSFORMERS, "model", "_no_split_modules"),
    Name(TRANSFORMERS, "model", "_prepare_generation_config"),
    Name(TRANSFORMERS, "checkpointed decoder layer", "_gradient_checkpointing_func"),
    Name(TRANSFORMERS, "transformers.AutoModelForCausalLM", "_model_mapping"),
    # accelerate
    Name(ACCELERATE, "accelerator.gradient_state", "_set_sync_gradients"),
    # DeepSpeed: the engine, its ZeRO-1/2 optimizer and parameters, its op registry (several without an underscore,
    # internal all the same: UNPREFIXED below)
    Name(DEEPSPEED, "engine", "_backward_prologue"),
    Name(DEEPSPEED, "engine", "_backward_prologue_per_tensor"),
    Name(DEEPSPEED, "ZeRO-1/2 optimizer", "bit16_groups"),
    Name(DEEPSPEED, "ZeRO-1/2 optimizer", "single_partition_of_fp32_groups"),
    Name(DEEPSPEED, "ZeRO-1/2 parameter", "_hp_mapping"),
    *(Name(DEEPSPEED, "ZeRO-1/2 optimizer", name) for name in (
        "check_grad_overflow", "compute_grad_norm", "cpu_offload", "has_moe_layers", "model_parallel_world_size",
        "zenflow", "check_overflow", "overflow")),
    Name(DEEPSPEED, "ZeRO-3 parameter", "ds_tensor"),
    Name(DEEPSPEED, "ZeRO-3 parameter", "ds_status"),
    Name(DEEPSPEED, "ZeRO-3 parameter", "all_gather"),
    Name(DEEPSPEED, "ZeRO-3 parameter offload", "_remove_module_hooks"),
    Name(DEEPSPEED, "ZeRO-3 parameter offload", "forward_hooks"),
    Name(DEEPSPEED, "ZeRO-3 parameter offload", "backward_hooks"),
    Name(DEEPSPEED, "deepspeed.ops", "__compatible_ops__"),
    Name(DEEPSPEED, "deepspeed.runtime.utils", "register_output_backward_hooks"),
    Name(DEEPSPEED, "deepspeed.runtime.base_optimizer", "ZeROOptimizer"),
    Name(DEEPSPEED, "ZeRO optimizer", "clear_backward_seen_flag"),
    # PEFT: the flags its ``disable_adapter`` sets (the model's since peft 0.18)
    Name(PEFT, "PEFT adapter layer", "_disable_adapters"),
    Name(PEFT, "PEFT model", "_adapters_disabled"),
)

# DeepSpeed internals named without a leading underscore: the package's scan forbids them outside this module too.
UNPREFIXED = tuple(n.name for n in NAMES if not n.name.startswith("_") or n.name.startswith("__"))

# The private methods of trl.GRPOTrainer and transformers' Trainer that hf-grpo's trainers override (and call
# through ``super()``); their signatures are pinned in tests/runtime/test_trl_signatures.py.
OVERRIDDEN = (
    "_calculate_rewards",  # GRPOTrainer
    "_compute_loss",  # DiffuGRPOTrainer (hands TRL's its model with the pass's mask seeds; see its SeededModel)
    "_generate_and_score_completions",  # both
    "_generate_single_turn",  # both
    "_get_per_token_logps_and_entropies",  # both
    "_init_training_state",  # GRPOTrainer (wrapped: hf_grpo.checks.resume)
    "_prepare_for_training",  # GRPOTrainer
    "_prepare_inputs",  # GRPOTrainer
    "_save_checkpoint",  # GRPOTrainer
    "_save_rng_state",  # GRPOTrainer
    "_tokenize_prompts",  # GRPOTrainer
)


# ---- trl.GRPOTrainer (trl 1.16.0) ------------------------------------------------------------------------------
def tokenizer(trainer) -> Any:
    """The text tokenizer TRL took from ``processing_class`` (a processor's ``.tokenizer``); None before TRL's
    ``__init__`` has set it (trl 1.16.0: ``GRPOTrainer._tokenizer``)."""
    return getattr(trainer, "_tokenizer", None)


def micro_step(trainer) -> int:
    """The training micro-batches TRL has prepared so far; ``micro_step % steps_per_generation`` is the index of the
    next one in the buffered rollout (trl 1.16.0: ``GRPOTrainer._step``)."""
    return trainer._step


def buffered_inputs(trainer) -> list | None:
    """The current rollout, split by TRL into its micro-batches (trl 1.16.0: ``GRPOTrainer._buffered_inputs``)."""
    return trainer._buffered_inputs


def set_buffered_inputs(trainer, micro_batches: list) -> None:
    """Replace the current rollout's micro-batches (trl 1.16.0: ``GRPOTrainer._buffered_inputs``)."""
    trainer._buffered_inputs = micro_batches


def metrics(trainer, mode: str) -> dict[str, list]:
    """TRL's metric lists of ``mode`` ("train" or "eval"), averaged into its next log (trl 1.16.0:
    ``GRPOTrainer._metrics``)."""
    return trainer._metrics[mode]


def summon_full_params(trainer):
    """TRL's context that gathers FSDP's full parameters for generation, a no-op otherwise (trl 1.16.0:
    ``GRPOTrainer._dist``, a ``DistributedBackend``)."""
    return trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False)


def entropy_bonus_enabled(trainer) -> bool:
    """Whether TRL's loss reads each token's entropy for its entropy bonus (trl 1.16.0:
    ``GRPOTrainer._entropy_bonus_enabled``)."""
    return bool(trainer._entropy_bonus_enabled)


def trl_tokenize_prompts(trainer, prompts) -> Any:
    """TRL's own tokenization of ``prompts``, past any override (trl 1.16.0: ``GRPOTrainer._tokenize_prompts``)."""
    import trl

    return trl.GRPOTrainer._tokenize_prompts(trainer, prompts)


def replaces_trl_loss(cls: type) -> bool:
    """Whether ``cls`` computes its loss otherwise than TRL (trl 1.16.0: ``GRPOTrainer._compute_loss``)."""
    import trl

    return cls._compute_loss is not trl.GRPOTrainer._compute_loss


# ---- transformers' Trainer (transformers 5.25.0) ---------------------------------------------------------------
def set_train_batch_size(trainer, size: int) -> None:
    """The per-device batch transformers' training loop sizes its dataloader with (transformers 5.25.0:
    ``Trainer._train_batch_size``)."""
    trainer._train_batch_size = size


def checkpoint_output_dir(trainer, trial) -> str:
    """The directory transformers saves this run's checkpoints under (transformers 5.25.0:
    ``Trainer._get_output_dir``)."""
    return trainer._get_output_dir(trial=trial)


def load_weights(trainer, checkpoint: str) -> None:
    """A checkpoint's weights into the model (transformers 5.25.0: ``Trainer._load_from_checkpoint``)."""
    trainer._load_from_checkpoint(checkpoint)


def load_optimizer_and_scheduler(trainer, checkpoint: str) -> None:
    """A checkpoint's optimizer and learning-rate schedule (transformers 5.25.0:
    ``Trainer._load_optimizer_and_scheduler``)."""
    trainer._load_optimizer_and_scheduler(checkpoint)


def load_scaler(trainer, checkpoint: str) -> None:
    """A checkpoint's gradient scaler (transformers 5.25.0: ``Trainer._load_scaler``)."""
    trainer._load_scaler(checkpoint)


# ---- transformers' models and configs (transformers 5.25.0) ----------------------------------------------------
def attention_implementation(config) -> str | None:
    """The attention implementation the model was loaded with, or None for an object without one (transformers
    5.25.0: ``PretrainedConfig._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config, name: str) -> None:
    """Set the attention implementation a model built from ``config`` uses (transformers 5.25.0:
    ``PretrainedConfig._attn_implementation``)."""
    config._attn_implementation = name


def attention_internal(config) -> str | None:
    """The attention implementation as stored, without the resolution the property does (transformers 5.25.0:
    ``PretrainedConfig._attn_implementation_internal``)."""
    return getattr(config, "_attn_implementation_internal", None)


def set_attention_internal(config, name: str | None) -> None:
    """Route a built model's attention through the registered function ``name`` (transformers 5.25.0:
    ``PretrainedConfig._attn_implementation_internal``; each layer reads it at every forward)."""
    config._attn_implementation_internal = name


def name_or_path(config) -> str:
    """The path or hub name the model was loaded from; empty for a model built in code (transformers 5.25.0:
    ``PretrainedConfig._name_or_path``)."""
    return getattr(config, "_name_or_path", "") or ""


def set_name_or_path(config, value: str) -> None:
    """Where the model's weights can be loaded from (transformers 5.25.0: ``PretrainedConfig._name_or_path``;
    TRL loads the reference model from it)."""
    config._name_or_path = value


def can_compile_fullgraph(model) -> bool:
    """Whether the model's class supports static-cache fullgraph decoding (transformers 5.25.0:
    ``PreTrainedModel._can_compile_fullgraph``)."""
    return bool(getattr(model, "_can_compile_fullgraph", False))


def no_split_modules(module) -> tuple[str, ...]:
    """The class names transformers keeps whole when it splits a model over devices (transformers 5.25.0:
    ``PreTrainedModel._no_split_modules``)."""
    return tuple(getattr(module, "_no_split_modules", None) or ())


def generation_config_preparer(model):
    """transformers' merge of a ``GenerationConfig`` with the model's own and its defaults, or None for a model
    without one (transformers 5.25.0: ``GenerationMixin._prepare_generation_config``)."""
    return getattr(model, "_prepare_generation_config", None)


def checkpoint_function(layer):
    """The checkpoint function ``activation_checkpointing_enable`` gave a decoder layer (transformers 5.25.0:
    ``GradientCheckpointingLayer._gradient_checkpointing_func``)."""
    return layer._gradient_checkpointing_func


def loads_as_causal_lm(config) -> bool:
    """Whether ``AutoModelForCausalLM`` maps ``config``'s class to a model (transformers 5.25.0:
    ``AutoModelForCausalLM._model_mapping``)."""
    from transformers import AutoModelForCausalLM

    return type(config) in AutoModelForCausalLM._model_mapping


# ---- accelerate (accelerate 1.16.0) ----------------------------------------------------------------------------
def set_sync_gradients(gradient_state, value: bool) -> None:
    """Whether this backward ends the accumulation (DDP all-reduces, DeepSpeed steps) (accelerate 1.16.0:
    ``GradientState._set_sync_gradients``)."""
    gradient_state._set_sync_gradients(value)


# ---- DeepSpeed (deepspeed 0.19.8) ------------------------------------------------------------------------------
def reset_backward_seen(engine) -> None:
    """What ``DeepSpeedEngine.forward`` resets on a ZeRO optimizer before the module runs (deepspeed 0.19.8:
    ``ZeROOptimizer.clear_backward_seen_flag``, from ``deepspeed.runtime.base_optimizer``)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(engine.optimizer, ZeROOptimizer) and hasattr(engine.optimizer, "clear_backward_seen_flag"):
        engine.optimizer.clear_backward_seen_flag()


def hook_engine_outputs(engine, outputs) -> None:
    """The hooks ``DeepSpeedEngine.forward`` puts on its outputs, which start ``engine.backward``'s bookkeeping;
    nothing where this DeepSpeed has none (before 0.18.5) (deepspeed 0.19.8: ``runtime.utils``'s function with the
    engine's ``_backward_prologue`` and ``_backward_prologue_per_tensor``)."""
    try:
        from deepspeed.runtime.utils import register_output_backward_hooks as register
    except ImportError:  # engine.backward starts the backward itself
        return
    register(outputs, preprocess_once_fn=engine._backward_prologue,
             preprocess_per_tensor_fn=engine._backward_prologue_per_tensor)


def zero_parameter_groups(zero_optimizer) -> list[list] | None:
    """A ZeRO-1/2 optimizer's parameter groups (the model's 16-bit parameters), or None for another optimizer
    (deepspeed 0.19.8: ``DeepSpeedZeroOptimizer.bit16_groups``)."""
    return getattr(zero_optimizer, "bit16_groups", None)


def zero_fp32_partition(zero_optimizer, group: int):
    """This rank's flat fp32 partition of parameter group ``group`` (deepspeed 0.19.8:
    ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups``)."""
    return zero_optimizer.single_partition_of_fp32_groups[group]


def zero_overflow_facts(zero_optimizer) -> dict[str, bool] | None:
    """What decides whether a ZeRO-1/2 optimizer's global-norm check finds every non-finite gradient, or None for
    another optimizer (deepspeed 0.19.8: ``DeepSpeedZeroOptimizer.check_grad_overflow``, ``compute_grad_norm``,
    ``cpu_offload``, ``has_moe_layers``, ``model_parallel_world_size``, ``zenflow``)."""
    if type(zero_optimizer).__name__ != "DeepSpeedZeroOptimizer":
        return None
    o = zero_optimizer
    return {"check_grad_overflow": o.check_grad_overflow, "compute_grad_norm": o.compute_grad_norm,
            "cpu_offload": o.cpu_offload, "has_moe_layers": o.has_moe_layers,
            "model_parallel": o.model_parallel_world_size > 1, "zenflow": o.zenflow}


def set_zero_overflow_search(zero_optimizer, search) -> None:
    """Replace, on the instance, the gradient-by-gradient search for a non-finite gradient that ``step`` runs before
    the global norm (deepspeed 0.19.8: ``DeepSpeedZeroOptimizer.check_overflow``, which sets ``overflow``)."""
    zero_optimizer.check_overflow = search


def zero_fragment(param) -> tuple[Any, Any] | None:
    """Where this rank's part of a ZeRO-1/2 parameter lies: ``(address in the parameter, address in the flat fp32
    partition)``, each with ``start`` and ``numel``; None when no part of it is this rank's (deepspeed 0.19.8:
    ``param._hp_mapping``, a ``tensor_fragment``)."""
    mapping = param._hp_mapping
    return None if mapping is None else (mapping.lp_fragment_address, mapping.hp_fragment_address)


def zero3_partition(param):
    """A ZeRO-3 parameter's own partition (this rank's flat slice of it), or None for another parameter
    (deepspeed 0.19.8: ``param.ds_tensor``)."""
    return getattr(param, "ds_tensor", None)


def zero3_gathering(engine):
    """What holds a ZeRO-3 engine's gathering hooks: its optimizer's ``parameter_offload``, or an engine built
    without an optimizer (TRL's reference) the ``DeepSpeedZeRoOffload`` it has in its place; None for another engine
    (deepspeed 0.19.8)."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if hasattr(offload, "_remove_module_hooks") else None


def remove_zero3_gathering_hooks(offload) -> int:
    """Remove the fetch and release hooks ZeRO-3 put on every submodule (around its forward and its backward) and on
    the model; returns how many submodule hooks there were (deepspeed 0.19.8: ``DeepSpeedZeRoOffload``'s
    ``_remove_module_hooks``, ``forward_hooks`` and ``backward_hooks``; TRL's ``remove_hooks`` empties them too)."""
    count = len(offload.forward_hooks) + len(offload.backward_hooks)
    offload._remove_module_hooks()
    offload.forward_hooks, offload.backward_hooks = [], []
    return count


def released_zero3(params) -> list:
    """The ZeRO-3 parameters of ``params`` that are released (their data empty until gathered) (deepspeed 0.19.8:
    ``param.ds_status`` ``NOT_AVAILABLE``)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]


def gather_zero3(params: list) -> None:
    """Gather released ZeRO-3 parameters, kept gathered until DeepSpeed releases them (deepspeed 0.19.8: the
    parameter's ``all_gather``; with one process it points each at its partition, no copy)."""
    if params:
        params[0].all_gather(param_list=params)


def compatible_ops() -> dict[str, bool]:
    """DeepSpeed's own record of which ops this machine can build, by name; written to skip one (deepspeed 0.19.8:
    ``deepspeed.ops.__compatible_ops__``)."""
    import deepspeed.ops

    return deepspeed.ops.__compatible_ops__


# ---- PEFT (peft 0.21.2) --------------------------------------------------------------------------------------
def adapters_disabled(layer) -> bool:
    """Whether an adapter layer (or a trained-module wrapper) runs as its base module (peft 0.21.2:
    ``BaseTunerLayer._disable_adapters``, ``AuxiliaryTrainingWrapper._disable_adapters``)."""
    return layer._disable_adapters


def set_adapters_disabled(layer, value: bool) -> None:
    """That flag set alone, where PEFT's ``enable_adapters`` also sets the adapters' ``requires_grad`` (peft 0.21.2:
    ``BaseTunerLayer._disable_adapters``)."""
    layer._disable_adapters = value


def model_adapters_disabled(model) -> bool | None:
    """The PEFT model's own record that ``disable_adapter`` is on, or None for a peft without it (peft 0.21.2:
    ``PeftModel._adapters_disabled``; not in 0.17)."""
    return vars(model).get("_adapters_disabled")


def set_model_adapters_disabled(model, value: bool | None) -> None:
    """Set that record, where the model keeps one (peft 0.21.2: ``PeftModel._adapters_disabled``)."""
    if value is not None and "_adapters_disabled" in vars(model):
        model._adapters_disabled = value
