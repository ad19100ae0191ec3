"""A module's ``forward`` replaced by an instance attribute, and put back: how lpoptim wraps a block's forward
(compress_activations) or a model's (the chunked LM loss) without touching its class, parameters or state_dict.

The wrapper object is kept under its own key in the module's ``__dict__`` too (straight into ``__dict__``:
torch.compile's OptimizedModule forwards unknown attributes to the module it wraps), so each wrapping can be
found and undone on its own; it carries ``original`` (the forward it replaced) and ``had_forward`` (whether that
was an instance attribute already).
"""
from __future__ import annotations

import torch.nn as nn


def install_forward(module: nn.Module, key: str, wrapper) -> None:
    """Make ``wrapper`` (built on ``module.forward``) the module's forward, findable under ``key``."""
    module.forward = wrapper
    module.__dict__[key] = wrapper


def had_own_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` is an instance attribute (a wrapping) rather than its class's method."""
    return "forward" in module.__dict__


def remove_forward(module: nn.Module, key: str) -> bool:
    """Undo ``install_forward(module, key, ...)``; False if there was nothing under ``key``."""
    wrapper = module.__dict__.pop(key, None)
    if wrapper is None:
        return False
    if wrapper.had_forward:
        module.forward = wrapper.original
    else:
        del module.forward
    return True
