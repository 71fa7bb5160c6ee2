"""Memory control: sizes that tune themselves and runs that survive running out of memory.

``autosize`` probes ``"auto"`` batch sizes, ``oom`` halves a chunk size on every rank after an out-of-memory,
``train_backoff`` does the same for the training micro-batch, ``token_budget`` packs a micro-batch into passes
of at most ``max_tokens_per_micro_batch`` tokens, ``stats`` measures time and peak memory, ``prompt_lengths`` finds
the training set's longest prompt.

May import: ``hf_grpo.plan``, torch, accelerate, transformers. Takes knobs and objects with the attributes it
reads, never the trainer class (so never ``hf_grpo.trainer`` or ``hf_grpo.config``).
"""
