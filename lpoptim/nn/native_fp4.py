"""Native FP4 GEMM for GPUs with FP4 tensor cores (sm_100, Blackwell): MXFP4, E2M1 values in blocks of 32 with
power-of-two (E8M0) scales, through torch._scaled_mm. UNTESTED: no sm_100 GPU was available; it is opt-in
(``Recipe(native_fp4=True)`` with ``fp4_block=32``) and falls back to the FP8-emulated path elsewhere.

The numbers are the same as ``operands.pow2_block_operand`` (scale 2^e with e = ceil(log2(amax/6))) without
the fold into E4M3, so no block loses bits to E4M3's subnormals.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import E2M1, pack_4bit, round_to_grid
from ..quant import finite_absmax, from_groups, pow2_block_exponent, to_groups


def native_fp4_supported(device: torch.device | None = None) -> bool:
    if not torch.cuda.is_available() or not hasattr(torch, "float4_e2m1fn_x2") \
            or not hasattr(torch, "float8_e8m0fnu"):
        return False
    return torch.cuda.get_device_capability(device) >= (10, 0)


def _to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) scales -> cuBLAS's swizzled block layout (128×4 tiles), flattened."""
    rows, cols = scales.shape
    rb, cb = -(-rows // 128), -(-cols // 4)
    padded = F.pad(scales, (0, cb * 4 - cols, 0, rb * 128 - rows))
    blocks = padded.view(rb, 128, cb, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def mxfp4(x: torch.Tensor, block: int = 32):
    """2-D x (K a multiple of 32) -> (packed float4_e2m1fn_x2 (R, K/2), blocked E8M0 scales)."""
    g = to_groups(x.float(), block)
    amax = finite_absmax(g, dim=-1)
    e = pow2_block_exponent(amax, E2M1.max, emin=-127)  # E8M0's range
    q = round_to_grid(g / torch.ldexp(torch.ones_like(amax), e).unsqueeze(-1), E2M1)
    packed = pack_4bit(from_groups(q, x.shape), E2M1, check=False).view(torch.float4_e2m1fn_x2)  # q: round_to_grid's
    e8m0 = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, _to_blocked(e8m0)


def gemm_mxfp4(x: torch.Tensor, w: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """x (M, K) @ w (N, K)ᵀ with both quantized to MXFP4 on the fly."""
    xa, sa = mxfp4(x)
    wb, sb = mxfp4(w)
    return torch._scaled_mm(xa, wb.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
