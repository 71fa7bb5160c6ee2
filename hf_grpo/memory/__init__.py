"""Memory control: sizes that tune themselves and runs that survive running out of memory.

``autosize`` probes ``"auto"`` batch sizes, ``oom`` halves a chunk size on every rank after an out-of-memory,
``train_backoff`` does the same for the training micro-batch, ``context_fit`` estimates the longest completion a
device fits, ``token_budget`` packs a micro-batch into passes of at most ``max_tokens_per_micro_batch`` tokens,
``stats`` measures time and peak memory, ``prompt_lengths`` finds the training set's longest prompt, ``flops``
counts the work a step must do and ``device_rates`` measures what the GPU can do (the efficiency figures).

May import: ``hf_grpo.plan``, ``hf_grpo.run_state``, ``hf_grpo.runtime``, torch, accelerate, transformers; not
``hf_grpo.generation`` (a backend says what autosize probes with: ``for_memory_probe``). Takes the run's facts and
sizes (``hf_grpo.run_state``), knobs, plain values and callables, never the trainer (so never ``hf_grpo.trainer``
or ``hf_grpo.config``).
"""
