"""``compress_activations``: wrap decoder blocks so that what autograd saves in them is kept in FP8.

Wrapping replaces the module's ``forward`` by an instance attribute that calls the original inside a
``PackContext`` (hooks.py) or, with ``recompute=True``, through ``fp8_checkpoint`` (recompute.py). Nothing about
the module's class, parameters, state_dict or hooks changes; ``remove()`` deletes the attribute again.

``compile=True`` compiles each block's original forward (``torch.compile``) and calls it from the wrapper, which
runs as plain Python: the fast way to combine the two. The wrapper enters the saved-tensor hooks and calls the
compiled forward; Dynamo sees no wrapper frame, no graph break and no resume function, so a block call costs the
host what a compiled block costs (wrapping a block already compiled with ``block.compile()`` instead put a graph
break at the wrapper and a Python frame callback on every call: host time on every block call, which at batch
1 leaves the GPU waiting). Dynamo guards on each handle's hooks: past its recompile limit (8), a process's ninth
handle over blocks of one class runs them eagerly; ``torch._dynamo.reset()`` between models avoids it.

torch.compile: the wrapper itself is never traced (``torch.compiler.disable(recursive=False)``): Dynamo runs it
eagerly and compiles the block's original forward as a frame of its own, so both orders work:
``torch.compile(wrapped_block)`` (or a compiled model containing wrapped blocks) and
``compress_activations(torch.compile(block))``. That frame is compiled under the handle's hooks, which
AOTAutograd inlines into its forward and backward graphs (graph_hooks.py): the packing runs inside the compiled
graphs. Dynamo guards on the active saved-tensor hooks, so a block compiled before it was wrapped, or after
``remove()``, compiles again.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import types
from typing import Iterable

import torch
import torch.nn as nn

from ..device import fp8_device_problem
from ..instance_forward import had_own_forward, install_forward, remove_forward
from .graph_hooks import GraphHooks
from .hooks import PackContext
from .policy import ActivationPolicy
from .recompute import fp8_checkpoint
from .stats import SavedStats

_ATTR = "_lpoptim_activations"


def _as_blocks(blocks) -> list[nn.Module]:
    if isinstance(blocks, nn.Module) and not isinstance(blocks, nn.ModuleList):
        return [blocks]
    if isinstance(blocks, (nn.ModuleList, list, tuple)):
        out = list(blocks)
        if not all(isinstance(b, nn.Module) for b in out):
            raise TypeError("compress_activations: every block must be an nn.Module")
        return out
    raise TypeError(f"compress_activations expects a module or a list of modules, got {type(blocks).__name__}")


class RemoveOnExit:
    """A handle that is also a context: ``with handle: ...`` calls its ``remove()`` on the way out."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


class ActivationHandle(RemoveOnExit):
    """What ``compress_activations`` returns: the wrapped blocks, their policy, statistics, and ``remove()``."""

    def __init__(self, blocks: list[nn.Module], policy: ActivationPolicy):
        self.blocks = blocks
        self.policy = policy
        self.stats: SavedStats | None = None  # set while ``record()`` is active
        # what compiled graphs of these blocks pack, one record per saved tensor, written when each graph is
        # compiled (their runs call no Python per tensor, so ``record()`` does not see them)
        self.graph_records: dict = {}  # (graph, saved node) -> SavedRecord
        self.hooks = GraphHooks(policy, self.graph_records)  # this handle's own: its graphs record here

    def graph_stats(self) -> SavedStats:
        """What the compiled graphs of the wrapped blocks save, by kind, as decided when each was compiled (one
        record per tensor and graph; ``record()`` covers what runs eagerly)."""
        return SavedStats(list(self.graph_records.values()))

    @contextlib.contextmanager
    def record(self):
        """Record every tensor the wrapped blocks save while the context is open::

            with handle.record() as stats:
                loss = model(x).sum()
            print(stats.bytes_by_kind(), stats.table())
        """
        prev, self.stats = self.stats, SavedStats()
        try:
            yield self.stats
        finally:
            self.stats = prev

    def remove(self):
        for b in self.blocks:
            _unwrap(b)
        self.blocks = []


def compress_activations(blocks: nn.Module | Iterable[nn.Module], policy: ActivationPolicy | None = None,
                         compile: bool | dict = False, **options) -> ActivationHandle:
    """Keep what autograd saves inside each block in FP8 E4M3; return a handle (``.remove()``, ``.record()``).

    ``blocks``: one module, or a list / ``nn.ModuleList`` of modules (e.g. ``model.layers``), each wrapped on
    its own (a ModuleList is never called, so its elements are). ``options`` are ``ActivationPolicy`` fields:
    ``recompute``, ``attention``, ``gemm_granularity``, ``group_size``, ``min_numel``, ``unknown``, ``derive``,
    ``fuse_replays``. ``compile``: run each block's forward compiled (``torch.compile``; the module docstring
    says why this beats wrapping a block compiled with ``block.compile()``); ``remove()`` leaves it uncompiled. A
    dict instead of True holds ``torch.compile``'s keyword arguments, e.g. ``{"mode": "reduce-overhead"}`` to replay
    each compiled block as a CUDA graph.
    """
    if not isinstance(compile, (bool, dict)):
        raise TypeError(f"compress_activations: compile is True, False or a dict of torch.compile arguments, got "
                        f"{compile!r}")
    if policy is None:
        policy = ActivationPolicy(**options)
    elif options:
        raise TypeError("pass either policy= or keyword options, not both")
    if isinstance(compile, dict) and compile.get("mode") in ("reduce-overhead", "max-autotune") and policy.recompute:
        raise ValueError(f"compress_activations: recompute=True runs each block again inside backward, outside the "
                         f"CUDA graphs of compile mode {compile['mode']!r}: not supported")
    mods = _as_blocks(blocks)
    # E4M3, the default, is what lpoptim's Triton kernels write (E5M2 takes torch ops, which any GPU runs eagerly)
    problem = policy.fmt.name == "e4m3" and fp8_device_problem((p for b in mods for p in b.parameters()),
                                                                "FP8 activations")
    if problem:
        raise ValueError(f"compress_activations: {problem}")
    from .offload import is_offloaded  # (offload.py imports this module)

    for b in mods:
        if is_wrapped(b):
            raise RuntimeError(f"{type(b).__name__} is already wrapped by compress_activations; remove() it first")
        if is_offloaded(b):
            raise ValueError(f"compress_activations: {type(b).__name__} is offloaded (offload_activations), whose "
                             "hooks would take its saved tensors first; use one or the other")
    handle = ActivationHandle(mods, policy)
    for b in mods:
        _wrap(b, handle, compile)
    return handle


def restore_activations(blocks_or_handle) -> None:
    """Undo ``compress_activations`` on these blocks (or on every block of a handle)."""
    if isinstance(blocks_or_handle, ActivationHandle):
        blocks_or_handle.remove()
        return
    for b in _as_blocks(blocks_or_handle):
        _unwrap(b)


class _WrappedForward:
    """The instance ``forward`` of a wrapped block.

    A class rather than a closure so that ``copy.deepcopy`` of a wrapped model gives a copy whose forward runs
    the copy (a closure would keep calling the original block). It is also the marker ``restore`` reads.
    """

    def __init__(self, module: nn.Module, original, had_forward: bool, handle: ActivationHandle,
                 compile: bool | dict = False):
        self.module, self.original, self.had_forward, self.handle = module, original, had_forward, handle
        self.compile_options = compile  # False, True or torch.compile's keyword arguments (kept for deepcopy)
        self.compile = compile is not False
        # what a call runs: the original forward, or its compiled form (one torch.compile per block; Dynamo shares
        # the compiled code between blocks of one class, whose modules it does not specialize on)
        self.run = torch.compile(original, **(compile if isinstance(compile, dict) else {})) if self.compile else original
        functools.update_wrapper(self, original)

    @torch.compiler.disable(recursive=False)  # Dynamo runs this eagerly and compiles ``original`` as its own frame
    def __call__(self, *args, **kwargs):
        policy, stats = self.handle.policy, self.handle.stats
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return self.run(*args, **kwargs)  # nothing is saved: nothing to do
        # about to run compiled: a compiled module, or Dynamo's frame callback set around this (disabled) frame, so
        # the frames it calls are compiled (torch.compile(wrapped_block), a compiled model around it). Read here,
        # not in a helper: Dynamo would compile the helper's frame, or disabling it would clear the callback.
        compiled = self.compile or isinstance(self.module, _OptimizedModule) or _eval_frame_callback() is not None
        if policy.recompute:
            return fp8_checkpoint(self.run, self.module, args, kwargs, policy, stats, decisions=not compiled)
        ctx = _open(self.module, policy, stats, (args, kwargs), self.handle.hooks, not compiled)
        try:
            out = self.run(*args, **kwargs)
        except BaseException as e:
            _close(ctx, type(e), e, e.__traceback__)
            raise
        _close(ctx, None, None, None)
        return out

    def __deepcopy__(self, memo):
        module = copy.deepcopy(self.module, memo)  # the copy under construction (already in memo)
        original = self.original
        if isinstance(original, types.MethodType) and original.__self__ is self.module:
            original = types.MethodType(original.__func__, module)
        else:
            original = copy.deepcopy(original, memo)
        return _WrappedForward(module, original, self.had_forward, self.handle, self.compile_options)


def _no_callback():
    return None


try:  # private torch API (torch 2.x); without it every call counts as eager, which only costs host time
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
    from torch._dynamo.eval_frame import OptimizedModule as _OptimizedModule
except ImportError:  # pragma: no cover
    _eval_frame_callback, _OptimizedModule = _no_callback, ()


# The context's bookkeeping runs with Dynamo off: called from the wrapper's frame, whose callees Dynamo compiles
# (recursive=False), its frames would be compiled too, graph-breaking and recompiling per input.
@torch.compiler.disable
def _open(module, policy, stats, inputs, hooks, track_ops: bool) -> PackContext:
    ctx = PackContext(module, policy, stats, inputs=inputs, hooks=hooks, track_ops=track_ops)
    ctx.__enter__()
    return ctx


@torch.compiler.disable
def _close(ctx: PackContext, *exc) -> None:
    ctx.__exit__(*exc)


def _wrap(module: nn.Module, handle: ActivationHandle, compile: bool = False):
    install_forward(module, _ATTR, _WrappedForward(module, module.forward, had_own_forward(module), handle, compile))


def _unwrap(module: nn.Module):
    remove_forward(module, _ATTR)


def is_wrapped(module: nn.Module) -> bool:
    """True if ``module`` is wrapped by ``compress_activations``."""
    return _ATTR in module.__dict__
