"""GEMM operands: quantize a 2-D tensor along its contraction dimension, and multiply two such operands.

An operand is a matrix read by the GEMM with its contraction dimension last: ``values`` (R, C) on a format's grid
held in an fp8 dtype, and ``scale`` fp32, one per row (R, 1) or one for the tensor. E2M1 and INT4 values are
exact in float8_e4m3fn, so the 4-bit recipes use the same container and the same FP8 tensor-core GEMM, which is
exact with fp32 accumulation (use_fast_accum=False). ``quantize(..., granularity="row")`` from lpoptim.quant is
the reference; on CUDA a fused Triton kernel (lpoptim/kernels/linear_quant.py) computes the same thing.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats import E4M3, E5M2, container_dtype, get_format, round_to_grid
from ..quant import finite_absmax, tensor_or_row_scale
from ..hadamard import block_hadamard

@dataclass
class Operand:
    values: torch.Tensor  # (R, C), fp8 dtype, contiguous
    scale: torch.Tensor   # fp32: (R, 1) per row, or 0-dim per tensor

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def quantize_operand_ref(x: torch.Tensor, fmt, granularity: str = "row", hadamard_block: int | None = None,
                         cols: int | None = None, amax: torch.Tensor | None = None) -> Operand:
    """Reference: zero-pad the columns to ``cols``, optional block Hadamard along them, absmax-quantize.
    ``amax`` (per tensor only): x's finite absmax, already known (tensor_amax), so not taken again."""
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


def _check_history(history, amax, granularity: str, hadamard_block=None) -> None:
    if history is not None and (amax is not None or granularity != "tensor" or hadamard_block):
        raise ValueError("history (delayed scaling): per-tensor scaling without amax or a Hadamard block only")


def quantize_operand(x: torch.Tensor, fmt, granularity: str = "row", hadamard_block: int | None = None,
                     pad_to: int = 16, amax: torch.Tensor | None = None, history=None) -> Operand:
    """Quantize the rows of 2-D ``x`` (any strides: pass ``t.t()`` to quantize columns, output transposed).

    Columns are zero-padded to a multiple of ``pad_to`` and of the Hadamard block (zeros change no GEMM result).
    ``amax``: per tensor, x's finite absmax (tensor_amax) when already known; the result is the same.
    ``history`` (nn.delayed.AmaxHistory): per tensor, delayed scaling: the scale from the larger of the history's
    absmax and x's own (nothing saturates), and x's absmax recorded there.
    """
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    _check_history(history, amax, granularity, hadamard_block)
    if amax is not None and (granularity != "tensor" or hadamard_block):
        raise ValueError("amax: per-tensor scaling without a Hadamard block only")
    if amax is not None and (amax.numel() != 1 or amax.dtype != torch.float32 or amax.device != x.device):
        raise ValueError(f"amax must be one fp32 value on {x.device}, got {tuple(amax.shape)} {amax.dtype} "
                         f"on {amax.device}")
    cols = padded(x.shape[1], math.lcm(pad_to, hadamard_block or 1))
    if use_kernels(x) and granularity == "tensor" and not hadamard_block:  # rows of x, or columns of x.t()
        from ..kernels.linear_quant import quantize_tensor_rows_cols
        if not x.is_contiguous() and x.t().is_contiguous():  # x.t(): read along its contiguous dimension
            return Operand(*quantize_tensor_rows_cols(x.t(), None, fmt, None, cols, amax, history)[1])
        return Operand(*quantize_tensor_rows_cols(x, fmt, None, cols, None, amax, history)[0])
    if use_kernels(x):
        from ..kernels.linear_quant import quantize_rows
        values, scale = quantize_rows(x, fmt, granularity, hadamard_block, cols)
        return Operand(values, scale)
    if history is not None:
        amax = history.take_ref(x)
    return quantize_operand_ref(x, fmt, granularity, hadamard_block, cols, amax)


def quantize_operand_and_transpose(x: torch.Tensor, row_fmt, col_fmt, pad_to: int = 16,
                                   granularity: str = "row", history=None) -> tuple[Operand, Operand]:
    """quantize_operand(x, row_fmt) and quantize_operand(x.t(), col_fmt): the same two operands, on CUDA in two
    passes over x instead of three. Per row: the row pass leaves the column maxima for a one-pass column
    quantizer (kernels.linear_quant.quantize_rows_and_cols); per tensor: the absmax, then one pass writing both
    copies (quantize_tensor_rows_cols); with ``history`` (delayed scaling, quantize_operand) that one pass alone."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    _check_history(history, None, granularity)
    row_cols, col_cols = padded(x.shape[1], pad_to), padded(x.shape[0], pad_to)
    if use_kernels(x) and x.is_contiguous():
        from ..kernels import linear_quant as lq
        if granularity == "tensor":
            rows, cols = lq.quantize_tensor_rows_cols(x, row_fmt, col_fmt, row_cols, col_cols, history=history)
        else:
            rows, cols = lq.quantize_rows_and_cols(x, get_format(row_fmt), get_format(col_fmt), row_cols, col_cols)
        return Operand(*rows), Operand(*cols)
    amax = history.take_ref(x) if history is not None else None  # once for both copies
    if granularity == "tensor" and get_format(row_fmt) is get_format(col_fmt):
        # one scale and one grid: xᵀ's codes are x's, transposed; rounded once (what Inductor compiles: one
        # reduction, then one pass writing both copies, as torchao's transposed FP8 copy)
        fmt = get_format(row_fmt)
        x32 = x.float()
        scale = tensor_or_row_scale(x32, fmt, "tensor", amax)
        q = round_for_cast(x32 / scale, fmt)
        dtype = container_dtype(fmt)
        return (Operand(F.pad(q, (0, row_cols - x.shape[1])).to(dtype), scale),
                Operand(F.pad(q.t(), (0, col_cols - x.shape[0])).to(dtype).contiguous(), scale))
    return (quantize_operand(x, row_fmt, granularity, None, pad_to, amax),
            quantize_operand(x.t(), col_fmt, granularity, None, pad_to, amax))


def quantize_operand_keep_col_max(x: torch.Tensor, fmt, pad_to: int = 16) -> tuple[Operand, torch.Tensor | None]:
    """quantize_operand(x, fmt) per row, and on CUDA each column's absmax too (None on the CPU): what
    quantize_transpose_from_max needs to quantize x's columns later in one pass (a weight: rows in the forward,
    columns in the backward)."""
    if not (use_kernels(x) and x.is_contiguous() and x.dim() == 2):
        return quantize_operand(x, fmt, "row", None, pad_to), None
    from ..kernels.linear_quant import quantize_rows
    col_max = torch.zeros(x.shape[1], device=x.device, dtype=torch.int32)
    values, scale = quantize_rows(x, get_format(fmt), "row", None, padded(x.shape[1], pad_to), col_max=col_max)
    return Operand(values, scale), col_max


def quantize_operand_keep_tensor_max(x: torch.Tensor, fmt, pad_to: int = 16) -> tuple[Operand, torch.Tensor]:
    """quantize_operand(x, fmt, "row"), and x's finite absmax (0-dim fp32), what a per-tensor copy of x (or of
    x.t()) needs as ``amax``. On CUDA the row kernel's first pass takes it on the way (no pass of its own);
    elsewhere tensor_amax does."""
    if not (use_kernels(x) and x.dim() == 2):
        return quantize_operand(x, fmt, "row", None, pad_to), tensor_amax(x)
    from ..kernels.linear_quant import quantize_rows
    bits = torch.zeros((), device=x.device, dtype=torch.int32)  # +0.0
    values, scale = quantize_rows(x, get_format(fmt), "row", None, padded(x.shape[1], pad_to), tensor_max=bits)
    return Operand(values, scale), bits.view(torch.float32)


def quantize_operand_delayed_keep_amax(x: torch.Tensor, fmt, history, pad_to: int = 16) -> tuple[Operand, torch.Tensor]:
    """quantize_operand(x, fmt, "tensor", history=history), and the absmax its scale came from (0-dim fp32,
    max(history, x's own)): a later copy of x.t() given it as ``amax`` has the same scale (a weight: rows in the
    forward, columns in the backward, with no absmax pass of their own)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    cols = padded(x.shape[1], pad_to)
    if use_kernels(x):
        from ..kernels.linear_quant import quantize_tensor_rows_cols
        used = torch.empty((), device=x.device, dtype=torch.float32)
        rows = quantize_tensor_rows_cols(x, fmt, None, cols, None, history=history, used_amax=used)[0]
        return Operand(*rows), used
    amax = history.take_ref(x)
    return quantize_operand_ref(x, fmt, "tensor", None, cols, amax), amax


def quantize_transpose_from_max(x: torch.Tensor, fmt, col_max: torch.Tensor, pad_to: int = 16) -> Operand:
    """quantize_operand(x.t(), fmt) per row, in one pass with the column maxima quantize_operand_keep_col_max
    left. x must not have changed since: autograd's version check guards a saved weight."""
    from ..kernels.linear_quant import quantize_cols_from_max
    return Operand(*quantize_cols_from_max(x, get_format(fmt), col_max, padded(x.shape[0], pad_to)))


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
