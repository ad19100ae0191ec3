"""Replaying cheap element-wise results in backward instead of saving them.

Many saved tensors are a cheap function of another saved tensor: SiLU's output (saved by the SwiGLU product)
is ``silu(gate)`` and ``gate`` is saved by SiLU itself; RMSNorm's output, saved by the next projection, is
``weight * (x.float() * r).to(bf16)`` with ``x.float()`` saved by the norm and ``r`` a tiny per-row statistic.
Saving them again costs a byte or more an element; replaying them costs one element-wise pass in backward.

While a wrapped block runs, ``OpTracker`` attaches a ``Source`` to the output of every op in ``DERIVABLE_OPS``
(deterministic, element-wise or layout-only): the function, its non-tensor arguments, and weak references to its
tensor arguments with their version counters. When autograd saves such an output, ``derive`` tries to express it
through things that are held anyway: tensors already packed in this forward, parameters and buffers, small
tensors, constants passed to the block (rotary tables, masks), or other derivable tensors (a few levels deep).
If every argument resolves, what is saved is a ``Derived``: no bytes of its own; backward calls the function on
the unpacked arguments. Otherwise the tensor is packed as usual. Version counters must match at every step, so an
in-place change after use is never replayed from a stale copy.
"""
from __future__ import annotations

import weakref

import torch

# Tensor methods and functions by ``__name__``; none random, none in place.
DERIVABLE_OPS = frozenset({
    "to", "float", "bfloat16", "half", "type_as",
    "silu", "gelu", "relu", "sigmoid", "tanh", "rsqrt", "neg", "__neg__",
    "mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "div", "__truediv__",
    "view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "squeeze", "unsqueeze",
})
MAX_DEPTH = 6

_SRC = "_lpoptim_src"
_HELD = "_lpoptim_held"


class Source:
    """How a tensor was computed in this forward by one op of ``DERIVABLE_OPS``."""

    __slots__ = ("token", "func", "args", "kwargs", "version")

    def __init__(self, token, func, args, kwargs, version):
        self.token, self.func, self.args, self.kwargs, self.version = token, func, args, kwargs, version


def record(ctx, func, args, kwargs, out) -> None:
    """Attach a Source to ``out`` (called by OpTracker after a derivable op).

    Each tensor argument is noted as what will give its value later without holding it: what already holds it
    (its packed copy, a parameter, a tiny or constant tensor), else its own Source (which holds no data), plus a
    weak reference to it in case it is packed later."""
    if type(out) is not torch.Tensor or not out.dtype.is_floating_point:
        return
    entries = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a is out:
                return  # x.to(x.dtype) returns x itself: nothing to replay
            entries.append((True, _note(ctx, a)))
        elif isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a):
            return
        else:
            entries.append((False, a))
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return
    try:
        setattr(out, _SRC, Source(ctx.token, func, entries, dict(kwargs), out._version))
    except (AttributeError, RuntimeError):
        pass


def _note(ctx, a: torch.Tensor):
    """(ready source or None, a's Source or None, weakref to a, a's version)."""
    ready = _held_or_cheap(ctx, a)
    src = getattr(a, _SRC, None)
    if src is not None and (src.token is not ctx.token or src.version != a._version):
        src = None
    return ready, src, weakref.ref(a), a._version


def _held_or_cheap(ctx, a: torch.Tensor):
    h = held(ctx.token, a)
    if h is not None:
        return h
    if ctx.is_module_tensor(a):
        return a  # a parameter or buffer: the module holds it
    if a.numel() < ctx.policy.min_numel:
        return a.detach()  # tiny (norm statistics): holding it costs nothing worth counting
    if is_constant(ctx, a):
        return a.detach()  # from outside the block (rotary table, mask): held by the model anyway
    return None


def is_constant(ctx, a: torch.Tensor) -> bool:
    """Passed to the block without needing grad (or a view of such a tensor): the caller holds it."""
    if a.requires_grad:
        return False
    return id(a) in ctx.constant_ids or (a._base is not None and id(a._base) in ctx.constant_ids)


def remember(token, t: torch.Tensor, held) -> None:
    """Note on ``t`` what now holds its value (a PackedActivation or Derived), for later derivations and dedupe."""
    try:
        setattr(t, _HELD, (token, t._version, held))
    except (AttributeError, RuntimeError):
        pass


def held(token, t: torch.Tensor):
    h = getattr(t, _HELD, None)
    if h is not None and h[0] is token and h[1] == t._version:
        return h[2]
    return None


class Derived:
    """A saved tensor replayed in backward: ``func`` on the unpacked arguments."""

    __slots__ = ("func", "args", "kwargs")

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs

    def unpack(self) -> torch.Tensor:
        vals = [_unpack(v) if is_t else v for is_t, v in self.args]
        with torch.no_grad():
            return self.func(*vals, **self.kwargs)


def _view_of(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """The view ``(size, stride)`` at ``offset`` elements past ``base``'s own start."""
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _unpack(x):
    return x.unpack() if hasattr(x, "unpack") else x


def derive(ctx, t: torch.Tensor):
    """A Derived giving ``t``'s value from what ``ctx`` (a PackContext) holds, or None."""
    src = getattr(t, _SRC, None)
    if src is not None and src.token is ctx.token and src.version == t._version:
        return _from_source(ctx, src, 0)
    base = t._base
    if base is not None and t._version == base._version:
        # A view made inside an op (F.linear flattens its input): replay the view on the base. A packed or kept
        # base comes back with its original strides; a replayed one only when it was contiguous.
        b = held(ctx.token, base)
        if b is None and base.is_contiguous():
            bsrc = getattr(base, _SRC, None)
            if bsrc is not None and bsrc.token is ctx.token and bsrc.version == base._version:
                b = _from_source(ctx, bsrc, 0)
        if b is None:
            return None
        return Derived(_view_of, [(True, b), (False, tuple(t.shape)), (False, t.stride()),
                                  (False, t.storage_offset() - base.storage_offset())], {})
    return None


def _from_source(ctx, src: Source, depth: int):
    if depth >= MAX_DEPTH:
        return None
    args = []
    for is_t, entry in src.args:
        if not is_t:
            args.append((False, entry))
            continue
        ready, asrc, ref, version = entry
        a = ref()
        r = None
        if a is not None and a._version == version:
            r = held(ctx.token, a)  # packed since the op ran
        if r is None:
            r = ready
        if r is None and asrc is not None:
            r = _from_source(ctx, asrc, depth + 1)
        if r is None:
            return None
        args.append((True, r))
    return Derived(src.func, args, src.kwargs)
