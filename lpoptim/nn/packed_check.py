"""A Hugging Face causal LM's forward without the host sync of its packed-sequence check, where it cannot matter.

In training (no attention mask, no KV cache) HF's causal mask asks whether ``position_ids`` hold several sequences
packed into one row (positions restarting): ``transformers.masking_utils.find_packed_sequence_indices`` ends in
``(mask[:, -1] == 0).all()`` read on the host, which waits for every kernel queued before it. It runs at the start
of each forward, so the host can never queue a step while the GPU still runs the previous one: the GPU idles
wherever the host is slower than the GPU (launches, Python), instead of only where it is slower over a whole step.

Where the caller passes neither ``position_ids`` nor ``cache_position``, a causal LM makes its positions itself as
one ``arange`` per row, which holds one sequence: the check's answer is known (None, no packing) without looking.
``skip_packed_check(model)`` answers it so for those calls; calls that pass positions (packed batches, as HF's
``DataCollatorWithFlattening`` makes them) keep HF's check. It works by hooks on the model (setting a context
variable for the duration of its forward) and a wrapper around HF's function that reads it (installed once; it
does nothing outside such a forward, or under torch.compile, where HF skips the host read itself).
"""
from __future__ import annotations

import contextvars
import inspect

import torch
import torch.nn as nn

_OWN_POSITIONS = contextvars.ContextVar("lpoptim_own_positions", default=False)
_POSITION_ARGS = ("position_ids", "cache_position")


def why_not(model: nn.Module) -> str | None:
    """Why ``model``'s packed-sequence check cannot be skipped (None: it can)."""
    name = type(model).__name__
    if not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return f"{name} is not a Hugging Face causal LM"
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        return f"{name}.forward takes no position_ids"
    if _masking_utils() is None:
        return "this transformers has no find_packed_sequence_indices"
    return None


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

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if not torch.compiler.is_compiling() and _OWN_POSITIONS.get():
            return None  # one arange per row: no packed sequence
        return original(position_ids, *args, **kwargs)

    find_packed_sequence_indices._lpoptim_original = original
    find_packed_sequence_indices.__doc__ = original.__doc__
    utils.find_packed_sequence_indices = find_packed_sequence_indices


class _OwnPositions:
    """The hooks: before the forward, whether this call leaves the positions to the model; after it (also when it
    raises), the previous value back."""

    def __init__(self, model: nn.Module):
        # the names of the forward's positional parameters after self: a call may pass positions positionally
        self.positional = [p.name for p in list(inspect.signature(type(model).forward).parameters.values())[1:]
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.tokens: list = []
        self.handles = [model.register_forward_pre_hook(self._enter, with_kwargs=True),
                        model.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args, kwargs):
        given = dict(zip(self.positional, args))
        own = all(kwargs.get(name) is None and given.get(name) is None for name in _POSITION_ARGS)
        self.tokens.append(_OWN_POSITIONS.set(own))

    def _exit(self, module, args, output):
        if self.tokens:
            _OWN_POSITIONS.reset(self.tokens.pop())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def skip_packed_check(model: nn.Module) -> _OwnPositions:
    """Answer HF's packed-sequence check without a host sync in the forwards of ``model`` (an HF causal LM) that
    pass no positions (module docstring). Returns a handle whose ``remove()`` undoes it. ValueError, naming why, for
    a model this does not apply to (``why_not``)."""
    why = why_not(model)
    if why:
        raise ValueError(f"skip_packed_check: {why}")
    _install_answer()
    return _OwnPositions(model)
