"""Triton building blocks that round onto a small float grid exactly as formats.round_to_grid does.

Rounding happens in fp32 (spacing from the exponent bits, a round-to-nearest-even by the 1.5·2^23 trick, which
is exact for |y| < 2^22 and needs no libdevice, so the interpreter runs it too); the cast to fp8 afterwards is
exact. The interpreter's own float->fp8 cast is wrong on carries and on NaN, which is why it is never asked to
round and NaN codes are written as integers.
"""
import functools

import triton
import triton.language as tl

from ..device import has_fp8_conversions
from ..formats import E4M3, E5M2

# the fp8 formats' fields, for the integer conversions (fp8_cast_bits, fp8_value without HW_FP8): mantissa bits and
# their mask, where they sit in an fp32 (23 - bits), the exponent's mask and bias (1 - the smallest normal exponent),
# the largest value, the smallest subnormal and its inverse (powers of two)
def _fp8_fields(fmt):
    return (tl.constexpr(fmt.man_bits), tl.constexpr((1 << fmt.man_bits) - 1), tl.constexpr(23 - fmt.man_bits),
            tl.constexpr((1 << fmt.exp_bits) - 1), tl.constexpr(1 - fmt.min_normal_exp), tl.constexpr(fmt.max),
            tl.constexpr(fmt.min_subnormal), tl.constexpr(1 / fmt.min_subnormal))


E4M3_MAN, E4M3_MAN_MASK, E4M3_SHIFT, E4M3_EXP_MASK, E4M3_BIAS, E4M3_MAX, E4M3_SUB, E4M3_SUB_INV = _fp8_fields(E4M3)
E5M2_MAN, E5M2_MAN_MASK, E5M2_SHIFT, E5M2_EXP_MASK, E5M2_BIAS, E5M2_MAX, E5M2_SUB, E5M2_SUB_INV = _fp8_fields(E5M2)

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 to an integer, ties to even


@triton.jit
def round_half_even(y):
    return (y + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def grid_magnitude(a, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr):
    """|x| (finite, >= 0) -> the nearest grid value, ties to even, saturating at FMAX."""
    a = tl.minimum(a, FMAX * 2.0)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXP) - MAN_BITS
    spacing = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inv_spacing = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    r = round_half_even(a * inv_spacing)  # scaling by powers of two: exact
    return tl.minimum(r * spacing, FMAX)


@triton.jit
def absmax_scale(amax, FMAX: tl.constexpr):
    """quant.absmax_scale: amax / FMAX correctly rounded, or 1 where that is 0 (amax zero or too small to scale)."""
    scale = tl.div_rn(amax, FMAX + tl.zeros_like(amax))
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def div_rn_by(t, s):
    """t / s correctly rounded, as tl.math.div_rn(t, s) gives it, for a tile ``t`` and a scale ``s`` broadcast over it
    (one, or a column of row scales): one division per scale, then per element a multiply and two corrections
    q += (t - q·s)·(1/s), each residual exact by FMA. After the first q is within an ulp of t / s; from there one
    correction rounds correctly (Markstein's theorem, 1/s correctly rounded). A quantizer that divided every element
    was bound by the division's instructions, not by memory (16384 x 4096 bf16, both copies: 104 against 99 us,
    and any further work per element, such as taking the absmax, added 45 us more: docs/linear.md).
    A residual is exact (which the theorem needs) where |t| >= 2^-103; below, t / s is under 2^-43 — far below any
    format's smallest code, and kept with its sign — unless s is tiny: scales below 2^-60 are scaled up with t by
    2^64 first (exact), which keeps both t and 1/s in range. A residual that is 0 (t = ±0: keeps zero's sign) or
    NaN (t = ±inf, NaN) leaves q as it was."""
    k = tl.where(s < 8.673617379884035e-19, 18446744073709551616.0, 1.0)  # 2^-60, 2^64
    s = s * k
    r = tl.broadcast_to(tl.math.div_rn(1.0 + tl.zeros_like(s), s), t.shape)
    s = tl.broadcast_to(s, t.shape)
    t = t * tl.broadcast_to(k, t.shape)
    q = t * r
    for _ in tl.static_range(2):
        e = tl.fma(-q, s, t)
        q = tl.where((e != 0) & (e == e), tl.fma(e, r, q), q)
    return q


@triton.jit
def round_to_grid(y, IS_INT: tl.constexpr, FMAX: tl.constexpr, MAN: tl.constexpr, EMIN: tl.constexpr,
                  QMIN: tl.constexpr, QMAX: tl.constexpr):
    """formats.round_to_grid in fp32: integers QMIN..QMAX, or a float grid (MAN mantissa bits, smallest normal
    exponent EMIN, largest value FMAX). NaN stays NaN (the GPU's min/max would drop it); -0.0 keeps its sign."""
    if IS_INT:
        q = tl.minimum(tl.maximum(round_half_even(y), QMIN), QMAX)
    else:
        q = with_sign_of(grid_magnitude(tl.abs(y), MAN, EMIN, FMAX), y)
    return tl.where(y != y, y, q)


@functools.cache
def interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET set to anything but 0). Read once, as Triton
    itself decides at import: the kernel wrappers ask on every launch."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def hardware_fp8(device) -> bool:
    """Whether Triton compiles FP8 conversions (E4M3) for kernels on ``device`` (lpoptim/device.py): GPUs of
    compute capability 8.9 or more, and the interpreter. Elsewhere (A100, A10, RTX 30xx) the optimizer's kernel
    converts by integer arithmetic instead (HW_FP8=False)."""
    return interpreted() or has_fp8_conversions(device)


@triton.jit
def with_sign_of(mag, x):
    """copysign(mag, x) on the bits (-0.0 keeps its sign, as torch.copysign does)."""
    bits = mag.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_int_fields(IS_E4M3: tl.constexpr):
    """E4M3's or E5M2's fields for the integer conversions, in _fp8_fields' order (one place for both)."""
    if IS_E4M3:
        return E4M3_MAN, E4M3_MAN_MASK, E4M3_SHIFT, E4M3_EXP_MASK, E4M3_BIAS, E4M3_MAX, E4M3_SUB, E4M3_SUB_INV
    else:
        return E5M2_MAN, E5M2_MAN_MASK, E5M2_SHIFT, E5M2_EXP_MASK, E5M2_BIAS, E5M2_MAX, E5M2_SUB, E5M2_SUB_INV


@triton.jit
def fp8_cast_bits(q, IS_E4M3: tl.constexpr, HW_FP8: tl.constexpr = True):
    """fp32 -> uint8 fp8 bit patterns. HW_FP8: by the hardware cast (exact for grid values; on the GPU it also
    rounds to nearest even and saturates, and NaN stays NaN). Else (GPUs without FP8 conversions, hardware_fp8)
    by integer arithmetic, for grid values only (the caller rounds first): magnitudes above the format's largest
    value saturate to it, NaN is the caller's (fp8_bits)."""
    if HW_FP8:
        if IS_E4M3:
            return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return q.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        MAN, MAN_MASK, SHIFT, _EXP_MASK, BIAS, FMAX, _SUB, SUB_INV = _fp8_int_fields(IS_E4M3)
        bits = q.to(tl.int32, bitcast=True)
        a = tl.minimum(tl.abs(q), FMAX)
        mag = a.to(tl.int32, bitcast=True)
        e = ((mag >> 23) & 0xFF) - 127 + BIAS  # the biased fp8 exponent; <= 0 below the smallest normal
        normal = (e << MAN) | ((mag >> SHIFT) & MAN_MASK)
        subnormal = (a * SUB_INV).to(tl.int32)  # exact: below the smallest normal, grid values are multiples of SUB
        return (tl.where(e > 0, normal, subnormal) | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def fp8_bits(q, IS_E4M3: tl.constexpr, HW_FP8: tl.constexpr = True):
    """fp32 grid values (or NaN) -> uint8 fp8 bit patterns; NaN becomes 0x7F / 0xFF (E4M3) or 0x7E / 0xFE (E5M2)
    by its sign, as torch writes it, on every backend (the interpreter's cast gets NaN wrong)."""
    nan_code: tl.constexpr = 0x7F if IS_E4M3 else 0x7E
    nan_bits = tl.where((q.to(tl.int32, bitcast=True) >> 31) != 0, nan_code | 0x80, nan_code)
    return tl.where(q != q, nan_bits, fp8_cast_bits(q, IS_E4M3, HW_FP8)).to(tl.uint8)


@triton.jit
def finite_abs(x):
    """|x|, with NaN and inf as 0: what an absmax scale is taken over (quant.finite_absmax)."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # NaN and inf compare false


@triton.jit
def fp8_value(b, IS_E4M3: tl.constexpr, ON_GPU: tl.constexpr, HW_FP8: tl.constexpr = True):
    """uint8 fp8 bit patterns -> fp32. The interpreter decodes NaN codes as numbers (E4M3 0x7F as 480), so
    there they are decoded by hand; the GPU's cast gets them right. Without HW_FP8 (GPUs without FP8
    conversions, hardware_fp8) the bits are decoded by integer arithmetic."""
    if not HW_FP8:
        MAN, MAN_MASK, SHIFT, EXP_MASK, BIAS, _FMAX, SUB, _SUB_INV = _fp8_int_fields(IS_E4M3)
        i = b.to(tl.int32) & 0xFF
        e = (i >> MAN) & EXP_MASK
        m = i & MAN_MASK
        normal = (((e + 127 - BIAS) << 23) | (m << SHIFT)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * SUB, normal)
        v = (v.to(tl.int32, bitcast=True) | ((i & 0x80) << 24)).to(tl.float32, bitcast=True)
        if IS_E4M3:
            v = tl.where((i & 0x7F) == 0x7F, float("nan"), v)
        else:  # exponent all ones: inf (mantissa 0) or NaN
            v = tl.where(e == EXP_MASK, tl.where(m == 0, with_sign_of(float("inf") + tl.zeros_like(v), v), float("nan")), v)
    elif IS_E4M3:
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if not ON_GPU:
            v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    else:
        v = b.to(tl.float8e5, bitcast=True).to(tl.float32)
        if not ON_GPU:
            v = tl.where((b & 0x7F) > 0x7C, float("nan"), v)
    return v


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, on the bits (the interpreter's own cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_as(ptr, x, mask, DTYPE: tl.constexpr, ON_GPU: tl.constexpr):
    """Store fp32 ``x`` as DTYPE with round-to-nearest-even on every backend (the GPU's cvt.rn does it in one
    instruction for two values; the interpreter's cast truncates, so there it is done on the bits)."""
    if DTYPE == tl.bfloat16 and not ON_GPU:
        tl.store(ptr, to_bf16_rne(x), mask=mask)
    else:
        tl.store(ptr, x.to(DTYPE), mask=mask)


@triton.jit
def fast_log2(x, ON_GPU: tl.constexpr):
    """log2 by the GPU's one-instruction approximation (tl.log2 calls a longer accurate routine)."""
    if ON_GPU:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def fast_exp2(x, ON_GPU: tl.constexpr):
    if ON_GPU:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def fast_rcp(x, ON_GPU: tl.constexpr):
    """1 / x by the GPU's one-instruction approximation (Triton's '/' is the slower IEEE division)."""
    if ON_GPU:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / x


TWO_23 = tl.constexpr(8388608.0)  # 2**23: at and above it, fp32 values are the integers


@triton.jit
def integer_at_2_23(z, UP: tl.constexpr, ON_GPU: tl.constexpr):
    """2**23 + floor(z), or + ceil(z) where UP, for 0 <= z < 2**23: an fp32 whose low bits are that integer (NaN
    stays NaN; with UP, a larger z gives a value at least 2**23 + z, inf stays). On the GPU one add rounded toward
    zero (or +inf) onto the integers at 2**23, a full-rate add where floor and ceil are conversions (FRND) at a
    quarter of its rate."""
    if ON_GPU:
        if UP:
            return tl.inline_asm_elementwise("add.rp.f32 $0, $1, 0f4B000000;", "=f,f", [z], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("add.rz.f32 $0, $1, 0f4B000000;", "=f,f", [z], dtype=tl.float32,
                                             is_pure=True, pack=1)
    elif UP:
        return tl.ceil(z) + TWO_23
    else:
        return tl.floor(z) + TWO_23


@triton.jit
def hash32(x):
    """lowbias32 on uint32 (optim/stochastic_round.hash32): products wrap mod 2^32, shifts are logical."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def round_bf16_stochastic(x, index, key):
    """fp32 -> fp32 on the bf16 grid, rounded at random (stochastic_round.round_bf16_stochastic): element
    ``index`` (int) adds hash32(index ^ key) & 0xFFFF to its bits and drops the low 16. Non-finite values are
    returned unchanged (the bf16 store rounds them to nearest)."""
    return round_bf16_with_bits(x, hash32(index.to(tl.uint32) ^ key))


@triton.jit
def round_bf16_with_bits(x, bits):
    """round_bf16_stochastic with the element's hash ``bits`` (uint32) given: their low 16 are the noise."""
    rounded = ((x.to(tl.uint32, bitcast=True) + (bits & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < float("inf"), rounded, x)
