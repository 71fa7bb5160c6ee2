"""GRPOTrainer: TRL's trainer with chunked generation, chunked log-probs and performance stats.

Every override of TRL's and transformers' methods is here, written against trl 1.16.0 (pyproject pins
``trl>=1.16,<1.17``; ``tests/runtime/test_trl_signatures.py`` pins their signatures; the other private names of TRL and
transformers it reads go through ``hf_grpo.runtime.upstream``). Each is thin and calls the original:

- ``_generate_single_turn``: the plain (text-only, no vLLM) path is served by a ``hf_grpo.generation`` backend,
  ``per_device_generation_batch_size`` prompts at a time inside one ``unwrap_model_for_generation``, or from a
  dense mirror under ZeRO-3 or with a LoRA policy's adapters merged (``generation.dense_mirror``, ``lora_merge``).
- ``compute_loss`` (public): token-budget passes (``memory.token_budget``); in one process the backward runs here,
  so an out-of-memory in it can be retried (``memory.train_backoff``).
- ``_generate_and_score_completions``: TRL's with its switches made quick (``training.scoring_switches``); corrected.
- ``_calculate_rewards``: timed; unscored completions counted, infinite rewards made unscored (``checks.unscored``).
  ``_get_per_token_logps_and_entropies``: timed; no-grad scoring chunks of ``token_budget.scoring_rows``; the
  models' ``forward`` runs the log-softmax ``tensor_batch_size`` rows at a time (``hf_grpo.logprob_head``); the old
  policy's pass answered by, or measured against, the sampler's log-probs (``training.rollout_logprobs``).
- ``_prepare_inputs``: ZeRO-3's hooks removed with one process (``zero3_one_process``), TRL's, then a prompt's rows
  in the same micro-batches where the gradient stays the same (``training.prompt_groups``). ``_tokenize_prompts``:
  TRL's, then prompts of no token or past the model's positions refused (``checks.prompts``); it sizes caches.
- ``training_step`` (time; compiled layers, ``training.compiled_layers``), ``log`` (``perf/``), and
  ``create_accelerator_and_postprocess`` (ZeRO-3's leaves or hooks), ``_save_rng_state`` (sizes and every rank's random
  state, before rank 0 marks a checkpoint complete), ``_save_checkpoint`` (a failed save named,
  ``checks.checkpoint_save``), ``_prepare_for_training`` (a checkpoint without ZeRO state, ``plain_to_zero``),
  ``_init_training_state`` (no epoch for a finished run, ``checks.resume``).
- ``train``: holds the output directory (``checks.output_lock``), refuses what ``checks.resume`` refuses, a token
  budget the longest prompt cannot fit and (at train begin) a completion length memory cannot fit
  (``memory.context_fit``), and settles "auto" sizes (``memory.autosize``).

``__init__`` sets up the process (``prepare_process``), checks the inputs (``checks.inputs``, ``checks.prompts``),
copies a policy built in code for TRL's reference (``reference_copy``), routes the policy through batch-invariant ops
for ``true_on_policy``, adds the run's files (``run_files``) and builds what helpers read (``run_state``: ``facts``,
``sizes``, ``decisions``). An out-of-memory chunk is halved on every rank (``memory.oom``); work counted (``flops``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any

import torch
import trl
from trl.models import unwrap_model_for_generation

from .training import compiled_layers as training_compile, eager_packing, graphs as training_graphs
from .training import lora_forward, prompt_groups, rollout_logprobs, scoring_switches, true_on_policy
from .checks import checkpoint_save, inputs as checks, output_lock, prompts as prompt_checks, resume, unscored
from .config import GRPOConfig
from .distributed import deepspeed_timers, plain_to_zero, prepare_process, zero3_leaves, zero3_one_process
from .distributed import zero_overflow
from .generation import GenerationBackend, backend_counts, compile_workers, decode_compile, dense_mirror, open_backend
from .generation.lora_merge import InPlaceLoraMerge
from .logprob_head import install_chunked_lm_head
from .memory import autosize, context_fit, prompt_lengths, token_budget, train_backoff
from .memory.device_rates import device_rates
from .memory.flops import WorkCounter
from .memory.oom import BACKOFF_FIELDS, SizeKnob, generate_with_backoff
from .memory.stats import PerformanceStats
from . import checkpointing, reference_copy, run_files
from .plan import BatchPlan
from .run_callbacks import RunCallbacks
from .run_state import RunDecisions, RunFacts, RunSizes, is_moe
from .runtime import collectives, upstream
from .training.cudnn_attention import cudnn_attention

logger = logging.getLogger("hf_grpo")


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose memory is set by ``hf_grpo.GRPOConfig``'s per-device sizes.

    Use it as TRL's trainer: ``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
    train_dataset=...)``. ``get_performance_stats()`` returns peak memory, time per phase and
    tokens/s; the same figures are logged under ``perf/``.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        checks.check_config_type(config, GRPOConfig)
        prepare_process(config)  # the process's setup the config leaves out: launcher watch, launch precision
        if getattr(config, "_batch_fields_changed", False):
            config.revalidate()  # fields written through config.optimization (the guide's API) are re-checked here
        self._check_inputs(*args, **kwargs)
        # inductor's compile workers boot while TRL sets up (reference, accelerator, data), not at the first rollout
        model = kwargs.get("model", args[0] if args else None)
        compile_workers.start_early(config, model)
        # a policy built in code: TRL loads the reference model (beta > 0) from a copy of it (hf_grpo.reference_copy)
        with reference_copy.reference_loadable(model, config.beta, kwargs.get("peft_config")):
            super().__init__(*args, **kwargs)
        checks.check_reward_outputs(self)
        self._position_limit = prompt_checks.check_loaded(  # the tokenizer, the prompts (an environment's: per rollout)
            upstream.tokenizer(self), self.model, self.max_completion_length, self.train_dataset,
            None if self.environment_factories else functools.partial(upstream.trl_tokenize_prompts, self))
        # what helpers read of the run: facts fixed now, the sizes as they change, what is decided once (run_state)
        self.facts, self.sizes, self.decisions = self._run_facts(), RunSizes.from_config(self.args), RunDecisions()
        token_budget.check_run(self.facts, self.sizes.max_tokens_per_micro_batch)
        self.perf = PerformanceStats(self.accelerator.device)
        # chunk sizes halved on every rank after an out-of-memory, and kept so (hf_grpo.memory.oom)
        self._oom_knobs = {name: SizeKnob(self.sizes, name, lambda *_: self.perf.add("oom_backoffs", 1))
                           for name in BACKOFF_FIELDS}
        # a training micro-batch's out-of-memory: retried in token-budget passes, where that is safe (one process)
        self._train_backoff_unavailable = train_backoff.reason_unavailable(self.args, self.facts)
        self._train_backoff = None if self._train_backoff_unavailable else train_backoff.MicroBatchBackoff(
            self._oom_knobs[token_budget.FIELD], self.loss_type, self.accelerator,
            lambda: self.model.zero_grad(set_to_none=True), lambda: upstream.metrics(self, "train"), self._longest_row)
        policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.work = WorkCounter(policy, recompute=self.facts.activation_checkpointing)  # (memory.flops)
        # packed or padded: the user's padding_free, else chosen once the sizes are settled (eager_packing)
        self.decisions.eager_rows = eager_packing.Choice(False, "chosen at train begin")
        packed_rows = ((lambda: self.decisions.eager_rows.packed) if self.args.padding_free is None
                       else self.args.padding_free)
        head = dict(temperature=self.temperature, chunk_rows=self._oom_knobs["tensor_batch_size"],
                    cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32, padding_free_rows=packed_rows)
        self.decisions.chunked_head = install_chunked_lm_head(policy, return_entropy=True, **head)
        # LoRA layers on the fused forward (not where ZeRO-3 or FSDP gathers the adapters' weights by module hooks)
        fused = self.args.lora_fused_forward and self.facts.sharding is None
        self.decisions.lora_fused_layers = lora_forward.install(policy) if fused else 0
        true_on_policy.install(policy, self.args, self.facts)
        if self.ref_model is not None:
            # TRL has already wrapped the reference (a DeepSpeed engine under ZeRO): the module inside is patched
            reference = self.accelerator.unwrap_model(self.ref_model)
            install_chunked_lm_head(reference, return_entropy=False, **head)
        self._sampled = rollout_logprobs.RolloutLogprobs.for_run(  # the sampler's log-probs: measured, used
            self.args, self.generation_config, self.tools or self.environment_factories)
        self.add_callback(RunCallbacks(self._begin_run, lambda: self.perf))
        run_files.add_run_files(self)  # metrics.jsonl and performance.json, for library scripts as for recipes
        self.add_callback(autosize.SaveSizesCallback(self.sizes, self.max_completion_length))

    # ---- public ------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """transformers', then the DeepSpeed config set before DeepSpeed wraps the policy and TRL the reference: its
        timer without device waits (``deepspeed_timers``), ZeRO-3's leaf modules or hooks (``zero3_one_process``)."""
        super().create_accelerator_and_postprocess()
        config = getattr(getattr(self.accelerator.state, "deepspeed_plugin", None), "deepspeed_config", None)
        deepspeed_timers.unsynchronized(config, self.accelerator.is_main_process)
        self.zero3_hooks_removed, self.zero3_leaf_marking = zero3_one_process.configure(  # (no marking: not ZeRO-3)
            config, self.model, self.accelerator.num_processes, self.args, self.accelerator.is_main_process)

    def batch_plan(self):
        """The batch plan with this run's real world size (and ZeRO-3's generation mirror, once decided)."""
        mirror = getattr(self.decisions.mirror, "plan_fields", dict)()  # (none decided: no fields)
        fields = {**vars(self.args), **self.sizes.plan_fields(), **mirror}
        if (leaves := self.zero3_leaf_marking).count:
            fields.update(leaf_module_classes=leaves.classes, leaf_module_count=leaves.count)
        return BatchPlan.from_fields(fields, self.accelerator.num_processes)

    def get_performance_stats(self) -> dict[str, Any]:
        """Peak memory, seconds per optimizer step by phase, tokens/s, decoder compiles and captures, the memory the
        generation backend keeps between rollouts, the batch plan, and on a GPU each phase's efficiency."""
        gib = getattr(self.decisions.backend, "cache_bytes", lambda: 0)() / 2**30
        stats = {**self.perf.summary(), "generation_cache_gib": gib, "batch_plan": self.batch_plan().to_dict()}
        if self.decisions.mirror is not None and self.decisions.mirror.mirror is not None:
            stats["mirror_refresh_s"] = self.perf.total("mirror_refresh_s")  # whole run, inside generation
        return stats

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # one writer per output_dir: refused while another run holds it (hf_grpo.checks.output_lock)
        with output_lock.held_for_run(self.args.output_dir, self.accelerator):
            return self._train_checked(resume_from_checkpoint, *args, **kwargs)

    def _train_checked(self, resume_from_checkpoint=None, *args, **kwargs):
        # another run's checkpoints, an incomplete checkpoint, a launch shape that cannot read it: refused
        # (hf_grpo.checks.resume); True becomes the newest complete checkpoint
        checkpoint = resume.checkpoint_to_resume(self, resume_from_checkpoint)
        # no per-shape cuDNN kernel builds (hf_grpo.training.cudnn_attention), in the "auto" probes as in training
        with cudnn_attention(self.args.cudnn_attention):
            token_budget.check_longest_row(self.sizes.max_tokens_per_micro_batch, self.max_completion_length,
                                           self._longest_prompt)  # before any probe or step
            # "auto" sizes are settled before TRL and transformers size the dataloader and the accumulation
            if self._settle_sizes(checkpoint):
                self.perf = PerformanceStats(self.accelerator.device)  # the probes are not part of the run's figures
            if self._train_backoff is None and self.accelerator.is_main_process:
                logger.info("an out-of-memory in a training micro-batch will end the run (no retry: %s)",
                            self._train_backoff_unavailable)
            return super().train(checkpoint, *args, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if not plain_to_zero.applies(resume_from_checkpoint, self.is_deepspeed_enabled):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        # a checkpoint without ZeRO state under ZeRO-1/2: weights before DeepSpeed, optimizer into its partitions
        upstream.load_weights(self, resume_from_checkpoint)  # (before DeepSpeed builds its fp32 master copy)
        prepared = super()._prepare_for_training(max_steps, train_dataloader, None)
        plain_to_zero.load_optimizer_state(self.model_wrapped, resume_from_checkpoint, self.accelerator.is_main_process)
        if plain_to_zero.has_schedule(resume_from_checkpoint, self.accelerator.is_main_process):
            upstream.load_optimizer_and_scheduler(self, resume_from_checkpoint)  # the schedule (DeepSpeed leaves it)
        upstream.load_scaler(self, resume_from_checkpoint)
        return prepared

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        # Ours too, before rank 0 marks the checkpoint complete (trainer_state.json, written next): the sizes a
        # resume reads (hf_grpo.memory.autosize), and every rank's random state (hf_grpo.distributed.rng_files).
        if self.args.should_save:
            autosize.save_sizes(self.sizes, self.max_completion_length, output_dir)
        self.accelerator.wait_for_everyone()  # (nothing in a one-process run)

    def _save_checkpoint(self, model, trial):  # a failed save (a full disk) named, with what it left intact
        with checkpoint_save.explained(upstream.checkpoint_output_dir(self, trial), self.state.global_step):
            return super()._save_checkpoint(model, trial)

    def training_step(self, model, inputs, num_items_in_batch=None):
        inner_before = self.perf.total("generation_s") + self.perf.total("reward_s")
        start = time.perf_counter()
        # the scored models' decoder layers compiled, if chosen: scoring, forward and backward (its recompute too)
        with training_compile.routed(self.decisions.train_layers, self._scored_models,
                                     lambda compiles: self.perf.add("train_compiles", float(compiles))):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.perf.sync()
        inner = self.perf.total("generation_s") + self.perf.total("reward_s") - inner_before
        # Generation and rewards happen inside training_step (in _prepare_inputs): not the training half.
        self.perf.add("train_s", time.perf_counter() - start - inner)
        self.perf.add("train_tokens", float(self._last_micro_batch_tokens))
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        budget = self.sizes.max_tokens_per_micro_batch
        if return_outputs or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        compute = self._sampled.watching(functools.partial(super().compute_loss, model))  # TRL's, a pass
        if self._train_backoff is not None and torch.is_grad_enabled():
            # Forward and backward run here, again at half the token budget after an out-of-memory
            # (hf_grpo.memory.train_backoff); the Trainer's backward gets a leaf and reaches no parameter.
            loss = self._train_backoff.step(model, compute, inputs, last_of_step=self.accelerator.sync_gradients)
            return loss.requires_grad_()
        if budget is None:
            return compute(inputs)
        # The micro-batch in token-budget passes, all but the last backpropagated there (hf_grpo.memory.token_budget)
        return token_budget.packed_loss(self.accelerator, model, inputs, budget, self.loss_type, compute)

    def _prepare_inputs(self, generation_batch):
        if self.facts.zero3_hooks_removed:  # the model as a plain one from its first pass (zero3_one_process)
            zero3_one_process.detach([self.model_wrapped, self.ref_model], self.accelerator.is_main_process)
        buffered = upstream.buffered_inputs(self)
        inputs = super()._prepare_inputs(generation_batch)
        rollout = upstream.buffered_inputs(self)
        if self.model.training and rollout is not buffered:  # a new rollout, split by TRL
            # a prompt's rows in the same micro-batches, where the step's gradient stays the same (prompt_groups)
            decisions = self.decisions
            if decisions.prompt_grouping is None:
                packed = prompt_groups.packed_rows(decisions, self.args.padding_free, self.model)
                decisions.prompt_grouping = prompt_groups.unavailable_reason(packed, self.sizes, self.facts) or "on"
                logger.info("micro-batches: %s", "a prompt's rows together" if decisions.prompt_grouping == "on" else
                            f"TRL's shuffled rows ({decisions.prompt_grouping})")
            regrouped = prompt_groups.regroup(rollout) if decisions.prompt_grouping == "on" else None
            if regrouped is not None:
                upstream.set_buffered_inputs(self, regrouped)
                inputs = regrouped[upstream.micro_step(self) % self.args.steps_per_generation]
        self._last_micro_batch_tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        return inputs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            logs.update({f"perf/{key}": value for key, value in self.perf.pop_window().items()})
            logs.update({f"perf/{k.field}": k.value for k in self._oom_knobs.values() if k.backoffs})
            logs.update(self._sampled.flush(self.accelerator.gather, self.accelerator.device))
        super().log(logs, start_time)

    # ---- overrides of TRL 1.16 private methods -------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        layers = self.decisions.train_layers
        with layers.suspended() if layers is not None else contextlib.nullcontext():
            return self._generate_unrouted(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)

    def _generate_unrouted(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        if self.use_vllm or self.use_transformers_continuous_batching or multimodal_fields or images is not None:
            with self.perf.phase("generation"):  # not the plain path: TRL's
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args,
                                                     **kwargs)
        mirror = self._generation_mirror()  # ZeRO-3 whole in one process: no gather (TRL's puts its hooks back)
        gather = self.args.ds3_gather_for_generation and mirror is None and not self.facts.zero3_hooks_removed
        with (
            self.perf.phase("generation"),
            unwrap_model_for_generation(  # with the mirror, ZeRO-3 weights are gathered into it layer by layer below
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=gather,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=checkpointing.rollout_kwargs(self.args),  # TRL's argument
            ) as unwrapped_model,
            torch.no_grad(), upstream.summon_full_params(self),
        ):
            try:
                if mirror is not None:
                    with self.perf.phase("mirror_refresh"):
                        # the same tensors with the current weights: captured graphs stay valid
                        unwrapped_model = mirror.refresh(unwrapped_model)
                backend = self._generation_backend(unwrapped_model)
                counts_before = backend_counts(backend)
                completion_ids, logprobs = generate_with_backoff(  # chunk halved on every rank after an OOM
                    backend, unwrapped_model, prompt_ids, self._oom_knobs["per_device_generation_batch_size"],
                    self.accelerator.device, generation_config=self.generation_config,
                    pad_token_id=upstream.tokenizer(self).pad_token_id, eos_token_ids=self.eos_token_ids,
                    pad_to_multiple_of=self.pad_to_multiple_of)
            finally:
                if mirror is not None:  # LoRA merged in place: the base weights back (overlapped: see ``restore``)
                    mirror.restore(overlap=self.model.training and self.decisions.train_graphs is None)
        if self.args.release_generation_memory:
            backend.release(empty_cache=False)  # the training step reuses the blocks; the compile is kept
        if self.decisions.mirror is not None and self.decisions.mirror.freed_between_rollouts:
            mirror.release()  # ZeRO-3's dense copy too: the next rollout's refresh allocates and fills it again
        self.perf.add("generated_tokens", float(sum(len(ids) for ids in completion_ids)))
        self.work.rollout(self.perf, prompt_ids, completion_ids, self.sizes.per_device_generation_batch_size)
        for key, after in backend_counts(backend).items():
            self.perf.add(key, float(after - counts_before[key]))
        self._sampled.on_rollout(logprobs, self.model.training, self.state, self.args, self.accelerator,
                                 upstream.metrics(self, "train"))
        return completion_ids, logprobs  # TRL's sampling_per_token_logps; the old policy's log-probs chosen above

    def _tokenize_prompts(self, prompts):  # a rollout's (or the longest-prompt scan's): none empty or too long
        return prompt_checks.checked(super()._tokenize_prompts(prompts), prompts, self.max_completion_length,
                                     self._position_limit)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self.perf.phase("reward"):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # every rank the same (the rewards are gathered); infinite ones set to NaN here, warned about once per function
        warned = self.__dict__.setdefault("_out_of_range_warned", set() if self.accelerator.is_main_process else None)
        for key, value in unscored.check_rollout(rewards, self.reward_func_names, self.reward_weights, warned).items():
            upstream.metrics(self, "train" if self.model.training else "eval")[key].append(value)
        return rewards

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if kwargs.get("batch_size") is not None:
            # TRL's no-grad scoring (old policy, reference) in row chunks, the same on every rank (unequal hung)
            kwargs["batch_size"] = token_budget.scoring_batch_size(
                model, kwargs["batch_size"], input_ids.shape[1], self.sizes.max_tokens_per_micro_batch,
                self.__dict__.setdefault("_scoring_chunks_logged", set()), self.accelerator.is_main_process)
        scoring, parent = not torch.is_grad_enabled(), super()._get_per_token_logps_and_entropies  # no grad: ref, old
        def score():
            self.work.forward(self.perf, input_ids, *args, scoring=scoring, **kwargs)  # FLOPs, on a GPU
            replayed = training_graphs.replay(self.decisions.train_graphs, self.perf, self.accelerator.autocast,
                                              model, input_ids, *args, **kwargs)  # a training micro-batch
            return parent(model, input_ids, *args, **kwargs) if replayed is None else replayed
        with self.perf.phase("logprob", *(("scoring",) if scoring else ())):  # the old policy's: maybe the sampler's
            step = self.state.global_step
            return self._sampled.scored(score, model is self.model, scoring, input_ids, args, kwargs, step)

    def _generate_and_score_completions(self, inputs):  # TRL's, then the importance-sampling correction if asked
        with scoring_switches.installed(self.__dict__, self.model, self.accelerator.unwrap_model):
            scored = super()._generate_and_score_completions(inputs)
        return rollout_logprobs.corrected(scored, self.args, self.loss_type, functools.partial(
            self._get_per_token_logps_and_entropies, self.model, batch_size=self.sizes.per_device_train_batch_size))

    # ---- helpers -----------------------------------------------------------------------------
    def _run_facts(self) -> RunFacts:
        """What the helpers read of this run, fixed once TRL has set it up (``hf_grpo.run_state``)."""
        args, model, accelerator = self.args, self.model, self.accelerator
        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        return RunFacts(
            device_type=accelerator.device.type, num_processes=accelerator.num_processes,
            distributed_type=accelerator.distributed_type.value, n_gpu=getattr(args, "n_gpu", 1),
            deepspeed=self.is_deepspeed_enabled, fsdp=self.is_fsdp_enabled,
            zero3=plugin is not None and zero3_leaves.is_zero3_config(plugin.deepspeed_config),
            attention=upstream.attention_implementation(model.config),
            half=bool(args.bf16 or args.fp16 or getattr(model, "dtype", None) in (torch.float16, torch.bfloat16)),
            moe=is_moe(model.config), zero3_hooks_removed=self.zero3_hooks_removed,
            pad_token_id=getattr(upstream.tokenizer(self), "pad_token_id", None), loss_type=self.loss_type,
            activation_checkpointing=bool(args.activation_checkpointing),
            max_completion_length=self.max_completion_length, reentrant_checkpointing=checkpointing.reentrant(args),
            entropy_per_micro_batch=self.top_entropy_quantile < 1.0 or upstream.entropy_bonus_enabled(self),
            off_policy_mask=self.off_policy_mask_threshold is not None,
            aux_loss_enabled=bool(getattr(self, "aux_loss_enabled", False)),
            router_aux_loss_coef=getattr(self, "router_aux_loss_coef", 0.0),
            replaced_loss=type(self).__name__ if upstream.replaces_trl_loss(type(self)) else None,
            training_graphs_unavailable=getattr(self, "training_graphs_unavailable", None))

    def _settle_sizes(self, checkpoint: str | None) -> dict[str, Any]:
        """The "auto" sizes and a resume's kept back-offs, into ``self.sizes`` (``memory.autosize``), and TRL's."""
        generate = dict(generation_config=self.generation_config, pad_token_id=upstream.tokenizer(self).pad_token_id,
                        eos_token_ids=self.eos_token_ids)
        target = lambda: autosize.ProbeTarget(  # the probes run the trainer's own scoring and backend
            self.model, self.accelerator.device, self._prompt_width(), self.max_completion_length, self._probe_score(),
            lambda: self._generation_backend(self.model), generate, self.optimizer is not None,
            tuple(self._oom_knobs.values()))
        chosen = autosize.resolve_auto_sizes(self.sizes, self.facts, self.args.auto_memory_fraction, target,
                                             checkpoint, self.accelerator.is_main_process)
        if self.sizes.differs_from(self.args):
            self.args = self.sizes.published(self.args)
            upstream.set_train_batch_size(self, self.args.train_batch_size)  # (its accelerator keeps A = 1)
        return chosen

    def _begin_run(self, max_steps: int, world_process_zero: bool) -> None:
        """At train begin, the sizes settled: how the training forward runs, decided once; the batch plan logged."""
        decisions = self.decisions
        decisions.train_layers = self._compiled_training_layers(max_steps)
        decisions.decode_compile = decode_compile.for_run(self.args, max_steps, decisions.backend, world_process_zero)
        given = "pad_to_multiple_of" in getattr(self.args, "_explicit_fields", frozenset())  # lengths aligned
        self.pad_to_multiple_of = training_compile.pad_multiple(decisions.train_layers, self.pad_to_multiple_of, given)
        decisions.eager_rows = eager_packing.for_run(self.args.padding_free, self.model, self.facts,
                                                     decisions.chunked_head, self.sizes.per_device_train_batch_size,
                                                     self._longest_prompt)
        decisions.train_graphs = training_graphs.start(self.args, self.model, self.facts, self.sizes, decisions,
                                                       self.accelerator.is_main_process, self.model_wrapped)
        self._generation_mirror()  # decided on every rank before the plan is printed
        zero_overflow.install(self.model_wrapped, world_process_zero)  # DeepSpeed's step: one search for NaN, not two
        self.perf.rates = device_rates(self.accelerator.device) if self.work.counts else None  # GPU only
        if world_process_zero:
            logger.info("hf-grpo batch plan (world size %d):\n%s", self.accelerator.num_processes, self.batch_plan())
        # the longest completion these sizes fit, logged; a max_completion_length past it refused (context_fit)
        context_fit.check_run(self.model, self.sizes, self.facts, prompt=self._prompt_width, main=world_process_zero,
                              packed=decisions.eager_rows.packed or decisions.graphs_replay, reference=self.ref_model
                              is not None, backend=self.args.generation_backend, device=self.accelerator.device)

    def _compiled_training_layers(self, planned_steps: int) -> training_compile.CompiledTrainingLayers | None:
        """The compiled decoder layers of the scoring and training forwards (``compile_training``), or None."""
        args, accelerator = self.args, self.accelerator
        return training_compile.choose_logged(args.compile_training, self._scored_models(), accelerator.device,
                                              self.facts, planned_steps, accelerator.is_main_process)

    def _probe_score(self):  # the autosize probes' training forward: ``score(input_ids, mask, logits_to_keep)``
        return functools.partial(self._get_per_token_logps_and_entropies, self.model, compute_entropy=True)

    def _scored_models(self) -> list[torch.nn.Module]:  # the policy, and the reference model where there is one
        return [self.model] + ([] if self.ref_model is None else [self.accelerator.unwrap_model(self.ref_model)])

    _check_inputs = staticmethod(checks.check_before_loading)  # before TRL loads anything
    _init_training_state = resume.no_epoch_if_finished(trl.GRPOTrainer._init_training_state)

    def _longest_prompt(self) -> int | None:
        """The training set's longest prompt in TRL's tokens, scanned once; None with environments (unknown)."""
        if "_longest_prompt_tokens" not in self.__dict__:
            quiet = self.args.disable_tqdm or not self.accelerator.is_main_process
            self._longest_prompt_tokens = None if self.environment_factories is not None else (
                prompt_lengths.longest_prompt(self.train_dataset, self._tokenize_prompts, quiet=quiet))
        return self._longest_prompt_tokens

    def _prompt_width(self) -> int:  # caches and probes: the longest prompt where known
        return self._longest_prompt() or getattr(self, "max_prompt_length", None) or 512

    def _longest_row(self, inputs) -> int:  # the longest prompt (else this micro-batch's) + max_completion_length
        return (self._longest_prompt() or max(token_budget.extents(inputs).prompt)) + self.max_completion_length

    def _generation_mirror(self) -> dense_mirror.DenseMirror | InPlaceLoraMerge | None:
        """The dense copy generation reads, or None (``dense_mirror.choose_for_run``): decided once, on every rank."""
        if not self.decisions.mirror_decided:
            model = self.accelerator.unwrap_model(self.model_wrapped)
            self.decisions.mirror_decided, self.decisions.mirror = dense_mirror.choose_for_run(
                self.args, model, self.facts.zero3, self.accelerator.device, collectives.min_over_ranks,
                self.accelerator.is_main_process)
        return None if self.decisions.mirror is None else self.decisions.mirror.mirror

    def _generation_backend(self, model: torch.nn.Module) -> GenerationBackend:
        if self.decisions.backend is None:
            mirror = self._generation_mirror()  # under ZeRO-3 the backend serves the mirror, whoever asks first
            longest, multiple = self._longest_prompt(), self.pad_to_multiple_of or 1  # one cache for the whole run
            self.decisions.backend = open_backend(
                self.args.generation_backend, model if mirror is None else mirror.module,
                None if longest is None else -(-longest // multiple) * multiple + self.max_completion_length,
                self.accelerator.is_main_process, self.decisions.decode_compile)
        return self.decisions.backend
