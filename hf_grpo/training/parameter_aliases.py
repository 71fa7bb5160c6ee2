"""A module's trainable parameters stood in by views of themselves, for a capture of the backward under DeepSpeed.

Autograd delivers a parameter's gradient through its accumulation node, which keeps the stream it was made on.
Under DeepSpeed those nodes are made on the default stream, and a captured backward that reaches them would make
that stream wait on the capture (cudaErrorStreamCaptureImplicit). Made inside the capture, the views are what the
forward reads and what the backward is asked the gradients of, so autograd stops short of the nodes. A view of a
parameter is the parameter's memory: the replayed forward reads the weights as they are at the replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ParameterAliases:
    """Where each of ``params`` sits in ``model`` (tied weights: every place), to swap views in and back."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter]):
        self.params = params
        wanted = {id(param) for param in params}
        self.owners = [module for module in model.modules()
                       if any(id(p) in wanted for p in module._parameters.values() if p is not None)]

    @contextmanager
    def swapped(self) -> Iterator[list[torch.Tensor]]:
        """Views of the parameters in their places for the block (yielded, in ``params``' order); the parameters
        back after it, in their modules' order (which ``model.parameters()`` and the optimizer follow)."""
        aliases = {id(param): param.view_as(param) for param in self.params}
        saved = [(module, dict(module._parameters)) for module in self.owners]
        try:
            for module, parameters in saved:
                for name, param in parameters.items():
                    if param is not None and id(param) in aliases:
                        del module._parameters[name]
                        setattr(module, name, aliases[id(param)])  # a plain attribute, read as the parameter was
            yield [aliases[id(param)] for param in self.params]
        finally:
            for module, parameters in saved:
                for name in parameters:
                    module.__dict__.pop(name, None)
                module._parameters.clear()
                module._parameters.update(parameters)
