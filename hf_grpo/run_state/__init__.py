"""What helpers know of a run, built by the trainer: facts, sizes and decisions, never the trainer itself.

``RunFacts`` (``facts``) is fixed once the trainer is built: the device, the processes, what shards the model, the
model's traits, the loss settings the helpers test. ``RunSizes`` (``sizes``) holds the sizes that change during a
run ("auto" sizes settled at train start, chunk sizes halved after an out-of-memory): the one place they live, so
the config the user built is never written after the trainer is. ``RunDecisions`` (``decisions``) holds what the
trainer decides once (generation backend and mirror, compiled layers, training graphs, eager layout, grouping).

``hf_grpo.training``, ``hf_grpo.memory`` and ``hf_grpo.generation`` take these, or plain values; where a helper must
run the trainer's own code (a probe's forward), the trainer passes a callable.

May import: nothing of ``hf_grpo`` (every other package imports from here), no torch.
"""

from .decisions import RunDecisions
from .facts import RunFacts, is_moe
from .sizes import SIZE_FIELDS, RunSizes

__all__ = ["RunDecisions", "RunFacts", "RunSizes", "SIZE_FIELDS", "is_moe"]
