"""The FP4 weight gradient's DGE factor, fused: dW · f'(W / s) in the weight's dtype, one pass.

Reference: ``dw * nn.fp4.dge_derivative(w.float() / scale, k, cap)`` then ``.to(w.dtype)``: about a dozen torch
element-wise passes over the weight in fp32, which took as long as the layer's GEMMs saved (docs/linear.md).
Here each element reads dW (fp32), W and its row's scale once and writes the result. The same formula: between
E2M1 neighbours a and a+δ, t = |2(|v| - a)/δ - 1| and f' = min(t^(1/k - 1) / k, cap); the power is evaluated as
exp2(log2(t)·(1/k - 1)), which may differ from torch.pow by an ulp or two (tested with a tolerance).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import interpreted, store_as


@triton.jit
def _dge_grad_kernel(dw_ptr, w_ptr, scale_ptr, out_ptr, N, C, K: tl.constexpr, CAP: tl.constexpr,
                     ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dw = tl.load(dw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:
        s = tl.load(scale_ptr + offs // C, mask=mask, other=1.0)
    else:
        s = tl.load(scale_ptr)
    a = tl.abs(tl.math.div_rn(w, s))  # the reference's w.float() / scale: IEEE division
    delta = tl.where(a < 2, 0.5, tl.where(a < 4, 1.0, 2.0))
    lo = tl.floor(a / delta) * delta  # divisions by powers of two: exact
    t = tl.abs(2 * (a - lo) / delta - 1)
    # t = 0: log2 -inf, the power inf, capped; a non-finite weight makes t NaN, which must stay NaN (as torch's
    # clamp keeps it; the GPU's min would drop it)
    f = tl.minimum(tl.exp2(tl.log2(t) * (1.0 / K - 1.0)) / K, CAP, propagate_nan=tl.PropagateNan.ALL)
    store_as(out_ptr + offs, dw * f, mask, out_ptr.dtype.element_ty, ON_GPU)


def dge_scale_grad(dw: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, k: float, cap: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """(dw · dge_derivative(w / scale, k, cap)).to(out_dtype) for 2-D contiguous ``dw`` (fp32) and ``w`` of one
    shape; ``scale`` fp32, one per row (R, 1) or one for the tensor."""
    if dw.shape != w.shape or dw.dim() != 2:
        raise ValueError(f"dw {tuple(dw.shape)} and w {tuple(w.shape)}: expected one 2-D shape")
    dw, w, scale = dw.contiguous(), w.contiguous(), scale.contiguous()
    out = torch.empty(w.shape, device=w.device, dtype=out_dtype)
    n = w.numel()
    if n:
        block = 1024
        _dge_grad_kernel[(triton.cdiv(n, block),)](dw, w, scale, out, n, w.shape[1], K=float(k), CAP=float(cap),
                                                   ROW_SCALE=scale.numel() != 1, BLOCK=block,
                                                   ON_GPU=not interpreted(), num_warps=4)
    return out
