"""Many tensors in one launch: their finite absmaxes, and their casts to E4M3 per tensor.

What an FP8 all-gather (nn/fp8_all_gather.py) needs for every weight shard of a model each step: one launch per
tensor costs the host tens of microseconds (Triton's Python launcher), times hundreds of weights, on the path of
every all-gather. Here the tensors are read through a table of their addresses (``TensorTable``: int64 on the
device, made once), a program grid of (programs per tensor, tensors). The arithmetic is linear_quant's: the same
finite absmax, and ``_quantize_tile`` with the scale ``absmax_scale(amax)``, so each tensor's codes are those
``quantize_tensor_rows_cols`` gives it alone. ``round_to=torch.bfloat16`` first rounds each element to bf16 as
torch's cast does (what FSDP2's mixed precision gathers: fp32 shards cast to bf16), by hand: the interpreter's cast
truncates.
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


class TensorTable:
    """Contiguous tensors of one dtype as the kernels read them: their addresses and sizes on their device."""

    def __init__(self, tensors: list[torch.Tensor]):
        if len({t.dtype for t in tensors}) != 1 or any(not t.is_contiguous() for t in tensors):
            raise ValueError("TensorTable: contiguous tensors of one dtype")
        device = tensors[0].device
        self.tensors, self.src = tensors, _TL_DTYPES[tensors[0].dtype]
        self.addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device)
        self.numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64).to(device)


def _rounding(round_to: torch.dtype | None) -> bool:
    if round_to not in (None, torch.bfloat16):
        raise ValueError(f"round_to: None or torch.bfloat16, got {round_to}")
    return round_to is not None


@triton.jit
def _load(src, offs, n, ROUND_BF16: tl.constexpr):
    x = tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
    if ROUND_BF16:  # to the nearest bf16, ties to even, as torch's .to(torch.bfloat16)
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, b.to(tl.float32, bitcast=True), float("nan"))  # torch's NaN: positive
    return x


@triton.jit
def _absmax_many_kernel(addresses, numels, out_bits, SRC: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    n = tl.load(numels + t)
    src = tl.load(addresses + t).to(tl.pointer_type(SRC))
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc = tl.maximum(acc, finite_abs(_load(src, start + tl.arange(0, BLOCK).to(tl.int64), n, ROUND_BF16)))
    tl.atomic_max(out_bits + t, tl.max(acc, axis=0).to(tl.int32, bitcast=True))  # |x| orders as its bits


def absmax_many(table: TensorTable, round_to: torch.dtype | None = None) -> torch.Tensor:
    """Each tensor's finite absmax (quant.finite_absmax), fp32 (len(tensors),)."""
    bits = torch.zeros(len(table.tensors), dtype=torch.int32, device=table.addresses.device)
    launcher(_absmax_many_kernel)((PROGRAMS_PER_TENSOR, len(table.tensors)), table.addresses, table.numels, bits,
                                  SRC=table.src, ROUND_BF16=_rounding(round_to), BLOCK=BLOCK, num_warps=4)
    return bits.view(torch.float32)


@triton.jit
def _cast_many_kernel(addresses, numels, dst, dst_offsets, dst_numels, amax, SRC: tl.constexpr, ROUND_BF16: tl.constexpr,
                      FMT: tl.constexpr, ON_GPU: tl.constexpr, BLOCK: tl.constexpr):
    """Tensor t's elements scaled by absmax_scale(amax[t]) into E4M3 at dst + dst_offsets[t]; zeros from its numel
    to dst_numels[t] (the padding rows of an uneven shard)."""
    t = tl.program_id(1)
    n = tl.load(numels + t)
    n_out = tl.load(dst_numels + t)
    src = tl.load(addresses + t).to(tl.pointer_type(SRC))
    out = dst + tl.load(dst_offsets + t)
    scale = absmax_scale(tl.load(amax + t), FMT[0])
    for start in range(tl.program_id(0) * BLOCK, n_out, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        x = _load(src, offs, n, ROUND_BF16)
        tl.store(out + offs, _quantize_tile(x, scale, FMT, dst.dtype.element_ty, ON_GPU), mask=offs < n_out)


class CastPlan:
    """A table's tensors cast together again and again (a unit's weight shards, at every all-gather), into one
    flat buffer: tensor i's codes at [starts[i], starts[i] + out_numels[i]) (``out_numels[i]`` >= its numel:
    zero-padded)."""

    def __init__(self, table: TensorTable, out_numels: list[int]):
        device = table.addresses.device
        self.table = table
        starts = [0]
        for n in out_numels:
            starts.append(starts[-1] + n)
        self.starts = starts
        self.offsets = torch.tensor(starts[:-1], dtype=torch.int64).to(device)
        self.out_numels = torch.tensor(out_numels, dtype=torch.int64).to(device)
        self.fmt = _format_constexprs("e4m3")

    def cast(self, amax: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
        """All the tensors in E4M3, each by its absmax in ``amax`` (fp32, one per tensor)."""
        t = self.table
        out = torch.empty(self.starts[-1], dtype=torch.float8_e4m3fn, device=t.addresses.device)
        launcher(_cast_many_kernel)((PROGRAMS_PER_TENSOR, len(t.tensors)), t.addresses, t.numels, out,
                                    self.offsets, self.out_numels, amax, SRC=t.src, ROUND_BF16=_rounding(round_to),
                                    FMT=self.fmt, ON_GPU=not interpreted(), BLOCK=BLOCK, num_warps=4)
        return out
