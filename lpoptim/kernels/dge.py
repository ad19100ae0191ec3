"""The FP4 weight gradient's DGE factor, fused: dW · f'(W / s) in the weight's dtype, one kernel.

Reference: ``dw * nn.fp4.dge_derivative(w.float() / scale, k, cap)`` then ``.to(w.dtype)``, with ``scale`` W's
E2M1 absmax scale (per row: quant.quantize(w, "e2m1", "row")): about a dozen torch element-wise passes over the
weight in fp32, which took as long as the layer's GEMMs saved (docs/linear.md). Here a program takes a block of
rows: their absmax (the per-row scale, as the quantizers compute it) in a first sweep over W, then each element
reads dW and W once (the second read of W mostly from L2) and writes the result. The same formula: between E2M1
neighbours a and a+δ, t = |2(|v| - a)/δ - 1| and f' = min(t^(1/k - 1) / k, cap); the power is evaluated as
exp2(log2(t)·(1/k - 1)), which may differ from torch.pow by an ulp or two (tested with a tolerance).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import E2M1
from .grid import absmax_scale, finite_abs, interpreted, store_as
from .launch import cdiv, launcher

# where the scale comes from: W's rows (computed here), a given one per row, or a given one for the tensor
_FROM_W, _PER_ROW, _PER_TENSOR = 0, 1, 2


@triton.jit
def _dge_grad_kernel(dw_ptr, w_ptr, scale_ptr, out_ptr, R, C, K: tl.constexpr, CAP: tl.constexpr,
                     FMAX: tl.constexpr, SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                     ON_GPU: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    base = rows[:, None].to(tl.int64) * C
    if SCALE == 0:  # the row's E2M1 scale from its finite absmax, as quant.quantize(w, "e2m1", "row")
        amax = tl.zeros((BLOCK_R,), tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = (rows[:, None] < R) & (cols[None, :] < C)
            w = tl.load(w_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(finite_abs(w), axis=1))
        s = absmax_scale(amax, FMAX)[:, None]
    elif SCALE == 1:
        s = tl.load(scale_ptr + rows, mask=rows < R, other=1.0)[:, None]
    else:
        s = tl.load(scale_ptr)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        dw = tl.load(dw_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
        a = tl.abs(tl.math.div_rn(w, tl.broadcast_to(s, w.shape)))  # the reference's w.float() / scale
        delta = tl.where(a < 2, 0.5, tl.where(a < 4, 1.0, 2.0))
        lo = tl.floor(a / delta) * delta  # divisions by powers of two: exact
        t = tl.abs(2 * (a - lo) / delta - 1)
        # t = 0: log2 -inf, the power inf, capped; a non-finite weight makes t NaN, which must stay NaN (as
        # torch's clamp keeps it; the GPU's min would drop it)
        f = tl.minimum(tl.exp2(tl.log2(t) * (1.0 / K - 1.0)) / K, CAP, propagate_nan=tl.PropagateNan.ALL)
        store_as(out_ptr + base + cols[None, :], dw * f, m, out_ptr.dtype.element_ty, ON_GPU)


def dge_scale_grad(dw: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, k: float, cap: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """(dw · dge_derivative(w / scale, k, cap)).to(out_dtype) for 2-D ``dw`` (fp32) and ``w`` of one shape.
    ``scale``: fp32, one per row (R, 1) or one for the tensor; None: W's per-row E2M1 scale, computed here."""
    if dw.shape != w.shape or dw.dim() != 2:
        raise ValueError(f"dw {tuple(dw.shape)} and w {tuple(w.shape)}: expected one 2-D shape")
    dw, w = dw.contiguous(), w.contiguous()
    mode = _FROM_W if scale is None else _PER_TENSOR if scale.numel() == 1 else _PER_ROW
    scale = w if scale is None else scale.contiguous()  # (a dummy pointer when computed here)
    out = torch.empty(w.shape, device=w.device, dtype=out_dtype)
    R, C = w.shape
    if R and C:
        block_r = 4
        launcher(_dge_grad_kernel)((cdiv(R, block_r),), dw, w, scale, out, R, C, K=float(k), CAP=float(cap),
                                   FMAX=float(E2M1.max), SCALE=mode, BLOCK_R=block_r, BLOCK_C=512,
                                   ON_GPU=not interpreted(), num_warps=4)
    return out
