"""BatchPlan: the arithmetic of the per-device batch-size contract, with no torch import; and the stand-ins for
"auto" sizes (``take_auto``) the plan computes with until ``hf_grpo.memory.autosize`` probes them.

Symbols follow the README's "Batch sizes: all per device" section (the contract): P per-device micro-batch, A accumulation steps, S micro-batches
per rollout, G generations per prompt, mu passes per rollout, g per-device generation chunk,
t log-softmax row chunk, W data-parallel processes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from fractions import Fraction
from typing import Any


def _plural(count: int | Fraction, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else (plural or word + 's')}"


def _bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def nearest_valid(value: int, ok, *, limit: int = 1 << 20) -> list[int]:
    """The closest integers >= 1 to ``value`` for which ``ok`` holds (one below, one above), closest first."""
    found = []
    for lower in range(value - 1, 0, -1):
        if ok(lower):
            found.append(lower)
            break
    for upper in range(value + 1, value + limit):
        if ok(upper):
            found.append(upper)
            break
    return sorted(found, key=lambda v: (abs(v - value), v))


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


# ---- "auto" sizes as given (probed at train start by hf_grpo.memory.autosize) ---------------------
AUTO = "auto"
# What "auto" means where nothing is probed (CPU). None: the whole per-device rollout in one chunk.
AUTO_DEFAULTS: dict[str, int | None] = {
    "per_device_generation_batch_size": None,
    "per_device_train_batch_size": 8,
    "tensor_batch_size": 1024,
}
AUTO_FIELDS = tuple(AUTO_DEFAULTS)


def coerce_size(name: str, value: Any) -> int | str | None:
    """A size field's value as an int, ``"auto"`` or None (tensor_batch_size, per_device_generation_batch_size).

    Command-line and YAML values may arrive as text ("4", "auto", "none"). Anything else is a ValueError
    naming the field, the value and what is valid. Range checks (>= 1) stay with the batch plan.
    """
    nullable = name != "per_device_train_batch_size"
    valid = "a positive integer or 'auto'" + (" or None" if nullable else "")
    if value is None:
        if nullable:
            return None
        raise ValueError(f"{name} must be {valid}, got None")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {valid}, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        if nullable and text.lower() in ("none", "null"):
            return None
        if re.fullmatch(r"[+-]?[0-9]+", text):
            return int(text)
    raise ValueError(f"{name} must be {valid}, got {value!r}")


def take_auto(values: dict[str, Any], probe_later: bool) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Replace each ``"auto"`` in ``values`` by its ``AUTO_DEFAULTS`` value.

    Returns the new values and the fields left for ``hf_grpo.memory.autosize.resolve_auto_sizes`` (none unless
    ``probe_later``, i.e. CUDA: there the defaults are provisional).
    """
    values = dict(values)
    auto = []
    for name in AUTO_FIELDS:
        values[name] = coerce_size(name, values.get(name))
        if values[name] == AUTO:
            values[name] = AUTO_DEFAULTS[name]
            auto.append(name)
    return values, tuple(auto) if probe_later else ()


@dataclass(frozen=True)
class BatchPlan:
    """Per-device batch sizes plus the world size, and everything derived from them."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_generations: int
    num_iterations: int
    per_device_generation_batch_size: int
    tensor_batch_size: int | None
    world_size: int = 1
    max_tokens_per_micro_batch: int | None = None  # token budget per forward/backward pass (None: one pass)
    # fields given as "auto" and not chosen yet (CUDA: probed at train start); their values above are provisional
    auto_batch_fields: tuple[str, ...] = ()
    # ZeRO-3 only, once the trainer has decided (hf_grpo.generation.dense_mirror): "on" or "off", else None; when on,
    # the dense copy of the weights the decoder reads: one model copy per device, in the generation dtype
    generation_mirror: str | None = None
    generation_mirror_kind: str = "ZeRO-3"
    generation_mirror_bytes: int = 0
    generation_mirror_dtype: str | None = None
    generation_mirror_in_place: bool = False  # ZeRO-3 with one process: the partitions read in place, no copy
    generation_mirror_freed: bool = False  # the copy's memory freed after each rollout (release_generation_memory)
    # ZeRO-3 only, set by the trainer (hf_grpo.distributed.zero3_leaves): modules whose parameters one hook fetches together
    leaf_module_classes: tuple[str, ...] = ()
    leaf_module_count: int = 0

    @classmethod
    def from_fields(cls, values: Mapping[str, Any], world_size: int) -> BatchPlan:
        """The plan of a config's fields (any mapping holding them, extra keys ignored)."""
        # A field with a default is optional: a mapping without it means "unset".
        given = {f.name: values[f.name] for f in fields(cls) if f.name != "world_size" and
                 (f.name in values or f.default is MISSING)}
        return cls(**given, world_size=world_size)

    # ---- derived figures -------------------------------------------------------------
    @property
    def rollout_per_device(self) -> int:
        """R = P x S completions generated on each device per rollout."""
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def global_rollout(self) -> int:
        return self.rollout_per_device * self.world_size

    @property
    def prompts_per_rollout(self) -> int:
        """Unique prompts per rollout, over all devices (R x W / G)."""
        return self.global_rollout // self.num_generations

    @property
    def global_batch_size(self) -> int:
        """Completions per optimizer step, over all devices (P x A x W)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def optimizer_steps_per_rollout(self) -> Fraction:
        """S x mu / A; below 1 when one optimizer step spans several rollouts."""
        return Fraction(self.steps_per_generation * self.num_iterations, self.gradient_accumulation_steps)

    @property
    def generation_chunks(self) -> int:
        return math.ceil(self.rollout_per_device / self.per_device_generation_batch_size)

    @property
    def last_generation_chunk(self) -> int:
        """Size of the last generation chunk (smaller than g when g does not divide R)."""
        return self.rollout_per_device - (self.generation_chunks - 1) * self.per_device_generation_batch_size

    def logprob_chunks(self, tokens: int) -> int:
        """Log-softmax chunks for a micro-batch of ``tokens`` token rows."""
        return 1 if self.tensor_batch_size is None else math.ceil(tokens / self.tensor_batch_size)

    # ---- validation --------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every broken rule of the contract, each as a message naming fields, values and a fix."""
        sizes = {
            "per_device_train_batch_size": (self.per_device_train_batch_size, 1),
            "gradient_accumulation_steps": (self.gradient_accumulation_steps, 1),
            "steps_per_generation": (self.steps_per_generation, 1),
            "num_generations": (self.num_generations, 2),
            "num_iterations": (self.num_iterations, 1),
            "per_device_generation_batch_size": (self.per_device_generation_batch_size, 1),
            "world size": (self.world_size, 1),
        }
        if self.tensor_batch_size is not None:
            sizes["tensor_batch_size"] = (self.tensor_batch_size, 1)
        if self.max_tokens_per_micro_batch is not None:
            sizes["max_tokens_per_micro_batch"] = (self.max_tokens_per_micro_batch, 1)
        found = []
        for name, (value, minimum) in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                why = " (GRPO compares completions within a group)" if name == "num_generations" else ""
                unset = {"tensor_batch_size": " or None for no chunking",
                         "max_tokens_per_micro_batch": " or None for one pass per micro-batch"}.get(name, "")
                found.append(f"{name} must be an integer >= {minimum}{unset}, got {value!r}{why}")
        if found:  # the rules below divide by these sizes
            return found

        P, S, A, G, W = (
            self.per_device_train_batch_size,
            self.steps_per_generation,
            self.gradient_accumulation_steps,
            self.num_generations,
            self.world_size,
        )
        if (P * S * W) % G:
            nearest_p = nearest_valid(P, lambda p: (p * S * W) % G == 0)
            nearest_s = nearest_valid(S, lambda s: (s * P * W) % G == 0 and (s % A == 0 or A % s == 0))
            found.append(
                f"per_device_train_batch_size ({P}) x steps_per_generation ({S}) x world size ({W}) = "
                f"{P * S * W} completions per rollout is not a multiple of num_generations ({G}), so a "
                f"prompt group would be split; nearest valid per_device_train_batch_size: {_either(nearest_p)}"
                + (f" (or steps_per_generation: {_either(nearest_s)})" if nearest_s else "")
            )
        if S % A and A % S:
            nearest_s = nearest_valid(S, lambda s: s % A == 0 or A % s == 0)
            found.append(
                f"steps_per_generation ({S}) and gradient_accumulation_steps ({A}) must divide one another, "
                f"so that a rollout of {P} x {S} x {W} = {P * S * W} completions covers whole optimizer steps "
                f"of {P} x {A} x {W} = {P * A * W} completions; nearest valid steps_per_generation: "
                f"{_either(nearest_s)}"
            )
        R = P * S
        if self.per_device_generation_batch_size > R:
            found.append(
                f"per_device_generation_batch_size ({self.per_device_generation_batch_size}) is larger than the "
                f"rollout on this device, per_device_train_batch_size ({P}) x steps_per_generation ({S}) = {R} "
                f"completions; nearest valid: {R}. It is a per-device chunk size; TRL's generation_batch_size "
                f"is the global rollout ({R * W} here) and keeps that meaning"
            )
        return found

    def validate(self) -> BatchPlan:
        """Raise one ``ValueError`` listing every broken rule; return self when all hold."""
        found = self.problems()
        if found:
            raise ValueError("Invalid batch sizes:\n  - " + "\n  - ".join(found))
        return self

    # ---- rendering ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        derived = {
            "rollout_per_device": self.rollout_per_device,
            "global_rollout": self.global_rollout,
            "prompts_per_rollout": self.prompts_per_rollout,
            "global_batch_size": self.global_batch_size,
            "optimizer_steps_per_rollout": float(self.optimizer_steps_per_rollout),
            "generation_chunks": self.generation_chunks,
        }
        return {**asdict(self), **derived}

    def _mirror_line(self) -> str:
        if self.generation_mirror_kind == "LoRA":
            if self.generation_mirror != "on":
                return "│   └── LoRA: decoded with the adapters as they are (lora_generation_mirror)"
            return ("│   └── LoRA: decoded with the adapters merged into the weights in place for each rollout, "
                    "restored after from a host copy; no GPU copy (lora_generation_mirror)")
        if self.generation_mirror != "on":
            return ("│   └── ZeRO-3: no dense mirror, the hf backend generates from the ZeRO-3 model "
                    "(zero3_generation_mirror)")
        if self.generation_mirror_in_place:
            return ("│   └── ZeRO-3: decoded from the partitions in place (one process holds them whole), no GPU copy "
                    "(zero3_generation_mirror)")
        held = (", held during rollouts only (release_generation_memory)" if self.generation_mirror_freed
                else ", held for the whole run")
        return (f"│   └── ZeRO-3: decoded from a dense mirror, one {self.generation_mirror_dtype} copy of the model per "
                f"device ({_bytes(self.generation_mirror_bytes)}), refreshed layer by layer{held} "
                f"(zero3_generation_mirror)")

    def __str__(self) -> str:
        P, A, S, W = (
            self.per_device_train_batch_size,
            self.gradient_accumulation_steps,
            self.steps_per_generation,
            self.world_size,
        )
        g, R = self.per_device_generation_batch_size, self.rollout_per_device
        devices = _plural(W, "device")
        chunks = f"{_plural(self.generation_chunks, 'chunk')} of {g}"
        if self.last_generation_chunk != g:
            chunks += f" (the last of {self.last_generation_chunk})"
        steps = self.optimizer_steps_per_rollout
        if steps >= 1 or steps.numerator != 1:
            steps_text = f"{_plural(steps, 'optimizer step')} per rollout"
        else:
            steps_text = f"1 optimizer step per {steps.denominator} rollouts"
        if self.tensor_batch_size is None:
            logsoftmax = "log-softmax over all token rows at once (tensor_batch_size unset)"
        else:
            logsoftmax = f"log-softmax in chunks of {self.tensor_batch_size} token rows (tensor_batch_size)"
        return "\n".join(
            [
                f"rollout: {_plural(self.prompts_per_rollout, 'prompt')} x "
                f"{_plural(self.num_generations, 'generation')} = {self.global_rollout} completions "
                f"({R} per device x {devices})",
                f"├── generation: {R} per device in {chunks} (per_device_generation_batch_size)",
                *([self._mirror_line()] if self.generation_mirror is not None else []),
                f"├── training: {_plural(S, 'micro-batch', 'micro-batches')} of {P} per device "
                f"(per_device_train_batch_size)",
                *([f"│   ├── each split into forward/backward passes of at most {self.max_tokens_per_micro_batch} padded "
                   f"tokens (max_tokens_per_micro_batch), equally many on every device"]
                  if self.max_tokens_per_micro_batch is not None else []),
                *([(f"│   ├── ZeRO-3: {self.leaf_module_count} leaf modules ({', '.join(self.leaf_module_classes)}), "
                    f"one parameter gather each (zero3_leaf_modules)")] if self.leaf_module_count else []),
                f"│   └── optimizer step every {_plural(A, 'micro-batch', 'micro-batches')}: "
                f"{P} x {A} x {devices} = {self.global_batch_size} completions",
                f"├── {steps_text}, {_plural(self.num_iterations, 'pass', 'passes')} (num_iterations)",
                f"└── {logsoftmax}",
                *([f"auto: {', '.join(self.auto_batch_fields)} chosen at train start (probed on the device); "
                   f"the values above are provisional"] if self.auto_batch_fields else []),
            ]
        )
