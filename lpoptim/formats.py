"""Number formats: E4M3, E5M2, E2M1 (FP4) and INT4, in pure torch.

This file is the reference for how lpoptim rounds. The Triton kernels round the same way, in fp32, before they
cast (the Triton interpreter's own float->fp8 cast is wrong when rounding carries into the next binade), so on
the same fp32 input they agree with it bit for bit (on the GPU the AdamW kernel lets the hardware's
round-to-nearest-even cast do it, which is the same rounding).

Rounding onto a float grid with ``m`` mantissa bits: the spacing of the grid around ``|x|`` is
``2**(max(e, e_min) - m)``, where ``e`` is ``|x|``'s binary exponent and ``e_min`` the exponent of the smallest
normal. Divide by that spacing (exact: a power of two), round to an integer, multiply back (exact), clamp at the
format's largest value. Rounding to nearest-even and stochastic rounding differ only in the integer rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A small floating-point format without infinities (values beyond ``max`` saturate)."""

    name: str
    exp_bits: int
    man_bits: int
    max: float
    min_normal_exp: int  # binary exponent of the smallest normal number
    dtype: torch.dtype | None  # the torch dtype holding exactly these values, when there is one

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.min_normal_exp

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_normal_exp - self.man_bits)

    def grid(self) -> torch.Tensor:
        """Every non-negative value of the format, ascending (float64; for tests and docs)."""
        step = 2.0 ** (self.min_normal_exp - self.man_bits)
        values = [i * step for i in range(1 << self.man_bits)]  # zero and the subnormals
        e = self.min_normal_exp
        while 2.0 ** e <= self.max:
            values += [v for i in range(1 << self.man_bits) if (v := 2.0 ** e * (1 + i / (1 << self.man_bits))) <= self.max]
            e += 1
        return torch.tensor(values, dtype=torch.float64)


@dataclass(frozen=True)
class IntFormat:
    """Signed integers ``qmin..qmax`` (INT4: -8..7; a symmetric variant uses -7..7)."""

    name: str
    qmin: int
    qmax: int

    @property
    def max(self) -> float:
        return float(self.qmax)


E4M3 = FloatFormat("e4m3", 4, 3, 448.0, -6, torch.float8_e4m3fn)
E5M2 = FloatFormat("e5m2", 5, 2, 57344.0, -14, torch.float8_e5m2)
E2M1 = FloatFormat("e2m1", 2, 1, 6.0, 0, None)
INT4 = IntFormat("int4", -8, 7)
INT4_SYM = IntFormat("int4_sym", -7, 7)

FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1, INT4, INT4_SYM)}


def get_format(name: str | FloatFormat | IntFormat) -> FloatFormat | IntFormat:
    if isinstance(name, (FloatFormat, IntFormat)):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown number format {name!r}; choose one of {sorted(FORMATS)}") from None


def container_dtype(fmt) -> torch.dtype:
    """The fp8 dtype that holds ``fmt``'s values exactly (E5M2 for E5M2; E4M3 for E4M3, E2M1 and INT4)."""
    fmt = get_format(fmt)
    if fmt is E5M2:
        return torch.float8_e5m2
    if isinstance(fmt, IntFormat) and max(fmt.qmax, -fmt.qmin) > 16:
        raise ValueError(f"{fmt.name} values are not exact in float8_e4m3fn")
    return torch.float8_e4m3fn


def round_half_even(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties to even (torch.round does exactly this)."""
    return torch.round(y)


def floor_plus_noise(y: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``floor(y + noise)`` without rounding the sum: in fp32 ``y + noise`` can round up to the next integer
    (8 + (1 - 2^-24) is 9.0), which moved values already on the grid off it (and biased every other value by
    up to 2^-21 of a grid step). ``y - floor(y)`` is exact, and so is ``1 - frac`` for ``|y| >= 1``."""
    r = torch.floor(y)
    return torch.where(noise >= 1.0 - (y - r), r + 1.0, r)  # inf - inf = NaN compares false: inf stays inf


def _grid_spacing(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Spacing of ``fmt``'s grid at magnitude ``a`` (a power of two), from fp32 exponent bits."""
    bits = a.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127  # fp32 subnormals give -127 and are clamped below
    exponent = exponent.clamp(min=fmt.min_normal_exp) - fmt.man_bits
    return ((exponent + 127) << 23).view(torch.float32)


def round_to_grid(x: torch.Tensor, fmt: FloatFormat | IntFormat | str, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round ``x`` onto ``fmt``'s grid in fp32, saturating at ±max. NaN stays NaN; ±inf saturates.

    ``noise``: uniform samples in [0, 1) of ``x``'s shape for stochastic rounding (``floor(y + u)``, computed
    exactly: unbiased, and values on the grid stay put);
    ``None`` rounds to nearest, ties to even.
    """
    fmt = get_format(fmt)
    x = x.float()
    if isinstance(fmt, IntFormat):
        r = round_half_even(x) if noise is None else floor_plus_noise(x, noise)
        return r.clamp(fmt.qmin, fmt.qmax)
    a = x.abs().clamp(max=fmt.max * 2)  # keeps inf out of the arithmetic; saturated below
    spacing = _grid_spacing(a.contiguous(), fmt)
    y = a / spacing  # exact: spacing is a power of two
    r = round_half_even(y) if noise is None else floor_plus_noise(y, noise)
    q = (r * spacing).clamp(max=fmt.max)
    q = torch.copysign(q, x)
    return torch.where(torch.isnan(x), x, q)


def stochastic_noise(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.rand(x.shape, device=x.device, dtype=torch.float32, generator=generator)


def to_fp8(x: torch.Tensor, fmt: FloatFormat | str = E4M3, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round onto the grid in fp32, then cast (exact) to the fp8 dtype."""
    fmt = get_format(fmt)
    if not isinstance(fmt, FloatFormat) or fmt.dtype is None:
        raise ValueError(f"{fmt.name} has no torch fp8 dtype; use round_to_grid")
    return round_to_grid(x, fmt, noise).to(fmt.dtype)


# ---- 4-bit codes and packing ------------------------------------------------------------------------------
# E2M1 nibble: sign bit, then the index into 0, .5, 1, 1.5, 2, 3, 4, 6 (which is the E2M1 bit pattern itself).
# INT4 nibble: two's complement. Two nibbles to a byte, the first element in the low nibble (as torch's
# float4_e2m1fn_x2 holds them).

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_to_nibble(q: torch.Tensor, check: bool = True) -> torch.Tensor:
    """E2M1-valued fp32 (already on the grid) -> uint8 nibbles 0..15. ``check`` verifies that (a host sync on
    the GPU: callers that just rounded with round_to_grid pass False)."""
    a = q.abs().float()
    values = E2M1_VALUES.to(a.device)
    idx = torch.searchsorted(values, a.contiguous())
    if check and not torch.equal(values[idx.clamp(max=7)], a):
        raise ValueError("e2m1_to_nibble expects values on the E2M1 grid (use round_to_grid first)")
    sign = torch.signbit(q).to(torch.uint8)
    return (sign << 3) | idx.to(torch.uint8)


def nibble_to_e2m1(n: torch.Tensor) -> torch.Tensor:
    values = E2M1_VALUES.to(n.device)[(n & 7).long()]
    return torch.where((n & 8) != 0, -values, values)


def int4_to_nibble(q: torch.Tensor) -> torch.Tensor:
    return (q.to(torch.int16) & 0xF).to(torch.uint8)


def nibble_to_int4(n: torch.Tensor) -> torch.Tensor:
    v = n.to(torch.int16)
    return torch.where(v >= 8, v - 16, v).to(torch.int8)


def pack_nibbles(n: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles (..., 2K) -> bytes (..., K); the last dimension must be even."""
    if n.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got {tuple(n.shape)}")
    n = n.to(torch.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    lo, hi = b & 0xF, b >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_4bit(q: torch.Tensor, fmt: FloatFormat | IntFormat | str, check: bool = True) -> torch.Tensor:
    """Grid values of E2M1 or INT4 -> packed bytes (two per byte); ``check`` as in e2m1_to_nibble."""
    fmt = get_format(fmt)
    nib = int4_to_nibble(q) if isinstance(fmt, IntFormat) else e2m1_to_nibble(q, check)
    return pack_nibbles(nib)


def unpack_4bit(b: torch.Tensor, fmt: FloatFormat | IntFormat | str) -> torch.Tensor:
    """Packed bytes -> fp32 grid values."""
    fmt = get_format(fmt)
    nib = unpack_nibbles(b)
    return nibble_to_int4(nib).float() if isinstance(fmt, IntFormat) else nibble_to_e2m1(nib)
