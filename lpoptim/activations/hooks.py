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
5. attention's saved tensors follow ``policy.attention``;
6. a tensor that a cheap element-wise op computed from things already held is replayed in backward instead
   (``policy.derive``, derive.py): it costs no bytes;
7. the rest is packed: per row (or tensor) if a GEMM saved it, per group of 16 otherwise.
"""
from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .codec import COMPRESSIBLE_DTYPES, PackedActivation, pack, packed_nbytes
from .derive import DERIVABLE_OPS, derive, held, is_constant, record, remember
from .policy import ActivationPolicy
from .stats import SavedStats


class OpTracker(TorchFunctionMode):
    """Remembers the outermost torch function running (its ``__name__``), e.g. ``linear`` or ``layer_norm``.

    Torch disables a mode inside its own handler, so a composite function (``multi_head_attention_forward``)
    names everything it saves; policy.py treats such names explicitly.
    """

    def __init__(self, ctx=None):
        super().__init__()
        self.op: str | None = None
        self.ctx = ctx  # when set, outputs of derivable ops get a Source (derive.py)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # Dynamo inlines modes: keep our bookkeeping out of its graphs
            return func(*args, **kwargs)
        prev, self.op = self.op, getattr(func, "__name__", None)
        try:
            out = func(*args, **kwargs)
        finally:
            self.op, name = prev, self.op
        if self.ctx is not None and name in DERIVABLE_OPS:
            record(self.ctx, func, args, kwargs, out)
        return out


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (some subclasses, meta)
        return None


def module_storage_ptrs(module: torch.nn.Module) -> set[int]:
    """Storage addresses of a module's parameters and buffers: what ``pack`` must never compress."""
    ptrs = set()
    for t in list(module.parameters()) + list(module.buffers()):
        p = _storage_ptr(t)
        if p:
            ptrs.add(p)
    return ptrs


class PackContext:
    """One forward of one wrapped block: hooks in, a dedupe table, records into ``stats`` when given."""

    def __init__(self, module: torch.nn.Module, policy: ActivationPolicy, stats: SavedStats | None = None,
                 inputs=()):
        self.policy = policy
        # Tensors handed to the block that need no grad (rotary tables, masks): the caller holds them, so they
        # are kept by reference, and views of them too. Anything else without grad was made inside the block
        # (e.g. by a custom autograd Function or a compiled graph) and is packed like any activation.
        self.constant_ids = {id(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and not t.requires_grad}
        self.stats = stats
        self.param_ptrs = module_storage_ptrs(module)
        self.token = object()  # identifies this forward: Sources and notes from other forwards are ignored
        self.tracker = OpTracker(self if policy.derive else None)
        self.seen: dict[tuple, tuple[weakref.ref, PackedActivation]] = {}
        self.kept_storages: dict[int, torch.Tensor] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)

    def __enter__(self):
        self._hooks.__enter__()
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)
        self.tracker.ctx = None
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
        return kept

    def is_module_tensor(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.nn.Parameter) or _storage_ptr(t) in self.param_ptrs

    def pack(self, t: torch.Tensor):
        if torch.compiler.is_compiling():
            # Dynamo traced a compiled block's forward with our hooks active; what its graph saves reaches this
            # hook again at run time, outside the graph, and is packed then.
            return t
        op = self.tracker.op
        nbytes = t.numel() * t.element_size()
        if not t.dtype.is_floating_point or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return self._keep("lowbit", t)  # already low-bit: never quantize twice
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) or t.is_sparse:
            return self._keep("other", t)
        sptr = _storage_ptr(t)
        if isinstance(t, torch.nn.Parameter) or sptr in self.param_ptrs:
            self._record("parameter", t, 0, 0)
            return t
        if t.dtype not in COMPRESSIBLE_DTYPES:
            return self._keep("other", t)
        if is_constant(self, t):
            return self._keep("constant", t)  # from outside the block (rotary table, mask): held anyway
        key = (sptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)
        hit = held(self.token, t)
        if hit is None:
            hit = self.seen.get(key)
            hit = hit[1] if hit is not None and hit[0]() is not None else None
        if hit is not None:
            self._record("duplicate", t, 0, 0)
            return hit
        kind = self.policy.kind_of(op)
        gran = self.policy.granularity_of(kind, op)
        if gran is None:
            return self._keep("attention", t)
        if t.numel() < self.policy.min_numel or packed_nbytes(t, gran, self.policy.group_size) * 3 > nbytes * 2:
            return self._keep("small", t)
        out = derive(self, t) if self.policy.derive else None
        if out is not None:
            self._record("derived", t, nbytes, 0)
        else:
            out = pack(t, gran, self.policy.group_size, self.policy.fmt)
            self._record(f"fp8_{gran}", t, nbytes, out.nbytes)
        # The base keeps the storage alive while the entry is valid: a dead base means the address may be reused.
        base = t._base if t._base is not None else t
        self.seen[key] = (weakref.ref(base), out)
        remember(self.token, t, out)
        return out


def unpack(x):
    # Kept tensors come back detached (returning a saved output itself from pack would make a reference cycle
    # through its grad_fn); autograd only needs their values. Packed and derived ones are rebuilt.
    return x if isinstance(x, torch.Tensor) else x.unpack()
