"""FP4-specific math (Wang et al. 2025, arXiv 2501.17116): the differentiable gradient estimator and outlier
clamping. Pure torch; small element-wise work beside the GEMMs.
"""
from __future__ import annotations

import math

import torch


def dge_derivative(v: torch.Tensor, k: float = 5.0, cap: float = 3.0) -> torch.Tensor:
    """f'(v) for E2M1-scaled weights v (|v| <= 6), the derivative of the smooth stand-in for rounding.

    Between neighbouring grid points a and a+δ (δ = 0.5 below 2, 1 below 4, 2 up to 6), with u = |v| - a:
        f(u)  = δ/2 · (1 + sign(2u/δ - 1) · |2u/δ - 1|^(1/k))
        f'(u) = (1/k) · |2u/δ - 1|^(1/k - 1)
    which is 1/k at grid points and unbounded at midpoints, hence the cap. Uncapped its mean over a step is 1;
    the cap at 3 (k = 5) brings the mean to 0.59: weight gradients shrink by that much on average (Adam does not
    mind a constant factor) and are weighted toward weights near a rounding threshold.
    """
    a = v.float().abs()
    delta = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    lo = torch.floor(a / delta) * delta
    t = (2 * (a - lo) / delta - 1).abs()
    return (t.pow(1.0 / k - 1.0) / k).clamp(max=cap)  # t = 0 gives inf, capped


def occ_threshold(x: torch.Tensor, alpha: float, max_samples: int = 1 << 20) -> torch.Tensor:
    """The α quantile of |x|, estimated on at most ``max_samples`` evenly strided elements (a 0-dim tensor).

    An exact quantile of a 16384×4096 activation needs a sort of 67 M elements; a strided sample of 1 M gives
    the same clamp to within the sample's resolution (about 1e-3 in quantile)."""
    a = x.detach().reshape(-1)
    if a.numel() == 0:  # no tokens: nothing to clamp
        return a.new_zeros((), dtype=torch.float32)
    step = max(1, math.ceil(a.numel() / max_samples))
    s = a[::step].float().abs()
    k = min(s.numel(), max(1, math.ceil(alpha * s.numel())))
    return s.kthvalue(k).values


def occ_split(x: torch.Tensor, alpha: float, max_samples: int = 1 << 20):
    """x -> (x clamped to ±τ, the sparse residual x - clamp(x)) with τ the α quantile of |x|."""
    tau = occ_threshold(x, alpha, max_samples).to(x.dtype)
    xc = torch.maximum(torch.minimum(x, tau), -tau)
    return xc, x - xc


def residual_matmul(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """r @ wᵀ in fp32 for a sparse residual r (about 1 - α of it non-zero): sparse on CUDA, dense on CPU."""
    if r.is_cuda:
        idx = r.nonzero().t()
        sp = torch.sparse_coo_tensor(idx, r[idx[0], idx[1]].float(), r.shape, is_coalesced=True)
        return torch.sparse.mm(sp, w.float().t())
    return r.float() @ w.float().t()
