"""Refusals made before a model loads or a step runs (or a rollout no reward scored), each an error naming what was
found and what is needed.

``inputs`` checks what a user hands the trainer (data set, model path, reward functions, installed backends),
``output_dirs`` refuses to overwrite another run's checkpoints by surprise, ``output_lock`` refuses a second run
into a folder another run is writing, ``checkpoints`` and ``resume`` resume only from complete checkpoints, ``unscored``
refuses a rollout no reward function scored and counts the completions none scored. ``prompts`` refuses a tokenizer
without an EOS token and prompts of no token or too long for the model; ``checkpoint_save`` names a save that
failed (a full disk) and the checkpoint it left intact.

May import: torch, numpy, accelerate, the standard library, and ``hf_grpo.runtime`` and ``hf_grpo.distributed``
(ranks agreeing on a checkpoint, a ZeRO checkpoint's shape, the exit hook of the output-dir lock). Never the
trainer or the config class (they call in here).
"""
