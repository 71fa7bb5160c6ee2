"""``RunSizes``: the batch and chunk sizes of a run as they stand, the one place they live once the trainer is built.

The trainer copies them from the config at construction. "auto" sizes are settled here at train start
(``hf_grpo.memory.autosize``) and an out-of-memory halves a chunk size here (``hf_grpo.memory.oom``); the batch
plan, ``perf/`` logs and the sizes saved in checkpoints read them here. TRL and transformers read the micro-batch
and the accumulation from the trainer's ``args``: where train start settles other values than the config's, the
trainer hands them a copy of the config carrying them (``published``); the user's config is left as built.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

SIZE_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
               "per_device_generation_batch_size", "tensor_batch_size", "max_tokens_per_micro_batch")


@dataclass
class RunSizes:
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    per_device_generation_batch_size: int | None
    tensor_batch_size: int | None
    max_tokens_per_micro_batch: int | None
    # "auto" sizes that hold provisional defaults until train start probes them (config.auto_batch_fields)
    auto_fields: tuple[str, ...] = ()
    # the value each chunk size started from in this run (before a kept back-off), saved with checkpoints
    configured: dict[str, Any] | None = field(default=None)

    @classmethod
    def from_config(cls, config: Any) -> RunSizes:
        return cls(**{name: getattr(config, name) for name in SIZE_FIELDS},
                   auto_fields=tuple(getattr(config, "auto_batch_fields", ())))

    def values(self) -> dict[str, Any]:
        """The sizes by field name, as the config names them."""
        return {name: getattr(self, name) for name in SIZE_FIELDS}

    def plan_fields(self) -> dict[str, Any]:
        """What the batch plan reads over the config's fields."""
        return {**self.values(), "auto_batch_fields": self.auto_fields}

    def differs_from(self, config: Any) -> bool:
        return any(getattr(config, name) != value for name, value in self.plan_fields().items())

    def published(self, config: Any) -> Any:
        """A copy of ``config`` carrying these sizes, for the code that reads them from ``args`` (TRL,
        transformers). A new object built here; ``config`` itself is not written."""
        carried = copy.copy(config)
        vars(carried).update(self.plan_fields())  # filled in as it is made, before anyone holds it
        return carried
