"""DiffuGRPOConfig: hf_grpo's GRPOConfig plus the masked-diffusion sampler and log-prob estimator settings.

It also carries (from ``hf_grpo.GRPOConfig``) the API of the batch-size guide this project grew from ("Batch Size
Configuration Guide for DeepSpeed Training"): ``config.optimization.<field>`` reads and writes the flat fields,
under the guide's names:

=================================  ===================================================================
``config.optimization.``            flat field
=================================  ===================================================================
``per_device_train_batch_size``     ``per_device_train_batch_size``
``generation_batch_size``           ``per_device_generation_batch_size`` (the per-device chunk, as in the
                                    guide; **not** TRL's ``config.generation_batch_size``, which is the
                                    global rollout, P x W x S, and keeps TRL's meaning)
``tensor_batch_size``               ``tensor_batch_size``
``enable_gradient_checkpointing``   ``activation_checkpointing`` (and TRL's alias, ``gradient_checkpointing``)
``enable_mixed_precision``          ``bf16`` (True turns bf16 on where the GPU has it, else stays fp32 and says so)
``enable_profiling``                ``enable_profiling`` (per-phase peak memory in ``memory_manager_stats``)
=================================  ===================================================================

A write checks its own value at once (a positive integer, a bool); rules that tie several fields
together (whole prompt groups, ``g <= R``, ...) are checked again when a trainer is built from the
config (``revalidate``), since the guide sets the fields one at a time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..config import (  # noqa: F401 (OptimizationView: this package's name too)
    GRPOConfig,
    OptimizationView,
    preset_factory,
)
from .block_cache import BLOCK_CACHES, check_block_cache_name
from .sampling_settings import CONFIDENCE_ALGORITHMS, REMASKING

logger = logging.getLogger("hf_grpo")

SAMPLER_CHOICES = ("auto", "llada", "dream")
ESTIMATORS = ("mean_field", "coupled")
LOGITS_SHIFT = ("auto", True, False)


OBJECTIVES = (None, "d1")
# d1's objective in TRL's terms: what objective="d1" sets (a different value set by the user is an error)
D1_OBJECTIVE = {
    "loss_type": "bnpo",  # one token mean over the micro-batch
    "use_bias_correction_kl": False,  # plain k3 KL (TRL 1.16's default multiplies it by the ratio)
    "scale_rewards": "none",  # advantages r - mean of the group, no std scaling
    "score_with_temperature": False,  # log-probs of the raw logits, not logits / temperature
}
# TRL terms d1's loss does not have: objective="d1" refuses a value other than their neutral one
D1_NEUTRAL = {
    "importance_sampling_level": "token",
    "delta": None,
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "mask_truncated_completions": False,
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _closest(values: list[int], target: int, count: int = 3) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:count])


@dataclass
class DiffuGRPOConfig(GRPOConfig):
    r"""
    ``hf_grpo.GRPOConfig`` for masked-diffusion LMs (LLaDA, Dream): diffu-GRPO (d1) on TRL.

    Every batch field keeps its per-device meaning (see ``GRPOConfig``); the rollout is generated
    ``per_device_generation_batch_size`` prompts at a time by the diffusion sampler (with a ``block_cache``,
    each block's full forward ``tensor_batch_size // row length`` of them at a time, at least one), and the
    log-prob estimate runs ``per_device_train_batch_size`` rows and ``tensor_batch_size`` token rows at a time.

    Parameters:
        block_length (`int`, defaults to `32`):
            Tokens per semi-autoregressive block; ``max_completion_length`` must be a multiple of it.
        diffusion_steps (`int`, defaults to `128`):
            Denoising steps for the whole completion, split evenly over the blocks (a multiple of the
            number of blocks, at most ``block_length`` steps per block).
        remasking (`str`, defaults to `"low_confidence"`):
            Which masked positions of the block a step commits: the most confident ones
            (``"low_confidence"``: the least confident stay masked) or uniformly random ones (``"random"``).
        block_cache (`str`, *optional*):
            ``None`` (default): every sampler step recomputes the whole row, exactly the published sampler.
            ``"dual"`` / ``"prefix"``: reuse keys/values within a block (``hf_grpo.diffusion.block_cache``), an
            approximation (a bidirectional model's prefix keys depend on the masked positions), different
            samples. On an 8B LLaDA shape at the published settings (one H100): ``"dual"`` 6.2x faster
            rollouts than the published algorithm (its step replayed from a CUDA graph on CUDA; 3.3x eager),
            ``"prefix"`` 2.5x.
        cfg_scale (`float`, defaults to `0.0`):
            Classifier-free guidance weight w: logits ``l_u + (w + 1)(l_c - l_u)``, ``l_u`` with the prompt
            masked. 0 turns it off (and halves the sampler's work).
        p_mask_prompt (`float`, defaults to `0.15`):
            Probability of masking each prompt token in the log-prob estimate (d1), in [0, 1).
        mask_token_id (`int`, *optional*):
            The mask token. None: taken from the model config, the tokenizer or the model family.
        logits_shift (`str` or `bool`, defaults to `"auto"`):
            True if position i predicts token i + 1 (Dream), False if it predicts token i (LLaDA);
            ``"auto"`` decides from the model type (others: False).
        sampler (`str`, defaults to `"auto"`):
            ``"llada"``: the semi-autoregressive block sampler (LLaDA's ``generate``); ``"dream"``: Dream's
            ``diffusion_generate`` (no blocks, ``linspace(1, schedule_eps)`` schedule, confidence by
            ``confidence_algorithm``, honours ``top_p`` / ``top_k``); ``"auto"``: Dream's for a Dream model
            (``model_type`` containing "dream"), LLaDA's otherwise.
        confidence_algorithm (`str`, defaults to `"entropy"`):
            Dream's sampler only: how a slot's confidence is measured, one of ``"maskgit_plus"`` (probability of
            the drawn token), ``"topk_margin"`` (top-1 minus top-2 probability), ``"entropy"`` (negative entropy;
            Dream's demos use it).
        confidence_temperature (`float`, defaults to `0.0`):
            Dream's sampler only (its ``alg_temp``): 0 commits the most confident slots; > 0 draws them from
            ``softmax(confidence / confidence_temperature)``.
        schedule_eps (`float`, defaults to `1e-3`):
            Dream's sampler only: the last time of its schedule ``linspace(1, eps, steps + 1)``, in (0, 1).
        forbid_mask_token (`bool`, defaults to `True`):
            Set the mask token's logit to -inf before each draw and confidence, so no completion holds the mask
            token. The published LLaDA and Dream samplers do not (a trained model gives it ~0 probability; an
            untrained one can leave mask tokens in its completions); False reproduces them token for token.
        objective (`str`, *optional*):
            ``None`` (default): TRL's loss as its fields configure it. ``"d1"``: d1's diffu-GRPO objective term
            by term: ``loss_type="bnpo"`` (one token mean over the micro-batch), ``use_bias_correction_kl=False``
            (plain k3 KL), ``scale_rewards="none"`` (advantages ``r - mean``), ``score_with_temperature=False``
            (raw logits); a different value of one of these, or of a TRL term d1 does not have (``delta``,
            ``top_entropy_quantile``, entropy bonus, sequence-level ratios, ...), is an error.
        score_with_temperature (`bool`, defaults to `True`):
            Whether the log-prob estimate divides the logits by ``temperature`` (TRL) or scores the raw
            logits (d1).
        logprob_estimator (`str`, defaults to `"mean_field"`):
            ``"mean_field"`` (d1: one forward, every completion token masked) or ``"coupled"``
            (two forwards with complementary completion masks; lower variance).
        enable_profiling (`bool`, defaults to `False`):
            Record peak memory per phase (generation, log-prob, training) in ``memory_manager_stats``.
        log_memory_usage (`bool`, defaults to `False`):
            Log the memory figures (``mem/...``) at every logging step.
    """

    max_completion_length: int | None = field(
        default=256, metadata={"help": "Completion length L: the number of mask tokens the sampler fills."}
    )
    block_length: int = field(default=32, metadata={"help": "Tokens per semi-autoregressive block."})
    diffusion_steps: int = field(default=128, metadata={"help": "Denoising steps for the whole completion."})
    remasking: str = field(default="low_confidence", metadata={"help": f"One of {REMASKING}."})
    cfg_scale: float = field(default=0.0, metadata={"help": "Classifier-free guidance weight (0: off)."})
    block_cache: str | None = field(
        default=None,
        metadata={"help": f"None (exact, default) or one of {BLOCK_CACHES}: APPROXIMATE key/value reuse within a "
                  "block for faster rollouts (see hf_grpo.diffusion.block_cache)."},
    )
    p_mask_prompt: float = field(
        default=0.15, metadata={"help": "Probability of masking each prompt token in the log-prob estimate."}
    )
    mask_token_id: int | None = field(
        default=None, metadata={"help": "Mask token id; None: from the model config, tokenizer or model family."}
    )
    logits_shift: str = field(
        default="auto",
        metadata={"help": "auto, true (Dream: position i predicts token i+1) or false (LLaDA: predicts token i)."},
    )
    logprob_estimator: str = field(default="mean_field", metadata={"help": f"One of {ESTIMATORS}."})
    sampler: str = field(default="auto", metadata={"help": f"One of {SAMPLER_CHOICES}: auto picks by model family."})
    confidence_algorithm: str = field(
        default="entropy", metadata={"help": f"Dream's sampler: one of {CONFIDENCE_ALGORITHMS}."}
    )
    confidence_temperature: float = field(
        default=0.0,
        metadata={"help": "Dream's sampler (alg_temp): 0 commits the most confident slots, > 0 draws them."},
    )
    schedule_eps: float = field(default=1e-3, metadata={"help": "Dream's sampler: schedule linspace(1, eps, steps+1)."})
    forbid_mask_token: bool = field(
        default=True,
        metadata={"help": "Set the mask token's logit to -inf before sampling (the published samplers do not)."},
    )
    objective: str | None = field(
        default=None,
        metadata={"help": "None (TRL's loss as configured) or 'd1': d1's objective term by term (bnpo token mean, "
                  "plain k3 KL, advantages r - mean, raw-logit scoring)."},
    )
    score_with_temperature: bool = field(
        default=True,
        metadata={"help": "Divide the logits by temperature when scoring (TRL); false scores raw logits (d1)."},
    )
    enable_profiling: bool = field(
        default=False, metadata={"help": "Record peak memory per phase in get_performance_stats()."}
    )
    log_memory_usage: bool = field(default=False, metadata={"help": "Log memory figures at each logging step."})

    def __post_init__(self):
        self._validate_diffusion()
        self._apply_objective()
        if self.generation_backend in ("cuda_graph", "vllm") or self.use_vllm:
            raise ValueError(
                f"generation_backend={self.generation_backend!r} (use_vllm={self.use_vllm}) cannot serve a "
                f"masked-diffusion model: DiffuGRPOTrainer generates with its diffusion sampler; leave "
                f"generation_backend at 'auto' (or 'hf')"
            )
        if self.use_transformers_continuous_batching:
            raise ValueError("use_transformers_continuous_batching=True decodes autoregressively; it cannot serve a "
                             "masked-diffusion model: set it to False")
        if self.true_on_policy:
            raise ValueError("true_on_policy=True matches an autoregressive decoder's log-probs to the trainer's; the "
                             "diffusion sampler records none (its log-probs are estimated): set it to False")
        super().__post_init__()

    def _validate_diffusion(self) -> None:
        L, block, steps = self.max_completion_length, self.block_length, self.diffusion_steps
        for name, value in (("max_completion_length", L), ("block_length", block), ("diffusion_steps", steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (the diffusion sampler fills a fixed number of "
                                 f"slots), got {value!r}")
        if L % block:
            raise ValueError(
                f"max_completion_length ({L}) must be a multiple of block_length ({block}): the completion is "
                f"decoded in whole blocks. Valid block_length values for {L} include "
                f"{_closest(_divisors(L), block)}; or set max_completion_length to "
                f"{_closest([block * m for m in range(1, L // block + 2)], L, 2)}"
            )
        blocks = L // block
        if steps % blocks:
            lower = steps // blocks * blocks
            options = [v for v in (lower, lower + blocks) if v >= blocks]
            raise ValueError(
                f"diffusion_steps ({steps}) must be a multiple of the number of blocks (max_completion_length / "
                f"block_length = {L} / {block} = {blocks}), so every block gets the same number of steps: "
                f"e.g. diffusion_steps={' or '.join(map(str, options))}"
            )
        if steps // blocks > block:
            raise ValueError(
                f"diffusion_steps ({steps}) gives {steps // blocks} steps per block of {block} tokens; a step "
                f"beyond one token per step commits nothing: use diffusion_steps <= {blocks * block} "
                f"(one token per step)"
            )
        check_block_cache_name(self.block_cache)
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if isinstance(self.cfg_scale, bool) or not isinstance(self.cfg_scale, (int, float)) or not (
            math.isfinite(self.cfg_scale) and self.cfg_scale >= 0
        ):
            raise ValueError(f"cfg_scale must be a finite number >= 0 (0 turns guidance off), got {self.cfg_scale!r}")
        p = self.p_mask_prompt
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 <= p < 1):
            raise ValueError(f"p_mask_prompt must be in [0, 1) (d1 uses 0.15; 0 masks no prompt token), got {p!r}")
        if self.mask_token_id is not None and (
            isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0
        ):
            raise ValueError(f"mask_token_id must be a token id >= 0 or None (from the model/tokenizer), "
                             f"got {self.mask_token_id!r}")
        shift = self.logits_shift
        if isinstance(shift, str):
            shift = {"auto": "auto", "true": True, "false": False}.get(shift.strip().lower(), shift)
        if shift not in LOGITS_SHIFT or (not isinstance(shift, bool) and shift != "auto"):
            raise ValueError(f"logits_shift must be 'auto', True (Dream: shifted) or False (LLaDA: unshifted), "
                             f"got {self.logits_shift!r}")
        self.logits_shift = shift
        if self.logprob_estimator not in ESTIMATORS:
            raise ValueError(f"logprob_estimator must be one of {ESTIMATORS}, got {self.logprob_estimator!r}")
        self._validate_sampler_choice()

    def _validate_sampler_choice(self) -> None:
        if self.sampler not in SAMPLER_CHOICES:
            raise ValueError(f"sampler must be one of {SAMPLER_CHOICES} ('auto': Dream's for Dream models, LLaDA's "
                             f"otherwise), got {self.sampler!r}")
        if self.confidence_algorithm not in CONFIDENCE_ALGORITHMS:
            raise ValueError(f"confidence_algorithm must be one of {CONFIDENCE_ALGORITHMS}, "
                             f"got {self.confidence_algorithm!r}")
        temp = self.confidence_temperature
        if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not (math.isfinite(temp) and temp >= 0):
            raise ValueError(f"confidence_temperature must be a finite number >= 0 (0: the most confident slots), "
                             f"got {temp!r}")
        eps = self.schedule_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"schedule_eps must be in (0, 1) (Dream uses 1e-3), got {eps!r}")
        if self.sampler == "dream" and (self.block_cache is not None or self.cfg_scale > 0
                                        or self.remasking != "low_confidence"):
            raise ValueError(f"sampler='dream' has no blocks, guidance or remasking choice: block_cache="
                             f"{self.block_cache!r}, cfg_scale={self.cfg_scale!r}, remasking={self.remasking!r} "
                             f"need sampler='llada' (or leave them at None, 0 and 'low_confidence')")

    def _apply_objective(self) -> None:
        """``objective="d1"``: set d1's terms (``D1_OBJECTIVE``); refuse any the user set otherwise."""
        if isinstance(self.objective, str) and self.objective.strip().lower() in ("none", "null", ""):
            self.objective = None  # from a command line: --objective none
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.objective is None:
            return
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)  # TRL's bool aliases
        current = {name: getattr(self, name) for name in (*D1_OBJECTIVE, *D1_NEUTRAL)}
        current["scale_rewards"] = scale
        for name, wanted in D1_OBJECTIVE.items():
            if name in self._explicit_fields and current[name] != wanted:
                raise ValueError(f"objective='d1' runs d1's loss, which needs {name}={wanted!r}; got "
                                 f"{name}={getattr(self, name)!r}. Leave {name} unset, or set objective=None")
            setattr(self, name, wanted)
        for name, neutral in D1_NEUTRAL.items():
            if current[name] != neutral:
                raise ValueError(f"objective='d1' runs d1's loss, which has no {name} term: {name} must be "
                                 f"{neutral!r}, got {current[name]!r}. Set objective=None to combine it with "
                                 f"TRL's loss")
        if self.epsilon_high is not None and self.epsilon_high != self.epsilon:
            raise ValueError(f"objective='d1' clips the ratio symmetrically to [1 - epsilon, 1 + epsilon]: "
                             f"epsilon_high must be None or equal to epsilon ({self.epsilon}), "
                             f"got {self.epsilon_high!r}")

    def _sampler_line(self, L, blocks, block, steps, per_block, per_step, guidance) -> str:
        dream = (f"Dream's sampler: {L} tokens, {steps} steps, no blocks, schedule linspace(1, {self.schedule_eps}), "
                 f"{self.confidence_algorithm} confidence" + (f" drawn at temperature {self.confidence_temperature}"
                                                              if self.confidence_temperature else ""))
        if self.sampler == "dream":
            return f"diffusion: {dream}"
        llada = (f"{L} tokens in {blocks} blocks of {block}, {steps} steps ({per_block} per block, {per_step} tokens "
                 f"per step), {self.remasking} remasking, {guidance}"
                 + (f", APPROXIMATE {self.block_cache} block cache" if self.block_cache else ""))
        if self.sampler == "llada":
            return f"diffusion: {llada}"
        return f"diffusion: {llada} (sampler auto: a Dream model gets Dream's sampler instead)"

    def _objective_line(self) -> str:
        if self.objective == "d1":
            return "d1 (bnpo token mean, plain k3 KL, advantages r - mean, log-probs of the raw logits)"
        kl = "k3 KL x ratio" if self.use_bias_correction_kl else "plain k3 KL"
        scoring = "logits / temperature" if self.score_with_temperature else "raw logits"
        return f"TRL's {self.loss_type} loss ({kl}, scale_rewards={self.scale_rewards}, log-probs of {scoring})"

    def revalidate(self, world_size: int | None = None) -> None:
        """``GRPOConfig.revalidate`` (batch fields written through ``config.optimization``), then the diffusion
        settings that depend on them."""
        super().revalidate(world_size)
        self._validate_diffusion()

    def diffusion_plan(self, world_size: int | None = None) -> str:
        """The sampler and estimator settings with their derived figures, as the trainer logs them."""
        plan = self.batch_plan(world_size)
        L, block, steps = self.max_completion_length, self.block_length, self.diffusion_steps
        blocks = L // block
        per_block = steps // blocks
        per_step = f"{block // per_block}" + (f"-{block // per_block + 1}" if block % per_block else "")
        guidance = f"cfg_scale {self.cfg_scale} (2 x rows per forward)" if self.cfg_scale > 0 else "no guidance"
        forwards = steps * plan.generation_chunks
        chunks = plan.generation_chunks
        shift = self.logits_shift if isinstance(self.logits_shift, bool) else "auto"
        views = 2 if self.logprob_estimator == "coupled" else 1
        mu = self.num_iterations
        needs_old = self.gradient_accumulation_steps % (self.steps_per_generation * mu) != 0  # as TRL decides
        seeds = f"{mu} seed{'s' if mu > 1 else ''}"
        parts = ([f"old log-probs for {seeds}"] if needs_old else []) + (
            [f"reference log-probs for {seeds}"] if self.beta else [])
        seed_free = self.logprob_estimator == "mean_field" and self.p_mask_prompt == 0  # every seed, the same masks
        if parts:
            rows = plan.rollout_per_device * views * (1 if seed_free else mu) * len(parts)
            extra = (f"{' and '.join(parts)}: {rows} row-forwards per device"
                     f"{' (p_mask_prompt 0: one forward serves every seed)' if seed_free and mu > 1 else ''}, "
                     f"{self.per_device_train_batch_size} rows at a time")
        else:
            extra = "nothing extra (the loss's own log-probs, detached, are the old ones)"
        lines = [
            self._sampler_line(L, blocks, block, steps, per_block, per_step, guidance),
            f"├── sampler: {forwards} forwards per rollout per device ({steps} per chunk x {chunks} "
            f"chunk{'s' if chunks > 1 else ''} of <= {self.per_device_generation_batch_size}), "
            + (f"a block's full forward <= {self.tensor_batch_size} token rows (at least one row)"
               if self.tensor_batch_size and self.block_cache else "full forwards over the whole chunk"),
            f"├── log-prob estimate: {self.logprob_estimator} ({views} forward{'s' if views > 1 else ''} per row), "
            f"prompt tokens masked with p={self.p_mask_prompt}, logits_shift={shift}",
            f"├── mask seeds: one per row and iteration ({mu}, num_iterations); iteration k = rollout pass",
            f"├── objective: {self._objective_line()}",
            f"└── at rollout time: {extra}",
        ]
        return "\n".join(lines)


create_memory_optimized_config = preset_factory("memory", DiffuGRPOConfig)
create_balanced_config = preset_factory("balanced", DiffuGRPOConfig)
create_speed_optimized_config = preset_factory("speed", DiffuGRPOConfig)


# The names of the batch-size guide: the same classes.
ImprovedDiffuGRPOConfig = DiffuGRPOConfig

__all__ = [
    "DiffuGRPOConfig",
    "ImprovedDiffuGRPOConfig",
    "OptimizationView",
    "create_balanced_config",
    "create_memory_optimized_config",
    "create_speed_optimized_config",
]

