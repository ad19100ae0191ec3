"""A 2-D tensor of one-byte elements (FP8 codes) transposed into a contiguous copy, tile by tile.

What the backward of a weight gathered in FP8 needs: the GEMM takes Wᵀ with its contraction dim contiguous, so
dx = dy W transposes W's codes each step (every weight, whole). torch's strided copy makes it element by element,
one side of each access uncoalesced; here each program loads a tile along its rows and stores it along its
columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launcher

TILE = 128


@triton.jit
def _transpose_kernel(src, dst, rows, cols, TILE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    c = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(src + r[:, None] * cols + c[None, :], mask=inside)
    tl.store(dst + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(inside))


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x`` (R, C), contiguous, one byte an element -> xᵀ (C, R), contiguous, of x's dtype."""
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose_bytes: a contiguous 2-D tensor of one-byte elements, got {x.dtype} "
                         f"{tuple(x.shape)}{'' if x.is_contiguous() else ' (not contiguous)'}")
    rows, cols = x.shape
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    if x.numel():
        launcher(_transpose_kernel)((triton.cdiv(rows, TILE), triton.cdiv(cols, TILE)), x.view(torch.uint8),
                                    out.view(torch.uint8), rows, cols, TILE=TILE, num_warps=8)
    return out
