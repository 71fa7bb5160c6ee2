"""``RunFacts``: what the helpers read of a run that does not change once the trainer is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunFacts:
    """The run's device, processes, sharding, model traits and loss settings, as the trainer found them."""

    # The defaults describe a one-process CPU run with nothing special (for tests); the trainer sets every field.
    device_type: str = "cpu"  # "cuda", "cpu", ...
    num_processes: int = 1
    distributed_type: str = "NO"  # accelerate's DistributedType value ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP", ...)
    n_gpu: int = 0  # GPUs of torch.nn.DataParallel in this process (transformers' args.n_gpu)
    deepspeed: bool = False  # any ZeRO stage
    zero3: bool = False  # ZeRO-3: the parameters partitioned across processes
    # ZeRO-3 with one process: DeepSpeed's gathering hooks removed, every parameter whole (zero3_one_process)
    zero3_hooks_removed: bool = False
    fsdp: bool = False
    attention: str | None = None  # the policy's attention implementation (config._attn_implementation)
    half: bool = False  # trains in fp16/bf16 (mixed precision, or a half-precision model)
    moe: bool = False  # a mixture-of-experts model (routes tokens with data-dependent shapes)
    pad_token_id: int | None = None  # the tokenizer's
    activation_checkpointing: bool = False
    reentrant_checkpointing: bool = False  # use_reentrant=True: parameters in a checkpoint unreachable by autograd.grad
    loss_type: str = "grpo"
    max_completion_length: int = 256
    entropy_per_micro_batch: bool = False  # the entropy mask's quantile or the entropy bonus, per micro-batch
    off_policy_mask: bool = False  # TRL's off-policy mask (off_policy_mask_threshold set)
    aux_loss_enabled: bool = False  # the MoE router's auxiliary loss is added to the GRPO loss
    router_aux_loss_coef: float = 0.0
    replaced_loss: str | None = None  # the trainer class that replaces TRL's GRPO loss, or None
    training_graphs_unavailable: str | None = None  # why the trainer class cannot replay training graphs

    @property
    def sharding(self) -> str | None:
        """What shards the policy's parameters across processes ("FSDP", "ZeRO-3"), or None (ZeRO-3 whose one process
        holds every parameter whole, with no gathering hooks, runs as an unsharded model)."""
        return "FSDP" if self.fsdp else "ZeRO-3" if self.zero3 and not self.zero3_hooks_removed else None

    @property
    def engine(self) -> str | None:
        """The engine that takes the batch sizes and manages the gradients ("DeepSpeed", "FSDP"), or None."""
        return "DeepSpeed" if self.deepspeed else "FSDP" if self.fsdp else None


MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe(config) -> bool:
    """Whether a model's config (its text config, for a multimodal one) describes a mixture of experts."""
    text = getattr(config, "get_text_config", lambda: config)()
    return any(getattr(text, name, None) for name in MOE_CONFIG_FIELDS)
