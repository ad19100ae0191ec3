"""Scaling, in pure torch: per tensor, per row, per group; COAT's dynamic range expansion, made safe.

Everything here is the reference the Triton kernels are tested against.

Groups run along the last dimension: a tensor of shape (..., N) is seen as R = numel / N rows, each split into
ceil(N / G) groups of G elements (the last one short). Sharding along dim 0 (FSDP2) keeps rows whole, so a
shard's groups are exactly the whole tensor's groups for those rows and a checkpoint reshards exactly.

Dynamic range expansion (COAT, arXiv 2410.19313): before quantizing a group, map x -> sign(x)·(|x|/c)^k with
c = max|x| and k chosen so that the group's smallest non-zero magnitude lands on the format's smallest normal;
the relative rounding error of every element is then about 1/k of the format's. Unlike COAT, k may be below 1:
a group whose range is wider than the format's is compressed, so no non-zero element rounds to zero (for v = g²,
a zero beside a live m made the update m / eps). k is kept on an 8-bit float grid inside the low mantissa byte
of the group's fp32 scale, so a group costs one fp32 number per moment (2.06 bytes per parameter at G=128, COAT
spends three). COAT's faults are avoided: k is never unbounded (a constant group gets the largest k, not inf or
NaN), the minimum is over non-zero finite elements (a zero does not collapse k), and non-finite elements are left
out of the group statistics, so they never poison their neighbours: NaN is kept as a NaN code, ±inf saturates to
the group's largest code (v = g² overflowing fp32 then stays finite, where a NaN would spread into the parameter).
One limit: an element below 2^-126 of its group's absmax (a range no k spans) decodes only to within 2^-120 of
that absmax, maybe to 0; the optimizer's decoder bounds what that could do to a step (adam_bound_terms).
benchmarks/state_quant_error.py measures the choice.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .formats import (E4M3, FloatFormat, IntFormat, get_format, int4_to_nibble, nibble_to_int4, pack_nibbles,
                      round_to_grid, unpack_nibbles)

# ---- shapes ------------------------------------------------------------------------------------------------


def rows_of(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(rows, row length) of a tensor seen along its last dimension; 0-dim tensors are one row of one."""
    n = shape[-1] if len(shape) else 1
    numel = 1
    for s in shape:
        numel *= s
    return (numel // n if n else 0), n


def num_groups(shape, group_size: int) -> tuple[int, int]:
    """(rows, groups per row) for groups of ``group_size`` along the last dimension."""
    r, n = rows_of(shape)
    return r, -(-n // group_size)


def to_groups(x: torch.Tensor, group_size: int, fill: float = 0.0) -> torch.Tensor:
    """(..., N) -> (R, ceil(N/G), G), the last group padded with ``fill``."""
    r, n = rows_of(x.shape)
    x = x.reshape(r, n)
    pad = (-n) % group_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.reshape(r, (n + pad) // group_size, group_size)  # explicit: -1 is ambiguous with no rows


def from_groups(g: torch.Tensor, shape) -> torch.Tensor:
    r, n = rows_of(shape)
    return g.reshape(r, g.numel() // r if r else 0)[:, :n].reshape(shape)


# ---- plain absmax scaling ----------------------------------------------------------------------------------


@dataclass
class Quantized:
    """Codes on a format's grid (as fp32 grid values or packed/fp8 storage) with their scales."""

    values: torch.Tensor  # grid values, same shape as the original (fp32, or an fp8 dtype)
    scale: torch.Tensor  # broadcastable against values after the granularity's reshaping
    fmt: FloatFormat | IntFormat
    granularity: str  # "tensor", "row", "group"
    group_size: int | None = None
    shape: tuple[int, ...] | None = None

    def dequantize(self) -> torch.Tensor:
        v = self.values.float()
        if self.granularity == "group":
            return from_groups(to_groups(v, self.group_size) * self.scale.unsqueeze(-1), self.shape)
        return v * self.scale


def finite_absmax(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    """max |x| over finite elements (0 if none): NaN and inf never set a scale."""
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), device=x.device, dtype=x.dtype))
    if a.numel() == 0:  # nothing to reduce (no tokens): 0, as for an all-zero row; amax refuses empty dims
        return a.sum() if dim is None else a.sum(dim=dim, keepdim=keepdim)
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)


def max_bits(fmax: float) -> tuple[int, int]:
    """fmax = 1.m·2^F as (F, m's 23 mantissa bits): what pow2_block_exponent compares amax's bits with."""
    mant, exp = math.frexp(fmax)  # fmax = mant·2^exp, mant in [0.5, 1)
    return exp - 1, int((mant * 2 - 1) * 2**23)


def pow2_block_exponent(amax: torch.Tensor, fmax: float, emin: int, emax: int = 127) -> torch.Tensor:
    """The smallest e with amax / 2^e <= fmax (a block's power-of-two scale), clamped to [emin, emax] (emin for a
    block whose amax is 0), int32, from amax's fp32 bits alone: amax = 1.a·2^E needs e = E - F, plus one where
    a > m (fmax = 1.m·2^F). Integer ops only, exact (no quotient to round, which also made a block whose
    amax / fmax underflows fp32 get e = -1), the same in Triton (kernels/act_quant.py) and in what Inductor
    compiles."""
    f_exp, f_mant = max_bits(fmax)
    bits = amax.float().contiguous().view(torch.int32)  # amax >= 0: no sign bit
    e = ((bits >> 23) & 0xFF) - 127 - f_exp + ((bits & 0x7FFFFF) > f_mant).int()
    return e.clamp(emin, emax)


def absmax_scale(amax: torch.Tensor, fmt: FloatFormat | IntFormat) -> torch.Tensor:
    """Scale that maps ``amax`` to the format's largest value; 1 where amax is 0 (nothing to scale), and also
    where amax / fmt.max underflows fp32 to 0 (amax below fmt.max * 2^-149): a zero scale would turn the
    group's zeros into 0/0 = NaN, while with scale 1 its values (all below 2^-140) round to 0."""
    # divided in float64 and rounded once: the correctly rounded fp32 quotient, what the kernels' div_rn gives
    # (torch's fp32 tensor / python-scalar multiplies by the reciprocal and can be an ulp off)
    scale = (amax.double() / fmt.max).float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def tensor_or_row_scale(x32: torch.Tensor, fmt: FloatFormat | IntFormat, granularity: str,
                        amax: torch.Tensor | None = None) -> torch.Tensor:
    """The absmax scale of fp32 ``x32``: one (0-dim) per "tensor" (from ``amax`` when given), or one per row (along
    the last dim, kept as a dim of 1) per "row"."""
    if granularity == "tensor":
        return absmax_scale(finite_absmax(x32) if amax is None else amax.float().reshape(()), fmt)
    return absmax_scale(finite_absmax(x32, dim=-1, keepdim=True), fmt)


def quantize(x: torch.Tensor, fmt="e4m3", granularity: str = "tensor", group_size: int = 128,
             noise: torch.Tensor | None = None, to_dtype: bool = False) -> Quantized:
    """Absmax-scaled quantization. ``granularity``: "tensor", "row" (last dim) or "group" (along the last dim)."""
    fmt = get_format(fmt)
    x32 = x.float()
    if granularity in ("tensor", "row"):
        scale = tensor_or_row_scale(x32, fmt, granularity)
        values = round_to_grid(x32 / scale, fmt, noise)
    elif granularity == "group":
        g = to_groups(x32, group_size)
        scale = absmax_scale(finite_absmax(g, dim=-1), fmt)
        n = None if noise is None else to_groups(noise, group_size)
        values = from_groups(round_to_grid(g / scale.unsqueeze(-1), fmt, n), x.shape)
    else:
        raise ValueError(f"granularity must be 'tensor', 'row' or 'group', got {granularity!r}")
    if to_dtype and isinstance(fmt, FloatFormat) and fmt.dtype is not None:
        values = values.to(fmt.dtype)
    return Quantized(values, scale, fmt, granularity, group_size if granularity == "group" else None, tuple(x.shape))


# ---- dynamic range expansion: the optimizer-state codec -----------------------------------------------------
# k is a tiny float held in the low mantissa byte of the group's fp32 scale: k = (1 + mant/32) · 2^e with
# e in [-4, 3], code = (e + 4) << 5 | mant, so k in [1/16, 15.75] on a grid finer than 1/32 of k everywhere and
# exact in fp32 (the kernel builds the same bits). One fp32 number per group and moment (2.06 bytes per parameter at
# G=128). k < 1 *compresses* a group whose range exceeds the format's: its smallest magnitude still lands on the
# floor instead of rounding to zero. That matters for v = g², which spans twice the range of g: a v that decoded
# to zero beside a live m made the update m / eps (steps of up to 10^5 x lr on shrinking gradients).

K_BITS = 8
K_MASK = (1 << K_BITS) - 1
K_MANT_BITS = 5
K_MIN_EXP, K_MAX_EXP = -4, 3
K_ONE = (0 - K_MIN_EXP) << K_MANT_BITS  # the code of k = 1 (128): no expansion, and what expansion=False writes
# k is rounded down onto its grid after adding this slack (1/64 of a grid step, in k's fp32 bits). A group decoded
# and encoded again sits exactly on a grid boundary: its decoded amin is the floor mapped back with the grid k it
# had, so the next exact k equals that grid k, and fp32 rounding (an approximate lg2 on the GPU) would pick it or
# the one below at random, so the kernel and the reference, or two runs, would drift apart. With the slack the
# larger one is kept; amin then maps to at least floor * 2^(-14.8/2048) > 0.99 floor, which still rounds to the floor.
K_SLACK_BITS = 1 << (23 - K_MANT_BITS - 6)


def expansion_floor(fmt: FloatFormat, target: str = "normal") -> float:
    """The value a group's smallest magnitude is expanded (or compressed) to: the format's smallest normal (the
    default: every element keeps the format's full relative precision; chosen on the worst-case step ratio and the
    mean update error, benchmarks/state_quant_error.py) or its smallest subnormal (COAT's choice)."""
    if target not in ("normal", "subnormal"):
        raise ValueError(f"expansion target must be 'normal' or 'subnormal', got {target!r}")
    return fmt.min_normal if target == "normal" else fmt.min_subnormal


def choose_k_code(amax: torch.Tensor, amin: torch.Tensor, fmt: FloatFormat, expansion: bool = True,
                  target: str = "normal") -> torch.Tensor:
    """The 8-bit code of the largest grid k with (amin/amax)^k · fmt.max >= the expansion floor (up to the slack).

    COAT's k = log(fmt.max / floor) / log(amax / amin), rounded down onto the grid, within [1/16, 15.75]: a
    constant group gets the largest k (not inf or NaN), a group wider than the format gets k < 1, amin is over
    non-zero finite elements only (a zero does not collapse k), and a group without such elements gets k = 1.
    """
    one = torch.full(amax.shape, K_ONE, dtype=torch.int32, device=amax.device)
    if not expansion:
        return one
    span = math.log2(fmt.max / expansion_floor(fmt, target))
    valid = (amax > 0) & torch.isfinite(amin)
    # log2(amax) - log2(amin), not log2(amax / amin): the kernel's order (two logs, no division)
    ratio_log2 = (torch.log2(torch.where(valid, amax, torch.ones_like(amax)))
                  - torch.log2(torch.where(valid, amin, torch.ones_like(amin))))
    k = span / ratio_log2.clamp_min(1e-6)  # a constant group: ratio 1, k huge, clamped below
    bits = k.float().view(torch.int32) + K_SLACK_BITS
    e = (bits >> 23) - 127
    code = ((e - K_MIN_EXP) << K_MANT_BITS) | ((bits >> (23 - K_MANT_BITS)) & ((1 << K_MANT_BITS) - 1))
    code = torch.where(e < K_MIN_EXP, 0, torch.where(e > K_MAX_EXP, K_MASK, code))
    return torch.where(valid, code, one).to(torch.int32)


def k_of(code: torch.Tensor) -> torch.Tensor:
    """k from its code, exactly: the fp32 with exponent (code >> 5) - 4 and mantissa's top five bits code & 31."""
    code = code.to(torch.int32)
    bits = (((code >> K_MANT_BITS) + (K_MIN_EXP + 127)) << 23) | ((code & ((1 << K_MANT_BITS) - 1)) << (23 - K_MANT_BITS))
    return bits.view(torch.float32)


def legacy_k_of(code: torch.Tensor) -> torch.Tensor:
    """k of states saved by lpoptim 0.1 (keys exp_avg / exp_avg_sq as uint8 codes): k = 1 + code / 16."""
    return 1.0 + code.float() * (1.0 / 16)


FP32_MIN_NORMAL = 2.0 ** -126
# a compiled layer's weight scale from its previous absmax (nn/weight_scale.py says why these): the headroom over
# that absmax, and the state's int32 slots (previous absmax, this call's own, the second launch's ticket)
PREV_ABSMAX_HEADROOM = 17 / 16
PREV_SLOTS = 3


def pack_scale(amax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """fp32 scale = amax with its low mantissa byte replaced by k's code. Groups with amax = 0 store 0, and so
    do groups whose amax is an fp32 subnormal (below 2^-126): there the low byte is most of the value, not a
    2^-15 change, and 1/c overflows to inf (0 * inf = NaN for the group's zeros), so such a group is flushed to
    zero (an absolute error below 2^-126)."""
    bits = (amax.float().contiguous().view(torch.int32) & ~K_MASK) | code
    return torch.where(amax >= FP32_MIN_NORMAL, bits.view(torch.float32), torch.zeros_like(amax, dtype=torch.float32))


def unpack_scale(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scale -> (c, k's code). c is used exactly as stored, low bits included, by encoder and decoder."""
    return scale, scale.contiguous().view(torch.int32) & K_MASK


def expand(t: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """t ** k for t in [0, 1] (k = 1 is left exact)."""
    return torch.where(code != K_ONE, torch.exp2(torch.log2(t) * k_of(code)), t)


def fma(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """a * b + c for fp32 a, b as a GPU's fma: the product is exact in fp64; the sum is rounded to fp64, then to
    fp32, which differs from one rounding only on rare double-rounding ties."""
    return (a.double() * b.double() + c).float()


def expand_to_max(t: torch.Tensor, code: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """fmt.max * t ** k, in the kernel's order: 2^(k log2 t + log2 fmt.max), one rounding for the exponent
    (log2 t is small for the values that matter, so the exponent keeps its precision). Every code takes it, k = 1
    too: within an ulp of t * fmt.max."""
    return torch.exp2(fma(torch.log2(t), k_of(code), log2_max(fmt)))


def compress(t: torch.Tensor, code: torch.Tensor, legacy: bool = False) -> torch.Tensor:
    """t ** (1 / k), the inverse of ``expand`` (``legacy``: k by legacy_k_of, code 0 meaning k = 1)."""
    if legacy:
        return torch.where(code > 0, torch.exp2(torch.log2(t) * (1.0 / legacy_k_of(code))), t)
    return torch.where(code != K_ONE, torch.exp2(torch.log2(t) * (1.0 / k_of(code))), t)


def group_stats(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x|, min non-zero |x|) over finite elements of each group (last dim); min is inf if none."""
    a = g.abs()
    finite = torch.isfinite(g)
    amax = torch.where(finite, a, torch.zeros_like(a)).amax(dim=-1)
    amin = torch.where(finite & (a > 0), a, torch.full_like(a, float("inf"))).amin(dim=-1)
    return amax, amin


@functools.cache
def log2_max(fmt: FloatFormat) -> float:
    """log2(fmt.max) rounded to fp32: the encoder's constant (reference and kernel)."""
    return torch.tensor(math.log2(fmt.max), dtype=torch.float32).item()


@functools.cache
def inv_max(fmt: FloatFormat) -> float:
    """1 / fmt.max rounded to fp32: the decoder multiplies by it (the kernel uses the same constant)."""
    return torch.tensor(1.0 / fmt.max, dtype=torch.float32).item()


def encode_groups(g: torch.Tensor, fmt: FloatFormat = E4M3, expansion: bool = True, target: str = "normal"):
    """Groups (R, n, G) fp32 -> (grid values (R, n, G) fp32, scales (R, n) fp32). The padding must be 0."""
    amax, amin = group_stats(g)
    scale = pack_scale(amax, choose_k_code(amax, amin, fmt, expansion, target))
    c, code = unpack_scale(scale)
    c = c.unsqueeze(-1)
    inv_c = 1.0 / torch.where(c > 0, c, torch.ones_like(c))  # one reciprocal per group (the kernel's is rcp.approx)
    # |x| <= amax <= c (1 + 2^-15): the clamp is the saturation (of +-inf too); a group without a finite
    # non-zero value (scale 0) encodes everything but NaN as 0
    t = torch.where(c > 0, (g.abs() * inv_c).clamp(max=1.0), torch.zeros_like(g))
    f = expand_to_max(t, code.unsqueeze(-1), fmt) if expansion else t * fmt.max
    q = torch.copysign(round_to_grid(f, fmt), g)  # +-inf saturates to the group's largest code
    return torch.where(torch.isnan(g), torch.full_like(q, float("nan")), q), scale


def decode_groups(q: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat = E4M3, legacy: bool = False) -> torch.Tensor:
    """Inverse of ``encode_groups``: grid values (R, n, G) and scales (R, n) -> fp32 groups (``legacy``: scales
    written by lpoptim 0.1, see legacy_k_of)."""
    c, code = unpack_scale(scale)
    t = compress(q.abs().float() * inv_max(fmt), code.unsqueeze(-1), legacy)  # fp32 times an fp32-exact scalar
    return torch.copysign(t * c.unsqueeze(-1), q.float())


def quantize_state(x: torch.Tensor, fmt: FloatFormat | str = E4M3, group_size: int = 128, expansion: bool = True,
                   target: str = "normal"):
    """A moment tensor -> (uint8 codes of x's shape: the fp8 bit patterns, fp32 scales (R, groups per row))."""
    fmt = get_format(fmt)
    q, scale = encode_groups(to_groups(x.float(), group_size), fmt, expansion, target)
    codes = from_groups(q, x.shape).to(fmt.dtype).view(torch.uint8)
    return codes, scale


def dequantize_state(codes: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat | str = E4M3,
                     group_size: int = 128, legacy: bool = False) -> torch.Tensor:
    fmt = get_format(fmt)
    q = to_groups(codes.view(fmt.dtype).float(), group_size)
    return from_groups(decode_groups(q, scale, fmt, legacy), codes.shape)


# ---- Adam's own bound on the decoded moments --------------------------------------------------------------------


def adam_bound_terms(beta1: float, beta2: float) -> tuple[float, float]:
    """(r, c) with which 1 / K_n = c / sum_{j<n} r^j = c (1 - r) / (1 - r^n) (adam_bound_inv).

    After n steps of Adam from zero moments, m_n = (1-b1) sum b1^(n-i) g_i and v_n = (1-b2) sum b2^(n-i) g_i^2,
    so by Cauchy-Schwarz m_n^2 <= K_n v_n with K_n = (1-b1)^2 / (1-b2) * sum_{j<n} (b1^2/b2)^j, whatever the
    gradients: |m| / sqrt(v) <= sqrt(K_n) bounds every element's update (about 7.3 lr for betas 0.9 / 0.999). A
    decoded state that broke it (a v rounded far down beside its m) would step further than Adam ever can, so the
    decoder raises such a v to m^2 / K_n. The bound survives its own use: moments that meet it at step n meet
    it at step n + 1 (Cauchy-Schwarz on the two terms of each recursion). beta2 = 0 has no bound: c = 0."""
    if beta2 <= 0:
        return 0.0, 0.0
    r = beta1 * beta1 / beta2
    # within fp32's reach of 1 (betas (0.8, 0.64): 1 - 2^-52), the sum is n: (1 - r^n) / (1 - r) would be 0 / 0
    return (1.0 if abs(r - 1.0) < 2.0 ** -20 else r), (1 - beta2) / (1 - beta1) ** 2


@functools.cache
def adam_bound_args(beta1: float, beta2: float) -> tuple[float, float, float]:
    """(r, log2 r, numerator) with 1 / K_n = numerator / (1 - r^n), or numerator / n where r = 1: what the kernel
    and adam_bound_inv take from the host (the numerator is c (1 - r), or c)."""
    r, c = adam_bound_terms(beta1, beta2)
    return r, (math.log2(r) if r > 0 else -math.inf), (c if r == 1.0 else c * (1 - r))


def adam_bound_inv(n: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """1 / K_n (adam_bound_terms) in fp32 for a step count n (fp32 tensor), in the kernel's order (r^n as
    2^(n log2 r): one exp2, log2 r from the host); 0 where the sum is 0 (no step yet: the moments are 0) or
    infinite. A safety bound, not an update: an ulp here or there moves nothing that matters."""
    r, log2_r, numerator = adam_bound_args(beta1, beta2)
    n = n.float()  # Python floats meet an fp32 tensor as fp32 scalars, as the kernel's arguments
    inv = numerator / (n if r == 1.0 else 1.0 - torch.exp2(n * log2_r))
    return torch.where((inv > 0) & (inv < math.inf), inv, torch.zeros_like(n))


# ---- the 4-bit state codec (state_bits=4) -----------------------------------------------------------------------
# Two codes per byte along the last dim (element 2i in the low nibble, 2i + 1 in the high one; an odd row's last
# high nibble is 0), one fp32 scale per group of G along the last dim: the group's finite absmax c, as is (no k).
# Chosen on the worst step and the mean update error (benchmarks/state_quant_error.py --bits 4, docs/optimizer.md):
#   m: INT4 with zero, c·q/7 for q in -7..7, the nibble q's two's complement; nibble 8 (-8) is NaN's code
#   v: linear without zero (Li et al. 2023), c·j/16 for j in 1..16, the nibble j - 1: a non-zero v never decodes
#      to 0 beside a live m; +-inf and NaN take j = 16
# Encoding multiplies |x| by top/c (one correctly rounded division per group) and rounds to nearest even onto the
# integers, or stochastically (floor(f + u), u uniform from a hash: stochastic_round.uniform_noise). Decoding multiplies the integer
# by 1/top and then by c (m: q · fp32(1/7), exact at q = ±7, so the absmax decodes to itself; v: j · c/16).
# m and v encoded together (quantize_state4_moments, what lpoptim.AdamW does) also keep each group's ratio bound:
# v's code is raised until no element's decoded m^2 / v exceeds the largest m^2 / v the group's exact moments had
# (state4_ratio_bound, encode4_v_floor); nothing more is stored.
# 0.5 B per moment and element + 4 B per group: 1.0625 B/param at G=128.

M4_TOP = 7.0
V4_TOP = 16.0
M4_NAN = 8
M4_INV = torch.tensor(1 / 7, dtype=torch.float32).item()  # 1/7 rounded to fp32
# the ratio bound's slack: a code whose floor lands within 2^-20 (relative) above an integer is not raised past it,
# so an exactly representable bound (the group's own largest ratio, decoded exactly) does not cost a grid step
RATIO_SLACK = 1.0 - 2.0 ** -20


def packed_shape(shape) -> tuple[int, ...]:
    """The packed codes' shape of a tensor of ``shape``: the last dim halved, rounded up (a 0-dim tensor: (1,))."""
    shape = tuple(shape)
    return (*shape[:-1], (shape[-1] + 1) // 2) if shape else (1,)


def pack_codes4(nibbles: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 of shape (..., N) -> uint8 (..., ceil(N/2)): formats.pack_nibbles (element 2i in the low
    nibble, 2i+1 in the high) with an odd last dimension padded by one zero nibble (a 0-dim tensor: one byte)."""
    x = nibbles.to(torch.uint8).reshape(packed_shape(nibbles.shape)[:-1] + (nibbles.shape[-1] if nibbles.dim() else 1,))
    if x.shape[-1] % 2:
        x = torch.nn.functional.pad(x, (0, 1))
    return pack_nibbles(x)


def unpack_codes4(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of pack_codes4: uint8 (..., ceil(N/2)) -> int32 nibbles of ``shape``."""
    x = unpack_nibbles(packed).to(torch.int32)
    return x[..., :rows_of(shape)[1]].reshape(shape)


def _div_rn(a, b: torch.Tensor) -> torch.Tensor:
    """a / b as fp32, correctly rounded (in float64 first: what the kernel's div_rn gives)."""
    return (a / b.double()).float() if not isinstance(b, float) else (a.double() / b).float()


def state4_scale(amax: torch.Tensor) -> torch.Tensor:
    """A group's fp32 scale: its finite absmax, 0 where that is below fp32's smallest normal (the group is
    flushed to 0, an absolute error below 2^-126: top / c would overflow, as in pack_scale)."""
    return torch.where(amax >= FP32_MIN_NORMAL, amax.float(), torch.zeros_like(amax, dtype=torch.float32))


def _encode4(g: torch.Tensor, second: bool, noise: torch.Tensor | None = None,
             floor: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """encode4_groups, and the rounded magnitudes (m: q = round(fmin(|x| · 7/c, 7)), 0..7, 7 for NaN as the
    kernel's NaN-dropping minimum gives it; v: j, 1..16). ``floor`` (v only; encode4_v_floor): a function of v's
    16/c per group giving, per element, what j is raised to (its ceil, capped at 16)."""
    amax, _ = group_stats(g)
    scale = state4_scale(amax)
    top = V4_TOP if second else M4_TOP
    inv = torch.where(scale > 0, _div_rn(top, torch.where(scale > 0, scale, 1.0)), 0.0).unsqueeze(-1)
    f = g.abs() * inv  # +-inf: inf (clamped below); a scale-0 group: 0
    # as the kernel: the top first, NaN to the top (its minimum drops NaN: a zero times the inf that 16/c or 7/c
    # gives for a scale just above the smallest normal is NaN there), then rounded
    f = torch.fmin(f, f.new_full((), V4_TOP if second else M4_TOP))
    if second:
        q = torch.floor(f + noise) if noise is not None else torch.round(f)
        j = q.clamp(1.0, V4_TOP)
        if floor is not None:  # raised to the ratio bound's code (fmax / fmin: a NaN bound raises nothing)
            j = torch.fmin(torch.fmax(j, torch.ceil(floor(inv))), j.new_full((), V4_TOP))
        j = torch.where(torch.isnan(g), V4_TOP, j)
        return j.to(torch.int32) - 1, scale, j
    q = torch.floor(f + noise) if noise is not None else torch.round(f)
    # the sign as the kernel takes it, from the sign bit (-0.0 beside a scale whose 7/c overflowed: -7)
    nib = int4_to_nibble(torch.where(torch.signbit(g), -q, q).to(torch.int32)).to(torch.int32)
    return torch.where(torch.isnan(g), M4_NAN, nib), scale, q


def encode4_groups(g: torch.Tensor, second: bool, noise: torch.Tensor | None = None):
    """Groups (R, n, G) fp32 -> (nibbles (R, n, G) int32, scales (R, n) fp32). ``second``: v's grid (j/16,
    j = 1..16), else m's (q/7, q = -7..7). ``noise``: uniform [0, 1) of g's shape: floor(f + noise), not round(f)."""
    nib, scale, _ = _encode4(g, second, noise)
    return nib, scale


def decode4_groups(nibbles: torch.Tensor, scale: torch.Tensor, second: bool) -> torch.Tensor:
    """Inverse of encode4_groups: nibbles (R, n, G) and scales (R, n) -> fp32 groups."""
    if second:
        return (nibbles + 1).float() * (scale * (1.0 / V4_TOP)).unsqueeze(-1)
    q = nibble_to_int4(nibbles).float()
    y = (q * M4_INV) * scale.unsqueeze(-1)  # 7 · fp32(1/7) rounds to 1: the group's absmax decodes exactly
    return torch.where(nibbles == M4_NAN, float("nan"), y)


def quantize_state4(x: torch.Tensor, second: bool, group_size: int = 128, noise: torch.Tensor | None = None):
    """A moment tensor -> (uint8 packed codes (packed_shape(x.shape)), fp32 scales (R, groups per row)), on its
    own (no ratio bound: quantize_state4_moments encodes m and v with it)."""
    n = None if noise is None else to_groups(noise.float(), group_size)
    nib, scale = encode4_groups(to_groups(x.float(), group_size), second, n)
    return pack_codes4(from_groups(nib, x.shape)), scale


def dequantize_state4(codes: torch.Tensor, scale: torch.Tensor, shape, second: bool,
                      group_size: int = 128) -> torch.Tensor:
    nib = to_groups(unpack_codes4(codes, shape), group_size)
    return from_groups(decode4_groups(nib, scale, second), shape)


# ---- the group's ratio bound, at encode (state_bits=4) ---------------------------------------------------------
# Adam's bound at decode (adam_bound_inv) caps every element's m^2 / v at K_t, the most any gradient stream can
# give; a 4-bit v that rounds down a grid step beside a large m still steps up to ~2x further than exact Adam.
# So the encoder, which has a group's exact fp32 m and v, takes their largest m^2 / v (r2) and raises v's code j
# (after its stochastic rounding) to at least ceil(16 · m_q^2 / (r2 · c)), m_q the decoded m and c v's scale (capped
# at 16): no element's decoded m^2 / v then exceeds what its group exactly had, and nothing is stored for it.
# Chosen on the worst step and the mean update error (benchmarks/state_quant_error.py --bits 4, docs/optimizer.md).
def ratio_bound_elements(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """m^2 / v per element, as the kernel computes it ((m·m)·(1/v), fp32): inf where v is 0 beside a non-zero m,
    0 where m is 0 and v is not, 0 where m and v are 0 or either is NaN (a NaN is left out of its group's bound,
    as of its scale)."""
    e = (m * m) * torch.reciprocal(v)
    return torch.where(torch.isnan(e), torch.zeros_like(e), e)


def state4_ratio_bound(m: torch.Tensor, v: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """The largest m^2 / v of each group of the exact fp32 moments (ratio_bound_elements), fp32, shaped as the
    scales (R, groups per row): 0 (no live m) and inf (v = 0 beside a live m) mean no bound."""
    return to_groups(ratio_bound_elements(m.float(), v.float()), group_size).amax(dim=-1)


def encode4_v_floor(q_m: torch.Tensor, scale_m: torch.Tensor, r2: torch.Tensor):
    """The ratio bound's floor on v's code, as a function of v's 16/c (what encode4_groups computes per group):
    per element q_m^2 · u, u = ((a · 16/c) · a) · RATIO_SLACK / r2 per group, a = fp32(1/7) · m's scale
    (m_q^2 / a^2 is q_m^2 up to the decode's roundings); u = 0 where r2 is 0 (no bound). q_m (R, n, G): m's rounded magnitudes
    (_encode4); scale_m, r2: (R, n). The kernel computes the same fp32 operations in the same order."""
    a = (M4_INV * scale_m).unsqueeze(-1)
    r2 = r2.float().unsqueeze(-1)
    q2 = q_m * q_m  # exact (integers up to 49)

    def floor(inv_v):
        w = ((a * inv_v) * a) * RATIO_SLACK
        return q2 * torch.where(r2 > 0, _div_rn(w, torch.where(r2 > 0, r2, 1.0)), torch.zeros_like(w))
    return floor


def quantize_state4_moments(m: torch.Tensor, v: torch.Tensor, group_size: int = 128,
                            noise: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """m and v -> (m's codes, m's scales, v's codes, v's scales) as quantize_state4 gives them, v's codes raised
    to the groups' ratio bound of these exact moments (``noise``: v's stochastic rounding)."""
    gm, gv = to_groups(m.float(), group_size), to_groups(v.float(), group_size)
    # state4_ratio_bound of the groups already made (their zero padding gives 0 either way)
    r2 = ratio_bound_elements(gm, gv).amax(dim=-1)
    nib_m, scale_m, q_m = _encode4(gm, False)
    n = None if noise is None else to_groups(noise.float(), group_size)
    nib_v, scale_v, _ = _encode4(gv, True, n, encode4_v_floor(q_m, scale_m, r2))
    return (pack_codes4(from_groups(nib_m, m.shape)), scale_m, pack_codes4(from_groups(nib_v, v.shape)), scale_v)
