"""The transformers model under the wrappers a run puts around it (PEFT, DDP, a DeepSpeed engine)."""

from __future__ import annotations

import torch


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT (or DDP-style ``.module``) wrappers."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and not hasattr(model, "config"):
        model = model.module
    return model
