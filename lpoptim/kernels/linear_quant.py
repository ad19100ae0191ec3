"""Fused GEMM-operand quantizer: (block Hadamard +) absmax scale + round onto a grid + cast, and transpose.

One kernel quantizes the rows of a 2-D tensor given by pointer and strides. Quantizing the *columns* of x (for
the weight-gradient GEMM, where tokens are contracted) is the same kernel on the strided view ``x.t()``: the tile
is loaded along x's contiguous dimension and stored transposed into the contiguous output, in one pass.

Numerics follow the references exactly: lpoptim.quant.quantize (scale = amax / max, x / scale, both correctly
rounded: ``div_rn``), lpoptim.formats.round_to_grid (spacing from the fp32 exponent, round half to even, clamp),
and lpoptim.hadamard.block_hadamard (±1 matrix with fp32 accumulation, then times the fp32 1/√b). With a
Hadamard block only the summation order differs from torch's matmul.
"""
from __future__ import annotations


import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from ..formats import IntFormat, container_dtype, get_format
from ..hadamard import hadamard_pm1, inv_sqrt
# unaliased: Inductor copies a kernel's dependencies under their own names (wrap_triton, nn/weight_scale.py)
from ..quant import PREV_ABSMAX_HEADROOM, PREV_SLOTS
from ..quant import absmax_scale as absmax_scale_ref
from .grid import absmax_scale
from .grid import div_rn_by, finite_abs, fp8_bits, interpreted, round_to_grid
from .launch import cdiv, launcher, next_power_of_2

@triton.jit
def _load_hadamard(h_ptr, HB: tl.constexpr, BF16_DOT: tl.constexpr):
    """The ±1 (HB, HB) matrix, loaded once per program (in the tile loop it was 8x the bytes of x's own tile, from
    L2, for every tile: what held the Hadamard quantizer at ~350 GB/s)."""
    hr = tl.arange(0, HB)
    h = tl.load(h_ptr + hr[:, None] * HB + hr[None, :])
    if BF16_DOT:  # bf16 input: ±1 products are exact, accumulation in fp32 on the tensor cores
        h = h.to(tl.bfloat16)
    return h


@triton.jit
def _load_tile(x_ptr, h, rows, c0, R, C, stride_r, stride_c, BLOCK_C: tl.constexpr,
               HAD: tl.constexpr, INV_SQRT: tl.constexpr, BF16_DOT: tl.constexpr):
    """x[rows, c0:c0 + BLOCK_C] in fp32, zeros outside x; with HAD, times the Hadamard ``h`` (_load_hadamard)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    t = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c, mask=mask,
                other=0.0)  # int64 offsets: operands past 2^31 elements
    if HAD:
        if BF16_DOT:
            t = tl.dot(t.to(tl.bfloat16), h, out_dtype=tl.float32)
        else:
            t = tl.dot(t.to(tl.float32), h, input_precision="ieee")
        t = t * INV_SQRT
    return t.to(tl.float32)


@triton.jit
def _finite_absmax_kernel(x_ptr, max_ptr, R, C, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """max |x| over finite elements, into one int32 (|x| orders as its bits do) by an atomic per program. The
    running maximum is a whole tile, reduced once at the end: no reduction between one tile's loads and the next."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    amax = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        t = finite_abs(_load_tile(x_ptr, 0.0, rows, c0, R, C, stride_r, stride_c, BLOCK_C, False, 1.0, False))
        amax = tl.maximum(amax, t)
    tl.atomic_max(max_ptr, tl.max(tl.max(amax, axis=1), axis=0).to(tl.int32, bitcast=True))


def finite_absmax(x: torch.Tensor) -> torch.Tensor:
    """quant.finite_absmax of 2-D ``x`` (any strides) as a 0-dim fp32 tensor: one read of x, no temporaries."""
    if not x.is_contiguous() and x.t().is_contiguous():
        x = x.t()  # the maximum does not care; the loads follow the contiguous dimension
    bits = torch.zeros((), device=x.device, dtype=torch.int32)  # +0.0
    R, C = x.shape
    if R and C:
        tune = TUNING["absmax"]
        block_c = min(tune["block_c"], next_power_of_2(max(C, 16)))
        launcher(_finite_absmax_kernel)((cdiv(R, tune["block_r"]),), x, bits, R, C, x.stride(0), x.stride(1),
                                        BLOCK_R=tune["block_r"], BLOCK_C=block_c, num_warps=tune["num_warps"])
    return bits.view(torch.float32)


@triton.jit
def _quantize_tile(t, scale, FMT: tl.constexpr, OUT_DTYPE: tl.constexpr, ON_GPU: tl.constexpr):
    """A tile divided by its scale (broadcast: a column of row scales, or one) and rounded onto the format's grid
    exactly as formats.round_to_grid, as fp8 codes of ``OUT_DTYPE``. ``FMT``: the format's constexprs
    (_format_constexprs)."""
    FMAX: tl.constexpr = FMT[0]
    IS_INT: tl.constexpr = FMT[1]
    MAN: tl.constexpr = FMT[2]
    EMIN: tl.constexpr = FMT[3]
    QMIN: tl.constexpr = FMT[4]
    QMAX: tl.constexpr = FMT[5]
    NATIVE: tl.constexpr = FMT[6]
    CONTAINER_E4M3: tl.constexpr = FMT[7]
    if ON_GPU:  # the same quotient without a division per element
        y = div_rn_by(t, scale)
    else:  # the interpreter's FMA may round twice
        y = tl.math.div_rn(t, tl.broadcast_to(scale, t.shape))
    if ON_GPU and NATIVE:  # E4M3 / E5M2 in their own dtype: the cast rounds to nearest even, +-inf clamped as
        return tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL).to(OUT_DTYPE)
    q = round_to_grid(y, IS_INT, FMAX, MAN, EMIN, QMIN, QMAX)
    if ON_GPU:
        return q.to(OUT_DTYPE)
    # the interpreter's cast is wrong on carries and NaN: rounded in fp32, NaN by hand
    return fp8_bits(q, CONTAINER_E4M3).to(OUT_DTYPE, bitcast=True)


# what the row kernel does with maxima besides scaling its rows by them (MAXIMA): nothing; also take each column's
# (atomics); take the rows' from colmax_ptr instead (one pass); also take x's (an atomic)
_NO_MAXIMA, _COL_MAX, _FROM_MAX, _TENSOR_MAX = (tl.constexpr(i) for i in range(4))


@triton.jit
def _quant_rows_kernel(x_ptr, out_ptr, scale_ptr, h_ptr, colmax_ptr, tmax_ptr, R, C, CP, stride_r, stride_c,
                       FMT: tl.constexpr, HAD: tl.constexpr, INV_SQRT: tl.constexpr, BF16_DOT: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MAXIMA: tl.constexpr, ON_GPU: tl.constexpr,
                       COLS_PER_PROGRAM: tl.constexpr):
    """Rows of x, per row: pass 1 each row's finite absmax (of the Hadamard-mixed values with HAD), pass 2 the
    codes; ``MAXIMA`` (_NO_MAXIMA, _COL_MAX, _FROM_MAX, _TENSOR_MAX) says what else happens to the maxima."""
    FMAX: tl.constexpr = FMT[0]
    COL_MAX: tl.constexpr = MAXIMA == _COL_MAX
    SCALE_FROM_MAX: tl.constexpr = MAXIMA == _FROM_MAX
    TENSOR_MAX: tl.constexpr = MAXIMA == _TENSOR_MAX
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAD:
        h = _load_hadamard(h_ptr, BLOCK_C, BF16_DOT)
    else:
        h = 0.0  # unused
    c_begin, c_end = 0, CP
    if SCALE_FROM_MAX:  # the rows' absmax came with another pass (the column maxima of quantize_rows_and_cols):
        # one pass, the columns split over a second grid axis
        c_begin = tl.program_id(1) * COLS_PER_PROGRAM
        c_end = tl.minimum(c_begin + COLS_PER_PROGRAM, CP)
        amax = tl.load(colmax_ptr + rows, mask=rows < R, other=0).to(tl.float32, bitcast=True)
        scale = absmax_scale(amax, FMAX)
        if tl.program_id(1) == 0:
            tl.store(scale_ptr + rows, scale, mask=rows < R)
    else:  # pass 1: the row's absmax over finite elements (the second pass re-reads from L2)
        amax = tl.zeros((BLOCK_R,), tl.float32)
        for c0 in range(0, CP, BLOCK_C):
            t = finite_abs(_load_tile(x_ptr, h, rows, c0, R, C, stride_r, stride_c, BLOCK_C, HAD, INV_SQRT,
                                      BF16_DOT))  # inf and NaN do not set the scale
            amax = tl.maximum(amax, tl.max(t, axis=1))
            if COL_MAX:  # and each column's, for the transposed copy: |x| orders as its bits (int atomics)
                cols = c0 + tl.arange(0, BLOCK_C)
                tl.atomic_max(colmax_ptr + cols, tl.max(t, axis=0).to(tl.int32, bitcast=True), mask=cols < C)
        scale = absmax_scale(amax, FMAX)
        tl.store(scale_ptr + rows, scale, mask=rows < R)
        if TENSOR_MAX:  # x's finite absmax is the largest row's (no Hadamard): an int atomic, |x| orders as its bits
            tl.atomic_max(tmax_ptr, tl.max(amax, axis=0).to(tl.int32, bitcast=True))
    for c0 in range(c_begin, c_end, BLOCK_C):
        t = _load_tile(x_ptr, h, rows, c0, R, C, stride_r, stride_c, BLOCK_C, HAD, INV_SQRT, BF16_DOT)
        q = _quantize_tile(t, scale[:, None], FMT, out_ptr.dtype.element_ty, ON_GPU)
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < CP)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * CP + cols[None, :], q, mask=mask)


# Tile shapes: rows per program, columns per tile, warps; each the fastest of a sweep on an H100 (torch 2.11,
# triton 3.6) over 16384 x 4096 and 16384 x 11008 bf16 inputs (absmax: within 4% of it), by a sweep script and
# result files kept in git history at commit 038516f (benchmarks/quant_tune.py, docs/results/quant/; the rows,
# from_max and tensor sweeps also in docs/results/console_h100.md). Read-only: a tile is a property of the kernel.
TUNING = MappingProxyType({k: MappingProxyType(v) for k, v in {
    # per row: 1.19-1.40 TB/s (0.95-1.26 with 32 x 128)
    "rows": dict(block_r=16, block_c=256, num_warps=4),
    # the one-pass column quantizer: its rows are x's columns, 64 of them make 128-byte runs of bf16 along x's rows
    "from_max": dict(block_r=64, block_c=128, num_warps=4),
    # per tensor: 1.22 / 1.55 TB/s (32 x 128: 0.88 / 1.50)
    "tensor": dict(block_r=32, block_c=256, num_warps=8),
    # delayed scaling: the pass also reduces its tile to one absmax, which a narrower tile with 4 warps does fastest
    # (x and xᵀ 110 / 284 us against 32 x 256's 116 / 295)
    "delayed": dict(block_r=32, block_c=128, num_warps=4),
    # delayed scaling's second launch (quantizing again where x's absmax is beyond its history): programs per SM,
    # each looping over tiles, so that the launch that finds nothing to do ends at once (redone: 320 / 249 / 227 /
    # 231 us at 1 / 2 / 4 / 8 a SM)
    "redo": dict(per_sm=4),
    # with a block Hadamard (the tile's columns are one Hadamard block): rows per program for its tl.dot
    "hadamard": dict(block_r=64, num_warps=8),
    # rows held whole (no Hadamard or column maxima, rows contiguous, at most max_width wide padded to a power of
    # two): one read of x instead of two; on 16384 x 4096 E2M1 0.091 ms against the two-pass kernel's 0.135, E4M3
    # 0.081 against 0.128; 11008 wide (padded to 16384) slower, hence max_width
    "whole_rows": dict(enabled=True, max_width=4096, elems=4096, num_warps=8),
    # the finite absmax pass (per-tensor scales): within 4% of the best tile on both shapes
    "absmax": dict(block_r=16, block_c=256, num_warps=4)}.items()})


def quantize_rows(x: torch.Tensor, fmt, granularity: str = "row", hadamard_block: int | None = None,
                  cols: int | None = None, col_max: torch.Tensor | None = None, row_max: torch.Tensor | None = None,
                  tensor_max: torch.Tensor | None = None):
    """Rows of 2-D ``x`` (any strides) -> (values (R, cols) fp8 contiguous, scale fp32 (R, 1) or 0-dim).

    Columns beyond x's are zero (padding for the GEMM). Same result as operands.quantize_operand_ref. At most one
    of these maxima (fp32 bits in int32 on x's device; per row without a Hadamard block):

    - ``col_max`` (one per column, zeros): the row pass also leaves each column's finite absmax there, what
      quantizing x.t() later takes as ``row_max``;
    - ``row_max`` (one per row): the rows' finite absmax, already known, so one pass (quantize_rows_and_cols);
    - ``tensor_max`` (one, zero): the first pass also leaves x's finite absmax there, what a per-tensor copy of x
      needs (``.view(torch.float32)``), without a pass of its own.

    (With a Hadamard the rows' maxima are of the mixed values; taking x's own alongside slowed the kernel by more
    than a separate absmax pass costs, measured on an H100.)
    """
    if col_max is not None or row_max is not None or tensor_max is not None:
        given = [(n, t) for n, t in (("col_max", col_max), ("row_max", row_max), ("tensor_max", tensor_max))
                 if t is not None]
        name, t = given[0]
        if (len(given) > 1 or granularity != "row" or hadamard_block or t.dtype != torch.int32
                or t.device != x.device or (name == "tensor_max" and t.numel() != 1)):
            raise ValueError(f"{name}: one of col_max, row_max and tensor_max, int32 on x's device (tensor_max: one "
                             "value), with per-row scales without a Hadamard block")
    fmt = get_format(fmt)
    R, C = x.shape
    cols = C if cols is None else cols
    if cols < C:
        raise ValueError(f"cols ({cols}) must be at least x's width ({C}): columns are padded, never dropped")
    if hadamard_block and cols % hadamard_block:
        raise ValueError(f"padded width {cols} is not a multiple of the Hadamard block {hadamard_block}")
    if granularity == "tensor":
        if hadamard_block:
            raise NotImplementedError("per-tensor scaling with a Hadamard transform: use granularity='row'")
        return quantize_tensor_rows_cols(x, fmt, None, cols, None)[0]
    if granularity != "row":
        raise ValueError(f"granularity must be 'row' or 'tensor', got {granularity!r}")
    out = torch.empty((R, cols), device=x.device, dtype=container_dtype(fmt))
    scale = torch.empty((R, 1), device=x.device, dtype=torch.float32)
    if R == 0:
        return out, scale
    had = bool(hadamard_block)
    width = next_power_of_2(max(cols, 16))
    whole = TUNING["whole_rows"]
    if (whole["enabled"] and not had and col_max is None and row_max is None and x.stride(1) == 1
            and width <= whole["max_width"]):
        rows = 1 << max(0, (whole["elems"] // width).bit_length() - 1)  # rows held whole: a power of two
        launcher(_quant_whole_rows_kernel)(
            (cdiv(R, rows),), x, out, scale, tensor_max if tensor_max is not None else scale, R, C, cols, x.stride(0),
            FMT=_format_constexprs(fmt), ROWS=rows, WIDTH=width, ON_GPU=not interpreted(),
            TENSOR_MAX=tensor_max is not None, num_warps=whole["num_warps"])
        return out, scale
    tune = TUNING["hadamard" if had else "rows" if row_max is None else "from_max"]
    if had and (hadamard_block > 128 or x.dtype != torch.bfloat16):  # swept for bf16 and 128 only: the matrix
        tune = dict(block_r=32, num_warps=4)  # stays live in the loop, so larger ones keep the smaller tile
    block_r = tune["block_r"]
    block_c = hadamard_block if had else min(tune["block_c"], next_power_of_2(max(cols, 16)))
    h = hadamard_pm1(hadamard_block, x.device) if had else scale  # dummy pointer when unused
    cols_per_program = 4 * block_c
    # at least one column program: the one with program_id(1) == 0 writes the scales, even for zero columns
    grid = (cdiv(R, block_r), 1 if row_max is None else max(1, cdiv(cols, cols_per_program)))
    maxima = col_max if col_max is not None else row_max if row_max is not None else scale  # (a dummy pointer)
    launcher(_quant_rows_kernel)(
        grid, x, out, scale, h, maxima, tensor_max if tensor_max is not None else scale,
        R, C, cols, x.stride(0), x.stride(1),
        FMT=_format_constexprs(fmt), HAD=had, INV_SQRT=inv_sqrt(hadamard_block) if had else 1.0,
        # the interpreter's bf16 tl.dot returns garbage (triton 3.9); its fp32 'ieee' dot computes the same sums
        BF16_DOT=x.dtype == torch.bfloat16 and not interpreted(), BLOCK_R=block_r, BLOCK_C=block_c,
        MAXIMA=(_COL_MAX if col_max is not None else _FROM_MAX if row_max is not None else
                _TENSOR_MAX if tensor_max is not None else _NO_MAXIMA).value,
        ON_GPU=not interpreted(), COLS_PER_PROGRAM=cols_per_program, num_warps=tune["num_warps"],
    )
    return out, scale


@triton.jit
def _quant_whole_rows_kernel(x_ptr, out_ptr, scale_ptr, tmax_ptr, R, C, CP, stride_r, FMT: tl.constexpr,
                             ROWS: tl.constexpr, WIDTH: tl.constexpr, ON_GPU: tl.constexpr,
                             TENSOR_MAX: tl.constexpr):
    """_quant_rows_kernel without a Hadamard, for rows that fit a tile whole (WIDTH, a power of two >= CP): ROWS
    rows per program, read from memory once; each row's absmax, its scale and the codes from registers."""
    FMAX: tl.constexpr = FMT[0]
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    t = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :],
                mask=(rows[:, None] < R) & (cols[None, :] < C), other=0.0).to(tl.float32)
    amax = tl.max(finite_abs(t), axis=1)  # inf and NaN do not set the scale
    scale = absmax_scale(amax, FMAX)
    tl.store(scale_ptr + rows, scale, mask=rows < R)
    if TENSOR_MAX:  # x's finite absmax is the largest row's: |x| orders as its bits
        tl.atomic_max(tmax_ptr, tl.max(amax, axis=0).to(tl.int32, bitcast=True))
    q = _quantize_tile(t, scale[:, None], FMT, out_ptr.dtype.element_ty, ON_GPU)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * CP + cols[None, :], q,
             mask=(rows[:, None] < R) & (cols[None, :] < CP))


PREV_HEADROOM = tl.constexpr(PREV_ABSMAX_HEADROOM)  # nn/weight_scale.py says why


# the history slots change every call: specialized (== 1, divisible by 16) they would compile a variant each
@triton.jit(do_not_specialize=["HIST_OFFSET", "W_SLOT", "Z_SLOT"])
def _quant_tensor_kernel(x_ptr, amax_ptr, row_ptr, row_scale_ptr, col_ptr, col_scale_ptr, R, C, RP, CP,
                         stride_r, stride_c, hist_ptr, HIST_OFFSET, W_SLOT, Z_SLOT,
                         ROW_FMT: tl.constexpr, COL_FMT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         ON_GPU: tl.constexpr, DELAYED: tl.constexpr, REDO: tl.constexpr, N_SLOTS: tl.constexpr,
                         SLOTS_P2: tl.constexpr, STORE_USED: tl.constexpr, PREV: tl.constexpr = False):
    """A (BLOCK_R, BLOCK_C) tile of x scaled by one per-tensor scale: written as rows (R, CP) in ROW_FMT and/or as
    columns, transposed, (C, RP) in COL_FMT (a format's constexprs, or None: no such copy), zero-padded. The
    scales (amax / FMAX) are worked out from the finite absmax: x's own at ``amax_ptr``, or with DELAYED the
    largest in x's history ring (nn/delayed.py: N_SLOTS int32 slots from ``hist_ptr + HIST_OFFSET``, all but
    W_SLOT and Z_SLOT), in which case each tile's finite absmax goes into slot W_SLOT (an atomic) and the first
    program zeroes slot Z_SLOT for the next call. REDO, launched after a DELAYED
    pass, quantizes again with x's own absmax (now in W_SLOT) where that exceeds the history's, and else does
    nothing: no value ever saturates, and the result is the reference's max(history, own) scale. With STORE_USED
    its first program stores that absmax, max(history, own), at ``amax_ptr`` (what a later copy scaled alike takes).

    The columns' copy loads the tile again, transposed (from L1/L2: DRAM sees x once), so that each store runs
    along its tile's own dimension 1, as the one-pass column quantizer does. Storing the rows' tile through
    transposed addresses instead gave wrong codes for fp32 input on an H100 (triton 3.6), bf16 right.

    PREV: a weight's previous-absmax state (nn/weight_scale.py: slots previous, own, ticket; W_SLOT 1, Z_SLOT 2)
    instead of a ring: the scale from the previous absmax (0 where not finite and non-negative) times
    PREV_HEADROOM, redone from x's own times PREV_HEADROOM where x's own is larger or less than half of the
    guess; the REDO launch's last program (a ticket in slot 2) then moves own to previous and zeroes own and the
    ticket for the next call (quantize_weight_prev)."""
    ROWS: tl.constexpr = ROW_FMT is not None
    COLS: tl.constexpr = COL_FMT is not None
    if DELAYED or REDO:
        s = tl.arange(0, SLOTS_P2)
        window = (s < N_SLOTS) & (s != W_SLOT) & (s != Z_SLOT)  # the slot being written and the one being zeroed
        amax = tl.max(tl.load(hist_ptr + HIST_OFFSET + s, mask=window, other=0), axis=0).to(tl.float32, bitcast=True)
        if PREV:
            amax = tl.where((amax >= 0) & (amax <= 3.4028234663852886e38), amax, 0.0) * PREV_HEADROOM
    else:
        amax = tl.load(amax_ptr)
    if REDO:  # after the DELAYED pass: x's own absmax is in slot W_SLOT; beyond the history's, x is quantized
        own = tl.load(hist_ptr + HIST_OFFSET + W_SLOT).to(tl.float32, bitcast=True)  # again with its own scale
        redo = own > amax
        used = own
        if PREV:
            redo = redo | (amax > 2 * own)
            used = own * PREV_HEADROOM
        if STORE_USED:
            if tl.program_id(0) == 0:
                tl.store(amax_ptr, tl.where(redo, used, amax))
        if redo:  # a few programs per SM, looping over the tiles: where nothing is redone, they end at once
            n_c = tl.cdiv(tl.maximum(C, CP), BLOCK_C)
            for tile in range(tl.program_id(0), tl.cdiv(tl.maximum(R, RP), BLOCK_R) * n_c, tl.num_programs(0)):
                rows = (tile // n_c) * BLOCK_R + tl.arange(0, BLOCK_R)
                cols = (tile % n_c) * BLOCK_C + tl.arange(0, BLOCK_C)
                if ROWS:
                    _quantize_store(x_ptr, rows, cols, stride_r, stride_c, R, C, row_ptr, CP, row_scale_ptr, used,
                                    tile == 0, ROW_FMT, ON_GPU, False)
                if COLS:
                    _quantize_store(x_ptr, cols, rows, stride_c, stride_r, C, R, col_ptr, RP, col_scale_ptr, used,
                                    tile == 0, COL_FMT, ON_GPU, False)
        if PREV:  # acq_rel: every program has read the slots before the last one takes its ticket and moves them
            tl.debug_barrier()  # (the scalar atomic runs on one thread: the program's other threads read first)
            if tl.atomic_add(hist_ptr + HIST_OFFSET + Z_SLOT, 1) == tl.num_programs(0) - 1:
                tl.store(hist_ptr + HIST_OFFSET, own.to(tl.int32, bitcast=True))
                tl.store(hist_ptr + HIST_OFFSET + W_SLOT, 0)
                tl.store(hist_ptr + HIST_OFFSET + Z_SLOT, 0)
    else:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        tile_max = 0.0
        if ROWS:
            tile_max = _quantize_store(x_ptr, rows, cols, stride_r, stride_c, R, C, row_ptr, CP, row_scale_ptr, amax,
                                       first, ROW_FMT, ON_GPU, DELAYED)
        if COLS:
            _quantize_store(x_ptr, cols, rows, stride_c, stride_r, C, R, col_ptr, RP, col_scale_ptr, amax, first,
                            COL_FMT, ON_GPU, False)
            if DELAYED and not ROWS:  # the maximum from the tile as the rows' copy loads it (from L1/L2 now): taken
                # over the transposed tile it was most of int4's per-tensor quantizer time (371 against 199 us a step
                # at 4096 x 4096, measured on an H100)
                t = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c,
                            mask=(rows[:, None] < R) & (cols[None, :] < C), other=0.0).to(tl.float32)
                tile_max = tl.max(tl.max(finite_abs(t), axis=1), axis=0)
        if DELAYED:
            # relaxed: the kernel's end orders it for the next launch; the default acq_rel would first wait for
            # this program's stores
            tl.atomic_max(hist_ptr + HIST_OFFSET + W_SLOT, tile_max.to(tl.int32, bitcast=True), sem="relaxed")
            if first:
                tl.store(hist_ptr + HIST_OFFSET + Z_SLOT, 0)


@triton.jit
def _quantize_store(x_ptr, a, b, stride_a, stride_b, A, B, out_ptr, OUT_W, scale_ptr, amax, first,
                    FMT: tl.constexpr, ON_GPU: tl.constexpr, TILE_MAX: tl.constexpr):
    """The tile x[a, b] (x is (A, B) along these indices) scaled by amax / FMAX, stored as out[a, b] in rows of
    OUT_W (zeros past B); ``first`` also stores the scale. Returns the tile's finite absmax with TILE_MAX, else 0."""
    t = tl.load(x_ptr + a[:, None].to(tl.int64) * stride_a + b[None, :].to(tl.int64) * stride_b,
                mask=(a[:, None] < A) & (b[None, :] < B), other=0.0).to(tl.float32)
    scale = absmax_scale(amax, FMT[0])
    q = _quantize_tile(t, scale, FMT, out_ptr.dtype.element_ty, ON_GPU)
    tl.store(out_ptr + a[:, None].to(tl.int64) * OUT_W + b[None, :], q, mask=(a[:, None] < A) & (b[None, :] < OUT_W))
    if first:
        tl.store(scale_ptr, scale)
    if TILE_MAX:
        return tl.max(tl.max(finite_abs(t), axis=1), axis=0)
    return 0.0


def _tensor_constexprs(row_fmt, col_fmt, slots: int, store_used: bool, interp: bool, prev: bool = False):
    """(_quant_tensor_kernel's constexprs but DELAYED and REDO, its tuning) for one configuration (formats or None
    for a copy not written; the history's slots, 0: no history; whether the used absmax is stored; PREV)."""
    tune = TUNING["delayed" if slots else "tensor"]
    consts = dict(ROW_FMT=None if row_fmt is None else _format_constexprs(row_fmt),
                  COL_FMT=None if col_fmt is None else _format_constexprs(col_fmt), BLOCK_R=tune["block_r"],
                  BLOCK_C=tune["block_c"], ON_GPU=not interp, N_SLOTS=max(slots, 1),
                  SLOTS_P2=next_power_of_2(max(slots, 1)), STORE_USED=store_used, PREV=prev)
    return consts, tune


@functools.cache
def _tensor_launch(row_fmt, col_fmt, slots: int, store_used: bool, interp: bool):
    """What quantize_tensor_rows_cols launches for one configuration (_tensor_constexprs' arguments), worked out
    once: (the first launch, the second (REDO) launch or None, the tile (block_r, block_c), the copies' container
    dtypes)."""
    delayed = slots > 0
    consts, tune = _tensor_constexprs(row_fmt, col_fmt, slots, store_used, interp)
    run = launcher(_quant_tensor_kernel)
    first = run.bind(tune["num_warps"], DELAYED=delayed, REDO=False, **consts)
    redo = run.bind(tune["num_warps"], DELAYED=False, REDO=True, **consts) if delayed else None
    dtypes = tuple(None if f is None else container_dtype(f) for f in (row_fmt, col_fmt))
    return first, redo, (tune["block_r"], tune["block_c"]), dtypes


@functools.cache
def _redo_programs(device: torch.device) -> int:
    if interpreted() or device.type != "cuda":
        return 4  # the interpreter pays per program
    return TUNING["redo"]["per_sm"] * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache  # per launch otherwise: a handful of formats
def _format_constexprs(fmt) -> tuple:
    """A format as _quantize_tile's FMT constexpr, written into its container (formats.container_dtype):
    (FMAX, IS_INT, MAN, EMIN, QMIN, QMAX, NATIVE, CONTAINER_E4M3). E4M3 and E5M2 are their container's own grid
    (NATIVE: the cast rounds); E2M1 and INT4 live in E4M3 codes but round onto their own grid first."""
    fmt = get_format(fmt)
    is_int = isinstance(fmt, IntFormat)
    return (float(fmt.max), is_int, 0 if is_int else fmt.man_bits, 0 if is_int else fmt.min_normal_exp,
            fmt.qmin if is_int else 0, fmt.qmax if is_int else 0, fmt.name in ("e4m3", "e5m2"),
            container_dtype(fmt) == torch.float8_e4m3fn)


def quantize_tensor_rows_cols(x: torch.Tensor, row_fmt, col_fmt, row_cols: int | None, col_cols: int | None,
                              amax: torch.Tensor | None = None, history=None, used_amax: torch.Tensor | None = None):
    """Per-tensor quantization of 2-D ``x`` (any strides) as rows (R, row_cols) with ``row_fmt`` and/or as
    columns, transposed, (C, col_cols) with ``col_fmt``: one pass for the finite absmax (none when ``amax``, x's
    finite absmax as finite_absmax gives it, is passed), one that reads each element once and writes both copies.
    ``history`` (nn.delayed.AmaxHistory, not with ``amax``): delayed scaling, the scale from the history and x's
    absmax recorded by the same pass, which is all the work where the history covers x's absmax; where it does
    not (the first call, a jump) a second launch quantizes again with x's own; ``used_amax`` (0-dim fp32, with
    ``history``) receives the absmax the scale came from, max(history, x's own), as history.take_ref returns it.
    A format of None skips that copy. Returns ((values, scale) or None, (values, scale) or None), each equal to
    operands.quantize_operand_ref(..., "tensor") of x or of x.t() (with the amax history.take_ref gives); where
    both copies have one format they share one scale tensor.

    An eager layer calls this four times a step: it is kept to few Python operations (the launches and their
    constexprs are worked out once per configuration, _tensor_launch)."""
    R, C = x.shape
    delayed = history is not None
    if delayed and amax is not None:
        raise ValueError("amax or history, not both")
    if used_amax is not None and not delayed:
        raise ValueError("used_amax: with history (delayed scaling) only")
    row_fmt = None if row_fmt is None else get_format(row_fmt)
    col_fmt = None if col_fmt is None else get_format(col_fmt)
    first, redo, (block_r, block_c), (row_dtype, col_dtype) = _tensor_launch(
        row_fmt, col_fmt, history.slots if delayed else 0, used_amax is not None, interpreted())
    if delayed:
        hist = history.bits
        # the used absmax's output, else an unused pointer (not the history: the interpreter copies aliased
        # arguments back in turn)
        amax = x if used_amax is None else used_amax
    else:
        hist = x
        if amax is None:
            amax = finite_absmax(x)
    device = x.device
    # pointers of a copy not written: read-only x (the interpreter copies aliased arguments back in turn)
    row_values = row_scale = col_values = col_scale = x
    if row_fmt is not None:
        row_values = torch.empty((R, row_cols), device=device, dtype=row_dtype)
        row_scale = torch.empty((), device=device, dtype=torch.float32)
    if col_fmt is not None:
        col_values = torch.empty((C, col_cols), device=device, dtype=col_dtype)
        # one format: one scale, which both copies store (the same value)
        col_scale = row_scale if col_fmt == row_fmt else torch.empty((), device=device, dtype=torch.float32)
    rows = (row_values, row_scale) if row_fmt is not None else None
    cols = (col_values, col_scale) if col_fmt is not None else None
    rp = col_cols if cols else R
    cp = row_cols if rows else C
    if max(R, rp) and max(C, cp):
        offset, write, zero = history.advance() if delayed else (0, 0, 0)  # counted once nothing can fail
        args = (x, amax, row_values, row_scale, col_values, col_scale, R, C, rp, cp, x.stride(0), x.stride(1),
                hist, offset, write, zero)
        grid = (cdiv(max(R, rp), block_r), cdiv(max(C, cp), block_c))
        first(grid, *args)
        if delayed:  # where x's own absmax exceeds the history's (a no-op launch otherwise)
            redo((min(grid[0] * grid[1], _redo_programs(device)),), *args)
    else:  # nothing to read: the scales of an all-zero tensor (delayed: of the history, which records a zero)
        if delayed:
            amax = history.take_ref(x)
            if used_amax is not None:
                used_amax.copy_(amax)
        for out, fmt in ((rows, row_fmt), (cols, col_fmt)):
            if out is not None:
                out[0].zero_()
                out[1].copy_(absmax_scale_ref(amax, fmt).reshape(()))
    return rows, cols


def quantize_rows_and_cols(x: torch.Tensor, row_fmt, col_fmt, row_cols: int, col_cols: int):
    """Rows of 2-D contiguous ``x`` and its columns (the transposed copy), per row and per column, in two passes
    over x instead of three: the row kernel also takes each column's absmax (atomics), so the column kernel
    knows its scales and quantizes in one pass (on its own it reads x twice, and x.t()'s strided tiles do not
    stay in L2 between its passes). Returns ((values, scale) of the rows, (values, scale) of the columns), each
    as quantize_rows gives them."""
    col_max = torch.zeros(x.shape[1], device=x.device, dtype=torch.int32)  # |x| bits: 0 is +0.0
    rows = quantize_rows(x, row_fmt, "row", None, row_cols, col_max=col_max)
    return rows, quantize_rows(x.t(), col_fmt, "row", None, col_cols, row_max=col_max)


def quantize_weight_prev(w: torch.Tensor, fmt, cols: int, state: torch.Tensor, wrap=None):
    """W (N, K) per tensor into rows of ``cols`` (fp8, zero-padded), scaled by its previous-absmax state (3 int32,
    nn/weight_scale.py, which gives the rule and the reference), which the launches update: -> (values, scale,
    the absmax the scale came from). ``wrap``: torch.library.wrap_triton inside a triton_op (Inductor then
    launches the kernels from its own code, no Python per call), else None (launched here)."""
    fmt = get_format(fmt)
    R, C = w.shape
    consts, tune = _tensor_constexprs(fmt, None, PREV_SLOTS, True, interpreted(), prev=True)
    values = torch.empty((R, cols), device=w.device, dtype=container_dtype(fmt))
    scale = torch.empty((), device=w.device, dtype=torch.float32)
    used = torch.empty((), device=w.device, dtype=torch.float32)
    # the columns' pointers are never written (COL_FMT None): the rows' own
    args = (w, used, values, scale, values, scale, R, C, R, cols, w.stride(0), w.stride(1), state, 0, 1, 2)
    grid = (cdiv(R, tune["block_r"]), cdiv(max(C, cols), tune["block_c"]))
    kernel = _quant_tensor_kernel if wrap is None else wrap(_quant_tensor_kernel)
    kernel[grid](*args, DELAYED=True, REDO=False, num_warps=tune["num_warps"], **consts)
    kernel[(min(grid[0] * grid[1], _redo_programs(w.device)),)](*args, DELAYED=False, REDO=True,
                                                                 num_warps=tune["num_warps"], **consts)
    return values, scale, used
