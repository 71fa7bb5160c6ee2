"""Whether the cuda_graph backend compiles its decode step before capturing it (``compile_generation``).

Compiled, each decoder layer's dozen small element-wise kernels become a few fused ones; uncompiled, the same eager
step is captured in a CUDA graph, so the host's launch cost is gone either way and only the GPU's time per kernel
differs. Measured at 0.5B, 32 rows, 256-token rollouts, from a cold compile cache:

* H100 (``bench/results/grpo_phases_h100_num_iterations2_decode_compile.jsonl``): the first rollout 8.29 s compiled
  against 1.33 s eager, each later one 0.50 s against 1.20 s: 7 s once, to save 2.7 ms a decode step, repaid after
  about 2,600 decode steps;
* H200 (``bench/results/cold_start_h200.jsonl``): 13.2 s against 2.1 s, then 0.42 s against 0.91 s: 11 s once, to
  save 1.9 ms a step, repaid after about 5,800.

``"auto"`` compiles where the run will decode at least ``AUTO_MIN_DECODE_STEPS`` (its rollouts x
``max_completion_length``, the most a rollout decodes), between the two: a run on the wrong side of either break-even
loses at most about 4 s. A 10-step run of 256-token completions captures the eager step, a 20-step one compiles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

SETTINGS = ("auto", "on", "off")
FIELD = "compile_generation"
AUTO_MIN_DECODE_STEPS = 4096


@dataclass
class DecodeCompileFields:
    r"""
    ``GRPOConfig``'s field for the decode step's compile (``hf_grpo.generation.decode_compile``).

    Parameters:
        compile_generation (`str`, *optional*, defaults to `"auto"`):
            For the ``cuda_graph`` backend: ``"on"`` compiles the one-token decode step (one decoder layer, about
            10 s on a fresh machine, a few from a warm compile cache) before capturing it; ``"off"`` captures the
            eager step (no compile; each decode step a few milliseconds slower); ``"auto"`` compiles where the run
            decodes at least 4,096 steps (rollouts x ``max_completion_length``), where the compile pays for itself.
    """

    compile_generation: str = field(default="auto", metadata={
        "help": f"One of {SETTINGS}, for the cuda_graph backend: 'on' compiles the decode step before capturing it "
        "(about 10 s once), 'off' captures the eager step, 'auto' compiles where the run decodes at least "
        f"{AUTO_MIN_DECODE_STEPS} steps (rollouts x max_completion_length). See hf_grpo.generation.decode_compile."})


def validate_setting(value: object) -> None:
    if value not in SETTINGS:
        raise ValueError(f"{FIELD} must be one of {SETTINGS}, got {value!r}")


def planned_rollouts(optimizer_steps: int, gradient_accumulation_steps: int, steps_per_generation: int,
                     num_iterations: int) -> int:
    """Rollouts in a run of ``optimizer_steps``: TRL generates every ``steps_per_generation x num_iterations``
    micro-batches, and an optimizer step takes ``gradient_accumulation_steps`` of them."""
    micro_batches = optimizer_steps * gradient_accumulation_steps
    every = steps_per_generation * num_iterations
    return -(-micro_batches // every)


def choose(setting: str, decode_steps: int | None) -> tuple[bool | None, str]:
    """``(compile, why)`` for the backend: True or False, or None for its own default (compile where torch can);
    ``decode_steps``: the most the run decodes (rollouts x max_completion_length), None where unknown."""
    validate_setting(setting)
    if setting == "on":
        return True, f"{FIELD}='on'"
    if setting == "off":
        return False, f"{FIELD}='off'"
    if decode_steps is not None and decode_steps < AUTO_MIN_DECODE_STEPS:
        return False, (f"{FIELD}='auto' compiles runs that decode at least {AUTO_MIN_DECODE_STEPS} steps, where the "
                       f"compile (about 10 s once) pays for itself; this run decodes at most {decode_steps}: the eager "
                       "step is captured ('on' compiles)")
    told = "an unknown number of" if decode_steps is None else f"up to {decode_steps}"
    return None, f"{FIELD}='auto': the run decodes {told} steps"


def choose_for_run(config, optimizer_steps: int) -> tuple[bool | None, str]:
    """``choose`` for a run of ``optimizer_steps`` with ``config`` (a ``GRPOConfig``); the backend logs it."""
    rollouts = planned_rollouts(optimizer_steps, config.gradient_accumulation_steps, config.steps_per_generation,
                                config.num_iterations)
    decode_steps = rollouts * config.max_completion_length if optimizer_steps > 0 else None
    return choose(config.compile_generation, decode_steps)


def for_run(config, optimizer_steps: int, opened, main: bool) -> tuple[bool | None, str]:
    """``choose_for_run``, at train begin. The "auto" size probes open the run's backend before its length is known:
    where ``opened`` is that backend, the decision is applied to it now (it would compile at the first rollout, still
    ahead) and logged on ``main``; a backend opened later gets it from ``open_backend``."""
    decision = choose_for_run(config, optimizer_steps)
    said = apply(opened, decision)
    if said and main:
        logging.getLogger("hf_grpo").info("generation backend: cuda_graph; %s", said)
    return decision


def apply(backend, decision: tuple[bool | None, str] | None) -> str | None:
    """Tell a cuda_graph ``backend`` not to compile where ``decision`` (``choose_for_run``'s) says so (it compiles
    where torch can otherwise), before its first rollout; the decision as its log line gives it, None for a backend
    that compiles no decode step or no decision."""
    if decision is None or getattr(backend, "name", None) != "cuda_graph":
        return None
    compile, why = decision
    backend.compile = backend.compile and compile is not False
    return f"decode step {'captured eager' if compile is False else 'compiled'} ({why})"


def expected_at_start(config) -> bool:
    """Whether a run with ``config`` is expected to compile its decode step, before TRL has set up (its
    ``max_steps`` where given; a run counted in epochs is taken to be long)."""
    steps = config.max_steps if config.max_steps and config.max_steps > 0 else 0
    return choose_for_run(config, steps)[0] is not False
