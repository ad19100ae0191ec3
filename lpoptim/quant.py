"""Scaling, in pure torch: per tensor, per row, per group; COAT's dynamic range expansion, made safe.

Everything here is the reference the Triton kernels are tested against.

Groups run along the last dimension: a tensor of shape (..., N) is seen as R = numel / N rows, each split into
ceil(N / G) groups of G elements (the last one short). Sharding along dim 0 (FSDP2) keeps rows whole, so a
shard's groups are exactly the whole tensor's groups for those rows and a checkpoint reshards exactly.

Dynamic range expansion (COAT, arXiv 2410.19313): before quantizing a group, map x -> sign(x)·(|x|/c)^k with
c = max|x| and k >= 1, so that the group's smallest magnitude lands near the format's smallest normal; the
relative rounding error of x is then 1/k of the format's. lpoptim restricts k to {1, 2, 4, 8}: raising to k is
repeated squaring and the inverse is repeated IEEE square roots, so the reference and the kernels agree bit for
bit, it costs no transcendental functions, and log2(k) fits in the two lowest mantissa bits of the group's fp32
scale (one fp32 number per group and moment: 2.0625 bytes per parameter at G=128). COAT's faults are avoided:
k is never below 1 nor unbounded (a constant group gets k=8, not inf), the minimum is over non-zero finite
elements (a zero does not collapse k), and non-finite elements are left out of the group statistics and kept as
NaN codes, so they never poison their neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import E4M3, FloatFormat, IntFormat, get_format, round_to_grid

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
    return x.reshape(r, -1, group_size)


def from_groups(g: torch.Tensor, shape) -> torch.Tensor:
    r, n = rows_of(shape)
    return g.reshape(r, -1)[:, :n].reshape(shape)


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


def _finite_absmax(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), device=x.device, dtype=x.dtype))
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)


def absmax_scale(amax: torch.Tensor, fmt: FloatFormat | IntFormat) -> torch.Tensor:
    """Scale that maps ``amax`` to the format's largest value; 1 where amax is 0 (nothing to scale)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))


def quantize(x: torch.Tensor, fmt="e4m3", granularity: str = "tensor", group_size: int = 128,
             noise: torch.Tensor | None = None, to_dtype: bool = False) -> Quantized:
    """Absmax-scaled quantization. ``granularity``: "tensor", "row" (last dim) or "group" (along the last dim)."""
    fmt = get_format(fmt)
    x32 = x.float()
    if granularity == "tensor":
        scale = absmax_scale(_finite_absmax(x32), fmt)
        values = round_to_grid(x32 / scale, fmt, noise)
    elif granularity == "row":
        scale = absmax_scale(_finite_absmax(x32, dim=-1, keepdim=True), fmt)
        values = round_to_grid(x32 / scale, fmt, noise)
    elif granularity == "group":
        g = to_groups(x32, group_size)
        scale = absmax_scale(_finite_absmax(g, dim=-1), fmt)
        n = None if noise is None else to_groups(noise, group_size)
        values = from_groups(round_to_grid(g / scale.unsqueeze(-1), fmt, n), x.shape)
    else:
        raise ValueError(f"granularity must be 'tensor', 'row' or 'group', got {granularity!r}")
    if to_dtype and isinstance(fmt, FloatFormat) and fmt.dtype is not None:
        values = values.to(fmt.dtype)
    return Quantized(values, scale, fmt, granularity, group_size if granularity == "group" else None, tuple(x.shape))


# ---- dynamic range expansion with k in {1, 2, 4, 8}: the optimizer-state codec ------------------------------

MAX_LOG2_K = 3  # k <= 8


def _pow2k(t: torch.Tensor, log2k: torch.Tensor) -> torch.Tensor:
    """t ** (2 ** log2k) by repeated squaring (exactly what the kernel does)."""
    for i in range(MAX_LOG2_K):
        t = torch.where(log2k > i, t * t, t)
    return t


def _root2k(t: torch.Tensor, log2k: torch.Tensor) -> torch.Tensor:
    """t ** (1 / 2 ** log2k) by repeated IEEE square roots."""
    for i in range(MAX_LOG2_K):
        t = torch.where(log2k > i, torch.sqrt(t), t)
    return t


def choose_log2k(amax: torch.Tensor, amin: torch.Tensor, fmt: FloatFormat, expansion: bool = True) -> torch.Tensor:
    """Largest log2 k in 0..3 such that (amin/amax)^k · fmt.max stays at or above the smallest normal.

    amin is the smallest non-zero finite magnitude in the group (inf when there is none). Constant groups get
    k = 8; groups whose range already exceeds the format's get k = 1 (plain absmax scaling).
    """
    log2k = torch.zeros(amax.shape, dtype=torch.int32, device=amax.device)
    if not expansion:
        return log2k
    ratio = torch.where((amax > 0) & torch.isfinite(amin), amin / amax, torch.zeros_like(amax))
    t = ratio
    for i in range(1, MAX_LOG2_K + 1):
        t = t * t
        log2k = torch.where(t * fmt.max >= fmt.min_normal, torch.full_like(log2k, i), log2k)
    return log2k


def pack_scale(amax: torch.Tensor, log2k: torch.Tensor) -> torch.Tensor:
    """fp32 scale = amax with its two lowest mantissa bits replaced by log2 k (a relative change below 2^-21).

    Groups with amax = 0 store 0 (k is irrelevant there: every code is 0)."""
    bits = (amax.float().contiguous().view(torch.int32) & ~3) | log2k
    return torch.where(amax > 0, bits.view(torch.float32), torch.zeros_like(amax, dtype=torch.float32))


def unpack_scale(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scale -> (c, log2 k). c is used exactly as stored, low bits included, by encoder and decoder."""
    return scale, scale.contiguous().view(torch.int32) & 3


def group_stats(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x|, min non-zero |x|) over finite elements of each group (last dim); min is inf if none."""
    a = g.abs()
    finite = torch.isfinite(g)
    amax = torch.where(finite, a, torch.zeros_like(a)).amax(dim=-1)
    amin = torch.where(finite & (a > 0), a, torch.full_like(a, float("inf"))).amin(dim=-1)
    return amax, amin


def inv_max(fmt: FloatFormat) -> float:
    """1 / fmt.max rounded to fp32: the decoder multiplies by it (the kernel uses the same constant)."""
    return torch.tensor(1.0 / fmt.max, dtype=torch.float32).item()


def encode_groups(g: torch.Tensor, fmt: FloatFormat = E4M3, expansion: bool = True):
    """Groups (R, n, G) fp32 -> (grid values (R, n, G) fp32, scales (R, n) fp32). The padding must be 0."""
    amax, amin = group_stats(g)
    log2k = choose_log2k(amax, amin, fmt, expansion)
    scale = pack_scale(amax, log2k)
    c, log2k = unpack_scale(scale)
    c = c.unsqueeze(-1)
    inv_c = 1.0 / torch.where(c > 0, c, torch.ones_like(c))  # one division per group (the kernel does the same)
    t = (g.abs() * inv_c).clamp(max=1.0)  # |x| <= amax <= c (1 + 2^-21): the clamp is the saturation
    f = _pow2k(t, log2k.unsqueeze(-1)) * fmt.max
    q = torch.copysign(round_to_grid(f, fmt), g)
    return torch.where(torch.isfinite(g), q, torch.full_like(q, float("nan"))), scale


def decode_groups(q: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat = E4M3) -> torch.Tensor:
    """Inverse of ``encode_groups``: grid values (R, n, G) and scales (R, n) -> fp32 groups."""
    c, log2k = unpack_scale(scale)
    inv = torch.tensor(inv_max(fmt), dtype=torch.float32, device=q.device)
    t = _root2k(q.abs().float() * inv, log2k.unsqueeze(-1))
    return torch.copysign(t * c.unsqueeze(-1), q.float())


def quantize_state(x: torch.Tensor, fmt: FloatFormat | str = E4M3, group_size: int = 128, expansion: bool = True):
    """A moment tensor -> (uint8 codes of x's shape: the fp8 bit patterns, fp32 scales (R, groups per row))."""
    fmt = get_format(fmt)
    q, scale = encode_groups(to_groups(x.float(), group_size), fmt, expansion)
    codes = from_groups(q, x.shape).to(fmt.dtype).view(torch.uint8)
    return codes, scale


def dequantize_state(codes: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat | str = E4M3,
                     group_size: int = 128) -> torch.Tensor:
    fmt = get_format(fmt)
    q = to_groups(codes.view(fmt.dtype).float(), group_size)
    return from_groups(decode_groups(q, scale, fmt), codes.shape)
