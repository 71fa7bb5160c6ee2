"""The work a GRPO step must do, counted from the model's shapes and the tokens it runs over.

Two figures make a step's floor on a GPU: the matmul FLOPs of the scoring and training passes (bound by the
device's matmul rate) and the bytes each decode step must read (the weights once, and every row's keys and values
so far; bound by the memory bandwidth). Both are counted here from plain values: what the trainer sees of a batch
(masks and completion lengths), never from timings.

What is counted is the useful work: a row's padding is not, and the prompt that a group's completions share is
counted once (the packed layout runs it once, ``training.padding_free``); activation checkpointing's recompute is,
because the run's memory needs it. So the achieved rate is this work over the measured time, and a layout that
computes padding shows a lower rate, as it should.

Per token and decoder layer (``L`` = the sum of the layer's matmul weights, ``a`` = heads x head dim):
forward ``2 L`` plus ``4 a`` per (query, key) pair attended; backward ``2 L`` for the inputs' gradient of every
matmul and ``2 T`` for the weights' gradient of the trainable ones (``T``: their weights), attention twice its
forward. The head (vocabulary ``V``, hidden ``H``) runs only for scored tokens: ``2 H V`` forward; in the backward
``2 H V`` for the hidden states' gradient, again for its weights where they train, and once more for the logits
the chunked head recomputes instead of keeping (``ops.chunked_logprobs``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..ops.equal_rows import first_equal_prompt
from ..run_state.facts import is_moe
from .stats import PerformanceStats


@dataclasses.dataclass(frozen=True)
class ModelWork:
    """A decoder-only model's per-token work, read from its modules (``from_model``)."""

    layers: int
    layer_matmul_params: int  # every matmul weight of one decoder layer (a frozen base and its adapters)
    layer_trainable_matmul_params: int  # those whose weights get a gradient
    attention_width: int  # heads x head dim: the query side of the attention products
    hidden: int
    vocab: int
    head_trainable: bool
    kv_bytes_per_token: int  # keys and values of one token over all layers, in the cache's dtype
    decode_weight_bytes: int  # what one decode step reads of the weights (the layers' matmuls and the head)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelWork | None:
        """The counts for ``model`` (a PEFT model or a plain one, partitioned by ZeRO-3 or not), or None where they
        would not describe its work: a mixture of experts (each token runs only some), a model that does not attend
        causally (masked diffusion), a config without the usual names, no decoder-layer list or head."""
        config = getattr(model, "config", None)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        names = ("num_hidden_layers", "num_attention_heads", "hidden_size")
        if (text is None or not all(getattr(text, name, None) for name in names)
                or getattr(text, "is_causal", True) is False or getattr(text, "is_encoder_decoder", False)
                or is_moe(text)):
            return None
        layers = _decoder_layers(model, text.num_hidden_layers)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if layers is None or head is None:
            return None
        matmul = trainable = base_bytes = 0
        for name, module in layers[0].named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or weight is None:
                continue
            count = _numel(weight)
            matmul += count
            trainable += count if weight.requires_grad else 0
            # a decode step reads the base weights (the adapters, in PEFT's lora_A / lora_B, are merged into them)
            if not any(part.startswith("lora_") for part in name.split(".")):
                base_bytes += count * weight.element_size()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_weight = head.weight
        element = head_weight.element_size()
        return cls(layers=len(layers), layer_matmul_params=matmul, layer_trainable_matmul_params=trainable,
                   attention_width=heads * head_dim, hidden=text.hidden_size, vocab=_numel(head_weight) //
                   text.hidden_size, head_trainable=head_weight.requires_grad,
                   kv_bytes_per_token=len(layers) * 2 * kv_heads * head_dim * element,
                   decode_weight_bytes=len(layers) * base_bytes + _numel(head_weight) * element)

    def forward_flops(self, tokens: int, pairs: int, scored: int) -> int:
        """One forward over ``tokens`` tokens attending over ``pairs`` (query, key) pairs, ``scored`` of them
        through the head."""
        layers = self.layers * (2 * self.layer_matmul_params * tokens + 4 * self.attention_width * pairs)
        return layers + 2 * self.hidden * self.vocab * scored

    def training_flops(self, tokens: int, pairs: int, scored: int, recompute: bool) -> int:
        """A forward and its backward (the layers' forward again where activations are recomputed)."""
        per_layer_forward = 2 * self.layer_matmul_params * tokens + 4 * self.attention_width * pairs
        backward = 2 * self.layer_matmul_params * tokens + 2 * self.layer_trainable_matmul_params * tokens
        backward += 8 * self.attention_width * pairs
        layers = self.layers * (per_layer_forward * (2 if recompute else 1) + backward)
        head_passes = 1 + 1 + 1 + int(self.head_trainable)  # forward, recomputed logits, hidden grad, weight grad
        return layers + head_passes * 2 * self.hidden * self.vocab * scored

    def decode_bytes(self, prompt_lengths: list[int], completion_lengths: list[int], chunk: int,
                     prompt_groups: list[int] | None = None) -> int:
        """Bytes a rollout's decode steps must read: ``chunk`` rows decode together (the generation batch), a
        chunk for as many steps as its longest completion, every step reading the weights once and each running
        row its keys and values so far. Rows of one chunk with the same ``prompt_groups`` entry (the same prompt)
        read that prompt's keys and values once a step while any of them runs: the decode attention reads a
        shared prompt from one row (``generation.filled_attention``). The prefill is matmul work, not counted
        here (``prefill_flops``)."""
        groups = list(range(len(prompt_lengths))) if prompt_groups is None else prompt_groups
        total = 0
        for start in range(0, len(completion_lengths), max(chunk, 1)):
            prompts = prompt_lengths[start:start + chunk]
            completions = completion_lengths[start:start + chunk]
            steps = max(completions, default=0)
            # a row decoding its s-th new token (s = 1 .. c - 1; the first comes from the prefill) reads its own
            # s tokens, and its prompt's p unless another running row of its prompt already reads them
            longest: dict[int, tuple[int, int]] = {}  # prompt -> (its length, its longest completion)
            for group, p, c in zip(groups[start:start + chunk], prompts, completions):
                longest[group] = (p, max(c, longest.get(group, (p, 0))[1]))
            cache = sum((c - 1) * p for p, c in longest.values() if c > 1)
            cache += sum((c - 1) * c // 2 for c in completions if c > 1)
            total += max(steps - 1, 0) * self.decode_weight_bytes + cache * self.kv_bytes_per_token
        return total

    def prefill_flops(self, prompt_lengths: list[int]) -> int:
        """The prefill's forward over each prompt (its last position through the head)."""
        return sum(self.forward_flops(p, p * (p + 1) // 2, 1) for p in prompt_lengths)


@dataclasses.dataclass(frozen=True)
class BatchTokens:
    """The tokens one scoring or training forward must compute: prompts shared by their group counted once."""

    tokens: int
    pairs: int  # (query, key) pairs attended, causal
    scored: int  # completion tokens through the head

    @classmethod
    def from_masks(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> BatchTokens:
        """From TRL's batch: ``[prompt | completion]`` rows, prompts left-padded, the last ``logits_to_keep``
        columns the completions. Rows with the same prompt (ids and mask) share it. One host read."""
        prompt_mask = attention_mask[:, :-logits_to_keep] if logits_to_keep else attention_mask
        prompt_lengths = prompt_mask.sum(dim=1)
        completion_lengths = attention_mask[:, prompt_mask.shape[1]:].sum(dim=1)
        group = first_equal_prompt(input_ids[:, :prompt_mask.shape[1]], prompt_mask)  # rows of one prompt: one group
        prompts, completions, groups = torch.stack([prompt_lengths, completion_lengths, group]).tolist()
        return cls.count(prompts, completions, groups)

    @classmethod
    def count(cls, prompts: list[int], completions: list[int], groups: list[int]) -> BatchTokens:
        """Rows of ``prompts[i]`` + ``completions[i]`` tokens; rows of one group share their prompt."""
        seen: dict[int, int] = {}
        for group, prompt in zip(groups, prompts):
            seen.setdefault(group, prompt)
        shared = seen.values()
        tokens = sum(shared) + sum(completions)
        pairs = sum(p * (p + 1) // 2 for p in shared)
        pairs += sum(c * p + c * (c + 1) // 2 for p, c in zip(prompts, completions))
        return cls(tokens=tokens, pairs=pairs, scored=sum(completions))


def _numel(tensor: torch.Tensor) -> int:
    return int(getattr(tensor, "ds_numel", 0) or tensor.numel())  # ZeRO-3 keeps the whole count beside a shard


def _decoder_layers(model: torch.nn.Module, count: int | None) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers: its ModuleList with ``num_hidden_layers`` entries."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and (count is None or len(module) == count):
            return module
    return None


class WorkCounter:
    """Adds a run's work to its ``PerformanceStats`` where the device's rates are known (a GPU): the FLOPs of each
    scoring and training forward (``train_flops``, ``scoring_flops``), the decode reads and prefill FLOPs of each
    rollout (``decode_bytes``, ``prefill_flops``). Elsewhere it counts nothing (one host read a forward saved)."""

    def __init__(self, model: torch.nn.Module, recompute: bool):
        self.work = ModelWork.from_model(model)
        self.recompute = recompute  # activation checkpointing runs each training forward twice

    @property
    def counts(self) -> bool:
        return self.work is not None

    def forward(self, perf: PerformanceStats, input_ids: torch.Tensor, attention_mask=None, logits_to_keep=None,
                *_, scoring: bool, **kwargs) -> None:
        """TRL's ``_get_per_token_logps_and_entropies`` arguments; ``scoring``: a no-grad pass (no backward)."""
        if perf.rates is None or self.work is None:
            return
        attention_mask = kwargs.get("attention_mask", attention_mask)
        logits_to_keep = kwargs.get("logits_to_keep", logits_to_keep)
        batch = BatchTokens.from_masks(input_ids, attention_mask, int(logits_to_keep))
        if scoring:
            flops = self.work.forward_flops(batch.tokens, batch.pairs, batch.scored)
            perf.add("scoring_flops", flops)
        else:
            flops = self.work.training_flops(batch.tokens, batch.pairs, batch.scored, recompute=self.recompute)
        perf.add("train_flops", flops)  # the training half: the scoring passes run inside training_step too

    def rollout(self, perf: PerformanceStats, prompt_ids, completion_ids, chunk: int | None) -> None:
        """A rollout generated ``chunk`` rows at a time (None: all at once)."""
        if perf.rates is None or self.work is None:
            return
        prompts, completions = [len(ids) for ids in prompt_ids], [len(ids) for ids in completion_ids]
        chunk = chunk or len(prompts)
        groups = _prompt_groups(prompt_ids)
        perf.add("decode_bytes", self.work.decode_bytes(prompts, completions, chunk, groups))
        # a chunk's rows of one prompt share its prefill (generation.shared_prefill): each counted once
        distinct = [length for start in range(0, len(prompts), chunk)
                    for length in dict(zip(groups[start:start + chunk], prompts[start:start + chunk])).values()]
        perf.add("prefill_flops", self.work.prefill_flops(distinct))


def _prompt_groups(prompt_ids) -> list[int]:
    """Each row's prompt as a number, equal for rows with equal token ids."""
    seen: dict[tuple, int] = {}
    return [seen.setdefault(tuple(ids), len(seen)) for ids in prompt_ids]
