"""Many tensors in one launch: their finite absmaxes, and their casts to E4M3 per tensor.

What an FP8 all-gather (nn/fp8_all_gather.py) needs for every weight shard of a model each step: one launch per
tensor costs the host tens of microseconds (Triton's Python launcher), times hundreds of weights, on the path of
every all-gather. Here the tensors are read through a table of their addresses (int64, on the device, made once:
``address_table``), a program grid of (programs per tensor, tensors). The arithmetic is linear_quant's: the same
finite absmax, and ``_quantize_tile`` with the scale ``absmax_scale(amax)``, so each tensor's codes are those
``quantize_tensor_rows_cols`` gives it alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import absmax_scale, finite_abs, interpreted
from .launch import launcher
from .linear_quant import _format_constexprs, _quantize_tile

BLOCK = 2048
PROGRAMS_PER_TENSOR = 32  # x up to ~30 tensors a launch: a few programs per SM of an H100
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def address_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' data addresses as int64 on their device (all contiguous, one dtype: checked)."""
    if len({t.dtype for t in tensors}) > 1 or any(not t.is_contiguous() for t in tensors):
        raise ValueError("address_table: contiguous tensors of one dtype")
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(tensors[0].device)


@triton.jit
def _absmax_many_kernel(src_table, numels, out_bits, SRC: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    n = tl.load(numels + t)
    src = tl.load(src_table + t).to(tl.pointer_type(SRC))
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        acc = tl.maximum(acc, finite_abs(tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)))
    tl.atomic_max(out_bits + t, tl.max(acc, axis=0).to(tl.int32, bitcast=True))  # |x| orders as its bits


def absmax_many(tensors: list[torch.Tensor], table: torch.Tensor) -> torch.Tensor:
    """Each tensor's finite absmax (quant.finite_absmax), fp32 (len(tensors),); ``table``: their address_table."""
    device = tensors[0].device
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64).to(device)
    bits = torch.zeros(len(tensors), dtype=torch.int32, device=device)
    launcher(_absmax_many_kernel)((PROGRAMS_PER_TENSOR, len(tensors)), table, numels, bits,
                                  SRC=_TL_DTYPES[tensors[0].dtype], BLOCK=BLOCK, num_warps=4)
    return bits.view(torch.float32)


@triton.jit
def _cast_many_kernel(src_table, numels, dst, dst_offsets, dst_numels, amax, SRC: tl.constexpr,
                      FMT: tl.constexpr, ON_GPU: tl.constexpr, BLOCK: tl.constexpr):
    """Tensor t's elements scaled by absmax_scale(amax[t]) into E4M3 at dst + dst_offsets[t]; zeros from its numel
    to dst_numels[t] (the padding rows of an uneven shard)."""
    t = tl.program_id(1)
    n = tl.load(numels + t)
    n_out = tl.load(dst_numels + t)
    src = tl.load(src_table + t).to(tl.pointer_type(SRC))
    out = dst + tl.load(dst_offsets + t)
    scale = absmax_scale(tl.load(amax + t), FMT[0])
    for start in range(tl.program_id(0) * BLOCK, n_out, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out + offs, _quantize_tile(x, scale, FMT, dst.dtype.element_ty, ON_GPU), mask=offs < n_out)


class CastPlan:
    """One set of tensors cast together again and again (a unit's weight shards, at every all-gather): the tables
    made once. ``out_numels[i]`` >= tensor i's numel: its slot in the output, zero-padded."""

    def __init__(self, tensors: list[torch.Tensor], out_numels: list[int]):
        device = tensors[0].device
        self.tensors, self.table = tensors, address_table(tensors)
        self.numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64).to(device)
        starts = [0]
        for n in out_numels:
            starts.append(starts[-1] + n)
        self.starts, self.total = starts, starts[-1]
        self.offsets = torch.tensor(starts[:-1], dtype=torch.int64).to(device)
        self.out_numels = torch.tensor(out_numels, dtype=torch.int64).to(device)
        self.src = _TL_DTYPES[tensors[0].dtype]
        self.fmt = _format_constexprs("e4m3")

    def cast(self, amax: torch.Tensor) -> torch.Tensor:
        """All the tensors in E4M3, each by its absmax in ``amax`` (fp32, one per tensor), in one flat buffer:
        tensor i's codes at [starts[i], starts[i] + out_numels[i])."""
        out = torch.empty(self.total, dtype=torch.float8_e4m3fn, device=self.table.device)
        launcher(_cast_many_kernel)((PROGRAMS_PER_TENSOR, len(self.tensors)), self.table, self.numels, out,
                                    self.offsets, self.out_numels, amax, SRC=self.src, FMT=self.fmt,
                                    ON_GPU=not interpreted(), BLOCK=BLOCK, num_warps=4)
        return out
