"""GRPOTrainer: TRL's trainer with chunked generation, chunked log-probs and performance stats.

Every override of TRL's and transformers' methods is here, written against trl 1.16.0 (pyproject pins
``trl>=1.16,<1.17``; ``tests/test_trl_signatures.py`` pins their signatures). Each is thin and calls the original:

- ``_generate_single_turn``: the plain (text-only, no vLLM) path is served by a ``hf_grpo.generation`` backend,
  ``per_device_generation_batch_size`` prompts at a time inside one ``unwrap_model_for_generation`` (one ZeRO-3
  gather a rollout), or from a dense mirror under ZeRO-3 (``generation.dense_mirror``), or with a LoRA policy's
  adapters merged in place (``generation.lora_merge``). Every other path is TRL's.
- ``compute_loss`` (public): token-budget passes (``memory.token_budget``); in one process the backward runs here,
  so an out-of-memory in it can be retried (``memory.train_backoff``).
- ``_calculate_rewards``: timed; a rollout nobody scored is an error, unscored completions counted
  (``checks.unscored``). ``_get_per_token_logps_and_entropies``: timed; its no-grad scoring chunks hold
  ``memory.token_budget.scoring_rows`` (TRL's own where dropout is active). The models' ``forward`` is patched
  after TRL's ``add_fused_lm_head`` so the
  log-softmax runs ``tensor_batch_size`` rows at a time (``hf_grpo.logprob_head``).
- ``_prepare_inputs``: TRL's, then a prompt's rows kept in the same micro-batches where the gradient stays the same
  (``training.prompt_groups``), and the micro-batch's tokens counted. TRL's ``_tokenize_prompts`` runs once over the
  training prompts to size the ``cuda_graph`` cache (``_longest_prompt``).
- ``training_step`` (time; compiled decoder layers inside it, ``training.compiled_layers``), ``log`` (``perf/``).
- ``create_accelerator_and_postprocess`` (ZeRO-3 leaf modules, ``distributed.zero3_leaves``), ``_save_rng_state``
  (the run's sizes and every rank's random state written before rank 0 marks a checkpoint complete,
  ``distributed.rng_files``) and ``_prepare_for_training`` (a checkpoint without ZeRO state loaded under ZeRO-1/2,
  ``distributed.plain_to_zero``).
- ``train``: holds the output directory (``checks.output_lock``), refuses what ``checks.resume`` refuses (another
  run's checkpoints, an incomplete checkpoint, a launch shape that cannot read it; ``True`` resumes the newest
  complete checkpoint) and a token budget the longest prompt cannot fit, then settles "auto" sizes
  (``memory.autosize``).

``__init__`` checks the training set, the model path and the reward functions first (``checks.inputs``), gives a
policy built in code a copy for TRL to load the reference model from (``reference_copy``) and adds the writers of
``metrics.jsonl`` and ``performance.json`` (``run_files``). A generation or head chunk that runs out of memory is
halved on every rank and retried (``memory.oom``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any

import torch
import trl
from trl.models import unwrap_model_for_generation

from .training import compiled_layers as training_compile, eager_packing, graphs as training_graphs, lora_forward
from .training import prompt_groups
from .checks import inputs as checks
from .checks import output_lock, resume
from .checks.unscored import METRIC as UNSCORED_METRIC, count_unscored
from .config import GRPOConfig
from .distributed import before_deepspeed_starts, plain_to_zero, zero3_leaves
from .generation import GenerationBackend, backend_counts, compile_workers, dense_mirror, resolve_backend
from .generation.lora_merge import InPlaceLoraMerge
from .logprob_head import install_chunked_lm_head
from .memory import autosize, prompt_lengths, token_budget, train_backoff
from .memory.oom import BACKOFF_FIELDS, SizeKnob, generate_with_backoff, min_over_ranks
from .memory.stats import PerformanceStats
from . import reference_copy, run_files
from .run_callbacks import RunCallbacks
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
        if not isinstance(config, GRPOConfig):
            got = "None (TRL would build its own default config)" if config is None else (
                f"{type(config).__module__}.{type(config).__name__}")
            raise TypeError(
                f"hf_grpo.GRPOTrainer needs args=hf_grpo.GRPOConfig(...), got args={got}; the per-device batch "
                f"fields live on hf_grpo.GRPOConfig: pass args=hf_grpo.GRPOConfig(output_dir=..., ...)"
            )
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
        token_budget.check_trainer(self)
        self.perf = PerformanceStats(self.accelerator.device)
        self._backend: GenerationBackend | None = None
        self._mirror_choice: dense_mirror.MirrorChoice | None = None  # ZeRO-3's or LoRA's dense mirror, decided once
        self._mirror_decided = False
        # chunk sizes halved on every rank after an out-of-memory, and kept so (hf_grpo.memory.oom)
        self._oom_knobs = {name: SizeKnob(self.args, name, lambda *_: self.perf.add("oom_backoffs", 1))
                           for name in BACKOFF_FIELDS}
        # a training micro-batch's out-of-memory: retried in token-budget passes, where that is safe (one process)
        self._train_backoff_unavailable = train_backoff.reason_unavailable(self)
        self._train_backoff = None if self._train_backoff_unavailable else train_backoff.MicroBatchBackoff(
            self._oom_knobs[token_budget.FIELD], self.loss_type, self.accelerator,
            lambda: self.model.zero_grad(set_to_none=True), lambda: self._metrics["train"], self._longest_row)
        policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        # eager micro-batches packed or padded: the user's padding_free, else chosen at train begin, once the
        # sizes are settled (eager_packing; padded until then, as the "auto" sizes' probes run)
        self._eager_rows = eager_packing.Choice(False, "chosen at train begin")
        packed_rows = (lambda: self._eager_rows.packed) if self.args.padding_free is None else self.args.padding_free
        head = dict(temperature=self.temperature, chunk_rows=self._oom_knobs["tensor_batch_size"],
                    cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32, padding_free_rows=packed_rows)
        self._chunked_head_installed = install_chunked_lm_head(policy, return_entropy=True, **head)
        # LoRA layers on the fused forward (not where ZeRO-3 or FSDP gathers the adapters' weights by module hooks)
        fused = self.args.lora_fused_forward and self._sharding() is None
        self.lora_fused_layers = lora_forward.install(policy) if fused else 0
        if self.ref_model is not None:
            # TRL has already wrapped the reference (a DeepSpeed engine under ZeRO): patch the module inside,
            # whose forward the wrapper calls.
            reference = self.accelerator.unwrap_model(self.ref_model)
            install_chunked_lm_head(reference, return_entropy=False, **head)
        self._train_layers: training_compile.CompiledTrainingLayers | None = None  # decided at train begin
        self._train_graphs: training_graphs.TrainingGraphs | None = None  # likewise
        self._prompt_grouping: str | None = None  # "on", or why a prompt's rows keep TRL's shuffle; decided once
        self.add_callback(RunCallbacks(self))
        run_files.add_run_files(self)  # metrics.jsonl and performance.json, for library scripts as for recipes
        self.add_callback(autosize.SaveSizesCallback())

    # ---- public ------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """transformers' (called inside ``Trainer.__init__``, once ``self.model`` is set), then, under ZeRO-3, the
        decoder layers made leaf modules (``zero3_leaf_modules``, ``hf_grpo.distributed.zero3_leaves``): before DeepSpeed wraps
        the policy (``accelerator.prepare`` in ``train``) and before TRL prepares the reference model later in its
        ``__init__`` from a copy of this DeepSpeed config, which then carries the class names."""
        super().create_accelerator_and_postprocess()
        self.zero3_leaf_marking = zero3_leaves.LeafMarking((), 0)  # what was flagged (none outside ZeRO-3)
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        config = plugin.deepspeed_config if plugin is not None else None
        if self.model is None or not zero3_leaves.is_zero3_config(config):
            return
        self.zero3_leaf_marking = zero3_leaves.mark(self.model, self.args.zero3_leaf_modules, zero3=True)
        zero3_leaves.add_to_deepspeed_config(config, self.zero3_leaf_marking.classes)
        if self.accelerator.is_main_process:
            logger.info("%s", self.zero3_leaf_marking)

    def batch_plan(self):
        """The batch plan with this run's real world size (and ZeRO-3's generation mirror, once decided)."""
        plan = self.args.batch_plan(world_size=self.accelerator.num_processes)
        if self._mirror_choice is not None:
            plan = dataclasses.replace(plan, **self._mirror_choice.plan_fields())
        if self.zero3_leaf_marking.count:
            plan = dataclasses.replace(plan, leaf_module_classes=self.zero3_leaf_marking.classes,
                                       leaf_module_count=self.zero3_leaf_marking.count)
        return plan

    def get_performance_stats(self) -> dict[str, Any]:
        """Peak memory, seconds per optimizer step by phase, tokens/s, decoder compiles and captures, the
        memory the generation backend keeps between rollouts, and the batch plan, over the run."""
        cache = getattr(self._backend, "cache_bytes", lambda: 0)()
        stats = {**self.perf.summary(), "generation_cache_gib": cache / 2**30,
                 "batch_plan": self.batch_plan().to_dict()}
        if self._mirror_choice is not None and self._mirror_choice.mirror is not None:
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
            token_budget.check_longest_row(self.args, self._longest_prompt)  # before any probe or step
            # "auto" sizes are settled before TRL and transformers size the dataloader and the accumulation
            if autosize.resolve_auto_sizes(self, checkpoint):
                self.perf = PerformanceStats(self.accelerator.device)  # the probes are not part of the run's figures
            if self._train_backoff is None and self.accelerator.is_main_process:
                logger.info("an out-of-memory in a training micro-batch will end the run (no retry: %s)",
                            self._train_backoff_unavailable)
            return super().train(checkpoint, *args, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if not plain_to_zero.applies(resume_from_checkpoint, self.is_deepspeed_enabled):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        # a checkpoint without ZeRO state under ZeRO-1/2: weights before DeepSpeed, optimizer into its partitions
        plain_to_zero.load_weights(self, resume_from_checkpoint)
        prepared = super()._prepare_for_training(max_steps, train_dataloader, None)
        plain_to_zero.load_optimizer_state(self.model_wrapped, resume_from_checkpoint, self.accelerator.is_main_process)
        if plain_to_zero.has_schedule(resume_from_checkpoint, self.accelerator.is_main_process):
            self._load_optimizer_and_scheduler(resume_from_checkpoint)  # the schedule (DeepSpeed leaves it to us)
        self._load_scaler(resume_from_checkpoint)
        return prepared

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        # Ours too, before rank 0 marks the checkpoint complete (trainer_state.json, written next): the sizes a
        # resume reads (hf_grpo.memory.autosize), and every rank's random state (hf_grpo.distributed.rng_files).
        if self.args.should_save:
            autosize.save_sizes(self.args, output_dir)
        self.accelerator.wait_for_everyone()  # (nothing in a one-process run)

    def training_step(self, model, inputs, num_items_in_batch=None):
        inner_before = self.perf.total("generation_s") + self.perf.total("reward_s")
        start = time.perf_counter()
        with self._routed_training_layers():  # scoring, forward and backward (its recompute too); not generation
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.perf.sync()
        inner = self.perf.total("generation_s") + self.perf.total("reward_s") - inner_before
        # Generation and scoring happen inside training_step (in _prepare_inputs); they are not training.
        self.perf.add("train_s", time.perf_counter() - start - inner)
        self.perf.add("train_tokens", float(self._last_micro_batch_tokens))
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        budget = self.args.max_tokens_per_micro_batch
        if return_outputs or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        compute = functools.partial(super().compute_loss, model)  # TRL's loss of one micro-batch or pass
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
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not buffered:  # a new rollout, split by TRL
            # a prompt's rows in the same micro-batches, where the step's gradient stays the same (prompt_groups)
            if self._prompt_grouping is None:
                self._prompt_grouping = prompt_groups.unavailable_reason(self) or "on"
                logger.info("micro-batches: %s", "a prompt's rows together" if self._prompt_grouping == "on" else
                            f"TRL's shuffled rows ({self._prompt_grouping})")
            regrouped = prompt_groups.regroup(self._buffered_inputs) if self._prompt_grouping == "on" else None
            if regrouped is not None:
                self._buffered_inputs = regrouped
                inputs = regrouped[self._step % self.args.steps_per_generation]
        self._last_micro_batch_tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        return inputs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            logs.update({f"perf/{key}": value for key, value in self.perf.pop_window().items()})
            logs.update({f"perf/{k.field}": k.value for k in self._oom_knobs.values() if k.backoffs})
        super().log(logs, start_time)

    # ---- overrides of TRL 1.16 private methods -------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        with self._train_layers.suspended() if self._train_layers is not None else contextlib.nullcontext():
            return self._generate_unrouted(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)

    def _generate_unrouted(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        plain_path = not (
            self.use_vllm or self.use_transformers_continuous_batching or multimodal_fields or images is not None
        )
        if not plain_path:
            with self.perf.phase("generation"):
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs
                )
        mirror = self._generation_mirror()
        with (
            self.perf.phase("generation"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                # With the mirror, ZeRO-3 weights are gathered into it layer by layer below, not all at once here.
                gather_deepspeed3_params=self.args.ds3_gather_for_generation and mirror is None,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            try:
                if mirror is not None:
                    with self.perf.phase("mirror_refresh"):
                        # the same tensors with the current weights: captured graphs stay valid
                        unwrapped_model = mirror.refresh(unwrapped_model)
                backend = self._generation_backend(unwrapped_model)
                counts_before = backend_counts(backend)
                completion_ids = generate_with_backoff(  # backend.generate, chunk halved on every rank after an OOM
                    backend,
                    unwrapped_model,
                    prompt_ids,
                    self._oom_knobs["per_device_generation_batch_size"],
                    self.accelerator.device,
                    generation_config=self.generation_config,
                    pad_token_id=self._tokenizer.pad_token_id,
                    eos_token_ids=self.eos_token_ids,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                )
            finally:
                if mirror is not None:  # LoRA merged in place: the base weights back before anything else reads them
                    mirror.restore()
        if self.args.release_generation_memory:
            backend.release(empty_cache=False)  # the training step reuses the blocks; the compile is kept
        self.perf.add("generated_tokens", float(sum(len(ids) for ids in completion_ids)))
        for key, after in backend_counts(backend).items():
            self.perf.add(key, float(after - counts_before[key]))
        return completion_ids, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self.perf.phase("reward"):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        unscored = count_unscored(rewards, self.reward_func_names)  # every rank the same: the rewards are gathered
        self._metrics["train" if self.model.training else "eval"][UNSCORED_METRIC].append(float(unscored))
        return rewards

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if kwargs.get("batch_size") is not None:
            # TRL's no-grad scoring of the rollout (old policy, reference) in row chunks (token_budget.scoring_rows)
            budget = self.args.max_tokens_per_micro_batch
            rows, why = token_budget.scoring_chunk_rows(model, kwargs["batch_size"], input_ids.shape[1], budget)
            logged = self.__dict__.setdefault("_scoring_chunks_logged", set())  # each reason once
            if why not in logged and self.accelerator.is_main_process:
                logger.info("old-policy / reference log-probs: %s", why)
            logged.add(why)
            # The same chunk on every rank (widths differ per rank): each chunk's head agrees on out-of-memory
            # with the other ranks (hf_grpo.memory.oom), so unequal chunk counts left a 2-process ZeRO-2 run hanging.
            kwargs["batch_size"] = rows if budget is None else min_over_ranks(rows)
        with self.perf.phase("logprob"):
            replayed = training_graphs.replay(self, model, input_ids, *args, **kwargs)  # a training micro-batch
            if replayed is not None:
                return replayed
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)

    # ---- helpers -----------------------------------------------------------------------------
    def _compiled_training_layers(self, planned_steps: int) -> training_compile.CompiledTrainingLayers | None:
        """The compiled decoder layers of the scoring and training forwards (``compile_training``), or None."""
        compiled, reason = training_compile.choose(self.args.compile_training, self._scored_models(),
                                                   self.accelerator.device, self._sharding(), planned_steps)
        if self.accelerator.is_main_process and compiled is None and self.args.compile_training not in ("auto", "off"):
            logger.warning("compile_training=%r is not applied: %s", self.args.compile_training, reason)  # asked for
        elif self.accelerator.is_main_process:
            logger.info("training forward: %s", "decoder layers compiled" if compiled is not None else f"eager ({reason})")
        return compiled

    def _align_lengths_for_compiled_layers(self) -> None:
        explicit = "pad_to_multiple_of" in getattr(self.args, "_explicit_fields", frozenset())
        self.pad_to_multiple_of = training_compile.pad_multiple(self._train_layers, self.pad_to_multiple_of, explicit)

    def _scored_models(self) -> list[torch.nn.Module]:
        """The policy, and the reference model where there is one: the models whose forwards score tokens."""
        models = [self.model]
        if self.ref_model is not None:
            models.append(self.accelerator.unwrap_model(self.ref_model))
        return models

    @contextlib.contextmanager
    def _routed_training_layers(self):
        """Within the block the scored models' decoder layers run compiled (``compile_training``), if chosen."""
        if self._train_layers is None:
            yield
            return
        before = self._train_layers.compiles
        try:
            with self._train_layers.route(*self._scored_models()):
                yield
        finally:
            self.perf.add("train_compiles", float(self._train_layers.compiles - before))

    @staticmethod
    def _check_inputs(model=None, reward_funcs=None, args=None, train_dataset=None, *_, **kwargs) -> None:
        """Before TRL loads anything: the training set, a model given by path, the generation backend."""
        checks.check_train_dataset(train_dataset)
        if isinstance(model, str):
            checks.check_model_path(model)
        checks.check_generation_backend_installed(args.generation_backend)
        before_deepspeed_starts(args.deepspeed)  # before TRL prepares DeepSpeed's engine

    def _longest_prompt(self) -> int | None:
        """Tokens in the training set's longest prompt (scanned once: the cache sizing and the "auto" probe
        both ask)."""
        if not hasattr(self, "_longest_prompt_tokens"):
            self._longest_prompt_tokens = self._scan_longest_prompt()
        return self._longest_prompt_tokens

    def _scan_longest_prompt(self) -> int | None:
        """Tokens in the training set's longest prompt, tokenized as TRL tokenizes them; None when unknown."""
        if self.environment_factories is not None:
            # Each rollout's environment appends its reset() observation to the prompt, so the dataset's prompts do
            # not tell the length; and TRL tokenizes them against the current batch's environments only.
            return None
        quiet = self.args.disable_tqdm or not self.accelerator.is_main_process
        return prompt_lengths.longest_prompt(self.train_dataset, self._tokenize_prompts, quiet=quiet)

    def _longest_row(self, inputs) -> int:
        """Tokens of the longest row the run can meet: longest prompt (the training set's, else this micro-batch's)
        plus max_completion_length. A token budget below it could not hold some rollout's row."""
        prompt = self._longest_prompt() or max(token_budget.extents(inputs).prompt)
        return prompt + self.max_completion_length

    def _generation_mirror(self) -> dense_mirror.DenseMirror | InPlaceLoraMerge | None:
        """The dense copy of the weights generation reads, or None: under ZeRO-3 (``zero3_generation_mirror``), and
        for a LoRA policy otherwise (``lora_generation_mirror``: the adapters merged).

        Decided once, the same on every rank: under ZeRO-3 its refresh gathers layer by layer, a collective."""
        if not self._mirror_decided:
            model = self.accelerator.unwrap_model(self.model_wrapped)
            zero3 = dense_mirror.is_zero3_partitioned(model)
            if not zero3 and self._zero3_configured():
                return None  # not partitioned yet (a model built in code, before DeepSpeed wraps it)
            choose, setting = ((dense_mirror.choose, self.args.zero3_generation_mirror) if zero3 else
                               (dense_mirror.choose_lora, self.args.lora_generation_mirror))
            choice = choose(setting, model, self.args.generation_backend, self.accelerator.device, min_over_ranks)
            self._mirror_decided = True
            self._mirror_choice = choice
            if choice is not None and self.accelerator.is_main_process:
                logger.info("%s generation mirror: %s", choice.kind, choice)
        return None if self._mirror_choice is None else self._mirror_choice.mirror

    def _sharding(self) -> str | None:
        """What shards the policy's parameters across processes ("FSDP", "ZeRO-3"), or None."""
        return "FSDP" if self.is_fsdp_enabled else "ZeRO-3" if self._zero3_configured() else None

    def _zero3_configured(self) -> bool:
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return plugin is not None and zero3_leaves.is_zero3_config(plugin.deepspeed_config)

    def _generation_backend(self, model: torch.nn.Module) -> GenerationBackend:
        if self._backend is None:
            mirror = self._generation_mirror()  # under ZeRO-3 the backend serves the mirror, whoever asks first
            served = model if mirror is None else mirror.module
            self._backend, reason = resolve_backend(self.args.generation_backend, served)
            if hasattr(self._backend, "reserve"):
                longest = self._longest_prompt()
                if longest is not None:  # one cache, one compile, for the whole run
                    multiple = self.pad_to_multiple_of or 1
                    self._backend.reserve(-(-longest // multiple) * multiple + self.max_completion_length)
            if self.accelerator.is_main_process:
                if reason is None:
                    logger.info("generation backend: %s", self._backend.name)
                elif self.args.generation_backend == "auto":
                    logger.info("generation backend: hf (%s)", reason)
                else:
                    logger.warning("generation_backend=%r falls back to 'hf': %s", self.args.generation_backend, reason)
        return self._backend
