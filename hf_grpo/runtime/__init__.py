"""The floor under the feature packages: what every one of them may import, and that imports none of them.

- ``upstream``: the one module that names another library's private attributes and methods (TRL, transformers,
  accelerate, DeepSpeed), each behind a function that says the version it was read from.
"""
