"""``RunDecisions``: what the trainer decides once in a run, for the helpers that read it later."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RunDecisions:
    """Each decision starts undecided (None) and is set once, at construction, train begin or the first rollout."""

    chunked_head: bool = True  # the policy's LM head runs in row chunks (False: TRL's fused head is kept)
    lora_fused_layers: int = 0  # LoRA layers on the fused forward
    backend: Any = None  # the generation backend (hf_grpo.generation), opened at the first rollout
    decode_compile: Any = None  # whether the decode step compiles, and why (generation.decode_compile), at train begin
    mirror_decided: bool = False
    mirror: Any = None  # ZeRO-3's or LoRA's dense generation mirror (generation.dense_mirror.MirrorChoice) or None
    train_layers: Any = None  # compiled decoder layers (training.compiled_layers), at train begin
    eager_rows: Any = None  # packed or padded eager micro-batches (training.eager_packing.Choice), at train begin
    train_graphs: Any = None  # CUDA-graph replay of micro-batches (training.graphs.TrainingGraphs), at train begin
    prompt_grouping: str | None = None  # "on", or why a prompt's rows keep TRL's shuffle; at the first rollout

    @property
    def graphs_replay(self) -> bool:
        """Whether micro-batches replay from CUDA graphs (chosen, and no capture has failed)."""
        return self.train_graphs is not None and self.train_graphs.failure is None
