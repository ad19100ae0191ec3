"""The fused step and the reference step run side by side on the same gradients (tests/test_adamw_kernel.py for
FP8 states, tests/test_state4.py for 4-bit ones)."""
import torch

from lpoptim.kernels import adamw_step as kernel
from lpoptim.optim.reference import reference_adamw_step
from lpoptim.optim.state import init_state


def kernel_and_reference(device, dtype, layout, shapes, steps=3, amsgrad=False, maximize=False, lr=1e-2,
                         grad_scale=None, found_inf=None, sr_salts=None, state_salts=None):
    """``steps`` steps of parameters of ``shapes`` through the kernel and through the reference, gradients drawn
    over five decades with zeros inside a group; returns (params, reference params, states, reference states)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    ref_p = [p.clone() for p in params]
    states = [init_state(p, layout, amsgrad) for p in params]
    ref_s = [init_state(p, layout, amsgrad) for p in params]
    hyper = dict(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    for _ in range(steps):
        grads = []
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 10.0 ** float(torch.randint(-5, 1, (), generator=gen))
            g.view(-1)[:3] = 0.0  # zeros inside a group must not collapse its range
            grads.append(g.to(device, dtype))
        kernel.fused_adamw_step([(p, g, s, layout) for p, g, s in zip(params, grads, states)],
                                grad_scale=grad_scale, found_inf=found_inf, sr_salts=sr_salts,
                                state_salts=state_salts, **hyper)
        for i, (p, g, s) in enumerate(zip(ref_p, grads, ref_s)):
            reference_adamw_step(p, g, s, layout, grad_scale=grad_scale, found_inf=found_inf,
                                 sr_salt=None if sr_salts is None else sr_salts[i],
                                 state_salt=None if state_salts is None else state_salts[i], **hyper)
    return params, ref_p, states, ref_s


def non_finite_grad(step: int, device="cpu", generator=None) -> torch.Tensor:
    """A small (8, 256) gradient with infinities at every step (one moving) and, at step 0, two NaNs: one beside
    live values, one the only nonzero value of its group of 128 (its scale 0, the NaN to be kept)."""
    g = (torch.randn(8, 256, generator=generator) * 1e-3).to(device)
    if step == 0:
        g[1, 5] = float("nan")
        g[6, :128] = 0.0
        g[6, 3] = float("nan")
    g[2, 9 + step] = float("inf")
    g[5, 200] = -float("inf")
    return g
