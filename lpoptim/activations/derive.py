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

Autocast's casts happen below torch functions, so they get no Source. The one that matters, the bf16 copy of an
fp32 weight that ``linear`` saves (transposed), is recognised from the autograd graph instead (``_param_cast``)
and replayed from the parameter.

A Derived (like a PackedActivation) read by several saved slots or replays is computed once per backward: the
readers are counted as pack hands it out (``count_use``) and the value is dropped after the last one.
"""
from __future__ import annotations

import weakref

import torch

from .codec import ComputedOnce

_Tensor = torch.Tensor

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
    if type(out) is not _Tensor or not out.dtype.is_floating_point:
        return
    entries = []
    for a in args:
        if isinstance(a, _Tensor):
            if a is out:
                return  # x.to(x.dtype) returns x itself: nothing to replay
            entries.append((True, _note(ctx, a)))
        elif isinstance(a, (list, tuple)) and any(isinstance(v, _Tensor) for v in a):
            return
        else:
            entries.append((False, a))
    if kwargs and any(isinstance(v, _Tensor) for v in kwargs.values()):
        return
    try:
        setattr(out, _SRC, Source(ctx.token, func, entries, dict(kwargs) if kwargs else {}, out._version))
    except (AttributeError, RuntimeError):
        pass


def _note(ctx, a: torch.Tensor):
    """(ready source or None, a's Source or None, weakref to a or None, a's version).

    This runs for every tensor argument of every derivable op in a wrapped forward (~60 a Llama block), so it
    does no more than it must: when something holds ``a`` already, that is what a replay will use (a later note
    on ``a`` of the same version would name the same value), so neither its Source nor a weak reference is
    needed."""
    version = a._version
    h = getattr(a, _HELD, None)  # held(), inlined
    if h is not None and h[0] is ctx.token and h[1] == version:
        return h[2], None, None, version
    ready = _cheap(ctx, a)
    if ready is not None:
        return ready, None, None, version
    src = getattr(a, _SRC, None)
    if src is not None and (src.token is not ctx.token or src.version != version):
        src = None
    return None, src, weakref.ref(a), version


def _cheap(ctx, a: torch.Tensor):
    """What holds ``a`` at no cost of ours, when nothing we packed does: the module, the caller, or ``a`` itself
    when it is tiny; None otherwise."""
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
    ids = ctx.constant_ids
    if id(a) in ids:
        return True
    base = a._base
    return base is not None and id(base) in ids


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


class Derived(ComputedOnce):
    """A saved tensor replayed in backward: ``func`` on the unpacked arguments.

    ``uses`` counts its readers (saved slots and other Deriveds, see ``count_use``): like a PackedActivation, it
    is replayed once and the result handed to the next ``uses - 1`` readers, then let go of. RMSNorm's output,
    saved by the q, k and v projections, is one replay instead of three."""

    __slots__ = ("func", "args", "kwargs", "fuse", "uses", "_memo", "_left")

    def __init__(self, func, args, kwargs, fuse: bool = False):
        self.func, self.args, self.kwargs, self.fuse = func, args, kwargs, fuse
        self.uses, self._memo, self._left = 0, None, 0

    def compute(self) -> torch.Tensor:
        if self.fuse:  # with the replays and decodes below it, as one compiled kernel (fused_replay.py)
            out = _fused_replay().run(self)
            if out is not None:
                return out
        return self.replay()

    def replay(self) -> torch.Tensor:
        vals = [(v if isinstance(v, torch.Tensor) else v.unpack()) if is_t else v for is_t, v in self.args]
        return call_without_grad(self.func, vals, self.kwargs)


def call_without_grad(fn, args, kwargs=None):
    """fn(*args, **kwargs) without grad, as every replay runs (backward runs without grad unless create_graph:
    then the context is skipped)."""
    if not torch.is_grad_enabled():
        return fn(*args, **(kwargs or {}))
    with torch.no_grad():
        return fn(*args, **(kwargs or {}))


def count_use(obj) -> None:
    """Count one more reader of ``obj`` (a PackedActivation or Derived): a saved slot pack() hands it to, or a
    Derived that has it as an argument. A Derived counts its arguments when it gets its first reader, once:
    however many read it, it replays (and so reads them) once. Readers that never come (a node backward does
    not run) only keep the decoded value until the graph is freed."""
    obj.uses += 1
    if obj.uses == 1 and type(obj) is Derived:
        for is_t, v in obj.args:
            if is_t and not isinstance(v, torch.Tensor):
                count_use(v)


def _view_of(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """The view ``(size, stride)`` at ``offset`` elements past ``base``'s own start."""
    return base.as_strided(size, stride, base.storage_offset() + offset)


def derive(ctx, t: torch.Tensor):
    """A Derived giving ``t``'s value from what ``ctx`` (a PackContext) holds, or None."""
    fuse = ctx.policy.fuse_replays
    if fuse is None:
        fuse = t.is_cuda
    src = getattr(t, _SRC, None)
    if src is not None and src.token is ctx.token and src.version == t._version:
        return _from_source(ctx, src, 0, fuse)
    base = t._base
    if base is None:
        return _param_cast(ctx, t)
    if t._version == base._version:
        # A view made inside an op (F.linear flattens its input, and takes its weight transposed): replay the
        # view on the base. A packed or kept base comes back with its original strides; a replayed one only when
        # it was contiguous.
        b = held(ctx.token, base)
        if b is None and base.is_contiguous():
            bsrc = getattr(base, _SRC, None)
            if bsrc is not None and bsrc.token is ctx.token and bsrc.version == base._version:
                b = _from_source(ctx, bsrc, 0, fuse)
        if b is None:
            b = _param_cast(ctx, base)
        if b is None:
            return None
        # (not fused itself: unpacking it computes its base, fused in turn; fused_replay.run declines views)
        return Derived(_view_of, [(True, b), (False, tuple(t.shape)), (False, t.stride()),
                                  (False, t.storage_offset() - base.storage_offset())], {})
    return None


# Autograd's node classes, to recognise autocast's weight casts (None where this torch names them otherwise).
_ToCopyBackward = getattr(torch._C._functions, "ToCopyBackward0", None)
_AccumulateGrad = getattr(torch._C._functions, "AccumulateGrad", None)


def _param_cast(ctx, x: torch.Tensor):
    """A Derived replaying ``x`` as ``p.to(x.dtype)`` when ``x`` is a dtype copy of a parameter or buffer ``p`` of
    the block, as autocast makes of fp32 weights for every matmul (below torch functions, so OpTracker never sees
    the cast and it has no Source), or None.

    ``linear`` saves that copy transposed, ``W.to(bf16).t()``. Packing it costs a strided copy to make it
    contiguous, and one back to the transposed strides on unpack (``elementwise_kernel<128,4>`` on CUDA, ~150 us
    each for a Llama-7B MLP weight), plus a byte a parameter until backward and an FP8-rounded weight in the input
    gradient. Replayed, it costs one contiguous cast in backward, viewed transposed (``derive``), and no memory.

    The copy is recognised from its graph: made by ``_to_copy`` (ToCopyBackward0) straight from the leaf
    (AccumulateGrad), not written since (version 0), and laid out as ``p``, which ``p.to(dtype)`` reproduces.
    As with every replay from a parameter, the parameter must not change between forward and backward (an
    optimizer step in backward updates a parameter only after every use of it has run its backward)."""
    fn = x.grad_fn
    if fn is None or type(fn) is not _ToCopyBackward or x._version != 0:
        return None
    node = fn.next_functions[0][0]
    if type(node) is not _AccumulateGrad:
        return None
    p = node.variable
    if (p.dtype == x.dtype or p.device != x.device or p.shape != x.shape or p.stride() != x.stride()
            or x.storage_offset() != 0 or not ctx.is_module_tensor(p)):
        return None
    return Derived(_cast, [(True, p), (False, x.dtype)], {})


def _cast(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return p.to(dtype)


_FUSED = None


def _fused_replay():
    """fused_replay.py, imported on first use (it imports this module)."""
    global _FUSED
    if _FUSED is None:
        from . import fused_replay
        _FUSED = fused_replay
    return _FUSED


def _from_source(ctx, src: Source, depth: int, fuse: bool):
    if depth >= MAX_DEPTH:
        return None
    args = []
    for is_t, entry in src.args:
        if not is_t:
            args.append((False, entry))
            continue
        ready, asrc, ref, version = entry
        r = None
        if ref is not None:  # nothing held the argument when the op ran: it may have been packed since
            a = ref()
            if a is not None:
                h = getattr(a, _HELD, None)  # held(), inlined
                if h is not None and h[0] is ctx.token and h[1] == version == a._version:
                    r = h[2]
        if r is None:
            r = ready
        if r is None and asrc is not None:
            r = _from_source(ctx, asrc, depth + 1, fuse)
        if r is None:
            return None
        args.append((True, r))
    return Derived(src.func, args, src.kwargs, fuse)
