"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as soon as the
gradient is accumulated. At batch 1 the peak of training is the optimizer step (parameters + gradients +
states, measured on one H100 at 1 × 2048 tokens); updating in backward means the whole set of gradients never
exists at once.

    handle = lpoptim.step_in_backward(opt)    # then: loss.backward() is the whole step; no opt.step()
    handle.remove()                           # back to the usual opt.step()

Parameters are stepped in buckets: as gradients arrive they are queued, and once ``bucket_mb`` of them wait
(or backward ends) the queue is stepped in one kernel launch per group and its gradients freed. One parameter at
a time (``bucket_mb=0``) spends more host time than the GPU spends on a 7B model's backward (about 10 small
launches each); a bucket holds at most that many MiB of gradients beyond the usual in-backward peak. The default,
256, measured on Llama-2-7B at 1 x 2048 on an H100 with a slow host, torch 2.11, triton 3.6
(`benchmarks/bench_buckets.py`, docs/results/bench_llama2_7b_buckets_h100.txt):
128 MiB 10.97 k tokens/s, 256 MiB 11.23 k, 512 MiB 11.22 k, peak 29.83 / 29.84 / 29.85 GiB (the peak of that
training step is not in backward, so the bucket hardly shows).

What the usual step sees and this cannot: all gradients at once. So no gradient clipping by global norm, no
gradient accumulation over micro-batches (each backward updates), and no GradScaler (it unscales and checks for
inf over all gradients before the step). The LR scheduler still works: each update reads its group's lr.

Under FSDP2 (``fully_shard``) the hooks run on the sharded parameters once their gradient is reduce-scattered
(FSDP2 calls them after assigning the shard's gradient), so each rank steps its own shard and frees it; a
bucket counts the local shards' bytes.
"""
from __future__ import annotations

import warnings
import weakref

import torch


# the attribute a hooked parameter carries: (a weak reference to its InBackwardHandle, the hook's RemovableHandle)
_HOOKED_BY = "_lpoptim_in_backward"


class InBackwardHandle:
    def __init__(self, hooks, optimizer, params=()):
        self._hooks = hooks
        self.optimizer = optimizer  # held here, strongly: the hooks only hold it weakly
        self._params = list(params)  # the hooked parameters, whose mark remove() takes off

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            owner = getattr(p, _HOOKED_BY, None)
            if owner is not None and owner[0]() is self:
                delattr(p, _HOOKED_BY)
        self._params = []


def check_not_hooked(params, caller: str = "lpoptim.step_in_backward") -> None:
    """Raise if a parameter is already stepped in backward by a live handle (another optimizer's hooks would go on
    updating it, and freeing its gradient before this optimizer sees it)."""
    for p in params:
        owner = getattr(p, _HOOKED_BY, None)
        handle = owner[0]() if owner is not None else None
        if handle is not None and handle.active:
            raise RuntimeError(
                f"{caller}: these parameters are already stepped inside backward by another optimizer (an earlier "
                "lpoptim.prepare or lpoptim.step_in_backward on this model); its hooks would keep updating them. "
                "Call plan.remove() on the optimizer that prepare returned (or remove() on step_in_backward's "
                "handle) first, or start from a fresh model")


ACCUMULATION_ERROR = (
    "lpoptim: a second backward ran before optimizer.step(): the optimizer steps inside backward "
    "(step_in_backward), so gradients cannot be accumulated over micro-batches, nor clipped by their global norm. "
    "Call optimizer.step() after every backward, or do not fuse the step (lpoptim.prepare(..., "
    "step_in_backward=False))")


def _warn_if_replicated(p: torch.Tensor) -> None:
    """Warn (once per handle) where a plain parameter trains in a process group of several ranks: that is how
    DistributedDataParallel looks from here, and DDP averages gradients only as backward ends, after the step
    these hooks take. (FSDP2's DTensor shards are stepped once reduced; other multi-process setups that do not
    average gradients can ignore it.)"""
    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and not hasattr(p, "device_mesh")):
        warnings.warn("lpoptim.step_in_backward: plain parameters in a process group of several ranks. Under "
                      "DistributedDataParallel each rank would step its own gradient before DDP averages it, and "
                      "the ranks would drift apart: use step_in_backward=False there (FSDP2 works)", stacklevel=2)


def step_in_backward(optimizer, bucket_mb: float = 256, require_step: bool = False) -> InBackwardHandle:
    """Register post-accumulate-grad hooks that step the parameters of ``optimizer`` (an lpoptim.AdamW) during
    backward, ``bucket_mb`` MiB of gradients at a time (0: each parameter as its gradient arrives), and then set
    their ``.grad`` to None. Whatever is queued when backward ends is stepped then.

    Frozen parameters (``requires_grad=False``) take no hook, as torch.optim skips them. A parameter is stepped in
    backward by one handle at a time: one that another active handle steps is refused (RuntimeError) until that
    handle's ``remove()``; the hooks of a handle dropped without it are replaced.

    ``require_step``: the loop still calls ``optimizer.step()`` once per backward (which then finds no gradients
    and does nothing); a second backward without it raises (before it updates anything) instead of silently
    stepping once per micro-batch, which is what a loop accumulating gradients would get."""
    if not hasattr(optimizer, "step_params"):
        raise TypeError(f"step_in_backward needs an optimizer with step_params (lpoptim.AdamW), "
                        f"not {type(optimizer).__name__}")
    if bucket_mb < 0:
        raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
    # frozen parameters get no gradient (torch.optim skips them) and take no hook
    hooked = [(index, p) for index, group in enumerate(optimizer.param_groups) for p in group["params"]
              if p.requires_grad]
    check_not_hooked(p for _, p in hooked)
    limit = bucket_mb * 2**20
    # the hooks live on the parameters (held by C++, out of the garbage collector's sight), so they hold the
    # optimizer only weakly: a strong reference would keep model and optimizer alive after the user drops them.
    # The handle holds it strongly, so keeping either the optimizer or the handle keeps training going.
    opt_ref = weakref.ref(optimizer)
    pending: dict[int, list] = {}  # group index -> params waiting
    state = {"bytes": 0, "flush_queued": False, "unclaimed_backward": False, "checked": False}

    def flush() -> None:
        opt = opt_ref()
        if opt is not None:
            for index, params in pending.items():
                opt.step_params(params, opt.param_groups[index])
                for p in params:
                    p.grad = None
        pending.clear()
        state["bytes"] = 0

    def at_backward_end() -> None:
        state["flush_queued"] = False
        state["unclaimed_backward"] = require_step
        flush()

    def make_hook(index: int):
        def hook(p: torch.Tensor) -> None:
            if not state["checked"]:
                state["checked"] = True
                _warn_if_replicated(p)
            if opt_ref() is None:  # never silently stop training: the user dropped what steps the parameters
                raise RuntimeError("lpoptim.step_in_backward: the optimizer was garbage-collected while its hooks "
                                   "are registered; keep a reference to it (or to the handle step_in_backward "
                                   "returned), or call handle.remove()")
            if state["unclaimed_backward"]:
                raise RuntimeError(ACCUMULATION_ERROR)
            pending.setdefault(index, []).append(p)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
            state["bytes"] += grad.numel() * grad.element_size()
            if not state["flush_queued"]:  # the engine runs this once the whole backward is done (queued even
                # when every parameter fills a bucket of its own, bucket_mb=0: it marks the backward for require_step)
                torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)
                state["flush_queued"] = True
            if state["bytes"] >= limit:
                flush()
        return hook

    hooks = []
    for index, p in hooked:
        old = getattr(p, _HOOKED_BY, None)
        if old is not None:  # a handle that was dropped without remove(): its hooks, which would raise, go
            old[1].remove()
        hooks.append(p.register_post_accumulate_grad_hook(make_hook(index)))
    if require_step:  # optimizer.step() claims the backward that stepped in its place
        hooks.append(optimizer.register_step_pre_hook(
            lambda _opt, _args, _kwargs: state.__setitem__("unclaimed_backward", False)))
    handle = InBackwardHandle(hooks, optimizer, [p for _, p in hooked])
    for (_, p), hook in zip(hooked, hooks):
        setattr(p, _HOOKED_BY, (weakref.ref(handle), hook))
    return handle
