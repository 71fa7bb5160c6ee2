"""``"auto"`` batch sizes: parsed with the config, probed once at train start on CUDA, saved with checkpoints.

Three fields may be ``"auto"``:

- ``per_device_generation_batch_size`` (g): probed by generating g full-length sequences at once.
- ``per_device_train_batch_size`` (P): probed by a forward and backward of P full-length sequences. The
  global batch per optimizer step and the rollout stay those of ``AUTO_DEFAULTS`` (P = 8): P is chosen
  among the divisors of 8 x gradient_accumulation_steps (and of 8 x steps_per_generation), and those two
  are scaled so P x A and P x S do not change. No prompt group is split and the optimisation is the one
  P = 8 would run; only the micro-batching differs.
- ``tensor_batch_size`` (t): probed with the train forward and backward at the chosen P.

On CPU (no CUDA device) ``"auto"`` resolves to ``AUTO_DEFAULTS`` when the config is built, without probing.
On CUDA the config holds those defaults provisionally (so TRL's own checks run) and lists the fields in
``config.auto_batch_fields``; ``resolve_auto_sizes`` replaces them in the run's sizes (``RunSizes``, never the
config) before the first step. A probe "fits"
when no rank runs out of memory and the peak allocated memory stays under ``auto_memory_fraction`` of the
device (of the per-process cap when one is set); sizes grow by doubling, then bisect, and every rank takes
the smallest size any rank found. The chosen sizes are printed and written to ``SIZES_FILE`` in every
checkpoint; a resumed run reads them instead of probing again where they were chosen for the same batch
(``hf_grpo.memory.saved_sizes``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..plan import AUTO, AUTO_DEFAULTS, AUTO_FIELDS, coerce_size, take_auto  # noqa: F401 (re-exported)
from ..run_state import RunFacts, RunSizes
from ..runtime.collectives import max_over_ranks, min_over_ranks
from .oom import BACKOFF_FIELDS, free_memory, is_oom, rng_state, set_rng_state
from .saved_sizes import SIZES_FILE, log_reuse, plan_reuse, read_saved_sizes, save_sizes  # noqa: F401 (re-exported)

logger = logging.getLogger("hf_grpo")

# Largest tensor_batch_size tried: past a few thousand rows the head's GEMMs gain nothing more.
MAX_AUTO_TENSOR_ROWS = 8192


# ---- search -------------------------------------------------------------------------------------
def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> tuple[int, list[tuple[int, bool]]]:
    """The largest of the ascending ``candidates`` for which ``fits`` holds, assuming it holds below a threshold.

    Grows by doubling the index (1st, 2nd, 4th, 8th candidate ...) until a failure, then bisects between
    the last success and the first failure. Returns it and every (candidate, fits) tried; if even the
    first fails, returns the first (the run's OOM back-off takes it from there).
    """
    tried: list[tuple[int, bool]] = []

    def check(index: int) -> bool:
        ok = fits(candidates[index])
        tried.append((candidates[index], ok))
        return ok

    if not check(0):
        return candidates[0], tried
    good, step = 0, 1
    bad = len(candidates)
    while good + step < len(candidates):
        if check(good + step):
            good, step = good + step, step * 2
        else:
            bad = good + step
            break
    while bad - good > 1:
        middle = (good + bad) // 2
        if check(middle):
            good = middle
        else:
            bad = middle
    return candidates[good], tried


def memory_cap_bytes(device: torch.device, fraction: float) -> int:
    """``fraction`` of the memory this process may use on ``device`` (the per-process cap if one is set)."""
    if device.index is None:  # a one-process run's accelerator says "cuda"; the fraction getter needs the index
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        total = int(total * getter(device))
    return int(total * fraction)


def fits_under(cap: int, device: torch.device, unit: Callable[[], None]) -> bool:
    """Run ``unit``; True on every rank when no rank ran out of memory and every rank's peak stayed under ``cap``."""
    free_memory()
    torch.cuda.reset_peak_memory_stats(device)
    ok = True
    try:
        unit()
        torch.cuda.synchronize(device)
    except Exception as err:
        if not is_oom(err):
            raise
        ok = False
    if ok:
        ok = torch.cuda.max_memory_allocated(device) <= cap
    free_memory()
    return not max_over_ranks(int(not ok))


def powers_of_two_upto(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, plus ``limit`` itself, ascending."""
    return sorted({1 << k for k in range(max(limit, 1).bit_length())} | {max(limit, 1)})


def train_batch_candidates(per_step: int, per_rollout: int) -> list[int]:
    """Micro-batch sizes P that divide both the per-device batch per optimizer step and the per-device rollout."""
    common = math.gcd(per_step, per_rollout)
    return [p for p in range(1, common + 1) if common % p == 0]


# ---- the run side ---------------------------------------------------------------------------------
def apply_train_batch_size(sizes: RunSizes, new: int) -> None:
    """Set P, scaling gradient_accumulation_steps and steps_per_generation so P x A and P x S stay fixed."""
    old = sizes.per_device_train_batch_size
    per_step = old * sizes.gradient_accumulation_steps
    per_rollout = old * sizes.steps_per_generation
    if per_step % new or per_rollout % new:
        raise ValueError(
            f"per_device_train_batch_size={new} must divide the per-device batch per optimizer step ({per_step}) "
            f"and the per-device rollout ({per_rollout}); valid: {train_batch_candidates(per_step, per_rollout)}"
        )
    sizes.per_device_train_batch_size = new
    sizes.gradient_accumulation_steps = per_step // new
    sizes.steps_per_generation = per_rollout // new


def apply_sizes(sizes: RunSizes, chosen: dict[str, Any], fields: Sequence[str]) -> None:
    for name in fields:
        if name == "per_device_train_batch_size":
            apply_train_batch_size(sizes, int(chosen[name]))
        else:
            setattr(sizes, name, chosen[name])


@dataclass
class ProbeTarget:
    """What the probes run on: the policy and the trainer's own scoring and generation, passed in by the trainer.

    ``score(input_ids, mask, logits_to_keep)`` is the trainer's log-prob forward (``(logps, entropies, ...)``);
    ``backend()`` its generation backend; ``generate_kwargs`` the rollout's (generation config, pad and EOS ids);
    ``knobs`` the run's out-of-memory knobs, held off while probing."""

    model: torch.nn.Module
    device: torch.device
    longest_prompt: int
    max_completion_length: int
    score: Callable[[torch.Tensor, torch.Tensor, int], tuple]
    backend: Callable[[], Any]
    generate_kwargs: dict[str, Any]
    optimizer_made: bool
    knobs: Sequence[Any] = ()


def resolve_auto_sizes(sizes: RunSizes, facts: RunFacts, memory_fraction: float, target: Callable[[], ProbeTarget],
                       checkpoint: str | None = None, main: bool = True) -> dict[str, Any]:
    """Replace the run's provisional "auto" sizes: from ``checkpoint``'s saved sizes where they were chosen for
    this run's batch, else by probing (``target()`` says on what); and keep the chunk sizes an out-of-memory had
    lowered there, where this run starts them from the same value (``hf_grpo.memory.saved_sizes``).

    Every rank calls it (the probes are collective). Returns the sizes set (each source logged on rank 0).
    """
    auto = tuple(sizes.auto_fields)
    reuse = plan_reuse(read_saved_sizes(checkpoint), sizes, facts.max_completion_length, auto)
    if checkpoint is not None and main:
        log_reuse(reuse, checkpoint)
    probed = tuple(name for name in auto if name not in reuse.auto)
    if not auto and not reuse.backoffs:
        sizes.configured = {name: getattr(sizes, name) for name in BACKOFF_FIELDS}
        return {}
    if auto and facts.engine is not None:
        # Their engines take the micro-batch and accumulation at init and partition the model; a probe of the
        # bare model would measure neither their memory nor their batch sizes. (A chunk size an out-of-memory
        # lowered in the saved run is kept as anywhere: it changes no engine's batch.)
        fields = ", ".join(auto)
        raise ValueError(
            f"{fields}='auto' is supported on one GPU and under DDP, not under DeepSpeed or FSDP; set "
            f"integers there (an out-of-memory in a generation or log-prob chunk still halves that chunk)"
        )
    apply_sizes(sizes, reuse.auto, tuple(reuse.auto))
    if probed:
        probe = Prober(sizes, target(), memory_fraction)
        start = rng_state(probe.device)  # probes sample: the run must draw as if none had run
        for name in ("per_device_generation_batch_size", "per_device_train_batch_size", "tensor_batch_size"):
            if name in probed:
                apply_sizes(sizes, {name: min_over_ranks(probe.search(name))}, [name])
        probe.close()
        set_rng_state(start, probe.device)
    sizes.auto_fields = ()
    sizes.configured = {name: getattr(sizes, name) for name in BACKOFF_FIELDS}  # before the kept back-offs
    apply_sizes(sizes, {name: lowered for name, (_, lowered) in reuse.backoffs.items()}, tuple(reuse.backoffs))
    chosen = {name: getattr(sizes, name) for name in (*auto, *reuse.backoffs)}
    if "per_device_train_batch_size" in auto:
        chosen["gradient_accumulation_steps"] = sizes.gradient_accumulation_steps
        chosen["steps_per_generation"] = sizes.steps_per_generation
    for names, source in ((reuse.auto, f"read from {checkpoint}, where the run that saved it chose them for the "
                                       f"same batch"),
                          (probed, f"probed under {memory_fraction:.0%} of device memory")):
        if names and main:
            logger.warning("auto batch sizes (%s): %s", source, ", ".join(
                f"{k}={v}" for k, v in chosen.items() if k in names or (
                    k in ("gradient_accumulation_steps", "steps_per_generation")
                    and "per_device_train_batch_size" in names)))
    return chosen


class Prober:
    """Tries sizes on the real model at the run's longest lengths (longest prompt + max_completion_length)."""

    def __init__(self, sizes: RunSizes, target: ProbeTarget, memory_fraction: float):
        self.sizes, self.target = sizes, target
        self.device = target.device
        self.cap = memory_cap_bytes(self.device, memory_fraction)
        self.length = int(target.longest_prompt) + int(target.max_completion_length)
        model = target.model
        self.vocab = model.get_input_embeddings().weight.shape[0]
        # The optimizer's state is made at its first step, after the probes: hold its likely size (Adam's
        # two moments, one copy of each trainable parameter each) so the probe leaves room for it.
        ballast = 0 if target.optimizer_made else 2 * sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._ballast = torch.empty(ballast, dtype=torch.uint8, device=self.device) if ballast else None
        self.knobs = list(target.knobs)
        for knob in self.knobs:  # a probe's OOM must fail the probe, not shrink the run's sizes
            knob.enabled = False
        self.log: list[dict[str, Any]] = []

    def close(self) -> None:
        for knob in self.knobs:
            knob.enabled = True
        self._ballast = None
        free_memory()

    def search(self, name: str) -> int:
        sizes = self.sizes
        if name == "per_device_generation_batch_size":
            rollout = sizes.per_device_train_batch_size * sizes.steps_per_generation
            candidates, unit = powers_of_two_upto(rollout), self._generation_unit
        elif name == "per_device_train_batch_size":
            candidates = train_batch_candidates(
                sizes.per_device_train_batch_size * sizes.gradient_accumulation_steps,
                sizes.per_device_train_batch_size * sizes.steps_per_generation)
            unit = lambda p: self._train_unit(p, sizes.tensor_batch_size)
        else:
            rows = sizes.per_device_train_batch_size * self.target.max_completion_length  # scored rows per micro-batch
            candidates = [t for t in powers_of_two_upto(MAX_AUTO_TENSOR_ROWS) if t >= 256 and t <= max(rows, 256)]
            unit = lambda t: self._train_unit(sizes.per_device_train_batch_size, t)
        best, tried = largest_fitting(candidates, lambda size: fits_under(self.cap, self.device, lambda: unit(size)))
        self.log.append({"field": name, "tried": tried, "chosen": best, "length": self.length})
        return best

    def _batch(self, rows: int, length: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)  # not the run's RNG: probing must not change the run
        return torch.randint(2, self.vocab, (rows, length), generator=generator).to(self.device)

    def _train_unit(self, rows: int, tensor_rows: int | None) -> None:
        target, sizes = self.target, self.sizes
        saved = sizes.tensor_batch_size
        sizes.tensor_batch_size = tensor_rows  # the head reads its chunk from the run's sizes
        try:
            input_ids = self._batch(rows, self.length)
            mask = torch.ones_like(input_ids)
            target.model.train()
            logps, entropies, _ = target.score(input_ids, mask, target.max_completion_length)
            (logps.sum() + entropies.sum()).backward()
        finally:
            sizes.tensor_batch_size = saved
            target.model.zero_grad(set_to_none=True)

    def _generation_unit(self, rows: int) -> None:
        target = self.target
        new_tokens = 2  # the cache is sized by prompt + new tokens; a full-length prefill bounds the decode's peak
        prompt = [self._batch(1, self.length - new_tokens)[0].tolist()] * rows
        kwargs = dict(target.generate_kwargs)
        config = kwargs["generation_config"]
        config = kwargs["generation_config"] = config.__class__.from_dict(config.to_dict())
        config.max_new_tokens, config.min_new_tokens = new_tokens, new_tokens
        backend = self._probe_backend()
        with torch.no_grad():
            backend.generate(target.model, prompt, chunk_size=rows, **kwargs)
        backend.release(empty_cache=False)

    def _probe_backend(self):
        # The run's backend, or what it measures with (cuda_graph: an eager one with the same cache size)
        return self.target.backend().for_memory_probe()


class SaveSizesCallback(TrainerCallback):
    """Writes the run's sizes (after "auto" and any OOM back-off) into a checkpoint saved with ``save_only_model``,
    for a resume to read. Other checkpoints get them from the trainer's ``_save_rng_state``, before
    ``trainer_state.json`` marks them complete (this callback runs after it, and after the old checkpoints'
    rotation)."""

    def __init__(self, sizes: RunSizes, max_completion_length: int):
        self.sizes, self.max_completion_length = sizes, max_completion_length

    def on_save(self, args, state, control, **kwargs):
        if args.save_only_model and state.is_world_process_zero:
            directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            save_sizes(self.sizes, self.max_completion_length, directory)
