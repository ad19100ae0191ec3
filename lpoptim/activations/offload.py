"""Saved activations moved to host memory: what the first blocks save for backward is copied to pinned CPU memory
while the forward goes on, and copied back ahead of those blocks' backward.

    handle = offload_activations(model.model.layers, 12)   # the first 12 blocks' saved tensors
    ...
    handle.remove()

The first blocks: their forward ends first, so their copies have the rest of the forward to finish, and their
backward comes last, so the copies back have the rest of the backward. When a block's forward returns, what it
saved is copied to pinned host tensors on a stream of its own (the compute stream never waits for it); each
tensor's GPU memory is freed when its copy is done, so the step's peak, at the start of backward, drops by about
what those blocks save, as long as PCIe keeps up (docs/prepare.md has the costs).

Copies back: when the backward of block i begins (its first saved tensor is unpacked), the offloaded blocks are
fetched, last first, down to block i - (n - k) + 1 (n blocks, k offloaded): one for each block whose backward has
finished and freed its own, so the fetches add no memory. They run on a second stream, into memory allocated on
the compute stream, which waits for each block's by an event; a block not fetched in time is fetched when
unpacked (correct, only slower). A fetched tensor lives as long as autograd keeps it (a second
backward, ``retain_graph=True``, reads it again). Each forward keeps its own bookkeeping: several forwards before
their backwards (accumulating micro-batches) each fetch their own blocks.

What moves: the tensors a block saves for backward (``saved_tensors_hooks`` around its forward, or around its
compiled forward: then the compiled graph's saved tensors, as it returns them), on the blocks' device, dense, of at
least ``min_bytes``, but not parameters (a linear layer's weight stays) nor the block's tensor arguments that do
not require grad, or views of them (rotary tables, masks: shared by the blocks, they outlive them). The same view
saved by several ops moves once; two views of one storage move as two tensors (copied, and fetched back, twice). Host memory holds the
offloaded blocks' tensors, pinned (torch's caching host allocator reuses them). Autograd skips its check for
tensors changed in place while hooks hold them; this one makes it, when the block's forward ends and at backward
(where the tensor still lives to tell). A block run again inside backward (a checkpointed recompute) is left as
it is.

Refused: ``compress_activations`` on the same blocks, in either order (its hooks would take the saved tensors
first), and FSDP2 (its gathered weights are saved as activations). Under CUDA graphs it would save nothing (their
pool keeps the memory): ``prepare`` refuses that pair. On CPU tensors (the tests) the same bookkeeping runs with
plain copies; ``offload_activations`` itself asks for CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterable

import torch
import torch.nn as nn

from ..instance_forward import had_own_forward, install_forward, remove_forward
from .wrap import RemoveOnExit, _as_blocks, is_wrapped

_ATTR = "_lpoptim_offload"


class _Pass:
    """One forward's bookkeeping, read by its backward (forwards may follow each other before a backward runs):
    its offloaded blocks, the blocks whose backward has begun, the next block to fetch ahead, the parameters'
    storages (as they were at this forward)."""
    __slots__ = ("blocks", "begun", "next_fetch", "params")

    def __init__(self, n_blocks: int, params: set):
        self.blocks: list[_Block | None] = [None] * n_blocks
        self.begun: set[int] = set()
        self.next_fetch = n_blocks - 1
        self.params = params


class _Block:
    """One offloaded block's saved tensors of one forward, the event after which their copies to host memory are
    done, and (fetched) the event after which their copies back are."""
    __slots__ = ("saved", "by_tensor", "inputs", "copied", "fetched")

    def __init__(self, inputs: set):
        self.copied = self.fetched = None
        self.saved = []  # weak references to its _Saved: autograd owns them
        self.by_tensor = {}  # during the forward: a tensor saved again (by several ops) is copied once
        self.inputs = inputs  # the storages of its tensor arguments without grad: they outlive it, so they stay


class _Saved:
    """One offloaded tensor: while the block's forward runs the tensor itself, then its pinned host copy (and a
    weak reference to the tensor, to see an in-place change); once fetched, its copy on the device."""
    __slots__ = ("block", "tensor", "version", "host", "source", "device_copy", "__weakref__")

    def __init__(self, block: _Block, t: torch.Tensor):
        self.block, self.tensor, self.version = block, t, t._version
        self.host = self.source = self.device_copy = None

    def check_version(self, t: torch.Tensor | None) -> None:
        """Autograd's own check, which its hooks skip: a saved tensor changed in place since it was saved."""
        if t is not None and t._version != self.version:
            raise RuntimeError("offload_activations: one of the tensors saved for gradient computation has been "
                               f"modified by an inplace operation (version {self.version} when saved, now "
                               f"{t._version}); without offloading, autograd raises the same")


class OffloadHandle(RemoveOnExit):
    """What ``offload_activations`` returns: the offloaded blocks, the bytes their last forward moved, ``remove()``."""

    def __init__(self, blocks: nn.Module | Iterable[nn.Module], n_blocks: int, min_bytes: int = 2**20):
        blocks = _as_blocks(blocks)
        if not (isinstance(n_blocks, int) and not isinstance(n_blocks, bool) and 1 <= n_blocks <= len(blocks)):
            raise ValueError(f"offload_activations: n_blocks is an int in 1..{len(blocks)} (the blocks), got "
                             f"{n_blocks!r}")
        if not (isinstance(min_bytes, int) and min_bytes >= 0):
            raise ValueError(f"offload_activations: min_bytes must be an int >= 0, got {min_bytes!r}")
        params = [p for b in blocks for p in b.parameters()]
        if not params:
            raise ValueError("offload_activations: the blocks have no parameters (their device is unknown)")
        from ..optim.distributed import is_dtensor

        if any(is_dtensor(p) for p in params):
            raise ValueError("offload_activations: FSDP2 (DTensor) blocks are not supported: their gathered weights "
                             "would be saved, and moved, as activations")
        for b in blocks:
            if is_wrapped(b):
                raise ValueError("offload_activations: a block is wrapped by compress_activations, whose hooks take "
                                 "its saved tensors first; use one or the other")
            if is_offloaded(b):
                raise ValueError("offload_activations: a block is offloaded already")
        self.device = params[0].device
        self.n_blocks, self.min_bytes = n_blocks, min_bytes
        self.blocks, self._n_total = blocks, len(blocks)
        self.offloaded_bytes = 0  # what the last forward moved to host memory
        cuda = self.device.type == "cuda"
        self._to_host = torch.cuda.Stream(self.device) if cuda else None
        self._to_device = torch.cuda.Stream(self.device) if cuda else None
        self._pass: _Pass | None = None  # the latest forward's
        self._params, self._params_key = None, None  # the parameters' storages, and what says they moved
        for i, b in enumerate(blocks):
            if b._compiled_call_impl is not None:  # block.compile(): around the compiled call
                b._compiled_call_impl = _OffloadedCall(self, i, b._compiled_call_impl)
            else:
                install_forward(b, _ATTR, _OffloadedForward(self, i, b.forward, had_own_forward(b)))

    # ---- the hooks -----------------------------------------------------------------------------------------

    def _call(self, i: int, fn, args, kwargs):
        # nothing is saved without grad; inside backward a block runs again for a recompute (checkpointing), whose
        # tensors are used at once: neither is offloaded, nor does it start a new forward's bookkeeping
        if (not torch.is_grad_enabled() or torch.is_inference_mode_enabled()
                or torch._C._current_graph_task_id() != -1):
            return fn(*args, **kwargs)
        if i == 0 or self._pass is None:  # a new forward
            self._pass = _Pass(self.n_blocks, self._param_storages())
            self.offloaded_bytes = 0
        p = self._pass
        block = None
        if i < self.n_blocks:
            # arguments without grad (rotary tables, masks) are shared by the blocks and outlive them; an input that
            # requires grad (the hidden states) is usually held by this block's saved tensors alone: it moves
            block = _Block({t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.requires_grad})
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, block, p.params),
                                                      functools.partial(self._unpack, i, p)):
            out = fn(*args, **kwargs)
        if block is not None:
            if block.saved:
                self._copy_out(block)
                p.blocks[i] = block
            block.by_tensor = block.inputs = None
        return out

    def _param_storages(self) -> set:
        """The blocks' parameter storages, taken again only where the first or last parameter moved (a model cast or
        moved as a whole): a loop over every parameter each forward cost 0.39 ms of host time for 320 (a 2-core
        CPU, torch 2.13)."""
        first, last = self.blocks[0], self.blocks[-1]
        key = tuple(next(b.parameters(), torch.empty(0)).untyped_storage().data_ptr() for b in (first, last))
        if key != self._params_key:
            self._params = {p.untyped_storage().data_ptr() for b in self.blocks for p in b.parameters()}
            self._params_key = key
        return self._params

    def _pack(self, block: _Block | None, params: set, t: torch.Tensor):
        if (block is None or type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device
                or t.numel() * t.element_size() < self.min_bytes or not _dense(t)):
            return t
        storage = t.untyped_storage().data_ptr()
        if storage in params or storage in block.inputs:  # weights, and what outlives the block anyway
            return t
        key = (storage, t.storage_offset(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())
        s = block.by_tensor.get(key)
        if s is None:  # copied when the block's forward ends
            s = block.by_tensor[key] = _Saved(block, t)
            block.saved.append(weakref.ref(s))
        return s

    def _copy_out(self, block: _Block) -> None:
        """The block's saved tensors to pinned host memory, on the copy stream, each tensor's memory held until its
        copy is done."""
        saved = [s for s in (ref() for ref in block.saved) if s is not None]
        cuda = self._to_host is not None
        if cuda:
            self._to_host.wait_stream(torch.cuda.current_stream(self.device))  # after the ops that made them
        with torch.cuda.stream(self._to_host) if cuda else contextlib.nullcontext():
            for s in saved:
                s.check_version(s.tensor)
                s.host = torch.empty_like(s.tensor, device="cpu", pin_memory=cuda)  # the same strides (dense)
                s.host.copy_(s.tensor, non_blocking=cuda)
                if cuda:
                    s.tensor.record_stream(self._to_host)  # its memory is not reused before its copy is done
                self.offloaded_bytes += s.tensor.numel() * s.tensor.element_size()
                s.source, s.tensor = weakref.ref(s.tensor), None
            if cuda:
                block.copied = self._to_host.record_event()

    def _unpack(self, i: int, p: _Pass, s):
        if i not in p.begun:  # block i's backward begins: fetch ahead, one block per block done
            p.begun.add(i)
            first = max(i - max(self._n_total - self.n_blocks - 1, 0), 0)
            while p.next_fetch >= first:
                block = p.blocks[p.next_fetch]
                if block is not None and block.fetched is None:
                    self._fetch(block)
                p.next_fetch -= 1
        if not isinstance(s, _Saved):
            return s
        if s.tensor is not None:  # unpacked before its block's forward ended (a gradient taken inside it)
            s.check_version(s.tensor)
            return s.tensor
        s.check_version(s.source())  # changed in place since (while it lives to tell)
        if s.device_copy is None:  # not fetched ahead
            self._fetch(s.block)
        if self._to_device is not None:
            torch.cuda.current_stream(self.device).wait_event(s.block.fetched)
        return s.device_copy  # kept while autograd keeps s: the tensor may be unpacked again

    def _fetch(self, block: _Block) -> None:
        """The block's tensors not yet back, copied back on the second stream into memory allocated on the compute
        stream (free there now)."""
        saved = [s for s in (ref() for ref in block.saved) if s is not None and s.device_copy is None]
        if self._to_device is None:
            for s in saved:
                s.device_copy = s.host.clone()
            block.fetched = True
            return
        compute = torch.cuda.current_stream(self.device)
        for s in saved:
            s.device_copy = torch.empty_like(s.host, device=self.device)
        self._to_device.wait_stream(compute)
        self._to_device.wait_event(block.copied)
        with torch.cuda.stream(self._to_device):
            for s in saved:
                s.device_copy.copy_(s.host, non_blocking=True)
            block.fetched = self._to_device.record_event()
        for s in saved:
            # freed unread (a graph dropped before its backward), its memory must not go back to the compute stream
            # before the copy into it is done: the compute stream then waits for it (read, it already has). Not
            # record_stream: that holds each freed tensor back until the fetches queued after it are done too
            weakref.finalize(s.device_copy, compute.wait_event, block.fetched).atexit = False

    # ---- undoing ---------------------------------------------------------------------------------------------

    def remove(self) -> None:
        for b in self.blocks:
            if not remove_forward(b, _ATTR) and isinstance(b._compiled_call_impl, _OffloadedCall):
                b._compiled_call_impl = b._compiled_call_impl.original
        self.blocks = []


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill exactly ``numel`` consecutive places in some order (its strides a permutation of
    a contiguous layout's): then it lies in a buffer of its own bytes with its own strides."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def is_offloaded(block: nn.Module) -> bool:
    """Whether ``block`` is offloaded by ``offload_activations``."""
    return _ATTR in block.__dict__ or isinstance(block._compiled_call_impl, _OffloadedCall)


class _OffloadedCall:
    """A compiled block's call (``block._compiled_call_impl``) inside the handle's hooks."""

    def __init__(self, handle: OffloadHandle, index: int, original):
        self.handle, self.index, self.original = handle, index, original

    def __call__(self, *args, **kwargs):
        return self.handle._call(self.index, self.original, args, kwargs)


class _OffloadedForward(_OffloadedCall):
    """An eager block's forward inside the handle's hooks (instance_forward's wrapper: ``had_forward``)."""

    def __init__(self, handle: OffloadHandle, index: int, original, had_forward: bool):
        super().__init__(handle, index, original)
        self.had_forward = had_forward
        functools.update_wrapper(self, original)

    # compiled later: Dynamo runs this eagerly and compiles ``original``
    __call__ = torch.compiler.disable(_OffloadedCall.__call__, recursive=False)


def offload_activations(blocks: nn.Module | Iterable[nn.Module], n_blocks: int, *,
                        min_bytes: int = 2**20) -> OffloadHandle:
    """Move what the first ``n_blocks`` of ``blocks`` save for backward to pinned host memory during the forward,
    and back ahead of their backward (module docstring). Blocks on one CUDA device; compile them first, if at all.
    ``min_bytes``: smaller saved tensors stay on the GPU."""
    blocks = _as_blocks(blocks)
    devices = {p.device for b in blocks for p in b.parameters()}
    if len(devices) > 1 or any(d.type != "cuda" for d in devices):
        raise ValueError(f"offload_activations moves saved activations from one GPU to host memory; the blocks' "
                         f"parameters are on {sorted(map(str, devices))}")
    return OffloadHandle(blocks, n_blocks, min_bytes)
