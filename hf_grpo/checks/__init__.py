"""Refusals made before a model loads or a step runs, each an error naming what was found and what is needed.

``inputs`` checks what a user hands the trainer (data set, model path, reward functions, installed backends),
``output_dirs`` refuses to overwrite another run's checkpoints by surprise, ``output_lock`` refuses a second run
into a folder another run is writing.

May import: torch, numpy, the standard library. Never the trainer or the config class (they call in here).
"""
