"""SamplingSettings: how a masked-diffusion sampler denoises, one frozen object shared by LLaDA's block sampler
(``sampler.diffusion_generate``), Dream's (``dream_sampler.dream_generate``) and the ``DiffusionSampler`` backend.

What the settings leave out belongs to the call or to the model: the completion length, the mask and pad ids,
how the model reads a row (``logits_shift``, ``padding_style``), how the forwards run (``cuda_graph``,
``tensor_batch_size``) and the noise (``generator``).

The three entry points still take the settings' fields as keyword arguments (``steps=8, block_length=4``);
``settings_from`` folds them into one SamplingSettings, and a name that is neither a setting nor a parameter is
a TypeError that lists the settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .block_cache import check_block_cache_name

SAMPLERS = ("llada", "dream")  # the semi-autoregressive block sampler (LLaDA's), Dream's diffusion_generate
REMASKING = ("low_confidence", "random")
CONFIDENCE_ALGORITHMS = ("maskgit_plus", "topk_margin", "entropy")


@dataclass(frozen=True)
class SamplingSettings:
    """``steps`` denoising steps in all; LLaDA's sampler splits the completion into blocks of ``block_length`` and
    commits by ``remasking`` with classifier-free guidance ``cfg_scale`` and an optional approximate
    ``block_cache``; Dream's (``sampler="dream"``) has no blocks and commits by ``confidence_algorithm`` on the
    schedule ``linspace(1, schedule_eps)``, drawing ``confidence_temperature``-softened positions and top_p /
    top_k-truncated tokens. Both draw tokens at ``temperature`` (0: argmax) and, with ``forbid_mask_token``, never
    the mask token itself."""

    steps: int
    block_length: int | None = None
    temperature: float = 0.0
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0
    block_cache: str | None = None
    forbid_mask_token: bool = True
    sampler: str = "llada"
    confidence_algorithm: str = "entropy"
    confidence_temperature: float = 0.0
    schedule_eps: float = 1e-3
    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self):
        check_block_cache_name(self.block_cache)
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.confidence_algorithm not in CONFIDENCE_ALGORITHMS:
            raise ValueError(f"Dream's confidence algorithm must be one of {CONFIDENCE_ALGORITHMS}, "
                             f"got {self.confidence_algorithm!r}")
        if self.sampler == "dream" and (self.block_cache is not None or self.cfg_scale > 0
                                        or self.remasking != "low_confidence"):
            raise ValueError(f"Dream's sampler has no blocks, guidance or remasking choice: "
                             f"block_cache={self.block_cache!r}, cfg_scale={self.cfg_scale!r} and "
                             f"remasking={self.remasking!r} need sampler='llada'")


SETTING_NAMES = tuple(f.name for f in dataclasses.fields(SamplingSettings))


def settings_from(caller: str, settings: SamplingSettings | None, given: dict[str, Any],
                  renamed: dict[str, str] | None = None, **fixed: Any) -> SamplingSettings:
    """``settings`` (or, without it, the defaults) with the settings passed as keyword arguments in ``given``
    (``renamed``: a caller's own name for a setting -> the setting) and ``fixed`` (what the caller always sets)."""
    renamed = renamed or {}
    values = {}
    for key, value in given.items():
        name = renamed.get(key, key)
        if name not in SETTING_NAMES:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}; it takes settings="
                            f"SamplingSettings(...) or these settings as keywords: {sorted({*SETTING_NAMES, *renamed})}")
        values[name] = value
    values.update(fixed)
    if settings is None:
        if "steps" not in values:
            raise TypeError(f"{caller}() needs settings=SamplingSettings(steps=...) or steps=...")
        return SamplingSettings(**values)
    if not isinstance(settings, SamplingSettings):
        raise TypeError(f"{caller}(): settings must be a SamplingSettings, got {type(settings).__name__}")
    return dataclasses.replace(settings, **values) if values else settings
