"""The ``hf-grpo`` command line: ``hf-grpo plan`` prints a config's batch plan without loading a model, and
``--from <framework>`` translates another framework's batch settings (``translate``).

May import: ``hf_grpo.config``, ``hf_grpo.plan``, ``hf_grpo.recipe_support.recipe_args`` and
``hf_grpo.diffusion.config`` (lazily); never the trainer, torch models or a GPU.
"""

from .main import main

__all__ = ["main"]
