"""Gradient helpers shared by the wrapper's tests (eager: test_activations.py; compiled: test_graph_hooks.py)."""
import torch
import torch.nn.functional as F


def _grads(block, x, kwargs, params_of=None):
    """Input and parameter gradients (fp32) of a fixed loss on ``block(x, **kwargs)``."""
    x = x.detach().requires_grad_(True)
    params_of = params_of or block
    params_of.zero_grad(set_to_none=True)
    y = block(x, **kwargs)
    y = y[0] if isinstance(y, tuple) else y
    w = torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype, device=y.device)
    (y.float() * w.float()).pow(2).sum().backward()
    return {"input": x.grad.float()} | {n: p.grad.float() for n, p in params_of.named_parameters()}


def _min_cos(a, b):
    """The smallest cosine similarity over the gradients of two ``_grads`` results."""
    return min(F.cosine_similarity(a[k].flatten(), b[k].flatten(), dim=0).item() for k in a)
