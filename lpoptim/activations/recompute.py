"""FP8 activation checkpointing: keep only a block's inputs, in FP8, and run the block again in backward.

Like ``torch.utils.checkpoint`` (reentrant style, but without its pitfalls: the parameters are inputs of the
autograd Function, so the block's output requires grad even when its input does not, and their gradients are
returned, not accumulated by a nested ``backward``), except that the input that requires grad (the residual
stream) is held as E4M3 codes with a scale per group of 16 instead of bf16: a Llama-7B block at 4 x 2048 tokens
holds 40 MiB instead of 64 MiB, and nothing else. Backward recomputes the block from the dequantized input,
with the forward's RNG state (dropout) and autocast state restored.

Inputs that do not require grad (rotary tables, masks) are kept by reference: they are shared between blocks,
so a copy per block would cost memory, not save it. Nothing else holds the block's input or output: the FP8 copy
is all that stays of the input until backward.

Discrete decisions on floating-point values (a MoE router's ``topk``, ``argmax``, ``sort``) are recorded in
forward and replayed in backward (``Decisions``): the replay sees the FP8-rounded input, and a token routed to
another expert than in forward would get the gradient of a computation that never ran. The replayed op takes
the forward's indices and gathers its values from the replay's input, so gradients flow as through the op.

A block given a KV cache (transformers' ``Cache``, passed when ``use_cache=True``) is refused: the forward
updates the cache, and the replay would update it again and read the keys and values twice.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .codec import COMPRESSIBLE_DTYPES, PackedActivation, pack
from .hooks import _warn_if_outer_hooks, autocast_state, reenter_autocast
from .policy import ActivationPolicy
from .stats import SavedStats



_TENSOR = object()  # a tensor's place among a call's outputs


class _Run:
    """The block call with its non-tensor arguments fixed; called with the tensor arguments only.

    It holds no tensor of the call: it lives in the autograd graph until backward, and a reference to the
    block's input or output there would keep them in full precision next to the FP8 copy."""

    def __init__(self, fn, flat, spec, tensor_idx):
        self.fn, self.spec, self.tensor_idx = fn, spec, tensor_idx
        self.flat = list(flat)
        for i in tensor_idx:
            self.flat[i] = None  # given with each call
        self.out_spec = None
        self.out_template = None  # the last call's outputs with _TENSOR in place of each tensor

    def __call__(self, tensors):
        flat = list(self.flat)
        for i, t in zip(self.tensor_idx, tensors):
            flat[i] = t
        args, kwargs = tree_unflatten(flat, self.spec)
        out = self.fn(*args, **kwargs)
        out_flat, self.out_spec = tree_flatten(out)
        self.out_template = [_TENSOR if isinstance(o, torch.Tensor) else o for o in out_flat]
        return [o for o in out_flat if isinstance(o, torch.Tensor)]


# Ops whose indices are a discrete decision on floating-point values, by ``__name__`` (torch functions and Tensor
# methods): the ones with values among their outputs (topk, sort, max / min along a dim) give the values as
# ``input.gather(dim, indices)``, which their own backward formulas are (a scatter of the gradient at indices).
_GATHERED = frozenset({"topk", "sort", "max", "min"})
_DECISION_OPS = _GATHERED | {"argsort", "argmax", "argmin"}


def _dim_of(name, args, kwargs):
    """The reduced / sorted dim of a decision op's call, or None where it makes no decision (max / min without a
    dim: a value; with a tensor: element-wise)."""
    if "dim" in kwargs:
        return kwargs["dim"]
    pos = 2 if name == "topk" else 1
    if len(args) > pos:
        return args[pos] if isinstance(args[pos], int) else None
    return None if name in ("max", "min") else -1


class Decisions(TorchFunctionMode):
    """Records the indices of ``_DECISION_OPS`` on floating-point inputs in forward, and hands them back, in the same
    order, to the same ops of the replay (after ``replay()``)."""

    def __init__(self):
        super().__init__()
        self.taken: list[tuple[str, tuple, torch.Tensor]] = []  # (op, input shape, indices) in call order
        self.replaying = False
        self.next = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        x = args[0] if args else None
        if (name not in _DECISION_OPS or not isinstance(x, torch.Tensor) or not x.is_floating_point()
                or torch.compiler.is_compiling()):
            return func(*args, **kwargs)
        dim = _dim_of(name, args, kwargs)
        if dim is None:
            return func(*args, **kwargs)
        if not self.replaying:
            out = func(*args, **kwargs)
            # a copy: the block may change the indices it was handed in place (idx += offset), which the replay
            # would then do again to the same tensor
            self.taken.append((name, tuple(x.shape), (out.indices if name in _GATHERED else out).clone()))
            return out
        if self.next >= len(self.taken) or self.taken[self.next][:2] != (name, tuple(x.shape)):
            raise RuntimeError(
                f"compress_activations(recompute=True): the block's replay called {name} on a {tuple(x.shape)} "
                "tensor where its forward had not; a recomputed block must make the same calls in backward")
        indices = self.taken[self.next][2].clone()  # each replay starts from the forward's own decisions
        self.next += 1
        if name not in _GATHERED:
            return indices
        keepdim = kwargs.get("keepdim", len(args) > 2 and bool(args[2])) if name in ("max", "min") else True
        values = x.gather(dim, indices if keepdim else indices.unsqueeze(dim))
        return getattr(torch.return_types, name)((values if keepdim else values.squeeze(dim), indices))

    def replay(self):
        """Enter for the replay: the recorded decisions are handed out from the first."""
        self.replaying, self.next = True, 0
        return self


class _FP8Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, policy, stats, decisions, n_in, *tensors):
        inputs, params = tensors[:n_in], tensors[n_in:]
        ctx.run, ctx.n_in, ctx.params = run, n_in, params
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_devices = sorted({t.device.index for t in inputs if t.is_cuda})
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.autocast = autocast_state()
        stored, kept = [], []
        for t in inputs:
            nbytes = t.numel() * t.element_size()
            if t.requires_grad and t.dtype in COMPRESSIBLE_DTYPES and t.numel() >= policy.min_numel:
                p = pack(t, "group", policy.group_size, policy.fmt)
                stored.append(p)
                if stats is not None:
                    stats.add("recompute_input", None, t, nbytes, p.nbytes)
            else:
                stored.append(None)
                kept.append(t)
        ctx.stored = stored
        ctx.input_requires_grad = [t.requires_grad for t in inputs]
        ctx.save_for_backward(*kept)
        ctx.decisions = decisions
        if decisions is None:
            outs = run(inputs)
        else:
            with decisions:
                outs = run(inputs)
            if stats is not None and decisions.taken:
                for _, _, indices in decisions.taken:
                    stats.add("decision", None, indices, indices.nbytes, indices.nbytes)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        kept = iter(ctx.saved_tensors)
        inputs = []
        for p, req in zip(ctx.stored, ctx.input_requires_grad):
            t = p.unpack() if isinstance(p, PackedActivation) else next(kept)
            inputs.append(t.detach().requires_grad_(req) if t.is_floating_point() else t)
        params = ctx.params
        with torch.random.fork_rng(devices=ctx.cuda_devices, enabled=True):
            torch.set_rng_state(ctx.cpu_rng)
            for d, s in zip(ctx.cuda_devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(s, d)
            replaying = ctx.decisions.replay() if ctx.decisions is not None else contextlib.nullcontext()
            with torch.enable_grad(), reenter_autocast(ctx.autocast), replaying:
                outs = ctx.run(inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        targets = [t for t in inputs if t.requires_grad] + [p for p in params if p.requires_grad]
        if not pairs or not targets:
            return (None,) * (5 + len(inputs) + len(params))
        got = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True))
        in_grads = [next(got) if t.requires_grad else None for t in inputs]
        p_grads = [next(got) if p.requires_grad else None for p in params]
        return (None, None, None, None, None, *in_grads, *p_grads)


def _flatten_call(args, kwargs):
    """(leaves, spec, the first transformers ``Cache`` among them or None). Caches are leaves: transformers can
    register them as pytree nodes (export support), and their flattened tensors would hide them."""
    cache_type = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache_type is None:  # transformers not imported: no cache
        return (*tree_flatten((args, kwargs)), None)
    flat, spec = tree_flatten((args, kwargs), is_leaf=lambda v: isinstance(v, cache_type))
    return flat, spec, next((v for v in flat if isinstance(v, cache_type)), None)


def fp8_checkpoint(fn, module: torch.nn.Module, args, kwargs, policy: ActivationPolicy,
                   stats: SavedStats | None = None, decisions: bool = True):
    """Call ``fn(*args, **kwargs)`` (a block's forward) keeping only its inputs, in FP8, for backward.

    The parameters that receive gradients are ``module.parameters()``; a block that uses parameters it does
    not own (tied weights of another module) would not get gradients for them, as with reentrant checkpoint.
    ``decisions``: record the block's discrete decisions (``Decisions``) for the replay; False where the block
    runs compiled (a TorchFunctionMode would be traced into its graphs).
    """
    _warn_if_outer_hooks()  # the FP8 inputs are held by the Function, not saved through the hooks
    flat, spec, cache = _flatten_call(args, kwargs)
    if cache is not None:
        raise RuntimeError(
            f"compress_activations(recompute=True) cannot replay {type(module).__name__} with a KV cache "
            f"({type(cache).__name__}: the replay would update it again); pass use_cache=False to the model or set "
            "model.config.use_cache=False for training")
    tensor_idx = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    inputs = [flat[i] for i in tensor_idx]
    params = [p for p in module.parameters() if p.requires_grad]
    if not any(t.requires_grad for t in inputs) and not params:
        return fn(*args, **kwargs)
    run = _Run(fn, flat, spec, tensor_idx)
    outs = iter(_FP8Recompute.apply(run, policy, stats, Decisions() if decisions else None, len(inputs),
                                    *inputs, *params))
    out_flat = [next(outs) if o is _TENSOR else o for o in run.out_template]
    run.out_template = None
    return tree_unflatten(out_flat, run.out_spec)
