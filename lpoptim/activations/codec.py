"""Packing one saved tensor into FP8 codes plus scales, and unpacking it.

Groups of E4M3 that tile the rows (a power-of-two size dividing the last dim: the default 16 on a transformer's
widths) take power-of-two scales held as one byte each (encode_pow2 / decode_pow2, which the compiled graphs'
packing uses too). Other cases keep fp32 scales with ``lpoptim.quant.quantize``'s numbers (absmax scaling, round to
nearest even onto the E4M3 grid). On the CPU the torch references run; on CUDA fused Triton kernels in
``lpoptim/kernels/act_quant.py`` compute the same bits in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats import E4M3, FloatFormat
from ..nn.operands import round_for_cast
from ..quant import Quantized, absmax_scale, finite_absmax, pow2_block_exponent, quantize, rows_of, to_groups

COMPRESSIBLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ComputedOnce:
    """What a saved slot holds when it is not the tensor itself: ``unpack`` computes the value (``compute``) once
    per backward and hands it to the next ``uses - 1`` readers, then lets go of it. Subclasses hold ``uses``,
    ``_memo`` and ``_left``."""

    __slots__ = ()

    def compute(self) -> torch.Tensor:
        raise NotImplementedError

    def unpack(self) -> torch.Tensor:
        memo = self._memo
        if memo is not None:
            self._left -= 1
            if self._left <= 0:
                self._memo = None
            return memo
        out = self.compute()
        if self.uses > 1:
            self._memo, self._left = out, self.uses - 1
        return out


@dataclass
class PackedActivation(ComputedOnce):
    """A saved tensor held as FP8 codes (``codes``: the fp8 dtype, same shape) and its scales."""

    codes: torch.Tensor
    # fp32 scales: tensor (1,), row (R,), group (R, ceil(N / group_size)); or, for groups that pow2_groups accepts,
    # uint8 biased exponents of power-of-two scales (R, N / group_size)
    scale: torch.Tensor
    granularity: str
    group_size: int
    dtype: torch.dtype  # the original dtype, restored on unpack
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # the original strides, restored on unpack when they were not contiguous
    fmt: FloatFormat = E4M3
    contiguous: bool = True  # the original was contiguous (its strides may still differ on size-1 dims)
    # packed in memory order (storage_rows): codes and scales follow the original's storage, not its index order,
    # and decoding restores its strides on a buffer of the same layout, with no copy either way
    storage_order: bool = False
    # How many saved slots and replays (derive.py) read this copy, counted by hooks.py: one tensor is often
    # saved by several ops (x by q, k and v's projections; a norm's input by pow and mul) and read again by the
    # replays that use it. Unpacking decodes once and hands the result to the next ``uses - 1`` readers, then
    # lets go of it: one kernel launch instead of one per reader. The value is held from its first reader to its
    # last (a few nodes of one block's backward, where autograd alone would have held it since forward), and
    # shared: readers must not write to it, which autograd's formulas do not.
    uses: int = field(default=0, init=False, repr=False, compare=False)
    _memo: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _left: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()

    def compute(self) -> torch.Tensor:
        return self.decode()

    def decode(self) -> torch.Tensor:
        """The tensor's value (dequantized, in its dtype and strides), computed afresh."""
        if self.scale.dtype == torch.uint8:  # power-of-two scales as exponent bytes (pow2_groups)
            out = decode_pow2(self.codes, self.scale, self.dtype, kernel=_use_triton(self.codes, self.fmt))
        elif _use_triton(self.codes, self.fmt):
            out = _kernels().dequantize(self.codes.view(torch.uint8), self.scale, self.granularity,
                                       self.group_size, self.dtype)
        else:
            out = _as_quantized(self).dequantize().to(self.dtype)
        if out.stride() != self.stride:
            # Some backward formulas (attention kernels, views) expect the layout they saved. Packed in memory
            # order, or contiguous with strides that differ only on size-1 dims, the original is the memory of a
            # contiguous buffer: a view of one, not a copy. (The reference's groups decode to a view of a padded
            # buffer when the last dim is not a multiple of the group: made contiguous first.)
            if self.storage_order or self.contiguous:
                return out.contiguous().as_strided(self.shape, self.stride)
            out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=out.device).copy_(out)
        return out


_DECODE_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _decode(codes: torch.Tensor) -> torch.Tensor:
    """fp8 codes -> their fp32 values through a 256-entry table: the same values as ``codes.float()``, which is
    slow on the CPU."""
    key = (codes.dtype, codes.device)
    table = _DECODE_TABLES.get(key)
    if table is None:
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(codes.dtype).float().to(codes.device)
        _DECODE_TABLES[key] = table
    return table[codes.view(torch.uint8).long()]


def _as_quantized(p: PackedActivation) -> Quantized:
    shape = tuple(p.codes.shape) if p.storage_order else tuple(p.shape)  # storage order: the 2-D rows packed
    scale = p.scale.reshape(()) if p.granularity == "tensor" else p.scale
    if p.granularity == "row":
        scale = scale.reshape(*shape[:-1], 1)
    return Quantized(_decode(p.codes), scale, p.fmt, p.granularity, p.group_size if p.granularity == "group" else None,
                     shape)


def storage_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s rows (vectors along its last dimension) in memory order, as a contiguous 2-D view of its storage,
    when ``t`` is not contiguous but is a permutation of a contiguous tensor that keeps the last dimension
    innermost (attention's q, k and v after ``transpose(1, 2)``): packing that view needs no copy, and the same
    layout rebuilt with ``as_strided`` is ``t``'s. None otherwise (overlapping, gapped, or last dim not innermost).
    """
    n = t.shape[-1] if t.dim() else 0
    if t.dim() < 2 or n < 2 or t.stride(-1) != 1 or t.numel() == 0:
        return None
    expected = 1  # dense and non-overlapping: sorted by stride, each stride is the product of the sizes inside it
    for st, sz in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if st != expected:
            return None
        expected *= sz
    return t.as_strided((t.numel() // n, n), (n, 1))


_ACT_QUANT = None


def _kernels():
    """lpoptim.kernels.act_quant, imported on first use (it imports Triton) and then kept: a ``from ..kernels
    import`` statement costs ~1 us of import machinery on every pack and unpack."""
    global _ACT_QUANT
    if _ACT_QUANT is None:
        from ..kernels import act_quant

        _ACT_QUANT = act_quant
    return _ACT_QUANT


def _use_triton(t: torch.Tensor, fmt: FloatFormat) -> bool:
    """The Triton kernels handle E4M3 on CUDA (by dtype, not identity: a copied policy has an equal format)."""
    return t.is_cuda and fmt.dtype is torch.float8_e4m3fn


# ---- power-of-two scales held as one byte (the biased exponent, as E8M0) -----------------------------------------

def pow2_groups(n: int, group_size: int, fmt: FloatFormat) -> bool:
    """Whether groups of ``group_size`` along a last dim of ``n`` take power-of-two scales of one byte: E4M3, a
    power-of-two group that tiles the row exactly. For groups of 16 an fp32 scale costs a quarter of the codes' bytes,
    a byte a sixteenth; a power of two leaves E4M3's relative precision as it is (only where its subnormals begin
    moves, by less than a binade), and dividing by it is exact, so the kernels multiply instead of dividing."""
    return fmt.dtype is torch.float8_e4m3fn and n % group_size == 0 and not group_size & (group_size - 1)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) in fp32 for int32 ``biased`` in 1..254: the value with that exponent field."""
    return (biased << 23).view(torch.float32)


def encode_pow2(t: torch.Tensor, group: int | None, fmt: FloatFormat = E4M3, kernel: bool | str = False):
    """``t`` -> (codes of t's shape in fmt's dtype, uint8 biased exponents (rows, groups per row)): one power-of-two
    scale per run of ``group`` elements along the last dim (the last dim's length: per row; None: one for the
    tensor). A group with nothing finite to scale (zeros, or only inf / NaN) gets scale 1, as absmax_scale gives
    the fp32 path: inf saturates to 448 there, NaN stays NaN. ``kernel``: E4M3 groups that pow2_groups accepts
    take kernels/act_quant.py's kernel (the caller decides: CUDA, or the interpreter in tests), the same bits in one
    pass: ``kernel="op"`` through the torch.library op a compiled graph launches itself (graph_hooks), any other
    true value launched directly (eager packing: the op's dispatch costs more host time than the launch)."""
    n = t.shape[-1] if t.dim() else 1
    if kernel and group is not None and pow2_groups(n, group, fmt):
        k = _kernels()
        quant = k.quantize_groups_pow2 if kernel == "op" else k.quantize_groups_pow2_eager
        return quant(t.detach().contiguous(), group)
    x = t.detach().float().reshape(-1, n) if t.dim() else t.detach().float().reshape(1, 1)
    if group is None:  # the whole tensor, one group
        x = x.reshape(1, -1)
    g = to_groups(x, x.shape[-1] if group is None else group)
    amax = finite_absmax(g, dim=-1)
    e = torch.where(amax > 0, pow2_block_exponent(amax, fmt.max, -126, 126), 0)  # (rows, groups per row)
    codes = round_for_cast(g * _pow2(127 - e).unsqueeze(-1), fmt).to(fmt.dtype).reshape(t.shape)
    return codes, (e + 127).to(torch.uint8)


def decode_pow2(codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype,
                kernel: bool | str = False) -> torch.Tensor:
    """encode_pow2's inverse, in ``dtype`` (clamped to its range: a power-of-two scale can round a group's largest
    value up past it). ``kernel``: E4M3 takes dequantize_groups_pow2 (the caller decides, as for encode_pow2)."""
    if exps.numel() == 0:  # nothing packed (an empty tensor)
        return torch.empty(codes.shape, dtype=dtype, device=codes.device)
    if kernel and codes.dtype == torch.float8_e4m3fn:
        k = _kernels()  # as encode_pow2
        dequant = k.dequantize_groups_pow2 if kernel == "op" else k.dequantize_groups_pow2_eager
        return dequant(codes.contiguous(), exps.contiguous(), dtype)
    # groups tile rows exactly: the k-th group of the flattened codes has the k-th scale, an index a shift computes
    # for groups (Inductor's (row, col) form would divide by the row length for every element)
    g = codes.numel() // exps.numel()
    v = codes.float().reshape(-1, g) * _pow2(exps.reshape(-1).int()).unsqueeze(-1)
    top = torch.finfo(dtype).max
    return v.clamp(-top, top).reshape(codes.shape).to(dtype)


def packed_nbytes(t: torch.Tensor, granularity: str, group_size: int, fmt: FloatFormat = E4M3) -> int:
    """Bytes a tensor would take packed (codes + scales), without packing it. (Called for every saved tensor, so
    without a table built per call.)"""
    r, n = rows_of(t.shape)
    if granularity == "row":
        scales = r
    elif granularity == "group" and pow2_groups(n, group_size, fmt):
        return t.numel() + r * (n // group_size)
    elif granularity == "group":
        scales = r * -(-n // group_size)
    elif granularity == "tensor":
        scales = 1
    else:
        raise KeyError(granularity)
    return t.numel() + 4 * scales


def pack(t: torch.Tensor, granularity: str, group_size: int = 16, fmt: FloatFormat = E4M3) -> PackedActivation:
    """Quantize ``t`` (fp32/bf16/fp16) to FP8 with absmax scales of the given granularity."""
    if t.dtype not in COMPRESSIBLE_DTYPES:
        raise TypeError(f"pack: expected one of {COMPRESSIBLE_DTYPES}, got {t.dtype}")
    shape, stride = tuple(t.shape), tuple(t.stride())
    x = t.detach()
    rows = None if x.is_contiguous() else storage_rows(x)  # (the test is free; a copy is not)
    if rows is not None:
        x = rows
    if granularity == "group" and pow2_groups(x.shape[-1] if x.dim() else 1, group_size, fmt):
        codes, scale = encode_pow2(x, group_size, fmt, kernel=_use_triton(x, fmt))
    elif _use_triton(x, fmt):
        act_quant = _kernels()
        if not x.is_contiguous():
            x = x.contiguous()
        if granularity == "group":
            codes, scale = act_quant.quantize_groups(x, group_size)
        elif granularity == "row":
            codes, scale = act_quant.quantize_rows(x)
        else:
            from ..kernels.linear_quant import finite_absmax  # one read of x, no temporaries; exact in any dtype

            scale = absmax_scale(finite_absmax(x.view(rows_of(x.shape))), fmt)
            codes, scale = act_quant.quantize_rows(x, scale)
        codes = codes.view(fmt.dtype)
    else:
        q = quantize(x, fmt, granularity, group_size, to_dtype=True)
        codes = q.values.contiguous()
        r, _ = rows_of(shape)
        scale = q.scale.reshape(1) if granularity == "tensor" else q.scale.reshape(r, -1) if granularity == "group" \
            else q.scale.reshape(r)
    if not scale.is_contiguous():
        scale = scale.contiguous()
    return PackedActivation(codes, scale, granularity, group_size, t.dtype, shape, stride, fmt, t.is_contiguous(),
                            rows is not None)
