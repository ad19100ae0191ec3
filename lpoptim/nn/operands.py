"""GEMM operands: how one is quantized (QuantSpec), the one call that quantizes it (quantize), and the GEMM.

An operand is a matrix read by the GEMM with its contraction dimension last: ``values`` (R, C) on a format's grid
held in an fp8 dtype, and ``scale`` fp32, one per row (R, 1) or one for the tensor. E2M1 and INT4 values are
exact in float8_e4m3fn, so the 4-bit recipes use the same container and the same FP8 tensor-core GEMM, which is
exact with fp32 accumulation (use_fast_accum=False).

What ``quantize(x, spec)`` computes, for 2-D ``x`` of any strides (``x.t()`` quantizes x's columns, output
transposed): x's columns zero-padded to a multiple of ``spec.pad_to`` and of the Hadamard block (zeros change no
GEMM result), a block Hadamard along them if the spec has one, then ``scale = amax / fmt.max`` from the finite
absmax of each row or of the tensor (x's own; or given; or with delayed scaling the larger of an amax history's
and x's own), and ``values = x / scale`` rounded onto the format's grid. ``quantize_pair`` gives x's and xᵀ's
operands together. Two backends compute the same bits: the reference (torch ops: the CPU, and what torch.compile
traces; ``quantize(..., granularity="row")`` of lpoptim.quant after hadamard.block_hadamard) and, for CUDA tensors
in eager mode, the Triton kernels of lpoptim/kernels/linear_quant.py.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats import E4M3, E5M2, container_dtype, get_format, round_to_grid
from ..quant import absmax_scale, finite_absmax, tensor_or_row_scale
from ..hadamard import block_hadamard, pick_block


@dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized along its rows (Recipe.specs gives each operand of a layer its own).

    ``granularity``: one scale per row, or "tensor": one. ``scaling`` (per tensor): "current", the absmax of the
    tensor itself (or the one passed as ``amax``), or "delayed", the larger of x's own and the window of the
    AmaxHistory passed as ``history``, which also records x's (nn/delayed.py; without a history: current).
    ``hadamard_block`` (per row): a block-diagonal Hadamard along the rows first, the block the largest power of
    two up to this one that divides the row width (hadamard.pick_block). ``keep``: also return, as the operand's
    ``amax``, what a later copy of x.t() takes its scales from without a pass of its own: "amax", the absmax the
    scale came from (per row: x's finite absmax), or "col_max", each column's finite absmax as fp32 bits in int32
    (per row, CUDA only: None elsewhere). The copy of x.t() made with x's in one go is quantize_pair's."""
    fmt: str
    granularity: str = "row"
    scaling: str = "current"
    hadamard_block: int | None = None
    keep: str | None = None
    pad_to: int = 16

    def __post_init__(self):  # both backends compute the same bits only for specs that pass these checks
        get_format(self.fmt)
        if self.granularity not in ("row", "tensor"):
            raise ValueError(f"granularity must be 'row' or 'tensor', got {self.granularity!r}")
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"scaling must be 'current' or 'delayed', got {self.scaling!r}")
        if self.keep not in (None, "amax", "col_max"):
            raise ValueError(f"keep must be None, 'amax' or 'col_max', got {self.keep!r}")
        if not (isinstance(self.pad_to, int) and self.pad_to >= 1):
            raise ValueError(f"pad_to must be a positive int, got {self.pad_to!r}")
        block = self.hadamard_block
        if block is not None and (block < 1 or block & (block - 1)):
            raise ValueError(f"hadamard_block must be a power of two, got {block}")
        if block and (self.keep or self.granularity == "tensor"):
            raise ValueError("a Hadamard block goes with per-row scaling and nothing kept (the statistic kept would "
                             "be of the rotated rows)")
        if self.keep == "col_max" and self.granularity != "row":  # neither backend would keep anything
            raise ValueError("keep='col_max' goes with per-row scaling (per tensor: keep='amax')")


@dataclass
class Operand:
    values: torch.Tensor  # (R, C), fp8 dtype, contiguous
    scale: torch.Tensor   # fp32: (R, 1) per row, or 0-dim per tensor
    amax: torch.Tensor | None = None  # what QuantSpec.keep asked for (None where it asked for nothing)

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def use_kernels(x: torch.Tensor) -> bool:
    """lpoptim's Triton kernels for CUDA tensors in eager mode; under torch.compile the reference's torch ops,
    which Inductor fuses into its own kernels (and into the ops around them)."""
    return x.is_cuda and not torch.compiler.is_compiling()


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The finite absmax of 2-D ``x`` as a 0-dim fp32 tensor (one read; a kernel on CUDA): what a per-tensor
    scale is made from, kept where the same tensor is quantized again (a weight: forward, then transposed in the
    backward)."""
    if use_kernels(x):
        from ..kernels.linear_quant import finite_absmax as kernel_absmax
        return kernel_absmax(x)
    return finite_absmax(x.float())


# ---- the dispatcher ------------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor | None = None, history=None) -> Operand:
    """x's rows quantized as ``spec`` says (module docstring), by the Triton kernels for CUDA tensors in eager
    mode, by the reference otherwise.

    ``amax``: the absmax the scales come from, already known, so not taken again: per tensor x's finite absmax
    (0-dim fp32, tensor_amax), per row each row's as a keep="col_max" pass over x.t() left it. ``history``: the
    operand's nn.delayed.AmaxHistory, used by a spec with scaling="delayed" only (not with ``amax``)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    history = _check(x, spec, amax, history)
    block = pick_block(x.shape[1], spec.hadamard_block) if spec.hadamard_block else None
    cols = padded(x.shape[1], math.lcm(spec.pad_to, block or 1))
    if use_kernels(x):
        return _quantize_kernel(x, spec, block, cols, amax, history)
    if spec.granularity == "row":
        op = quantize_operand_ref(x, spec.fmt, "row", block, cols, row_max=amax)
        if spec.keep == "amax":
            op.amax = finite_absmax(x.float())
        return op
    if history is not None:
        amax = history.take_ref(x)
    elif spec.keep == "amax" and amax is None:  # taken once: a later copy of x.t() gets the same scale
        amax = finite_absmax(x.float())
    op = quantize_operand_ref(x, spec.fmt, "tensor", block, cols, amax)
    if spec.keep == "amax":
        op.amax = amax
    return op


def quantize_pair(x: torch.Tensor, rows: QuantSpec, cols: QuantSpec, history=None) -> tuple[Operand, Operand]:
    """quantize(x, rows) and quantize(x.t(), cols), one scaling for both (one history record), on CUDA in two
    passes over x instead of three: per row the row pass leaves the column maxima for a one-pass column quantizer
    (kernels.linear_quant.quantize_rows_and_cols); per tensor the absmax, then one pass writing both copies
    (quantize_tensor_rows_cols), with a history (delayed scaling) that one pass alone."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    if (rows.granularity, rows.scaling) != (cols.granularity, cols.scaling) or any(
            s.hadamard_block or s.keep for s in (rows, cols)):
        raise ValueError(f"quantize_pair: one granularity and scaling for both copies, without a Hadamard block or "
                         f"keep; got {rows} and {cols}")
    history = _check(x, rows, None, history)
    row_cols, col_cols = padded(x.shape[1], rows.pad_to), padded(x.shape[0], cols.pad_to)
    if use_kernels(x) and x.is_contiguous():
        from ..kernels import linear_quant as lq
        if rows.granularity == "tensor":
            r, c = lq.quantize_tensor_rows_cols(x, rows.fmt, cols.fmt, row_cols, col_cols, history=history)
        else:
            r, c = lq.quantize_rows_and_cols(x, get_format(rows.fmt), get_format(cols.fmt), row_cols, col_cols)
        return Operand(*r), Operand(*c)
    amax = history.take_ref(x) if history is not None else None  # once for both copies
    fmt = get_format(rows.fmt)
    if rows.granularity == "tensor" and fmt is get_format(cols.fmt):
        # one scale and one grid: xᵀ's codes are x's, transposed; rounded once (what Inductor compiles: one
        # reduction, then one pass writing both copies, as torchao's transposed FP8 copy)
        x32 = x.float()
        scale = tensor_or_row_scale(x32, fmt, "tensor", amax)
        q = round_for_cast(x32 / scale, fmt)
        dtype = container_dtype(fmt)
        return (Operand(F.pad(q, (0, row_cols - x.shape[1])).to(dtype), scale),
                Operand(F.pad(q.t(), (0, col_cols - x.shape[0])).to(dtype).contiguous(), scale))
    return quantize(x, rows, amax), quantize(x.t(), cols, amax)


def _check(x: torch.Tensor, spec: QuantSpec, amax, history):
    """The history quantize uses (None for current scaling), after checking the arguments fit the spec (whose own
    fields QuantSpec checked when it was made)."""
    if spec.scaling != "delayed":
        history = None
    elif history is not None and (amax is not None or spec.granularity != "tensor" or spec.hadamard_block):
        raise ValueError("history (delayed scaling): per-tensor scaling without amax or a Hadamard block only")
    if amax is not None:
        if spec.granularity == "tensor" and (amax.numel() != 1 or amax.dtype != torch.float32
                                             or amax.device != x.device):
            raise ValueError(f"amax must be one fp32 value on {x.device}, got {tuple(amax.shape)} {amax.dtype} "
                             f"on {amax.device}")
        if spec.granularity == "row" and (amax.shape != (x.shape[0],) or amax.dtype != torch.int32):
            raise ValueError(f"amax per row: one int32 (fp32 bits) per row of x, got {tuple(amax.shape)} "
                             f"{amax.dtype}")
        if spec.hadamard_block:
            raise ValueError("amax: not with a Hadamard block (the maxima are of the mixed values)")
    return history


def _quantize_kernel(x, spec: QuantSpec, block, cols, amax, history) -> Operand:
    """quantize's Triton backend (CUDA, eager)."""
    from ..kernels import linear_quant as lq
    keep = spec.keep
    if spec.granularity == "tensor":  # (no Hadamard block: QuantSpec refuses one per tensor)
        used = None
        if keep == "amax":
            if history is not None:  # the absmax the scale came from, max(history, own), from the same pass
                used = torch.empty((), device=x.device, dtype=torch.float32)
            elif amax is None:  # taken once: a later copy of x.t() gets the same scale
                amax = lq.finite_absmax(x)
        if not x.is_contiguous() and x.t().is_contiguous():  # x.t(): read along its contiguous dimension
            out = lq.quantize_tensor_rows_cols(x.t(), None, spec.fmt, None, cols, amax, history, used)[1]
        else:
            out = lq.quantize_tensor_rows_cols(x, spec.fmt, None, cols, None, amax, history, used)[0]
        return Operand(*out, (used if history is not None else amax) if keep == "amax" else None)
    fmt = get_format(spec.fmt)
    if amax is not None:  # the rows' maxima, left by a keep="col_max" pass over x.t(): one pass
        return Operand(*lq.quantize_rows(x, fmt, "row", None, cols, row_max=amax))
    if keep == "col_max" and x.is_contiguous():
        kept = torch.zeros(x.shape[1], device=x.device, dtype=torch.int32)  # |x| bits: 0 is +0.0
        return Operand(*lq.quantize_rows(x, fmt, "row", block, cols, col_max=kept), kept)
    if keep == "amax":  # the first pass takes x's absmax on the way (no pass of its own)
        kept = torch.zeros((), device=x.device, dtype=torch.int32)  # +0.0
        values, scale = lq.quantize_rows(x, fmt, "row", block, cols, tensor_max=kept)
        return Operand(values, scale, kept.view(torch.float32))
    return Operand(*lq.quantize_rows(x, fmt, "row", block, cols))


# ---- the reference backend ----------------------------------------------------------------------------------

def quantize_operand_ref(x: torch.Tensor, fmt, granularity: str = "row", hadamard_block: int | None = None,
                         cols: int | None = None, amax: torch.Tensor | None = None,
                         row_max: torch.Tensor | None = None) -> Operand:
    """The reference backend: zero-pad the columns to ``cols``, a block Hadamard along them with exactly
    ``hadamard_block``, absmax-quantize. ``amax`` (per tensor): x's finite absmax, already known, so not taken
    again; ``row_max`` (per row): each row's, as fp32 bits in int32."""
    fmt = get_format(fmt)
    x = x.float()
    if cols is not None and cols != x.shape[1]:
        x = F.pad(x, (0, cols - x.shape[1]))
    if hadamard_block:
        x = block_hadamard(x, hadamard_block)
    if granularity not in ("tensor", "row"):
        raise ValueError(f"granularity must be 'tensor' or 'row', got {granularity!r}")
    if amax is not None and granularity != "tensor":
        raise ValueError("amax: per-tensor quantization only")
    if row_max is not None:
        scale = absmax_scale(row_max.view(torch.float32).reshape(-1, 1), fmt)
    else:
        scale = tensor_or_row_scale(x, fmt, granularity, amax)
    values = round_for_cast(x / scale, fmt).to(container_dtype(fmt))
    scale = scale.reshape(-1, 1) if granularity == "row" else scale.reshape(())
    return Operand(values.contiguous(), scale)  # x.t() would leave a transposed layout


def round_for_cast(y: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 ``y`` made ready for the cast to ``fmt``'s container: rounded onto the grid (formats.round_to_grid), or
    on CUDA for E4M3 / E5M2 only clamped, since there the cast itself rounds to nearest even (as the kernels
    do): the same codes from one cheap element-wise op. Compiled, round_to_grid's bit arithmetic
    made Inductor's weight casts compute-bound (about a third of the bandwidth in a 7B step profile)."""
    if y.is_cuda and fmt in (E4M3, E5M2):
        return y.clamp(-fmt.max, fmt.max)
    return round_to_grid(y, fmt)


# ---- the GEMM ------------------------------------------------------------------------------------------------

def _scales(a: Operand, b: Operand):
    sa, sb = a.scale, b.scale.reshape(1, -1) if b.scale.dim() else b.scale
    if sa.dim() != sb.dim():  # row-wise on one side only: the CUDA kernel wants both row-wise
        if sa.dim() == 0:
            sa = sa.expand(a.values.shape[0], 1).contiguous()
        else:
            sb = sb.reshape(1, 1).expand(1, b.values.shape[0]).contiguous()
    return sa, sb


def _scaled_mm(a: Operand, b: Operand, sa, sb, out_dtype, fast_accum):
    # row-wise scales: the CUDA kernel writes bf16 only
    return torch._scaled_mm(a.values, b.values.t(), scale_a=sa, scale_b=sb,
                            out_dtype=torch.bfloat16 if sa.dim() == 2 else out_dtype,
                            use_fast_accum=fast_accum).to(out_dtype)


def gemm(a: Operand, b: Operand, out_dtype: torch.dtype = torch.float32, fast_accum: bool = False) -> torch.Tensor:
    """(a.values·a.scale) @ (b.values·b.scale)ᵀ: a (M, K), b (N, K), the contraction dim K last in both.

    CUDA: torch._scaled_mm with fp32 accumulation (b passed column-major, as Hopper wants); ``fast_accum``:
    Hopper's faster FP8 accumulation, which drops low bits (Recipe.fast_accum; not exact for 4-bit values).
    CPU: the same product in fp32 from the grid values (exact for 4-bit values: products are multiples of 1/4;
    ``fast_accum`` changes nothing there).
    """
    sa, sb = _scales(a, b)
    if a.values.is_cuda and torch.compiler.is_compiling():  # no fallback to trace: Inductor compiles the call
        return _scaled_mm(a, b, sa, sb, out_dtype, fast_accum)
    if a.values.is_cuda:
        try:
            return _scaled_mm(a, b, sa, sb, out_dtype, fast_accum)
        except torch.OutOfMemoryError:  # not a missing kernel: the fp32 emulation would need more memory still
            raise
        except RuntimeError as e:  # keep training correct, and say so (benchmarks/linear.py records these warnings)
            warnings.warn(f"torch._scaled_mm failed ({str(e).splitlines()[0]}); emulating in fp32", stacklevel=2)
    acc = a.values.float() @ b.values.float().t()
    return (acc * sa * sb).to(out_dtype)
