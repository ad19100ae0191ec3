"""Triton kernels that pack saved activations into FP8 E4M3 codes with their scales, and unpack them.

Groups that tile the rows (a power-of-two group size dividing the last dim: the default) take one-byte
power-of-two scales (``_quant_groups_pow2_kernel``: codec.encode_pow2 / decode_pow2's torch forms, bit for bit);
the kernels below that keep fp32 scales serve the rest (rows, the tensor, groups that do not tile). For them:

They compute exactly what ``lpoptim.quant.quantize(x, E4M3, granularity)`` followed by ``.to(fp8)`` computes,
bit for bit, in one read of the input and one write of the codes (plus the scales):

- scale = max finite |x| over the group (row, tensor) / 448, or 1 where that max is 0 (``quant.absmax_scale``);
- y = x / scale, correctly rounded (``tl.div_rn``: Triton's plain ``/`` on fp32 is an approximate division);
- y rounded onto the E4M3 grid in fp32 with ``formats.round_to_grid``'s arithmetic (spacing from the exponent
  bits, round half to even, saturate at 448), and only then cast to fp8, where the cast is exact. The Triton
  interpreter's own float->fp8 cast rounds wrongly when it carries into the next binade; this way interpreter
  and GPU agree.

Unpacking multiplies the fp32 value of the code by its fp32 scale and casts to the output dtype (round to
nearest even), as ``Quantized.dequantize().to(dtype)`` does.

Layout: the input is seen as R rows of N (its last dimension). Codes are uint8 (the fp8 bit patterns), same
shape as the input. Scales are fp32: (R, ceil(N/G)) for groups of G, (R,) for rows, (1,) for the tensor.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant import max_bits, rows_of
from .grid import absmax_scale, finite_abs, fp8_bits, fp8_value, interpreted, round_to_grid, store_as
from .launch import cdiv, launcher, next_power_of_2  # plain Python: triton's are jit functions, slow per pack



@triton.jit
def _round_e4m3(y):
    """fp32 -> fp32 on the E4M3 grid, as formats.round_to_grid(y, E4M3) (NaN stays NaN, +-inf saturates)."""
    return round_to_grid(y, False, 448.0, 3, -6, 0, 0)


@triton.jit
def _quant_groups_kernel(x_ptr, codes_ptr, scale_ptr, total_groups, N, NG,
                         G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr):
    # One program quantizes BLOCK_G groups; group id -> (row, group in row) -> columns. GP: G rounded up to 2^k.
    gid = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    row = gid // NG
    col = (gid % NG) * G
    k = tl.arange(0, GP)
    cols = col[:, None] + k[None, :]
    mask = (gid[:, None] < total_groups) & (cols < N) & (k[None, :] < G)
    offs = row[:, None].to(tl.int64) * N + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(finite_abs(x), axis=1)
    scale = absmax_scale(amax, 448.0)
    q = _round_e4m3(tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)))  # triton 3.6: no implicit broadcast here
    tl.store(codes_ptr + offs, fp8_bits(q, True), mask=mask)
    tl.store(scale_ptr + gid, scale, mask=gid < total_groups)


@triton.jit
def _quant_rows_kernel(x_ptr, codes_ptr, scale_ptr, N, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: a pass for the row's max (skipped when a tensor-wide scale is given), then a pass
    # that quantizes; the second read of a row (a few KiB) comes from cache.
    row = tl.program_id(0).to(tl.int64)
    base = row * N
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, finite_abs(x))
        scale = absmax_scale(tl.max(amax, axis=0), 448.0)
        tl.store(scale_ptr + row, scale)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
        q = _round_e4m3(tl.div_rn(x, scale))
        tl.store(codes_ptr + base + cols, fp8_bits(q, True), mask=cols < N)


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, out_ptr, numel, N, NG,
                    G: tl.constexpr, MODE: tl.constexpr, ON_GPU: tl.constexpr, BLOCK: tl.constexpr):
    # MODE 0: groups of G along rows of N (NG groups a row); 1: one scale a row; 2: one scale.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    c = tl.load(codes_ptr + offs, mask=mask, other=0)
    v = fp8_value(c, True, ON_GPU)
    if MODE == 0:
        s_idx = (offs // N) * NG + (offs % N) // G
    elif MODE == 1:
        s_idx = offs // N
    else:
        s_idx = offs * 0
    s = tl.load(scale_ptr + s_idx, mask=mask, other=1.0)
    store_as(out_ptr + offs, v * s, mask, out_ptr.dtype.element_ty, ON_GPU)  # round to nearest even everywhere


@triton.jit
def _quant_groups_pow2_kernel(x_ptr, codes_ptr, exp_ptr, total_groups, FMAX: tl.constexpr, F_EXP: tl.constexpr,
                              F_MANT: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, ON_GPU: tl.constexpr):
    """Groups of G consecutive elements (the last dim a multiple of G) -> E4M3 codes and one power-of-two scale
    per group as a biased exponent byte: codec.encode_pow2's torch form (quant.pow2_block_exponent on amax's
    bits, scale 1 where nothing is finite), bit for bit."""
    gid = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs = gid[:, None] * G + tl.arange(0, G)[None, :]
    mask = gid[:, None] < total_groups
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bits = tl.max(finite_abs(x), axis=1).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - F_EXP + ((bits & 0x7FFFFF) > F_MANT).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    e = tl.where(bits == 0, 0, e)  # nothing finite to scale (zeros, or only inf / NaN): scale 1, inf saturating at 448
    y = x * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # / 2^e, exact
    if ON_GPU:  # the cast rounds to nearest even; +-inf clamped, NaN kept
        q = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL).to(codes_ptr.dtype.element_ty)
    else:  # the interpreter's cast is wrong on carries and NaN
        q = fp8_bits(_round_e4m3(y), True).to(codes_ptr.dtype.element_ty, bitcast=True)
    tl.store(codes_ptr + offs, q, mask=mask)
    tl.store(exp_ptr + gid, (e + 127).to(tl.uint8), mask=gid < total_groups)


def _quant_pow2_launch(x: torch.Tensor, group_size: int):
    """(codes, exponents, grid, args, constexprs) of one _quant_groups_pow2_kernel launch (grid None: nothing to
    read). Shared by the graph op and the eager function, which launch it their own way."""
    r, n = rows_of(x.shape)
    if not x.is_contiguous() or n % group_size or group_size & (group_size - 1):
        raise ValueError(f"quantize_groups_pow2: contiguous input with a last dim ({n}) that a power-of-two group "
                         f"size ({group_size}) divides")
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    exps = torch.empty((r, n // group_size), dtype=torch.uint8, device=x.device)
    total = r * (n // group_size)
    consts = _quant_pow2_consts(group_size)
    return codes, exps, (cdiv(total, consts["BLOCK_G"]),) if total else None, (x, codes, exps, total), consts


@functools.cache
def _quant_pow2_consts(group_size: int) -> dict:
    f_exp, f_mant = E4M3_MAX_BITS
    return dict(FMAX=448.0, F_EXP=f_exp, F_MANT=f_mant, G=group_size, BLOCK_G=max(1, 2048 // group_size),
                ON_GPU=_ON_GPU)


@torch.library.triton_op("lpoptim::quantize_groups_pow2", mutates_args=())
def quantize_groups_pow2(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (contiguous, last dim a multiple of ``group_size``, a power of two) -> (float8_e4m3fn codes of x's shape,
    uint8 biased exponents (R, N / G)): graph_hooks.pack_in_graph's groups in one pass.

    A triton_op: inside a compiled graph Inductor launches the kernel from its own generated code (no Python
    per call) and schedules around it; it cannot fuse it. Inductor's own kernel for the same torch ops took twice
    as long on a Llama block (H100, docs/activations.md). Eager code calls quantize_groups_pow2_eager (the same
    kernel without the op's dispatch)."""
    codes, exps, grid, args, consts = _quant_pow2_launch(x, group_size)
    if grid is not None:
        torch.library.wrap_triton(_quant_groups_pow2_kernel)[grid](*args, **consts)
    return codes, exps


def quantize_groups_pow2_eager(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups_pow2 launched directly through lpoptim's cached launcher, for eager packing: the op's
    dispatch and wrap_triton cost several times the launch's host time per saved tensor."""
    codes, exps, grid, args, consts = _quant_pow2_launch(x, group_size)
    if grid is not None:
        launcher(_quant_groups_pow2_kernel)(grid, *args, **consts)
    return codes, exps


@triton.jit
def _dequant_groups_pow2_kernel(codes_ptr, exp_ptr, out_ptr, total_groups, TOP: tl.constexpr, G: tl.constexpr,
                                BLOCK_G: tl.constexpr, ON_GPU: tl.constexpr):
    """E4M3 codes (uint8 bits) times 2^(exponent byte - 127) per group of G, stored as out's dtype (round to
    nearest even): codec.decode_pow2's torch form."""
    gid = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs = gid[:, None] * G + tl.arange(0, G)[None, :]
    mask = gid[:, None] < total_groups
    v = fp8_value(tl.load(codes_ptr + offs, mask=mask, other=0), True, ON_GPU)
    e = tl.load(exp_ptr + gid, mask=gid < total_groups, other=127).to(tl.int32)
    # a power-of-two scale can round a group's largest value up past the output dtype's range: clamped to it
    y = tl.clamp(v * (e << 23).to(tl.float32, bitcast=True)[:, None], -TOP, TOP, propagate_nan=tl.PropagateNan.ALL)
    store_as(out_ptr + offs, y, mask, out_ptr.dtype.element_ty, ON_GPU)


def _dequant_pow2_launch(codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype):
    """(output, grid, args, constexprs) of one _dequant_groups_pow2_kernel launch (grid None: nothing to read)."""
    r, n = rows_of(codes.shape)
    ng = exps.shape[-1] if exps.dim() else 1
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    total = r * ng
    consts = _dequant_pow2_consts(n // ng if ng else 1, dtype)
    return out, (cdiv(total, consts["BLOCK_G"]),) if total else None, (codes.view(torch.uint8), exps, out, total), \
        consts


@functools.cache
def _dequant_pow2_consts(g: int, dtype: torch.dtype) -> dict:
    return dict(TOP=torch.finfo(dtype).max, G=g, BLOCK_G=max(1, 2048 // g), ON_GPU=_ON_GPU)


@torch.library.triton_op("lpoptim::dequantize_groups_pow2", mutates_args=())
def dequantize_groups_pow2(codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_groups_pow2's inverse: codes (R, N) float8_e4m3fn, exps (R, N / G) uint8 -> (R, N) ``dtype``. One pass
    of our own in a compiled backward: fused into Inductor's reductions there, the per-element exponent loads (1-byte
    gathers with index arithmetic) made them 2.4x slower than reading the bf16 original (a Llama block, H100)."""
    out, grid, args, consts = _dequant_pow2_launch(codes, exps, dtype)
    if grid is not None:
        torch.library.wrap_triton(_dequant_groups_pow2_kernel)[grid](*args, **consts)
    return out


def dequantize_groups_pow2_eager(codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_groups_pow2 launched directly (eager unpacking), as quantize_groups_pow2_eager."""
    out, grid, args, consts = _dequant_pow2_launch(codes, exps, dtype)
    if grid is not None:
        launcher(_dequant_groups_pow2_kernel)(grid, *args, **consts)
    return out


# The wrappers below run on every pack and unpack of a saved activation, on the host thread that launches the
# GPU's kernels: they build nothing per call that can be built once (the launch parameters depend on the group size
# and the granularity only).
_MODES = {"group": 0, "row": 1, "tensor": 2}
E4M3_MAX_BITS = max_bits(448.0)  # (8, 0x600000): 448 = 1.75 * 2^8
_ON_GPU = not interpreted()  # read once: the wrappers run per saved tensor


@functools.cache
def _group_blocks(group_size: int) -> tuple[int, int]:
    """(GP: group_size rounded up to a power of 2, BLOCK_G: groups per program, ~1024 elements)."""
    gp = next_power_of_2(group_size)
    return gp, max(1, 1024 // gp)


def quantize_groups(x: torch.Tensor, group_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x (contiguous, fp32/bf16/fp16) -> (uint8 codes of x's shape, fp32 scales (R, ceil(N/G)))."""
    assert x.is_contiguous()
    r, n = rows_of(x.shape)
    ng = cdiv(n, group_size)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((r, ng), dtype=torch.float32, device=x.device)
    total = r * ng
    if total:
        gp, block_g = _group_blocks(group_size)
        launcher(_quant_groups_kernel)((cdiv(total, block_g),), x, codes, scales, total, n, ng,
                                       G=group_size, GP=gp, BLOCK_G=block_g)
    return codes, scales


def quantize_rows(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (contiguous) -> (uint8 codes, fp32 scales (R,)); with ``scale`` (one fp32 element) use it for all rows."""
    assert x.is_contiguous()
    r, n = rows_of(x.shape)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = scale.reshape(1).float() if scale is not None else torch.empty(r, dtype=torch.float32, device=x.device)
    if r and n:
        block = min(next_power_of_2(n), 2048)
        launcher(_quant_rows_kernel)((r,), x, codes, scales, n, HAS_SCALE=scale is not None, BLOCK=block)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, granularity: str, group_size: int = 16,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 codes + fp32 scales -> a tensor of ``dtype`` and the codes' shape."""
    assert codes.is_contiguous() and scales.is_contiguous()
    _, n = rows_of(codes.shape)
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    numel = codes.numel()
    if numel:
        block = 1024
        launcher(_dequant_kernel)((cdiv(numel, block),), codes, scales, out, numel, n, cdiv(n, group_size),
                                  G=group_size, MODE=_MODES[granularity], ON_GPU=_ON_GPU, BLOCK=block)
    return out
