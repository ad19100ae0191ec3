"""FP8 activation checkpointing: keep only a block's inputs, in FP8, and run the block again in backward.

Like ``torch.utils.checkpoint`` (reentrant style, but without its pitfalls: the parameters are inputs of the
autograd Function, so the block's output requires grad even when its input does not, and their gradients are
returned, not accumulated by a nested ``backward``), except that the input that requires grad (the residual
stream) is held as E4M3 codes with a scale per group of 16 instead of bf16: a Llama-7B block at 4 x 2048 tokens
holds 40 MiB instead of 64 MiB, and nothing else. Backward recomputes the block from the dequantized input,
with the forward's RNG state (dropout) and autocast state restored.

Inputs that do not require grad (rotary tables, masks) are kept by reference: they are shared between blocks,
so a copy per block would cost memory, not save it.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .codec import COMPRESSIBLE_DTYPES, PackedActivation, pack
from .policy import ActivationPolicy
from .stats import SavedStats

_AUTOCAST_DEVICES = ("cuda", "cpu")


class _Run:
    """The block call with its non-tensor arguments fixed; called with the tensor arguments only."""

    def __init__(self, fn, flat, spec, tensor_idx):
        self.fn, self.flat, self.spec, self.tensor_idx = fn, flat, spec, tensor_idx
        self.out_spec = None
        self.out_flat = None

    def __call__(self, tensors):
        flat = list(self.flat)
        for i, t in zip(self.tensor_idx, tensors):
            flat[i] = t
        args, kwargs = tree_unflatten(flat, self.spec)
        out = self.fn(*args, **kwargs)
        out_flat, self.out_spec = tree_flatten(out)
        self.out_flat = out_flat
        return [o for o in out_flat if isinstance(o, torch.Tensor)]


class _FP8Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, policy, stats, n_in, *tensors):
        inputs, params = tensors[:n_in], tensors[n_in:]
        ctx.run, ctx.n_in, ctx.params = run, n_in, params
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_devices = sorted({t.device.index for t in inputs if t.is_cuda})
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES]
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
        outs = run(inputs)
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
            with torch.enable_grad(), _autocast(ctx.autocast):
                outs = ctx.run(inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        targets = [t for t in inputs if t.requires_grad] + [p for p in params if p.requires_grad]
        if not pairs or not targets:
            return (None,) * (4 + len(inputs) + len(params))
        got = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True))
        in_grads = [next(got) if t.requires_grad else None for t in inputs]
        p_grads = [next(got) if p.requires_grad else None for p in params]
        return (None, None, None, None, *in_grads, *p_grads)


class _autocast:
    """Re-enter the forward's autocast state for every device type in backward."""

    def __init__(self, states):
        self.ctxs = [torch.autocast(d, dtype=dt, enabled=on) for d, on, dt in states]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
        return False


def fp8_checkpoint(fn, module: torch.nn.Module, args, kwargs, policy: ActivationPolicy,
                   stats: SavedStats | None = None):
    """Call ``fn(*args, **kwargs)`` (a block's forward) keeping only its inputs, in FP8, for backward.

    The parameters that receive gradients are ``module.parameters()``; a block that uses parameters it does
    not own (tied weights of another module) would not get gradients for them, as with reentrant checkpoint.
    """
    flat, spec = tree_flatten((args, kwargs))
    tensor_idx = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    inputs = [flat[i] for i in tensor_idx]
    params = [p for p in module.parameters() if p.requires_grad]
    if not any(t.requires_grad for t in inputs) and not params:
        return fn(*args, **kwargs)
    run = _Run(fn, flat, spec, tensor_idx)
    outs = iter(_FP8Recompute.apply(run, policy, stats, len(inputs), *inputs, *params))
    out_flat = [next(outs) if isinstance(o, torch.Tensor) else o for o in run.out_flat]
    return tree_unflatten(out_flat, run.out_spec)
