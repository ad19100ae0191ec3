"""The saved-tensor hooks that keep a block's activations in FP8 while it runs forward.

``PackContext`` is entered around one forward of a wrapped block. It installs
``torch.autograd.graph.saved_tensors_hooks`` (every tensor autograd saves goes through ``pack``, every use in
backward through ``unpack``) and an ``OpTracker``, a TorchFunctionMode that remembers which torch function is
running, so that ``pack`` knows which op is saving the tensor and can pick its granularity (policy.py).

Rules ``pack`` applies, in order:
1. non-float dtypes (codes a low-bit linear saved: uint8, int8, fp8) and tensor subclasses are left alone;
2. parameters and buffers of the block, and views of them, are left alone (the module holds them anyway), and
   so are constants: tensors passed to the block that need no grad (rotary tables, masks), and views of them;
3. a tensor already packed in this forward (same storage address, offset, shape, strides, dtype and version
   counter, and the first one's base tensor still alive, so the address cannot have been reused) shares the
   first packed copy;
4. tensors below ``min_numel`` elements, or not smaller once packed (e.g. a last dimension of 1 with groups
   of 16), are left alone;
5. masks (what dropout saves: on the CPU a float tensor of 0 and 1/(1-p)) are kept exactly;
   attention's saved tensors follow ``policy.attention``, but its output, which the output projection reads
   too, is recomputed in backward from the kept q, k and v (``policy.attention_output="replay"``), or packed as
   a GEMM input ("gemm");
6. a tensor that a cheap element-wise op computed from things already held, or autocast's low-precision copy
   of a parameter, is replayed in backward instead (``policy.derive``, derive.py): it costs no bytes;
7. the rest is packed: per row (or tensor) if a GEMM saved it, per group of 16 otherwise.

What ``pack`` returns for several saved slots (rule 3) or several replays is counted (``derive.count_use``), so
that backward decodes (or replays) it once and hands the value to its other readers (codec.py, derive.py).

This all runs on the host thread that launches the GPU's kernels, once per torch call and per saved tensor, so it
is kept lean: benchmarks/activation_overhead.py measures it.
"""
from __future__ import annotations

import functools
import types
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from . import graph_hooks
from .codec import COMPRESSIBLE_DTYPES, PackedActivation, pack, packed_nbytes
from .derive import _HELD, DERIVABLE_OPS, Derived, _cheap, count_use, derive, held, record, remember
from .policy import MASK_OPS, ActivationPolicy
from .stats import SavedStats

# Host overhead matters here: ``__torch_function__`` runs for every torch call inside a wrapped block and ``pack``
# for every saved tensor, on the host thread that launches the GPU's kernels. A Llama block makes ~60 such calls
# and saves ~40 tensors per forward, so a microsecond spent on each costs ~100 us a block. Hence the module-level
# aliases, the per-function cache and the cheap type checks below.
_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_COMPRESSIBLE = frozenset(COMPRESSIBLE_DTYPES)
_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

# func -> (its ``__name__``, whether derive.py records its output). Torch hands the mode a few hundred distinct
# functions at most (Tensor methods and torch functions), so the table stays small.
_FUNC_INFO: dict = {}


def _func_info(func) -> tuple[str | None, bool]:
    name = getattr(func, "__name__", None)
    info = (name, name in DERIVABLE_OPS)
    try:
        _FUNC_INFO[func] = info
    except TypeError:  # an unhashable callable: looked up again next time
        pass
    return info


def _mha_body():
    """``F.multi_head_attention_forward`` without its torch-function dispatch (its first statement), or None.

    Torch disables a mode inside its handler, so through the public function the tracker would name everything
    nn.MultiheadAttention saves ``multi_head_attention_forward``: its in- and out-projections' inputs kept whole
    as attention, and the out-projection's input (a copy of attention's output) stored beside attention's own.
    The same code with ``has_torch_function`` answering False runs its torch calls under the tracker instead:
    ``linear`` saves GEMM inputs, attention saves its own, and the out-projection's input replays from
    attention's output (derive.py), as in any block written with these calls."""
    f = torch.nn.functional.multi_head_attention_forward
    if not hasattr(f, "__code__") or "has_torch_function" not in f.__code__.co_names:
        return None
    scope = dict(f.__globals__, has_torch_function=lambda _: False)
    body = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    body.__kwdefaults__ = f.__kwdefaults__
    return body


_MHA = torch.nn.functional.multi_head_attention_forward
_MHA_BODY = _mha_body()


class OpTracker(TorchFunctionMode):
    """Remembers the outermost torch function running (its ``__name__``), e.g. ``linear`` or ``layer_norm``.

    Torch disables a mode inside its own handler, so a composite function names everything it saves; policy.py
    treats such names explicitly. ``multi_head_attention_forward`` is run with the tracker on inside (_mha_body).
    """

    def __init__(self, ctx=None):
        super().__init__()
        self.op: str | None = None
        self.call = None  # (args, kwargs) of the running scaled_dot_product_attention
        self.ctx = ctx  # when set, outputs of derivable ops get a Source (derive.py)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if _is_compiling():  # Dynamo inlines modes: keep our bookkeeping out of its graphs
            return func(*args, **kwargs)
        try:
            name, derivable = _FUNC_INFO[func]
        except (KeyError, TypeError):  # the first call of this function (or an unhashable callable)
            name, derivable = _func_info(func)
        if func is _MHA and _MHA_BODY is not None:
            with self:  # (the handler runs with this mode popped: pushed again for the body's calls)
                return _MHA_BODY(*args, **kwargs)
        prev, self.op = self.op, name
        if func is _SDPA:  # its arguments, for replaying its output (_attention_replay)
            self.call = (args, kwargs)
        try:
            out = func(*args, **kwargs)
        finally:
            self.op = prev
            self.call = None
        if derivable and self.ctx is not None:
            record(self.ctx, func, args, kwargs, out)
        return out


def _is_attention_output(t: torch.Tensor) -> bool:
    """``t`` is the first output of the attention op saving it (its out, not q, k, v or the logsumexp): saved as
    an output, it already has the attention node as its grad_fn."""
    fn = t.grad_fn
    if fn is None or t.output_nr != 0:
        return False
    name = type(fn).__name__
    hit = _ATTENTION_NODES.get(name)
    if hit is None:
        hit = _ATTENTION_NODES[name] = "Attention" in name or "ScaledDotProduct" in name
    return hit


_ATTENTION_NODES: dict[str, bool] = {}
_SDPA = torch.nn.functional.scaled_dot_product_attention
_AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_state() -> list[tuple]:
    """(device type, enabled, dtype) of autocast for every device type: what a replay in backward re-enters."""
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES]


class reenter_autocast:
    """Re-enter a forward's autocast state (``autocast_state()``) for every device type, in backward."""

    def __init__(self, states):
        self.ctxs = [torch.autocast(d, dtype=dt, enabled=on) for d, on, dt in states]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
        return False


class _AttentionReplay:
    """``scaled_dot_product_attention`` called again in backward, under the forward's autocast state, with its
    tensor arguments and keyword arguments passed positionally (a Derived's arguments)."""

    __name__ = "scaled_dot_product_attention"

    def __init__(self, n_args: int, kw_names: tuple, autocast):
        self.n_args, self.kw_names, self.autocast = n_args, kw_names, autocast

    def __call__(self, *vals):
        kwargs = dict(zip(self.kw_names, vals[self.n_args:]))
        with reenter_autocast(self.autocast):
            return _SDPA(*vals[:self.n_args], **kwargs)


def _attention_replay(ctx, out: torch.Tensor):
    """A Derived that recomputes attention's output ``out`` from q, k, v and the mask when all of them are held
    as they were (kept, a parameter, a constant or tiny), else None.

    Attention's backward reads its output for D = rowsum(dO * O), subtracted from dP: FP8 rounding of O there
    moves q's and k's gradients (cosine 0.995 on OPT / BERT blocks, 0.998 on Llama's at head dim 64), while the
    forward run again on the same inputs gives the same bits. It costs one attention forward in backward and no
    memory; dropout inside attention (a random mask) is not replayed."""
    call = ctx.tracker.call
    if call is None:
        return None
    args, kwargs = call
    dropout_p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    if dropout_p:
        return None
    kw_names = tuple(kwargs)
    entries = []
    for a in (*args, *kwargs.values()):
        if not isinstance(a, torch.Tensor):
            entries.append((False, a))
            continue
        h = held(ctx.token, a)
        if h is None:
            h = _cheap(ctx, a)
        if h is None or (not isinstance(h, torch.Tensor) and type(h) is not Derived and
                         not isinstance(h, PackedActivation)):
            return None
        entries.append((True, h))
    return Derived(_AttentionReplay(len(args), kw_names, autocast_state()), entries, {})


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (some subclasses, meta)
        return None


def _is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)`` without the metaclass's Python ``__instancecheck__`` (~10x slower) in the
    common cases. Like it, a tensor flagged ``_is_param`` (a tensor subclass made a Parameter) counts."""
    cls = type(t)
    if cls is _Parameter:
        return True
    if cls is _Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, _Parameter)


def _module_tensors(module: torch.nn.Module):
    """Every parameter and buffer of ``module`` and its submodules, as ``parameters()`` and ``buffers()`` give
    them but without building their dotted names (which costs ~20 us a block on every forward)."""
    stack, seen = [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        for t in m._parameters.values():
            if t is not None:
                yield t
        for t in m._buffers.values():
            if t is not None:
                yield t
        stack.extend(c for c in m._modules.values() if c is not None)


def module_storage_ptrs(module: torch.nn.Module) -> set[int]:
    """Storage addresses of a module's parameters and buffers: what ``pack`` must never compress."""
    ptrs = set()
    for t in _module_tensors(module):
        p = _storage_ptr(t)
        if p:
            ptrs.add(p)
    return ptrs


def _constant_ids(inputs) -> set[int]:
    """ids of the tensors among ``inputs`` (args, kwargs) that need no grad. The usual call (tensors and plain
    scalars as positional or keyword arguments) is read directly; anything else goes through pytree."""
    args, kwargs = inputs if isinstance(inputs, tuple) and len(inputs) == 2 else (inputs, {})
    if isinstance(args, tuple) and isinstance(kwargs, dict):
        ids = set()
        for v in (*args, *kwargs.values()):
            if isinstance(v, _Tensor):
                if not v.requires_grad:
                    ids.add(id(v))
            elif v is not None and not isinstance(v, (bool, int, float, str)):
                break  # a container (or an object pytree may open): let pytree walk everything
        else:
            return ids
    return {id(t) for t in tree_leaves(inputs) if isinstance(t, _Tensor) and not t.requires_grad}


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_warned_outer = False


def _warn_if_outer_hooks() -> None:
    """Warn once when a user's saved_tensors_hooks (save_on_cpu, ...) are active around a wrapped block.

    Torch calls only the innermost saved-tensor hooks, so inside the block lpoptim's replace the user's: they see
    nothing the block saves, and e.g. save_on_cpu leaves it on the device. (Composing them, calling the user's
    hooks on the codes and kept tensors lpoptim holds, is not done yet.)"""
    global _warned_outer
    if _warned_outer or _top_hooks is None:
        return
    top = _top_hooks(False)
    if top is None or getattr(top[0], "_lpoptim", False):
        return
    _warned_outer = True
    warnings.warn(
        "compress_activations: the saved_tensors_hooks active around a wrapped block (e.g. "
        "torch.autograd.graph.save_on_cpu) do not see what the block saves; lpoptim's hooks hold it (in FP8, on "
        "its device) instead", stacklevel=3)


class PackContext:
    """One forward of one wrapped block: hooks in, a dedupe table, records into ``stats`` when given."""

    def __init__(self, module: torch.nn.Module, policy: ActivationPolicy, stats: SavedStats | None = None,
                 inputs=(), hooks: graph_hooks.GraphHooks | None = None, track_ops: bool = True):
        self.policy = policy
        # Tensors handed to the block that need no grad (rotary tables, masks): the caller holds them, so they
        # are kept by reference, and views of them too. Anything else without grad was made inside the block
        # (e.g. by a custom autograd Function or a compiled graph) and is packed like any activation.
        self.constant_ids = _constant_ids(inputs)
        self.stats = stats
        self.module = module  # its parameters' storages are looked up on the first eager pack (param_ptrs)
        self.token = object()  # identifies this forward: Sources and notes from other forwards are ignored
        self.tracker = OpTracker(self if policy.derive else None)
        # The tracker names the op saving each tensor in eager mode. Around a compiled forward it would only slow
        # the host (every torch call of the compiled code's wrappers goes through its Python), and the graphs
        # name their ops themselves (graph_hooks.py); eager code between graph breaks then gets the policy's
        # ``unknown`` granularity and no replays.
        self.track_ops = track_ops
        self.seen: dict[tuple, tuple[weakref.ref, PackedActivation]] = {}
        self.kept_storages: dict[int, torch.Tensor] = {}
        # GraphModule hooks: in eager mode they call self.pack (and Kept / PackedActivation's unpack); a compiled
        # graph traced under them packs inside the graph itself (graph_hooks.py). The handle's (its graphs record
        # into it), or the policy's.
        self.hooks = hooks or graph_hooks.hooks_for(policy)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack)

    @functools.cached_property
    def param_ptrs(self) -> set[int]:
        """Storage addresses of the block's parameters and buffers, what pack must never compress: taken when the
        first tensor is packed eagerly (a compiled forward packs inside its graphs and never asks)."""
        return module_storage_ptrs(self.module)

    def __enter__(self):
        _warn_if_outer_hooks()
        self._hooks.__enter__()  # (raises under torch.func transforms: then nothing is pushed)
        graph_hooks.push(self)
        if self.track_ops:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self.track_ops:
            self.tracker.__exit__(*exc)
        self.tracker.ctx = None
        graph_hooks.pop(self)
        self._hooks.__exit__(*exc)
        self.seen.clear()  # the packed copies live on in the graph; the table only served this forward
        self.constant_ids.clear()
        self.kept_storages.clear()
        self._hooks = None  # it holds self.pack: drop it so the context is freed without the cycle collector
        return False

    def _record(self, kind, t, original, stored):
        if self.stats is not None:
            self.stats.add(kind, self.tracker.op, t, original, stored)

    def _keep(self, kind, t):
        """Record and return a tensor kept as it is. Its memory is its storage's, counted once per forward
        (q, k and v viewed out of one projection cost that projection once)."""
        if self.stats is not None:
            ptr = _storage_ptr(t)
            if ptr is None:
                size = t.numel() * t.element_size()
            elif ptr in self.kept_storages:
                size = 0
            else:
                self.kept_storages[ptr] = t  # held until exit, so the address cannot be reused meanwhile
                size = t.untyped_storage().nbytes()
            self._record(kind, t, size, size)
        kept = t.detach()
        remember(self.token, t, kept)  # later views and casts of it can be replayed from it (derive.py)
        return Kept(kept)

    def is_module_tensor(self, t: torch.Tensor) -> bool:
        return _is_parameter(t) or _storage_ptr(t) in self.param_ptrs

    def pack(self, t: torch.Tensor):
        if _is_compiling():  # Dynamo tracing: what its graph saves is packed inside the graph (graph_hooks.py)
            return t
        dtype = t.dtype
        if dtype not in _COMPRESSIBLE:
            return self._pack_other(t)
        # Rules 1-7 of the module docstring in order. This runs for every saved tensor, so each property is read
        # once and some helpers (_is_parameter, is_constant, held, remember) are inlined.
        cls = type(t)
        if cls is _Tensor:
            is_param = getattr(t, "_is_param", False)  # as nn.Parameter's isinstance check
        elif cls is _Parameter:
            is_param = True
        else:
            is_param = isinstance(t, _Parameter)
            if not is_param:
                return self._keep("other", t)  # a tensor subclass
        if t.is_sparse:
            return self._keep("other", t)
        sptr = _storage_ptr(t)
        stats = self.stats
        if is_param or sptr in self.param_ptrs:
            if stats is not None:
                stats.add("parameter", self.tracker.op, t, 0, 0)
            return t
        if not t.requires_grad:
            ids, base = self.constant_ids, t._base
            if id(t) in ids or (base is not None and id(base) in ids):
                return self._keep("constant", t)  # from outside the block (rotary table, mask): held anyway
        token, version = self.token, t._version
        h = getattr(t, _HELD, None)  # packed (or kept) before, under this very version
        hit = h[2] if h is not None and h[0] is token and h[1] == version else None
        shape = t.shape  # a torch.Size: hashes and compares as the tuple
        key = (sptr, t.storage_offset(), shape, t.stride(), dtype, t.device, version)
        if hit is None:
            entry = self.seen.get(key)
            if entry is not None and entry[0]() is not None:
                hit = entry[1]
        if hit is not None:
            if stats is not None:
                stats.add("duplicate", self.tracker.op, t, 0, 0)
            if isinstance(hit, _Tensor):  # kept: wrapped again, so this save checks the version on use too
                return Kept(hit)
            count_use(hit)
            return hit
        policy = self.policy
        gran = policy.granularity_for(self.tracker.op)
        if gran is None:
            op = self.tracker.op
            if op in MASK_OPS:
                return self._keep("mask", t)
            if policy.attention_output == "keep" or not _is_attention_output(t):
                return self._keep("attention", t)
            out = _attention_replay(self, t) if policy.attention_output == "replay" else None
            if out is not None:  # recomputed in backward from q, k and v, which are kept
                if stats is not None:
                    stats.add("derived", op, t, t.numel() * t.element_size(), 0)
                remember(self.token, t, out)
                count_use(out)
                return out
            gran = policy.gemm_granularity  # also the output projection's input: a GEMM input
        numel = t.numel()
        nbytes = numel * t.element_size()
        if numel < policy.min_numel or packed_nbytes(t, gran, policy.group_size, policy.fmt) * 3 > nbytes * 2:
            return self._keep("small", t)
        out = derive(self, t) if policy.derive else None
        if out is not None:
            if stats is not None:
                stats.add("derived", self.tracker.op, t, nbytes, 0)
        else:
            out = pack(t, gran, policy.group_size, policy.fmt)
            if stats is not None:
                stats.add(f"fp8_{gran}", self.tracker.op, t, nbytes, out.nbytes)
        # The base keeps the storage alive while the entry is valid: a dead base means the address may be reused.
        base = t._base
        self.seen[key] = (weakref.ref(base if base is not None else t), out)
        try:
            setattr(t, _HELD, (token, version, out))  # derive.remember: later casts and views replay from it
        except (AttributeError, RuntimeError):
            pass
        count_use(out)
        return out

    def _pack_other(self, t: torch.Tensor):
        """Rules 1, 2 and the float dtypes lpoptim does not pack (float64): kept, or a parameter."""
        if not t.dtype.is_floating_point or t.dtype in _FP8:
            return self._keep("lowbit", t)  # already low-bit: never quantize twice
        if (type(t) is not _Tensor and not _is_parameter(t)) or t.is_sparse:
            return self._keep("other", t)
        if _is_parameter(t) or _storage_ptr(t) in self.param_ptrs:
            self._record("parameter", t, 0, 0)
            return t
        return self._keep("other", t)


class Kept:
    """A tensor kept as it is, with its version when saved. Saved-tensor hooks switch off autograd's check that a
    saved tensor was not modified in place before backward; this puts it back, so such a change raises, as it
    would without the wrapper, instead of giving wrong gradients."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a {tuple(self.tensor.shape)} tensor saved inside a block wrapped by lpoptim.compress_activations "
                f"is at version {self.tensor._version}, saved at version {self.version}")
        return self.tensor

