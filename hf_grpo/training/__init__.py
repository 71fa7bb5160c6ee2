"""The training half of a step: how a micro-batch's forward and backward run once TRL hands it over.

``padding_free`` packs a micro-batch's rows into one sequence (variable-length attention, per-row positions;
``eager_packing`` decides it for eager micro-batches where the user left it to "auto"),
``graph_inputs`` brings it to the static shape of a bucket (``shape_reuse``: a new shape's first micro-batches in a
captured larger one), ``graphs`` replays its forward and backward (and the rollout's reference and old-policy
scoring) from CUDA graphs (``graph_buckets``) through ``cuda_graph_recorder``, ``compiled_layers``
compiles one decoder layer for every layer, ``cudnn_attention`` keeps cuDNN's attention out of training, and
``rank_shapes`` gives a micro-batch one static shape on every rank.

May import: ``hf_grpo.runtime`` (the compiled-layer, graph-capture and weight-signature helpers the decoder
shares, rank collectives), ``hf_grpo.run_state``, ``hf_grpo.distributed`` (DDP around a replay), ``hf_grpo.memory``,
torch, transformers; not ``hf_grpo.generation``. Never the trainer or the config class: they import from here.
"""
