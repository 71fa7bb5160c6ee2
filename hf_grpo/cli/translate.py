"""Batch settings of other RL frameworks, translated to hf-grpo's per-device fields.

Each ``from_<framework>(settings, world_size)`` takes that framework's ``key=value`` batch settings
(its own names, counted its own way) and returns a ``Translation``: the hf-grpo field values, the
batch plan they give, notes for knobs with no exact equivalent, and the source framework's own
arithmetic, which the plan is checked against (the same completions per optimizer step and the
same optimizer steps per rollout). Bad input raises ``TranslationError`` naming the key, the value
and what would be valid. No torch import: like ``plan``, this is arithmetic.

What each knob counts, read off the frameworks' own code:

- SkyRL: ``train_batch_size`` and ``policy_mini_batch_size`` are global **prompt** counts; the
  mini-batch is multiplied by ``n_samples_per_prompt`` and divided by the data-parallel size
  (``validate_batch_sizes``); ``micro_train_batch_size_per_gpu`` counts samples on one GPU.
- veRL: ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` are global prompt counts (the
  worker does ``ppo_mini_batch_size *= rollout.n; //= dp size``); ``ppo_micro_batch_size_per_gpu``
  counts samples on one GPU.
- OpenRLHF: ``rollout_batch_size`` counts prompts, ``train_batch_size`` counts samples, both global;
  ``micro_train_batch_size`` and ``micro_rollout_batch_size`` count samples on one GPU.
- trlx (PPO): one completion per prompt; ``train.batch_size``, ``method.num_rollouts`` and
  ``method.chunk_size`` are per process.
- d1 (diffu-GRPO on TRL): TRL's per-device fields; ``generation_batch_size`` is the per-device
  generation chunk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from .translation import (
    Knob,
    Translation,
    TranslationError,
    close_knob,
    counted,
    divide_exactly,
    finish_translation,
    flatten_config,
    group_size,
    is_null,
    matching_knobs,
    mini_batch_fixes,
    parse_settings,
    required_values,
    resolve_knobs,
    unknown_key_error,
    world_size_from,
)


# ---- whole configs and command-line overrides ------------------------------------------------------


def merge_settings(framework: str, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's settings with command-line ``KEY=VALUE`` on top: an override in tail form
    (``rollout.n=8``) replaces the file's full key (``actor_rollout_ref.rollout.n``)."""
    merged = dict(base)
    for key, value in overrides.items():
        matches = matching_knobs(FRAMEWORKS[framework][0], key)
        if len(matches) == 1:
            merged.pop(matches[0].key, None)
        merged[key] = value
    return merged


def split_settings(framework: str, settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the batch settings, the other keys) of a whole pasted config. A key that looks like a typo of a batch
    key (``train_batch_sise``) is an error with "did you mean", unless its value is null."""
    knobs = FRAMEWORKS[framework][0]
    batch: dict[str, Any] = {}
    others: list[str] = []
    for given, raw in settings.items():
        if matching_knobs(knobs, given):
            batch[given] = raw
        elif close_knob(knobs, given) is not None and not is_null(raw):
            unknown_key_error(framework, knobs, given)
        else:
            others.append(given)
    return batch, others


# ---- SkyRL ------------------------------------------------------------------------------------------

SKYRL = (
    Knob("trainer.train_batch_size", "prompts per training step, global"),
    Knob("generator.n_samples_per_prompt", "samples per prompt"),
    Knob("trainer.policy_mini_batch_size", "prompts per optimizer step, global (x n_samples_per_prompt samples)"),
    Knob("trainer.micro_train_batch_size_per_gpu", "samples per forward/backward on one GPU"),
    Knob("trainer.update_epochs_per_batch", "passes over each training batch"),
    Knob("trainer.micro_forward_batch_size_per_gpu", "samples per log-prob forward on one GPU"),
    Knob("trainer.placement.policy_num_nodes", "nodes of the policy"),
    Knob("trainer.placement.policy_num_gpus_per_node", "GPUs per node of the policy"),
    Knob("trainer.policy.sequence_parallel_size", "GPUs sharing one sequence", neutral=1,
         lacks="hf-grpo has no sequence parallelism; every process is data-parallel"),
    Knob("generator.sampling_params.max_generate_length", "completion tokens"),
    Knob("trainer.max_prompt_length", "prompt tokens"),
)


def from_skyrl(settings: Mapping[str, Any], world_size: int | None = None) -> Translation:
    name = "skyrl"
    v = resolve_knobs(name, SKYRL, settings)
    world = world_size_from(name, v, "trainer.placement.policy_num_nodes", "trainer.placement.policy_num_gpus_per_node",
                            world_size)
    G = group_size(name, "generator.n_samples_per_prompt", v)
    prompts, mini, micro = required_values(name, v, "trainer.train_batch_size", "trainer.policy_mini_batch_size",
                                           "trainer.micro_train_batch_size_per_gpu")
    epochs = v.get("trainer.update_epochs_per_batch", 1)
    minis = divide_exactly(name, "trainer.train_batch_size", prompts, "trainer.policy_mini_batch_size", mini,
                           "the last mini-batch would be partial")
    mini_per_gpu = divide_exactly(name, "policy_mini_batch_size x n_samples_per_prompt", mini * G, "the number of GPUs",
                                  world, "the mini-batch does not split evenly over the GPUs",
                                  mini_batch_fixes("trainer.policy_mini_batch_size", mini, prompts, G, world))
    A = divide_exactly(name, "the per-GPU mini-batch policy_mini_batch_size x n_samples_per_prompt / GPUs",
                       mini_per_gpu,
                       "trainer.micro_train_batch_size_per_gpu", micro, "the last micro-batch would be partial",
                       {"trainer.micro_train_batch_size_per_gpu": (micro, lambda d: mini_per_gpu % d == 0)})
    fields = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": A,
              "steps_per_generation": A * minis, "num_generations": G, "num_iterations": epochs}
    notes = []
    if "generator.sampling_params.max_generate_length" in v:
        fields["max_completion_length"] = v["generator.sampling_params.max_generate_length"]
    if "trainer.micro_forward_batch_size_per_gpu" in v:
        notes.append(_SCORING_CHUNKS.format("trainer.micro_forward_batch_size_per_gpu"))
    if "trainer.max_prompt_length" in v:
        notes.append(_NO_PROMPT_LENGTH.format("trainer.max_prompt_length"))
    steps = Fraction(minis * epochs)
    source = (f"skyrl: {mini} prompts x {G} samples = {mini * G} samples per optimizer step; {prompts} / {mini} "
              f"mini-batches x {counted(epochs, 'epoch')} = {steps} optimizer steps per training step")
    return finish_translation(name, fields, world, source, notes, mini * G, steps, prompts * G)


# What hf_grpo.memory.token_budget.scoring_rows does (SCORING_ROWS_PER_TRAINING_ROW = 2), said where another
# framework sizes its log-prob forwards itself; written out here because the command line never imports torch.
_SCORING_CHUNKS = ("{}: no separate field; hf-grpo scores the old-policy and reference log-probs without grad in "
                   "chunks of 2 x per_device_train_batch_size rows (1 x under \"eager\" attention; with "
                   "max_tokens_per_micro_batch, at most twice its tokens)")
_NO_PROMPT_LENGTH = ("{}: no equivalent; TRL 1.16 does not truncate prompts, so filter or truncate long prompts "
                     "in the dataset")


# ---- veRL -------------------------------------------------------------------------------------------

VERL = (
    Knob("data.train_batch_size", "prompts per training step, global"),
    Knob("actor_rollout_ref.rollout.n", "samples per prompt"),
    Knob("actor_rollout_ref.actor.ppo_mini_batch_size", "prompts per optimizer step, global (x rollout.n samples)"),
    Knob("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "samples per forward/backward on one GPU"),
    Knob("actor_rollout_ref.actor.ppo_micro_batch_size", "samples per forward/backward, global (deprecated)"),
    Knob("actor_rollout_ref.actor.ppo_epochs", "passes over each training batch"),
    Knob("actor_rollout_ref.actor.use_dynamic_bsz", "pack micro-batches by a token budget", kind=bool),
    Knob("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "tokens per micro-batch on one GPU (dynamic bsz)"),
    Knob("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "samples per old log-prob forward"),
    Knob("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "samples per reference log-prob forward"),
    Knob("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "GPUs sharing one sequence", neutral=1,
         lacks="hf-grpo has no sequence parallelism; every process is data-parallel"),
    Knob("trainer.nnodes", "nodes"),
    Knob("trainer.n_gpus_per_node", "GPUs per node"),
    Knob("data.max_response_length", "completion tokens"),
    Knob("data.max_prompt_length", "prompt tokens"),
)


def from_verl(settings: Mapping[str, Any], world_size: int | None = None) -> Translation:
    name = "verl"
    v = resolve_knobs(name, VERL, settings)
    world = world_size_from(name, v, "trainer.nnodes", "trainer.n_gpus_per_node", world_size)
    G = group_size(name, "actor_rollout_ref.rollout.n", v)
    prompts, mini = required_values(name, v, "data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size")
    epochs = v.get("actor_rollout_ref.actor.ppo_epochs", 1)
    minis = divide_exactly(name, "data.train_batch_size", prompts, "actor_rollout_ref.actor.ppo_mini_batch_size", mini,
                           "the last mini-batch would be partial")
    mini_per_gpu = divide_exactly(name, "ppo_mini_batch_size x rollout.n", mini * G, "the number of GPUs", world,
                                  "the mini-batch does not split evenly over the GPUs",
                                  mini_batch_fixes("actor_rollout_ref.actor.ppo_mini_batch_size", mini, prompts, G,
                                                   world))
    notes = []
    dynamic = v.get("actor_rollout_ref.actor.use_dynamic_bsz", False)
    micro_keys = [k for k in ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                              "actor_rollout_ref.actor.ppo_micro_batch_size") if k in v]
    if len(micro_keys) > 1:
        raise TranslationError(f"{name}: give one of {' and '.join(micro_keys)}, not both (veRL rejects both too)")
    if dynamic:
        # veRL ignores the micro-batch size then: a GPU's mini-batch is cut into pieces by a token budget.
        (budget,) = required_values(name, v, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                    why=" (the token budget of use_dynamic_bsz=true)")
        micro, A = mini_per_gpu, 1
        notes.append(f"use_dynamic_bsz=true: veRL packs each GPU's mini-batch of {mini_per_gpu} samples into "
                     f"micro-batches of at most {budget} tokens. hf-grpo: one micro-batch of {mini_per_gpu} per "
                     f"optimizer step, run in forward/backward passes of at most max_tokens_per_micro_batch={budget} "
                     f"tokens. veRL's budget counts real tokens (sequences packed without padding), hf-grpo's counts "
                     f"padded ones (rows x (longest prompt + longest completion) of a pass), so the same number holds "
                     f"fewer completions per pass here")
        if micro_keys:
            notes.append(f"{micro_keys[0]}: ignored, as veRL ignores it under use_dynamic_bsz=true")
    else:
        if not micro_keys:
            required_values(name, v, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
        key, micro = micro_keys[0], v[micro_keys[0]]
        if key.endswith("ppo_micro_batch_size"):  # the deprecated global form
            fix = {key: (micro, lambda m: m % world == 0 and mini_per_gpu % (m // world) == 0)}
            micro = divide_exactly(name, key, micro, "the number of GPUs", world,
                                   "it does not split evenly over the GPUs",
                                   fix)
        else:
            fix = {key: (micro, lambda d: mini_per_gpu % d == 0)}
        A = divide_exactly(name, "the per-GPU mini-batch ppo_mini_batch_size x rollout.n / GPUs", mini_per_gpu,
                           "the micro-batch per GPU", micro, "the last micro-batch would be partial", fix)
        if "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" in v:
            notes.append("actor_rollout_ref.actor.ppo_max_token_len_per_gpu: not used by veRL without "
                         "use_dynamic_bsz=true, so not translated")
    fields = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": A,
              "steps_per_generation": A * minis, "num_generations": G, "num_iterations": epochs}
    if dynamic:
        fields["max_tokens_per_micro_batch"] = budget
    if "data.max_response_length" in v:
        fields["max_completion_length"] = v["data.max_response_length"]
    for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"):
        if key in v:
            notes.append(_SCORING_CHUNKS.format(key))
    if "data.max_prompt_length" in v:
        notes.append(_NO_PROMPT_LENGTH.format("data.max_prompt_length"))
    steps = Fraction(minis * epochs)
    source = (f"verl: {mini} prompts x {G} samples = {mini * G} samples per optimizer step; {prompts} / {mini} "
              f"mini-batches x {counted(epochs, 'epoch')} = {steps} optimizer steps per training step")
    return finish_translation(name, fields, world, source, notes, mini * G, steps, prompts * G)


# ---- OpenRLHF ---------------------------------------------------------------------------------------

OPENRLHF = (
    Knob("rollout_batch_size", "prompts per rollout, global"),
    Knob("n_samples_per_prompt", "samples per prompt"),
    Knob("train_batch_size", "samples per optimizer step, global"),
    Knob("micro_train_batch_size", "samples per forward/backward on one GPU"),
    Knob("micro_rollout_batch_size", "samples per generation / experience chunk on one GPU"),
    Knob("max_epochs", "passes over each rollout"),
    Knob("actor_num_nodes", "nodes of the actor"),
    Knob("actor_num_gpus_per_node", "GPUs per node of the actor"),
    Knob("ring_attn_size", "GPUs sharing one sequence", neutral=1,
         lacks="hf-grpo has no ring attention / sequence parallelism; every process is data-parallel"),
    Knob("generate_max_len", "completion tokens"),
    Knob("prompt_max_len", "prompt tokens"),
)


def from_openrlhf(settings: Mapping[str, Any], world_size: int | None = None) -> Translation:
    name = "openrlhf"
    v = resolve_knobs(name, OPENRLHF, settings)
    world = world_size_from(name, v, "actor_num_nodes", "actor_num_gpus_per_node", world_size)
    G = group_size(name, "n_samples_per_prompt", v)
    prompts, batch, micro = required_values(name, v, "rollout_batch_size", "train_batch_size", "micro_train_batch_size")
    epochs = v.get("max_epochs", 1)
    R = divide_exactly(name, "rollout_batch_size x n_samples_per_prompt", prompts * G, "the number of GPUs", world,
                       "the rollout does not split evenly over the GPUs",
                       {"rollout_batch_size": (prompts, lambda p: p * G % world == 0),
                       "GPUs": (world, lambda w: prompts * G % w == 0)})
    updates = divide_exactly(name, "rollout_batch_size x n_samples_per_prompt", prompts * G, "train_batch_size", batch,
                             "the last optimizer step of a rollout would be partial",
                             {"rollout_batch_size": (prompts, lambda p: p * G % batch == 0),
                             "train_batch_size": (batch, lambda b: prompts * G % b == 0 and b % (micro * world) == 0)})
    A = divide_exactly(name, "train_batch_size", batch, "micro_train_batch_size x GPUs", micro * world,
                       "the optimizer step does not split into whole micro-batches on every GPU",
                       {"train_batch_size": (batch, lambda b: b % (micro * world) == 0 and prompts * G % b == 0),
                       "micro_train_batch_size": (micro, lambda m: batch % (m * world) == 0)})
    fields = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": A,
              "steps_per_generation": A * updates, "num_generations": G, "num_iterations": epochs}
    notes = []
    if "micro_rollout_batch_size" in v:
        chunk = v["micro_rollout_batch_size"]
        if chunk > R:
            raise TranslationError(f"{name}: micro_rollout_batch_size ({chunk}) is larger than a GPU's share of the "
                                   f"rollout, rollout_batch_size x n_samples_per_prompt / GPUs = {R}; give at most "
                                   f"{R}")
        fields["per_device_generation_batch_size"] = chunk
        notes.append("micro_rollout_batch_size: the generation chunk (per_device_generation_batch_size); OpenRLHF "
                     "also runs the old-policy and reference log-probs in it, hf-grpo runs those in chunks of twice "
                     "per_device_train_batch_size")
    if "generate_max_len" in v:
        fields["max_completion_length"] = v["generate_max_len"]
    if "prompt_max_len" in v:
        notes.append(_NO_PROMPT_LENGTH.format("prompt_max_len"))
    steps = Fraction(updates * epochs)
    source = (f"openrlhf: train_batch_size = {batch} samples per optimizer step; {prompts} prompts x {G} samples / "
              f"{batch} x {counted(epochs, 'epoch')} = {steps} optimizer steps per rollout")
    return finish_translation(name, fields, world, source, notes, batch, steps, prompts * G)


# ---- trlx -------------------------------------------------------------------------------------------

TRLX = (
    Knob("train.batch_size", "samples per optimizer step, per process"),
    Knob("train.minibatch_size", "samples per forward/backward, per process"),
    Knob("method.num_rollouts", "samples collected per rollout, per process"),
    Knob("method.chunk_size", "prompts generated at once, per process"),
    Knob("method.ppo_epochs", "passes over each rollout"),
    Knob("method.gen_kwargs.max_new_tokens", "completion tokens"),
)


def from_trlx(settings: Mapping[str, Any], world_size: int | None = None,
              num_generations: int | None = None) -> Translation:
    name = "trlx"
    v = resolve_knobs(name, TRLX, settings)
    world = world_size_from(name, v, None, None, world_size)
    if num_generations is None or num_generations < 2:
        got = "" if num_generations is None else f", got {num_generations}"
        raise TranslationError(
            f"trlx: PPO samples one completion per prompt and learns a value head; GRPO needs a group of at least "
            f"2 completions per prompt to compare instead. Give --num_generations G (>= 2{got}): "
            f"the translation keeps method.num_rollouts completions per process, from num_rollouts x processes / G "
            f"prompts")
    batch, rollouts, chunk, epochs = required_values(name, v, "train.batch_size", "method.num_rollouts",
                                                     "method.chunk_size", "method.ppo_epochs")
    micro = v.get("train.minibatch_size", batch)
    A = divide_exactly(name, "train.batch_size", batch, "train.minibatch_size", micro,
                       "trlx asserts 'Minibatch size must divide batch size'")
    notes = [(f"trlx is PPO with a value head; hf-grpo is GRPO: group-relative advantages over num_generations="
              f"{num_generations} completions per prompt, no value head. The batch arithmetic is kept, the algorithm "
              f"is not")]
    # trlx generates whole chunks until it holds num_rollouts, so it may collect more.
    collected = math.ceil(rollouts / chunk) * chunk
    if collected != rollouts:
        notes.append(f"method.num_rollouts={rollouts} is not a multiple of method.chunk_size={chunk}: trlx collects "
                     f"whole chunks, {collected} per process, and so does this translation")
    updates = divide_exactly(name, "the samples trlx collects per process", collected, "train.batch_size", batch,
                             "trlx's last batch of a rollout would be a smaller optimizer step",
                             {"method.num_rollouts": (rollouts, lambda r: r % chunk == 0 and r % batch == 0),
                             "train.batch_size": (batch, lambda b: collected % b == 0
                             and b % v.get("train.minibatch_size", b) == 0)})
    divide_exactly(name, "the rollout of all processes (collected x processes)", collected * world, "--num_generations",
                   num_generations, "a prompt group would be split",
                   {"--num_generations": (num_generations, lambda g: g >= 2 and collected * world % g == 0)})
    fields = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": A,
              "steps_per_generation": A * updates, "num_generations": num_generations, "num_iterations": epochs,
              "per_device_generation_batch_size": chunk}
    if "method.gen_kwargs.max_new_tokens" in v:
        fields["max_completion_length"] = v["method.gen_kwargs.max_new_tokens"]
    steps = Fraction(updates * epochs)
    source = (f"trlx: batch_size {batch} x {counted(world, 'process')} = {batch * world} samples per optimizer step; "
              f"{collected} / {batch} batches x {epochs} ppo_epochs = {steps} optimizer steps per rollout")
    return finish_translation(name, fields, world, source, notes, batch * world, steps, collected * world)


# ---- d1 (diffu-GRPO on TRL) -------------------------------------------------------------------------

D1 = (
    Knob("per_device_train_batch_size", "completions per forward/backward on one device"),
    Knob("gradient_accumulation_steps", "micro-batches per optimizer step"),
    Knob("num_generations", "completions per prompt"),
    Knob("num_iterations", "passes over each generated batch"),
    Knob("generation_batch_size", "completions generated at once on one device (the guide's meaning)"),
    Knob("tensor_batch_size", "token rows per log-softmax chunk"),
    Knob("max_completion_length", "completion tokens"),
    Knob("block_length", "tokens per semi-autoregressive block"),
    Knob("diffusion_steps", "denoising steps per completion"),
)


def from_d1(settings: Mapping[str, Any], world_size: int | None = None) -> Translation:
    name = "d1"
    v = resolve_knobs(name, D1, settings)
    world = world_size_from(name, v, None, None, world_size)
    G = group_size(name, "num_generations", v)
    P, A = required_values(name, v, "per_device_train_batch_size", "gradient_accumulation_steps")
    mu = v.get("num_iterations", 1)
    fields = {"per_device_train_batch_size": P, "gradient_accumulation_steps": A, "num_generations": G,
              "num_iterations": mu}
    notes = [(f"d1 (TRL 0.16) generates each of the {A} micro-batches of an optimizer step on its own; hf-grpo "
              f"generates them as one rollout of {P} x {A} = {P * A} per device (steps_per_generation = "
              f"gradient_accumulation_steps), then reuses it num_iterations={mu} times as d1 does")]
    if "generation_batch_size" in v:
        fields["per_device_generation_batch_size"] = v["generation_batch_size"]
        notes.append("generation_batch_size (the guide's per-device chunk) is per_device_generation_batch_size; "
                     "hf-grpo's generation_batch_size is TRL's global rollout")
    for key in ("tensor_batch_size", "max_completion_length", "block_length", "diffusion_steps"):
        if key in v:
            fields[key] = v[key]
    if "block_length" in v or "diffusion_steps" in v:
        notes.append("block_length / diffusion_steps are fields of hf_grpo.DiffuGRPOConfig (recipes/diffu_*.py)")
    source = (f"d1: {P} x {A} x {counted(world, 'device')} = {P * A * world} completions per optimizer step; "
              f"each generated "
              f"batch is used for num_iterations = {mu} optimizer steps")
    return finish_translation(name, fields, world, source, notes, P * A * world, Fraction(mu), P * A * world)


# ---- the registry -------------------------------------------------------------------------------------

FRAMEWORKS: dict[str, tuple[tuple[Knob, ...], Callable[..., Translation]]] = {
    "skyrl": (SKYRL, from_skyrl),
    "verl": (VERL, from_verl),
    "openrlhf": (OPENRLHF, from_openrlhf),
    "trlx": (TRLX, from_trlx),
    "d1": (D1, from_d1),
}


def translate(framework: str, settings: Mapping[str, Any], world_size: int | None = None,
              num_generations: int | None = None) -> Translation:
    """Dispatch to ``from_<framework>``; ``num_generations`` is for trlx only (its PPO has no groups).

    ``settings`` may be a whole config of the framework: keys that are not batch settings are left out and
    listed once in a note; a near miss of a batch key is an error with "did you mean"."""
    if framework not in FRAMEWORKS:
        raise TranslationError(f"unknown framework {framework!r}; one of {', '.join(FRAMEWORKS)}")
    settings, others = split_settings(framework, settings)
    if framework == "trlx":
        translation = from_trlx(settings, world_size, num_generations)
    elif num_generations is not None:
        key = {"skyrl": "generator.n_samples_per_prompt", "verl": "actor_rollout_ref.rollout.n",
               "openrlhf": "n_samples_per_prompt", "d1": "num_generations"}[framework]
        raise TranslationError(f"--num_generations is for trlx only; {framework} sets the group size with {key}")
    else:
        translation = FRAMEWORKS[framework][1](settings, world_size)
    if others:
        note = f"not batch settings, ignored ({len(others)}): {', '.join(others)}"
        translation = dataclasses.replace(translation, notes=(*translation.notes, note))
    return translation


def render(translation: Translation) -> str:
    """What ``hf-grpo plan --from`` prints: the flags, the plan, the source's own count, the notes."""
    t = translation
    processes = counted(t.world_size, "process")
    lines = [f"hf-grpo flags (a recipe launched on {processes}):", t.flags(), "", "batch plan:", str(t.plan), "",
             f"checked against {t.source}"]
    lines += [f"note: {note}" for note in t.notes]
    return "\n".join(lines)


def knob_keys(framework: str) -> list[str]:
    return [k.key for k in FRAMEWORKS[framework][0]]


__all__ = ["FRAMEWORKS", "Knob", "Translation", "TranslationError", "flatten_config", "from_d1", "from_openrlhf",
           "from_skyrl", "from_trlx", "from_verl", "knob_keys", "parse_settings", "render", "split_settings",
           "translate"]
