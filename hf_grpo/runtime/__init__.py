"""The floor under the feature packages: what every one of them may import, and that imports none of them
(``tests/project/test_layering.py`` checks it).

- ``collectives``: the small all-reduces every rank calls alike (``max_over_ranks``, ``min_over_ranks``).
- ``graph_capture``: CUDA-graph capture and the weights a captured graph depends on, for decoding and training.
- ``regional_compile``: one compiled decoder layer serving every layer, for decoding and training.
- ``model_wrappers``: the transformers model under PEFT, DDP or DeepSpeed wrappers (``base_model``).
- ``exit_hooks``: what a process undoes before it ends abruptly (the output-dir lock's release).
- ``upstream``: the one module that names another library's private attributes and methods (TRL, transformers,
  accelerate, DeepSpeed), each behind a function that says the version it was read from.
"""
