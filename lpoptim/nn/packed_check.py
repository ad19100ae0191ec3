"""A Hugging Face causal LM's forward without the host sync of its packed-sequence check, where it cannot matter.

In training (no attention mask, no KV cache) HF's causal mask asks whether ``position_ids`` hold several sequences
packed into one row (positions restarting): ``transformers.masking_utils.find_packed_sequence_indices`` ends in
``(mask[:, -1] == 0).all()`` read on the host, which waits for every kernel queued before it. It runs at the start
of each forward, so the host can never queue a step while the GPU still runs the previous one: the GPU idles
wherever the host is slower than the GPU (launches, Python), instead of only where it is slower over a whole step.

Where the base model (``LlamaModel`` in ``LlamaForCausalLM``, ...: the module that makes the positions and the
mask) is called with neither ``position_ids`` nor ``cache_position``, it makes its positions itself as one
``arange`` per row, which holds one sequence: the check's answer is known (None, no packing) without looking.
``skip_packed_check(model)`` answers it so during those calls: the base model's ``forward`` is wrapped (an
instance attribute, instance_forward.py) to set a context variable for its duration, and HF's function is wrapped
once per process to answer None while it is set. Calls that pass positions (packed batches, as HF's
``DataCollatorWithFlattening`` makes them; a subclass's forward that makes positions of its own and passes them
down) keep HF's check. While it is set, any HF model called inside that forward (from a hook, say) is answered
None too. Under torch.compile (a whole model compiled) nothing is set: HF skips the host read there itself.
Flash-attention's own packed-sequence test (``_is_packed_sequence``, per layer) is not answered: only the sdpa and
eager attention paths lose their sync.
"""
from __future__ import annotations

import contextvars
import functools
import inspect

import torch
import torch.nn as nn

from ..instance_forward import had_own_forward, install_forward, remove_forward
from .causal_lm_loss import base_models, is_causal_lm

_OWN_POSITIONS = contextvars.ContextVar("lpoptim_own_positions", default=False)
_POSITION_ARGS = ("position_ids", "cache_position")
_ATTR = "_lpoptim_packed_check"


def why_not(model: nn.Module) -> str | None:
    """Why ``model``'s packed-sequence check cannot be skipped (None: it can)."""
    name = type(model).__name__
    if not is_causal_lm(model):
        return f"{name} is not a Hugging Face causal LM"
    if _masking_utils() is None:
        return "this transformers has no find_packed_sequence_indices"
    bases = base_models(model)
    for b in bases:  # a forward of the user's own may make positions its own way
        if not type(b).forward.__module__.startswith("transformers."):
            return f"{type(b).__name__}.forward is not transformers' own"
    if not any(_takes_positions(b) for b in bases):
        return f"{name} has no base model whose forward takes position_ids"
    return None


def _takes_positions(module: nn.Module) -> bool:
    return "position_ids" in inspect.signature(type(module).forward).parameters


def _masking_utils():
    try:
        from transformers import masking_utils
    except ImportError:
        return None
    return masking_utils if callable(getattr(masking_utils, "find_packed_sequence_indices", None)) else None


def _install_answer() -> None:
    """Wrap HF's find_packed_sequence_indices (once per process) to answer None inside a forward whose positions
    are the model's own."""
    utils = _masking_utils()
    original = utils.find_packed_sequence_indices
    if getattr(original, "_lpoptim_original", None) is not None:
        return

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if not torch.compiler.is_compiling() and _OWN_POSITIONS.get():
            return None  # one arange per row: no packed sequence
        return original(position_ids, *args, **kwargs)

    find_packed_sequence_indices._lpoptim_original = original
    utils.find_packed_sequence_indices = find_packed_sequence_indices


class _OwnPositionsForward:
    """The base model's instance ``forward``: the original, with the context variable saying whether this call
    leaves the positions to the model (set and reset around it here, so nested, raising and concurrent calls each
    restore their own)."""

    def __init__(self, module: nn.Module, original, had_forward: bool):
        self.original, self.had_forward = original, had_forward
        # the names of the forward's positional parameters after self: a call may pass positions positionally
        self.positional = [p.name for p in list(inspect.signature(type(module).forward).parameters.values())[1:]
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.__signature__ = inspect.signature(original)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # Dynamo traces no context variable; HF reads nothing on the host there
            return self.original(*args, **kwargs)
        given = dict(zip(self.positional, args))
        own = all(kwargs.get(name) is None and given.get(name) is None for name in _POSITION_ARGS)
        token = _OWN_POSITIONS.set(own)
        try:
            return self.original(*args, **kwargs)
        finally:
            _OWN_POSITIONS.reset(token)


class _Handle:
    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def remove(self) -> None:
        for m in self.modules:
            remove_forward(m, _ATTR)
        self.modules = []


def skip_packed_check(model: nn.Module) -> _Handle:
    """Answer HF's packed-sequence check without a host sync in the forwards of ``model`` (an HF causal LM) whose
    base model is given no positions (module docstring). Returns a handle whose ``remove()`` undoes it.
    ValueError, naming why, for a model this does not apply to (``why_not``)."""
    why = why_not(model)
    if why:
        raise ValueError(f"skip_packed_check: {why}")
    _install_answer()
    wrapped = []
    for base in base_models(model):
        if _ATTR not in base.__dict__ and _takes_positions(base):
            install_forward(base, _ATTR, _OwnPositionsForward(base, base.forward, had_own_forward(base)))
            wrapped.append(base)
    return _Handle(wrapped)
