"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as soon as the
gradient is accumulated. At batch 1 the peak of training is the optimizer step (parameters + gradients +
states, DESIGN.md §6); updating in backward means the whole set of gradients never exists at once.

    handle = lpoptim.step_in_backward(opt)    # then: loss.backward() is the whole step; no opt.step()
    handle.remove()                           # back to the usual opt.step()

What the usual step sees and this cannot: all gradients at once. So no gradient clipping by global norm, no
gradient accumulation over micro-batches (each backward updates), and no GradScaler (it unscales and checks for
inf over all gradients before the step). The LR scheduler still works: each update reads its group's lr.
"""
from __future__ import annotations

import torch


class InBackwardHandle:
    def __init__(self, hooks):
        self._hooks = hooks

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def step_in_backward(optimizer) -> InBackwardHandle:
    """Register post-accumulate-grad hooks that step each parameter of ``optimizer`` (an lpoptim.AdamW) during
    backward and then set its ``.grad`` to None."""
    if not hasattr(optimizer, "step_param"):
        raise TypeError(f"step_in_backward needs an optimizer with step_param (lpoptim.AdamW), "
                        f"not {type(optimizer).__name__}")

    def make_hook(group):
        def hook(p: torch.Tensor) -> None:
            optimizer.step_param(p, group)
            p.grad = None
        return hook

    hooks = [p.register_post_accumulate_grad_hook(make_hook(group))
             for group in optimizer.param_groups for p in group["params"]]
    return InBackwardHandle(hooks)
