"""DiffuGRPOTrainer: diffu-GRPO (d1) for masked-diffusion LMs (LLaDA, Dream) on TRL 1.16, via hf_grpo.GRPOTrainer.

TRL computes GRPO's advantages, clipped ratio, KL (k3) and logging; this subclass changes what a
"log-probability" is and how completions are drawn. Overrides, each thin (written against trl 1.16.0):

- ``_generation_backend`` (hf_grpo's helper): the diffusion sampler (``hf_grpo.diffusion.sampler``),
  which hf_grpo's ``_generate_single_turn`` runs ``per_device_generation_batch_size`` prompts at a time
  inside one ``unwrap_model_for_generation`` (one ZeRO-3 gather per rollout). ``_generation_mirror`` and
  ``_compiled_training_layers`` (hf_grpo's helpers) keep the sampler on the live LoRA model and the forwards
  eager: the merged LoRA copy and the compiled layers serve causal decoders.
- ``_generate_and_score_completions``: TRL's, with its causal old/reference passes turned into free
  placeholders; then the rollout gets one mask seed per row and iteration (``mask_seeds`` [B, mu], CPU)
  and, where needed, the old and reference log-probs for **all** ``num_iterations`` seeds
  (``diffu_old_logps`` / ``diffu_ref_logps`` [B, mu, C]: batch-first so TRL's shuffle and split keep each
  row with its seeds). Old log-probs are computed exactly when TRL would compute them
  (``gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0``); otherwise the loss
  uses its own forward, detached, which under the same seed and weights is the same number.
- ``_compute_loss``: picks iteration ``k`` = the rollout pass this micro-batch belongs to
  (``(micro-step - first micro-step of the rollout) // steps_per_generation``: it counts rollout passes,
  not micro-batches, so every one of the mu seeds is used under gradient accumulation), selects
  ``[:, k]`` of the stored old/ref log-probs and hands the row seeds of iteration k, with the model
  (``SeededModel``, as TRL's loss's ``model``), to ``_get_per_token_logps_and_entropies``; the rest is TRL's loss.
- ``_get_per_token_logps_and_entropies``: the masked-diffusion estimate (``hf_grpo.diffusion.logprobs``)
  instead of the causal one, under the seeds that came with the model (TRL's no-grad passes in its rollout come
  without: placeholders), through ``chunked_logprobs`` with ``tensor_batch_size`` token rows, read from the
  run's sizes (``self.sizes``) at every call, as the sampler reads it at every rollout.
- ``_generate_single_turn`` and ``training_step``: only wrapped for per-phase memory figures.

On its first forward the trainer probes whether the model attends to padding whatever mask it is given
(the released LLaDA code, ``hf_grpo.diffusion.model.attends_to_padding``); if so, the sampler and the estimator
never pad a batch (docs/diffusion.md). The sampler is LLaDA's block sampler or Dream's own (``sampler``,
chosen by model family by default).

Public: ``get_performance_stats()`` adds ``memory_manager_stats`` and ``diffusion``; ``log`` adds ``mem/``
figures with ``log_memory_usage``.

The reference model is TRL's: a frozen copy loaded from the policy's path (full fine-tuning, ``beta > 0``)
or the PEFT base model with the adapter disabled. ``__init__`` adds what TRL cannot do for these models: a
policy built in code (no path to load a reference from) gets a deep copy as its frozen reference; a policy
given by name is loaded here (as TRL would) so that a remote-code model without ``GenerationMixin`` gets the
``generation_config`` TRL reads; activation checkpointing is turned off, with a warning, for a model that
does not implement it (LLaDA's remote code); fields written through ``config.optimization`` are re-checked.
Where the run differs from the config (no checkpointing; ``beta`` 0 for TRL's constructor where the reference is
built here), TRL and transformers get a shallow copy of it (``_run_config``): the user's object is never written.

Not done yet (GPU speed work): a block-prefix KV cache for the sampler (every step recomputes the prompt and
the finished blocks) and CUDA-graph capture of its fixed-shape step.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
from typing import Any

import torch
from transformers import GenerationConfig, TrainerCallback
from trl.trainer.utils import create_model_from_path, use_adapter

from .. import checkpointing
from ..distributed import prepare_process
from ..runtime import upstream
from ..generation.base import is_zero3_partitioned
from ..trainer import GRPOTrainer
from .config import DiffuGRPOConfig
from .logprobs import EstimatorSpec, masked_logprobs, rollout_mask_seeds
from .memory import MemoryTracker
from .model import (
    attends_to_padding,
    base_module,
    head_unsupported_reason,
    padding_style,
    resolve_logits_shift,
    resolve_mask_token_id,
)
from .sampler import DiffusionSampler, resolve_sampler
from .sampling_settings import SamplingSettings

logger = logging.getLogger("hf_grpo")


class _DiffusionPlanCallback(TrainerCallback):
    def __init__(self, trainer: DiffuGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plan = self.trainer.args.diffusion_plan(self.trainer.accelerator.num_processes)
            logger.info("hf-grpo diffusion plan (mask token %d, logits %s):\n%s", self.trainer.mask_token_id,
                        "shifted" if self.trainer.logits_shift else "unshifted", plan)


def _supports_checkpointing(model) -> bool:
    return bool(getattr(base_module(model), "supports_gradient_checkpointing", False))


def _loads_as_causal_lm(config) -> bool:
    """Whether ``AutoModelForCausalLM.from_pretrained`` can open a checkpoint with this config (as TRL's
    reference loader does)."""
    auto_map = getattr(config, "auto_map", None) or {}
    if auto_map:
        return "AutoModelForCausalLM" in auto_map
    return upstream.loads_as_causal_lm(config)


@dataclasses.dataclass(frozen=True)
class SeededModel:
    """The model of one loss pass with the mask seeds of its rows (``[B]``, CPU): what ``_compute_loss`` hands TRL's
    loss as its ``model``, which TRL passes on, as it is, to ``_get_per_token_logps_and_entropies`` (trl 1.16.0; its
    ``_compute_loss`` reads ``model`` nowhere else: tests/diffusion/test_diffu_trainer_inputs.py checks it)."""

    model: torch.nn.Module
    seeds: torch.Tensor


class DiffuGRPOTrainer(GRPOTrainer):
    """GRPO for masked-diffusion LMs; use it as ``hf_grpo.GRPOTrainer`` with ``args=DiffuGRPOConfig(...)``."""

    # its forwards score masked completions with its own estimator, not a causal head (hf_grpo.training.graphs)
    training_graphs_unavailable = "the diffusion trainer scores completions with its own estimator"

    def __init__(self, model, reward_funcs=None, args: DiffuGRPOConfig | None = None, **kwargs: Any):
        if not isinstance(args, DiffuGRPOConfig):
            got = "None" if args is None else f"{type(args).__module__}.{type(args).__name__}"
            raise TypeError(f"DiffuGRPOTrainer needs args=hf_grpo.DiffuGRPOConfig(...), got args={got}: the "
                            f"diffusion fields (block_length, diffusion_steps, p_mask_prompt, ...) live there")
        prepare_process(args)  # before a model is loaded by name here (GRPOTrainer's first step too; idempotent)
        if getattr(args, "_batch_fields_changed", False):
            args.revalidate()  # fields written through config.optimization are re-derived and checked here
        self._check_inputs(model, reward_funcs, args, kwargs.get("train_dataset"))  # before loading by name
        if isinstance(model, str):
            model = self._load(model, args, kwargs.get("quantization_config"))
            kwargs.pop("quantization_config", None)
        if getattr(model, "generation_config", None) is None:  # remote-code models without GenerationMixin
            model.generation_config = GenerationConfig(eos_token_id=getattr(model.config, "eos_token_id", None))
        self._padding_probed = False
        self._rollout_start_step = 0
        self._eval_rollouts = 0
        # (micro-step, iteration k, seed of the first row): the last few loss passes, for tests and debugging
        self.mask_seed_trace: collections.deque = collections.deque(maxlen=4096)
        frozen = self._in_code_reference(model, args, kwargs.get("peft_config"))
        super().__init__(model=model, reward_funcs=reward_funcs, args=self._run_config(args, model, frozen), **kwargs)
        if frozen is not None:  # TRL was told beta 0 (no reference to load): the run's beta and reference, here
            self.args.beta = self.beta = args.beta
            self.ref_model = self._prepare_reference(frozen)

        self.mask_token_id = resolve_mask_token_id(args.mask_token_id, self.model, self.processing_class)
        self.logits_shift = resolve_logits_shift(args.logits_shift, self.model)
        self.sampler_algorithm = resolve_sampler(args, self.model)
        reason = head_unsupported_reason(self.model)
        if reason is not None:
            logger.warning("the diffusion log-probs use full logits (%s): tensor_batch_size bounds only the "
                           "log-softmax, not the logits", reason)
        # d1 scores raw logits; TRL scores logits / temperature
        temperature = self.temperature if args.score_with_temperature and self.temperature > 0 else 1.0
        # no tensor_batch_size here: each estimate reads it from the run's sizes (settled at train start, halved
        # after an out-of-memory), as the sampler does (_estimate, _generation_backend)
        self.estimator = EstimatorSpec(
            mask_token_id=self.mask_token_id, pad_token_id=upstream.tokenizer(self).pad_token_id,
            completion_slots=args.max_completion_length, p_mask_prompt=args.p_mask_prompt,
            logits_shift=self.logits_shift, estimator=args.logprob_estimator, temperature=temperature,
            padding_style=padding_style(self.model),
        )
        self.memory = MemoryTracker(self.accelerator.device, args)
        self.add_callback(_DiffusionPlanCallback(self))

    @staticmethod
    def _run_config(args: DiffuGRPOConfig, model, frozen) -> DiffuGRPOConfig:
        """The config TRL and transformers are built with (``self.args`` after): the user's, or where this run
        differs from it a shallow copy (as ``RunSizes.published`` makes), so the user's object is never written."""
        unsupported = args.activation_checkpointing and not _supports_checkpointing(model)
        if unsupported:
            logger.warning("activation_checkpointing=True but %s does not support it; training without it",
                           type(base_module(model)).__name__)
        if not unsupported and frozen is None:
            return args
        run = copy.copy(args)
        if unsupported:
            checkpointing.set_checkpointing(run, False)  # what transformers' training loop and TRL read
        if frozen is not None:
            run.beta = 0.0  # TRL would load the reference from the (empty) path of an in-code model; set after init
        return run

    @staticmethod
    def _load(name: str, args: DiffuGRPOConfig, quantization_config=None):
        """Load the policy as TRL would, so a remote-code model can be fixed up before TRL touches it."""
        from accelerate.utils import set_seed

        set_seed(args.seed)
        init = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            init["quantization_config"] = quantization_config
        if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
            init["device_map"] = None
        init.setdefault("trust_remote_code", args.trust_remote_code)
        return create_model_from_path(name, **init)

    @staticmethod
    def _in_code_reference(model, args: DiffuGRPOConfig, peft_config):
        """A frozen deep copy of the policy where TRL cannot load the reference, or None (TRL builds it).

        TRL reloads the reference from the policy's path with ``AutoModelForCausalLM``. That fails for an
        in-code model (no path) and for a checkpoint whose ``auto_map`` registers ``AutoModel`` only (Dream);
        there the policy, just loaded and not yet trained, is copied instead."""
        from accelerate.utils import is_peft_model

        if args.beta == 0.0 or peft_config is not None or is_peft_model(model) or args.sync_ref_model:
            return None
        if upstream.name_or_path(model.config) and _loads_as_causal_lm(model.config):
            return None  # TRL loads the reference from this path, as for any policy
        if is_zero3_partitioned(model):
            raise ValueError(
                f"beta={args.beta} needs a reference model, and {type(model).__name__} cannot be reloaded through "
                "AutoModelForCausalLM (its auto_map registers AutoModel only) nor copied once ZeRO-3 has partitioned "
                "it: train with --use_peft (the reference is the base model), with beta 0, or under ZeRO-1/2")
        frozen = copy.deepcopy(model).eval()
        frozen.requires_grad_(False)
        return frozen

    def _prepare_reference(self, reference):
        """What TRL does to the reference it builds: no dropout, then DeepSpeed / FSDP / device placement."""
        from trl.models import prepare_deepspeed, prepare_fsdp
        from trl.trainer.utils import disable_dropout_in_model

        if self.args.disable_dropout:
            disable_dropout_in_model(reference)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(reference, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(reference, self.accelerator)
        return self.accelerator.prepare_model(reference, evaluation_mode=True)

    # ---- public ------------------------------------------------------------------------------
    def get_performance_stats(self) -> dict[str, Any]:
        """hf_grpo's figures plus ``memory_manager_stats`` (peak/current memory) and the sampler's settings."""
        stats = super().get_performance_stats()
        stats["memory_manager_stats"] = self.memory.stats()
        sampler = self.decisions.backend
        stats["diffusion"] = {
            "sampler_forwards": getattr(sampler, "forwards", 0),
            "mask_token_id": self.mask_token_id,
            "logits_shift": self.logits_shift,
            "logprob_estimator": self.estimator.estimator,
            "sampler": self.sampler_algorithm,
            "attends_to_padding": self.estimator.attends_to_padding,  # the probe's finding (False before it ran)
        }
        return stats

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.args.log_memory_usage and self.model.training and "loss" in logs:
            figures = self.memory.stats()
            logs.update({f"mem/{k}": v for k, v in figures.items() if isinstance(v, float)})
        super().log(logs, start_time)

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.memory.phase("train"):
            return super().training_step(model, inputs, num_items_in_batch)

    # ---- generation ------------------------------------------------------------------------------
    def _generation_backend(self, model: torch.nn.Module) -> DiffusionSampler:
        if self.decisions.backend is None:
            args = self.args
            settings = SamplingSettings(
                steps=args.diffusion_steps, block_length=args.block_length, remasking=args.remasking,
                cfg_scale=args.cfg_scale, block_cache=args.block_cache, forbid_mask_token=args.forbid_mask_token,
                sampler=self.sampler_algorithm, confidence_algorithm=args.confidence_algorithm,
                confidence_temperature=args.confidence_temperature, schedule_eps=args.schedule_eps,
            )
            self.decisions.backend = DiffusionSampler(
                settings, mask_token_id=self.mask_token_id, logits_shift=self.logits_shift,
                padding_style=self.estimator.padding_style, autocast=self.accelerator.autocast,
            )
            if self.accelerator.is_main_process:
                how = ("no KV cache: every step recomputes the row" if args.block_cache is None
                       else f"APPROXIMATE {args.block_cache} block cache")
                if self.sampler_algorithm == "dream":
                    how = f"Dream's diffusion_generate, {args.confidence_algorithm} confidence"
                logger.info("generation backend: diffusion sampler (%s)", how)
        self._probe_padding(model)
        if isinstance(self.decisions.backend, DiffusionSampler):
            self.decisions.backend.attends_to_padding = self.estimator.attends_to_padding
            self.decisions.backend.tensor_batch_size = self.sizes.tensor_batch_size  # as it stands at this rollout
        return self.decisions.backend

    def _probe_padding(self, model) -> None:
        """Once, on the first forward of any kind: find a model that attends to the padding it is told to hide
        (the released LLaDA code); the sampler and the estimator then never pad a batch (equal-length rows run
        together). Every rank runs it (a ZeRO-3 forward is collective) and gets the same answer."""
        if self._padding_probed:
            return
        self._padding_probed = True
        with torch.no_grad(), self.accelerator.autocast():
            attended = attends_to_padding(model, self.estimator.padding_style, self.mask_token_id,
                                          upstream.tokenizer(self).pad_token_id, self.accelerator.device)
        self.estimator.attends_to_padding = attended
        if attended and self.accelerator.is_main_process:
            logger.warning("%s attends to padding whatever mask it is given (as the released LLaDA modelling code "
                           "does): prompts of equal length are sampled and scored together, so no batch is padded "
                           "(more, smaller forwards where prompt lengths vary)", type(base_module(model)).__name__)

    def _generate_single_turn(self, *args, **kwargs):
        with self.memory.phase("generation"):
            return super()._generate_single_turn(*args, **kwargs)

    def _generation_mirror(self):
        # The sampler runs LoRA adapters as they are (merging serves the cuda_graph decoder only): of the
        # dense mirrors only ZeRO-3's applies.
        return super()._generation_mirror() if self.facts.zero3 else None

    def _compiled_training_layers(self, planned_steps: int):
        # The compiled layers were built and measured for causal decoders; the estimator's forwards stay eager.
        if self.args.compile_training == "on" and self.accelerator.is_main_process:
            logger.warning("compile_training='on' is not applied: the diffusion trainer's forwards run eager")
        return None

    # ---- rollout -----------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        output = super()._generate_and_score_completions(inputs)  # its causal old/ref passes: placeholders (below)
        output.pop("old_per_token_logps", None)
        output.pop("ref_per_token_logps", None)
        rows = output["prompt_ids"].size(0)
        iterations = self.num_iterations if training else 1
        first = self.accelerator.process_index * rows
        output["mask_seeds"] = rollout_mask_seeds(self.args.seed, self._rollout_key(training),
                                                  range(first, first + rows), iterations)
        generate_every = self.args.steps_per_generation * self.num_iterations
        need_old = training and self.args.gradient_accumulation_steps % generate_every != 0  # as TRL decides
        with torch.no_grad(), checkpointing.paused(self.model, checkpointing.rollout_kwargs(self.args)):
            if need_old:
                output["diffu_old_logps"] = self._all_seeds(self.model, output)
            if self.beta != 0.0:
                output["diffu_ref_logps"] = self._reference_logps(output)
        if training:
            self._rollout_start_step = upstream.micro_step(self)
        return output

    def _rollout_key(self, training: bool) -> str:
        """The global rollout index: micro-steps since the start (resume-safe: from the optimizer step count)."""
        if not training:
            self._eval_rollouts += 1
            return f"eval{self._eval_rollouts}"
        accumulation = self.args.gradient_accumulation_steps
        micro_step = self.state.global_step * accumulation + upstream.micro_step(self) % accumulation
        return str(micro_step // (self.args.steps_per_generation * self.num_iterations))

    def _reference_logps(self, output) -> torch.Tensor:
        if self.ref_model is not None:
            return self._all_seeds(self.ref_model, output)
        # PEFT: the base model with the adapter disabled (or TRL's frozen "ref" copy of a pretrained adapter)
        unwrapped = self.accelerator.unwrap_model(self.model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            return self._all_seeds(self.model, output)

    def _all_seeds(self, model, output) -> torch.Tensor:
        """``[B, mu, C]`` log-probs of the rollout's completions for each iteration's seeds (no grad)."""
        seeds = output["mask_seeds"]
        if self.estimator.seed_independent:  # nothing random in the masks: one estimate serves every seed
            once = self._estimate(model, output, seeds[:, 0], self.sizes.per_device_train_batch_size, False)[0]
            return once.unsqueeze(1).expand(-1, seeds.size(1), -1).contiguous()
        per_seed = [
            self._estimate(model, output, seeds[:, k], self.sizes.per_device_train_batch_size, False)[0]
            for k in range(seeds.size(1))
        ]
        return torch.stack(per_seed, dim=1)

    def _probe_score(self):
        """The autosize probes' training forward, with a mask seed for each row: any seeds cost the same memory."""
        def score(input_ids, attention_mask, logits_to_keep):
            seeded = SeededModel(self.model, torch.zeros(input_ids.size(0), dtype=torch.long))
            return self._get_per_token_logps_and_entropies(seeded, input_ids, attention_mask, logits_to_keep,
                                                           compute_entropy=True)
        return score

    def _estimate(self, model, batch, seeds, row_chunk, entropy: bool):
        self._probe_padding(model)
        spec = dataclasses.replace(self.estimator, tensor_batch_size=self.sizes.tensor_batch_size)
        with self.perf.phase("logprob"), self.memory.phase("logprob"):
            result = masked_logprobs(
                model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
                seeds, spec, row_chunk=row_chunk, return_entropy=entropy,
                unwrapped=self.accelerator.unwrap_model(model), autocast=self.accelerator.autocast,
            )
        return result if entropy else (result, None)

    # ---- loss --------------------------------------------------------------------------------------
    def _iteration_index(self) -> int:
        """The rollout pass of the current micro-batch: 0 .. num_iterations - 1."""
        passes = (upstream.micro_step(self) - self._rollout_start_step) // self.args.steps_per_generation
        return min(max(passes, 0), self.num_iterations - 1)

    def _compute_loss(self, model, inputs):
        k = self._iteration_index() if self.model.training else 0
        inputs = dict(inputs)
        seeds = inputs.pop("mask_seeds")
        old, ref = inputs.pop("diffu_old_logps", None), inputs.pop("diffu_ref_logps", None)
        if old is not None:
            inputs["old_per_token_logps"] = old[:, k]
        if ref is not None:
            inputs["ref_per_token_logps"] = ref[:, k]
        if self.model.training:
            self.mask_seed_trace.append((upstream.micro_step(self), k, int(seeds[0, k]) if len(seeds) else None))
        return super()._compute_loss(SeededModel(model, seeds[:, k]), inputs)  # the seeds go with the model

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        if not isinstance(model, SeededModel):  # no loss pass: no seeds
            if batch_size is not None and not torch.is_grad_enabled():
                # TRL's causal old/reference passes inside its rollout: placeholders, estimated for all seeds after it
                return input_ids.new_zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32), None, None
            raise RuntimeError("DiffuGRPOTrainer scores completions with a mask seed per row; "
                               "_get_per_token_logps_and_entropies was called outside _compute_loss")
        if any(value is not None for value in kwargs.values()):
            raise ValueError("DiffuGRPOTrainer scores text only; got multimodal inputs "
                             f"({sorted(k for k, v in kwargs.items() if v is not None)})")
        C = logits_to_keep
        batch = {"prompt_ids": input_ids[:, :-C], "prompt_mask": attention_mask[:, :-C],
                 "completion_ids": input_ids[:, -C:], "completion_mask": attention_mask[:, -C:]}
        logps, entropies = self._estimate(model.model, batch, model.seeds, batch_size, compute_entropy)
        return logps, entropies, None


# The batch-size guide's name: the same class.
ImprovedDiffuGRPOTrainer = DiffuGRPOTrainer
