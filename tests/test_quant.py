"""lpoptim.quant: absmax scaling and the optimizer-state codec (dynamic range expansion), on CPU, fast.

Bounds used below, for a float format with m mantissa bits, smallest normal 2^emin and largest value M:

* round to nearest moves y by at most half the grid spacing at |y|, hs(y) = 2^(max(floor(log2 |y|), emin) - m - 1):
  at most 2^-(m+1)·|y| for normal |y| (E4M3: 2^-4), and 2^(emin-m-1) absolute for subnormal |y|.
* the state codec stores f = M·(|x|/c)^k on the grid (c: the group's scale) and decodes x' = c·(f'/M)^(1/k),
  so x'/x = (f'/f)^(1/k) = (1+δ)^(1/k) with δ = (f'-f)/f, |δ| <= hs(f)/f. Hence the per-element bound
  |x'-x| <= |x|·max((1+d)^(1/k) - 1, 1 - (1-d)^(1/k)) with d = hs(f)/f, which is at most |x|·d for k >= 1 (both
  (1+δ)^(1/k) <= 1+δ for δ >= 0 and >= 1+δ for δ < 0); k < 1 (a group wider than the format, compressed)
  magnifies it instead of letting the group's small elements round to zero.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from lpoptim.formats import E2M1, E4M3, E5M2, INT4, FloatFormat, IntFormat, round_to_grid
from lpoptim.quant import (K_MASK, K_ONE, absmax_scale, choose_k_code, compress, decode_groups,
                           dequantize_state, encode_groups, expand, expansion_floor, from_groups, group_stats,
                           inv_max, k_of, num_groups, pack_scale, quantize, quantize_state, rows_of, to_groups,
                           unpack_scale)

HYP = settings(max_examples=80, deadline=None)
FP32_MIN_NORMAL = 2.0 ** -126
SLACK = 2.0 ** -14  # fp32 arithmetic (x/c, log2, exp2, 1/k, 1/M: a few ulps, times k <= 17) stays far below it


# ---- helpers ------------------------------------------------------------------------------------------------------


def half_step(y: torch.Tensor, fmt) -> torch.Tensor:
    """Half the grid spacing of ``fmt`` at magnitude y (float64)."""
    y = y.double()
    if isinstance(fmt, IntFormat):
        return torch.full_like(y, 0.5)
    e = torch.floor(torch.log2(y.clamp_min(1e-300))).clamp(min=math.log2(fmt.min_normal))
    return torch.exp2(e - fmt.man_bits - 1)


def per_element_scale(q, shape) -> torch.Tensor:
    """q.scale broadcast to the original shape."""
    if q.granularity == "group":
        r, ng = q.scale.shape
        return from_groups(q.scale.unsqueeze(-1).expand(r, ng, q.group_size), shape)
    return q.scale.expand(shape)


def group_absmax(x: torch.Tensor, g: int) -> torch.Tensor:
    """Finite absmax of each element's group, broadcast back to x's shape (float64)."""
    xg = to_groups(x.double(), g)
    a = torch.where(torch.isfinite(xg), xg.abs(), 0).amax(-1, keepdim=True).expand(xg.shape)
    return from_groups(a, x.shape)


def codec(x, fmt=E4M3, g=128, expansion=True):
    codes, scale = quantize_state(x, fmt, g, expansion)
    return codes, scale, dequantize_state(codes, scale, fmt, g)


def expanded(x: torch.Tensor, scale: torch.Tensor, fmt, g: int):
    """(f, k, c) per element, float64: the expanded value the codec rounds, from the stored scale."""
    c, code = unpack_scale(scale)
    r, ng = scale.shape
    c = c.double().unsqueeze(-1).expand(r, ng, g)
    k = k_of(code).double().unsqueeze(-1).expand(r, ng, g)
    a = to_groups(x.double(), g).abs()
    t = torch.where(c > 0, a / torch.where(c > 0, c, 1.0), 0.0).clamp(max=1.0)
    f = fmt.max * t ** k
    return from_groups(f, x.shape), from_groups(k, x.shape), from_groups(c, x.shape)


def state_bound(x: torch.Tensor, scale: torch.Tensor, fmt, g: int) -> torch.Tensor:
    """Per-element bound on |decode(encode(x)) - x| (see the module docstring), float64, finite x only.

    A group stored with scale 0 (all zero, or absmax below fp32's smallest normal) decodes to 0: bound |x|.
    Elements above c (c differs from the absmax by < 2^-15) saturate at c: add |x| - c. Slack: fp32 arithmetic
    (relative SLACK), a midpoint that fp32 and float64 round apart (2^-10 of the bound), and the absolute 2^-149
    step of decoded values that are fp32 subnormals (an fp32 subnormal element of a group with a normal absmax).
    """
    f, k, c = expanded(x, scale, fmt, g)
    a = x.double().abs()
    d = torch.where(f > 0, (half_step(f, fmt) / f.clamp_min(1e-300)).clamp(max=1.0), 0.0)
    rel = torch.maximum((1 + d) ** (1 / k) - 1, 1 - (1 - d) ** (1 / k))
    bound = a * rel + (a - c).clamp(min=0)
    # a group whose scale is 0 decodes to 0; an element below 2^-126 of its group's absmax (|x| / c leaves fp32's
    # normal range: a range no k on the grid spans) decodes to within 2^-120 of that absmax
    bound = torch.where(c > 0, bound, a)
    bound = torch.where(a >= c * FP32_MIN_NORMAL, bound, torch.maximum(bound, a + c * 2.0 ** -120))
    # fp32's log2 / exp2 of t = |x| / c err by ulps of |log2 t| (up to 126), which 1/k (up to 16) magnifies
    t_log2 = torch.log2((a / torch.where(c > 0, c, 1.0)).clamp(2.0 ** -149, 1.0)).abs()
    fp32_slack = a * (SLACK + t_log2 * 2.0 ** -20 / k)
    return bound * (1 + 2.0 ** -10) + fp32_slack + 2.0 ** -148  # decoded fp32 subnormals round at 2^-149


def assert_state_invariants(x: torch.Tensor, fmt=E4M3, g=128, expansion=True):
    """Everything that must hold for any input; returns (codes, scale, decoded)."""
    codes, scale, y = codec(x, fmt, g, expansion)
    r, ng = num_groups(x.shape, g)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (r, ng)
    assert y.dtype == torch.float32 and y.shape == x.shape
    finite = torch.isfinite(x)
    # NaN in, NaN out, in its place only; +-inf saturates (finite, its sign kept, at the group's largest
    # magnitude); never NaN (or inf) from finite input
    assert torch.isnan(y[torch.isnan(x)]).all()
    inf = torch.isinf(x)
    assert torch.isfinite(y[inf]).all() and torch.equal(torch.signbit(y[inf]), torch.signbit(x[inf]))
    assert torch.isfinite(y[finite]).all()
    assert torch.isfinite(scale).all() and (scale >= 0).all()
    # sign (signbit, so -0.0 too) survives
    assert torch.equal(torch.signbit(y[finite]), torch.signbit(x[finite]))
    # the per-element bound, over finite elements
    xf = torch.where(finite, x, 0.0)
    err = (y.double() - x.double()).abs()
    bound = state_bound(xf, scale, fmt, g)
    bad = finite & ~(err <= bound)
    assert not bad.any(), (x[bad][:5], y[bad][:5], bound[bad][:5])
    # the group bound where k >= 1: |err| <= 2^-(m+1) · group absmax, E4M3 2^-4 (why: test_group_bound_reasoning);
    # a group whose absmax is an fp32 subnormal is flushed to zero
    amax = group_absmax(x, g)
    normal = finite & (amax >= FP32_MIN_NORMAL)
    k_elem = expanded(x, scale, fmt, g)[1]
    wide = normal & (k_elem >= 1)
    assert (err[wide] <= 2.0 ** -(fmt.man_bits + 1) * amax[wide] * (1 + 2.0 ** -14) + 2.0 ** -148).all()
    assert (y[finite & ~normal] == 0).all()
    # scale: c within 2^-15 of the absmax, low byte = k's code, 0 for a flushed or empty group
    c, code = unpack_scale(scale)
    amax_g = torch.where(torch.isfinite(to_groups(x, g)), to_groups(x, g).abs(), 0).amax(-1)
    live = amax_g >= FP32_MIN_NORMAL
    assert ((c.double() - amax_g.double()).abs() <= 2.0 ** -15 * amax_g.double())[live].all()
    assert (scale[~live] == 0).all()
    assert ((code >= 0) & (code <= K_MASK)).all()
    if not expansion:
        assert (code[live] == K_ONE).all()
    # expansion never flushes a non-zero finite element of a live group to zero (k lands amin on the floor, not
    # below it, compressing the group if it must), unless k is at the bottom of its grid (a range beyond 2^236) or
    # the element is below 2^-126 of the group's absmax
    if expansion:
        in_range = x.double().abs() >= amax.double() * FP32_MIN_NORMAL
        lost = (finite & (x != 0) & (y == 0) & in_range
                & (from_groups(code.unsqueeze(-1).expand(r, ng, g), x.shape) > 0))
        assert not lost.any()
    return codes, scale, y


def assert_reencode_stable(y: torch.Tensor, codes, scale, fmt=E4M3, g=128):
    """Re-encoding decoded values moves them by at most one rounding (half a grid step, mapped back), and not
    at all where the group's scale comes out the same (but for decoded values that are fp32 subnormals: they
    hold their value only to 2^-149, which a compressed group's codes can resolve)."""
    codes2, scale2, y2 = codec(y, fmt, g)
    finite = torch.isfinite(y)
    err = (y2.double() - y.double()).abs()
    assert (err <= state_bound(torch.where(finite, y, 0.0), scale2, fmt, g))[finite].all()
    same = from_groups((scale2 == scale).unsqueeze(-1).expand(*scale.shape, g), y.shape)
    keep = same & finite & ((y.abs() >= FP32_MIN_NORMAL) | (y == 0))
    assert torch.equal(codes2[keep], codes[keep])


def structured(gen: torch.Generator, shape, decades: float = 3.0, row_octaves: int = 30) -> torch.Tensor:
    """Like Adam moments: random signs, magnitudes log-normal over ~``decades`` decades, rows of different size
    (up to 2^±row_octaves)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.exp(torch.randn(shape, generator=gen, dtype=torch.float64) * decades * math.log(10) / 3)
    row_scale = torch.exp2(torch.randint(-row_octaves, row_octaves + 1, (*shape[:-1], 1), generator=gen)).double()
    return (x * row_scale).float()


# ---- shapes -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, g", [((), 16), ((1,), 16), ((7,), 16), ((3, 50), 16), ((2, 3, 33), 32),
                                      ((4, 128), 128), ((2, 0), 16)])
def test_to_groups_from_groups(shape, g):
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1
    r, n = rows_of(shape)
    if not shape:
        assert (r, n) == (1, 1)  # a 0-dim tensor is one row of one
    else:
        assert n == shape[-1] and r == (math.prod(shape[:-1]) if n else 0)
    if r * n == 0:
        return
    gr = to_groups(x, g, fill=-5.0)
    assert gr.shape == (r, -(-n // g), g) and (r, gr.shape[1]) == num_groups(shape, g)
    assert torch.equal(from_groups(gr, shape), x)
    # the padding is the fill value, the rest is x's rows in order
    flat = gr.reshape(r, -1)
    assert (flat[:, n:] == -5.0).all() and torch.equal(flat[:, :n], x.reshape(r, n))


# ---- plain absmax quantization ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1, INT4])
@pytest.mark.parametrize("gran", ["tensor", "row", "group"])
def test_quantize_error_bound(fmt, gran):
    gen = torch.Generator().manual_seed(10)
    x = structured(gen, (5, 70), decades=2, row_octaves=2)
    x[2] *= 1e-20  # one row far below the others (all subnormal or zero under a per-tensor scale)
    x[3, 0] = 0.0
    q = quantize(x, fmt, gran, group_size=32)
    assert q.values.shape == x.shape and q.fmt is fmt and q.granularity == gran and q.shape == (5, 70)
    # the scale is the finite absmax over the format's largest value
    if gran == "tensor":
        amax = x.abs().amax()
    elif gran == "row":
        amax = x.abs().amax(-1, keepdim=True)
    else:
        amax = to_groups(x, 32).abs().amax(-1)
        assert q.scale.shape == (5, 3)
    assert torch.equal(q.scale, amax / fmt.max)
    # values lie on the grid, and the absmax element lands on ±max
    assert torch.equal(round_to_grid(q.values, fmt), q.values)
    s = per_element_scale(q, x.shape)
    assert q.values.abs().amax() == fmt.max
    # error: half a grid step of |x|/s, times s
    y = q.dequantize()
    err = (y.double() - x.double()).abs()
    yy = x.double().abs() / s.double()
    bound = s.double() * half_step(yy * (1 + 2.0 ** -20), fmt) + x.double().abs() * 2.0 ** -20
    assert (err <= bound).all()
    # relative, for elements in the format's normal range: 2^-(m+1) (E4M3 2^-4, E5M2 2^-3, E2M1 2^-2);
    # INT4: half a step of amax/7
    if isinstance(fmt, FloatFormat):
        normal = yy >= fmt.min_normal
        assert normal.float().mean() > (0.5 if fmt.dtype is not None else 0.01)  # E2M1's normals: 2.6 octaves
        assert (err[normal] <= 2.0 ** -(fmt.man_bits + 1) * x.double().abs()[normal] * (1 + 2.0 ** -20)).all()
    else:
        assert (err <= 0.5 * s.double() * (1 + 2.0 ** -20)).all()
        assert (q.values >= -7).all() and (q.values <= 7).all()  # absmax scaling never reaches -8
    # signs kept
    assert torch.equal(torch.signbit(y), torch.signbit(x))


@pytest.mark.parametrize("fmt", [E4M3, E2M1, INT4])
@pytest.mark.parametrize("gran", ["tensor", "row", "group"])
def test_quantize_zeros(fmt, gran):
    z = torch.zeros(3, 40)
    q = quantize(z, fmt, gran, group_size=16)
    assert (q.scale == 1).all() and (q.values == 0).all() and (q.dequantize() == 0).all()
    # a zero row / group inside a non-zero tensor: scale 1 there, the others unaffected
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(11))
    x[1] = 0
    q = quantize(x, fmt, gran, group_size=16)
    assert (q.dequantize()[1] == 0).all() and not torch.isnan(q.dequantize()).any()
    if gran != "tensor":
        assert (q.scale[1] == 1).all() and (q.scale[[0, 2]] != 1).all()


def test_quantize_group_sizes_not_a_multiple():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 50, generator=gen)
    x[:, 48:] *= 100  # the short last group (2 elements) has its own scale
    q = quantize(x, "e4m3", "group", group_size=16)
    assert q.scale.shape == (3, 4) and q.group_size == 16
    for j in range(4):
        assert torch.equal(q.scale[:, j], x[:, 16 * j:16 * j + 16].abs().amax(-1) / 448)
    assert (q.values[:, 48:].abs().amax(-1) == 448).all()
    # 0-dim, 1-element and odd tensors
    for shape in [(), (1,), (5,), (3, 1), (2, 3, 17)]:
        x = torch.randn(shape, generator=gen) + 3
        for gran in ("tensor", "row", "group"):
            y = quantize(x, "e4m3", gran, group_size=16).dequantize()
            assert y.shape == x.shape and ((y - x).abs() <= x.abs() * 2.0 ** -4 + 1e-7).all()


@pytest.mark.parametrize("gran", ["tensor", "row", "group"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_nonfinite_does_not_touch_scales(gran, bad):
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 64, generator=gen)
    clean = x.clone()
    x[1, 20] = bad
    x[2, 0:16] = bad  # a whole group of it
    clean[1, 20] = 0.0
    clean[2, 0:16] = 0.0
    q, qc = quantize(x, "e4m3", gran, group_size=16), quantize(clean, "e4m3", gran, group_size=16)
    assert torch.equal(q.scale, qc.scale)  # over finite elements only
    bad_mask = ~torch.isfinite(x)
    assert torch.equal(q.values[~bad_mask], qc.values[~bad_mask])
    y = q.dequantize()
    if math.isnan(bad):
        assert torch.isnan(y[bad_mask]).all()
    else:  # ±inf saturates at ± the group's finite absmax
        s = per_element_scale(q, x.shape)
        assert torch.equal(y[bad_mask], (math.copysign(448, bad) * s)[bad_mask])
    assert torch.isfinite(y[~bad_mask]).all()


def test_quantize_tiny_absmax_gives_no_nan():
    """Regression: an absmax below 448 * 2^-149 made amax / 448 underflow to a zero scale, and 0 / 0 = NaN."""
    for amax in (1e-45, 1e-44, 1e-43, 6e-43, 1e-42, 1e-39):
        x = torch.tensor([[0.0, -0.0, amax, -amax / 2]])
        for fmt in ("e4m3", "e2m1", "int4"):
            for gran in ("tensor", "row", "group"):
                q = quantize(x, fmt, gran, group_size=16)
                y = q.dequantize()
                assert torch.isfinite(q.values).all() and torch.isfinite(y).all(), (amax, fmt, gran, y)
                assert (q.scale > 0).all()
                assert ((y - x).abs() <= 2 * amax).all() and y[0, 0] == 0
    assert absmax_scale(torch.tensor([0.0, 1e-45, 448.0]), E4M3).tolist() == [1.0, 1.0, 1.0]


def test_quantize_noise_and_dtype_and_idempotence():
    gen = torch.Generator().manual_seed(14)
    x = structured(gen, (3, 45))
    q = quantize(x, "e4m3", "group", group_size=16)
    # noise: u = 0 rounds magnitudes down, u -> 1 up; the same shape and group layout as x
    lo = quantize(x, "e4m3", "group", group_size=16, noise=torch.zeros_like(x))
    hi = quantize(x, "e4m3", "group", group_size=16, noise=torch.full_like(x, 1 - 2.0 ** -24))
    assert (lo.values.abs() <= q.values.abs()).all() and (hi.values.abs() >= q.values.abs()).all()
    assert ((lo.values == q.values) | (hi.values == q.values)).all()
    # to_dtype: the same values in the fp8 dtype
    q8 = quantize(x, "e4m3", "group", group_size=16, to_dtype=True)
    assert q8.values.dtype == torch.float8_e4m3fn and torch.equal(q8.values.float(), q.values)
    assert torch.equal(q8.dequantize(), q.dequantize())
    assert quantize(x, "int4", to_dtype=True).values.dtype == torch.float32
    # quantizing the dequantized values gives the same codes
    for gran in ("tensor", "row", "group"):
        for fmt in ("e4m3", "e5m2", "e2m1", "int4"):
            q1 = quantize(x, fmt, gran, group_size=16)
            q2 = quantize(q1.dequantize(), fmt, gran, group_size=16)
            assert torch.equal(q2.values, q1.values)
    with pytest.raises(ValueError):
        quantize(x, "e4m3", "block")


@HYP
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 150)), elements=st.floats(width=32)),
       st.sampled_from(["e4m3", "e5m2", "e2m1", "int4"]), st.sampled_from(["tensor", "row", "group"]),
       st.sampled_from([16, 32, 128]))
def test_quantize_property(arr, fmt, gran, g):
    x = torch.from_numpy(arr)
    q = quantize(x, fmt, gran, group_size=g)
    y = q.dequantize()
    finite = torch.isfinite(x)
    assert torch.equal(torch.isnan(y), torch.isnan(x))  # NaN only where NaN came in
    assert torch.isfinite(y[finite]).all()
    # ±inf saturates at ±max (INT4: -8) times the scale: finite unless the absmax is near fp32's largest
    assert torch.equal(torch.signbit(y[torch.isinf(x)]), torch.signbit(x[torch.isinf(x)]))
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    s = per_element_scale(q, x.shape).double()
    f = q.fmt
    ok = finite & (s >= FP32_MIN_NORMAL)  # a subnormal scale has too few bits for the bound
    xx = torch.where(finite, x, 0).double()
    bound = s * half_step(xx.abs() / s * (1 + 2.0 ** -20), f) + xx.abs() * 2.0 ** -20
    err = (y.double() - xx).abs()
    assert (err <= bound)[ok].all()
    assert torch.equal(torch.signbit(y)[finite], torch.signbit(x)[finite])


# ---- the state codec: k, scales, expansion ------------------------------------------------------------------------


def test_k_grid_and_scale_packing():
    codes = torch.arange(256, dtype=torch.int32)
    want = (1 + (codes & 31).double() / 32) * torch.exp2((codes >> 5).double() - 4)
    assert torch.equal(k_of(codes).double(), want)  # exact
    assert k_of(torch.tensor(K_ONE)) == 1 and k_of(torch.tensor(0)) == 1 / 16 and k_of(torch.tensor(255)) == 15.75
    assert (k_of(codes[1:]) > k_of(codes[:-1])).all() and (k_of(codes[1:]) / k_of(codes[:-1]) <= 1 + 1 / 32).all()
    amax = torch.tensor([1.0, 3.0, 1e-30, 448.0, 3.4e38, 2.0 ** -126, 0.0, 1e-40])
    code = torch.tensor([0, 255, 17, 128, 255, 3, 9, 9], dtype=torch.int32)
    s = pack_scale(amax, code)
    c, back = unpack_scale(s)
    assert torch.equal(c, s)  # c is used as stored
    assert back[:6].tolist() == code[:6].tolist()
    assert s[6] == 0 and s[7] == 0 and back[6] == 0 and back[7] == 0  # zero and fp32-subnormal absmax: scale 0
    bits, abits = s.view(torch.int32), amax.view(torch.int32)
    assert torch.equal(bits[:6] & ~K_MASK, abits[:6] & ~K_MASK)  # the non-k bits are the absmax's
    assert ((c[:6].double() - amax[:6].double()).abs() <= 2.0 ** -15 * amax[:6].double()).all()
    assert torch.isfinite(s).all()


def test_expand_compress():
    t = torch.cat([torch.tensor([0.0, 1.0, 2.0 ** -20, 0.5]), torch.rand(200, generator=torch.Generator().manual_seed(15))])
    for c in (0, 1, 16, 100, K_ONE, 200, 255):
        code = torch.full(t.shape, c, dtype=torch.int32)
        e = expand(t, code)
        k = k_of(torch.tensor(c)).item()
        # fp32 exp2(k·log2 t): relative error ~2^-24 times |k·log2 t| (< 150 here); underflow below 1e-38
        assert torch.allclose(e.double(), t.double() ** k, rtol=1e-5, atol=1e-38)
        assert e[0] == 0 and e[1] == 1
        ok = e >= 2.0 ** -126
        assert torch.allclose(compress(e, code).double()[ok], t.double()[ok], rtol=1e-5, atol=0)
        assert compress(e, code)[0] == 0 and compress(e, code)[1] == 1
        if c == K_ONE:
            assert torch.equal(e, t) and torch.equal(compress(t, code), t)  # k = 1 is exact
        assert not torch.isnan(e).any()


def test_choose_k_code_is_the_largest_grid_k():
    """code = the largest grid k in [1/16, 15.75] with (amin/amax)^k · max >= floor (float64 check)."""
    gen = torch.Generator().manual_seed(16)
    lr = torch.cat([torch.empty(3000, dtype=torch.float64).uniform_(0, 25, generator=gen),
                    torch.empty(500, dtype=torch.float64).uniform_(25, 230, generator=gen),
                    torch.tensor([0.0, 1e-7, 0.5, 1.0, 14.8, 17.8, 17.9, 40.0, 200.0], dtype=torch.float64)])
    amax = torch.exp2(torch.empty_like(lr).uniform_(-60, 60, generator=gen))
    amax[3000:3500] = torch.exp2(torch.empty(500, dtype=torch.float64).uniform_(110, 120, generator=gen))
    amin = amax * torch.exp2(-lr)
    for fmt in (E4M3, E5M2):
        for target in ("subnormal", "normal"):
            floor = expansion_floor(fmt, target)
            code = choose_k_code(amax.float(), amin.float(), fmt, True, target)
            assert code.dtype == torch.int32 and (code >= 0).all() and (code <= 255).all()
            span = math.log2(fmt.max / floor)
            ratio = torch.log2(amax.float().double() / amin.float().double())
            k = k_of(code).double()
            tol = 1e-4  # fp32 log2 and division near a grid boundary
            # (amin/amax)^kk * max >= floor, but for the slack: k may exceed the exact k by 1/64 of a grid step
            # (2^-11 of k's binade)
            fits = lambda kk: kk * ratio <= span + tol + ratio * 2.0 ** (torch.floor(torch.log2(kk)) - 11)
            assert (fits(k) | (code == 0)).all()
            k_next = k_of((code + 1).clamp(max=255)).double()
            live = amin.float() > 0  # (amin below fp32's range reads as a zero element)
            assert (~fits(k_next * (1 + 2 * tol)) | (code == 255) | ~live).all()  # the next grid k would not fit
            assert (k[lr > span + 0.1] < 1).all()  # ratio beyond the span: compressed, never left to round to 0
            assert (code[(lr > 16 * span + 1) & live] == 0).all()  # beyond 16 spans: the smallest k
            assert (code[lr < span / 15.8] == 255).all()  # small ratios (and a constant group): the largest k
    with pytest.raises(ValueError):
        expansion_floor(E4M3, "zero")
    # invalid groups: no element (amax 0) or no non-zero finite element (amin inf)
    code = choose_k_code(torch.tensor([0.0, 1.0, 0.0]), torch.tensor([math.inf, math.inf, 0.0]), E4M3)
    assert code.tolist() == [K_ONE] * 3
    assert (choose_k_code(amax.float(), amin.float(), E4M3, expansion=False) == K_ONE).all()


def test_group_stats_skip_zeros_and_nonfinite():
    g = torch.tensor([[[0.0, -3.0, 0.5, math.nan], [math.inf, 0.0, 0.0, 0.0], [-0.0, 2.0, -1e-3, 2.0]]])
    amax, amin = group_stats(g)
    assert amax.tolist() == [[3.0, 0.0, 2.0]]
    assert amin[0, 0] == 0.5 and amin[0, 1] == math.inf and amin[0, 2] == torch.tensor(1e-3).item()


# ---- the state codec: round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("g", [16, 128])
@pytest.mark.parametrize("expansion", [True, False])
def test_state_round_trip_bounds(fmt, g, expansion):
    gen = torch.Generator().manual_seed(17)
    x = structured(gen, (6, 300), decades=3)
    x[1] = structured(gen, (300,), decades=12)  # beyond E4M3's range: compressed (k < 1) where expanded
    codes, scale, y = assert_state_invariants(x, fmt, g, expansion)
    f, k, _ = expanded(x, scale, fmt, g)
    rel = (y.double() - x.double()).abs() / x.double().abs()
    normal = f >= fmt.min_normal * (1 + 2.0 ** -10)
    assert normal.float().mean() > (0.95 if expansion else 0.7)
    # elements whose expanded value is normal: at most 2^-(m+1) relative (E4M3: 2^-4) where k >= 1 ...
    d = 2.0 ** -(fmt.man_bits + 1)
    assert (rel[normal & (k >= 1)] <= d).all()
    if expansion:  # every non-zero element keeps a relative bound (the floor is normal), compressed groups too
        assert (y[x != 0] != 0).all() and (k < 1).any()
        assert (rel[x != 0] <= torch.maximum((1 + 1.1 * d) ** (1 / k) - 1, 1 - (1 - 1.1 * d) ** (1 / k))[x != 0]).all()
    # ... and in fact at most max((1+d)^(1/k) - 1, 1 - (1-d)^(1/k)): expansion divides the error by ~k
    kn = k[normal]
    tight = torch.maximum((1 + d) ** (1 / kn) - 1, 1 - (1 - d) ** (1 / kn)) + SLACK
    assert (rel[normal] <= tight).all()
    if expansion and fmt is E4M3:
        assert (k != 1).float().mean() > 0.3  # the test exercises expansion (and compression)
        # expansion buys accuracy for most elements: median relative error well below plain E4M3's
        _, _, y_plain = codec(x, fmt, g, expansion=False)
        rel_plain = (y_plain.double() - x.double()).abs() / x.double().abs()
        # where k >= 1; compressed groups (k < 1) trade their large elements' precision for never rounding a small
        # one to zero, which plain E4M3 does (chosen on update errors along real gradient streams, not one round trip)
        rows = [0, 2, 3, 4, 5]  # row 1 spans 12 decades: k < 1 in most groups
        expanded_rows = k[rows] >= 1
        assert rel[rows][expanded_rows].median() < 0.85 * rel_plain[rows][expanded_rows].median()
        assert (y_plain[x != 0] == 0).any() and not (y[x != 0] == 0).any()
    assert_reencode_stable(y, codes, scale, fmt, g)


def test_group_bound_reasoning():
    """Where k >= 1 the whole-tensor bound |x' - x| <= 2^-4 · group absmax, checked on its worst cases; where
    k < 1 (a compressed group) the per-element relative bound (1 + 2^-4)^(1/k) - 1.

    Every non-zero element expands to at least the floor, E4M3's smallest normal 2^-6 (k is chosen so, up to the
    slack that leaves it above 0.99 · 2^-6, where the grid is still as fine), so |δ| <= 2^-4 and |x'-x| <= |x|·2^-4
    for k >= 1. Here: codes over the whole grid, with elements swept over the whole expanded range, worst measured.
    """
    gen = torch.Generator().manual_seed(18)
    span = math.log2(448 / 2 ** -6)
    worst = 0.0
    for code in list(range(0, 256, 5)) + [255]:
        k = k_of(torch.tensor(code)).item()
        if span / k > 120:  # amin would leave fp32's normal range
            continue
        # a group with amax 1 and amin = 2^(-span/k) (so this k is chosen), the rest swept across [amin, 1]
        amin = 2.0 ** (-span / k) * (1 + 1e-6)
        inner = torch.exp2(torch.empty(126, dtype=torch.float64).uniform_(math.log2(amin), 0, generator=gen))
        x = torch.cat([torch.tensor([1.0, amin], dtype=torch.float64), inner]).float().reshape(1, 128)
        codes, scale, y = assert_state_invariants(x, E4M3, 128)
        assert abs(unpack_scale(scale)[1].item() - code) <= 1
        if k >= 1:
            worst = max(worst, ((y - x).abs().max() / x.abs().max()).item())
        else:
            rel = ((y.double() - x.double()) / x.double()).abs().max().item()
            assert rel <= (1 + 2.0 ** -4) ** (1 / k) - 1 + SLACK / k
    assert worst <= 2.0 ** -4


def test_zero_groups():
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(19))
    x[0] = 0.0
    x[1, 32:64] = -0.0
    codes, scale, y = assert_state_invariants(x, E4M3, 32)
    assert (scale[0] == 0).all() and scale[1, 1] == 0 and (scale[2] > 0).all()
    assert (y[0] == 0).all() and (y[1, 32:64] == 0).all() and torch.signbit(y[1, 32:64]).all()
    assert (codes[0] == 0).all() and (codes[1, 32:64] == 0x80).all()  # E4M3 +0 / -0
    z = torch.zeros(5, 7)
    codes, scale, y = codec(z, E4M3, 16)
    assert (scale == 0).all() and (y == 0).all() and (codes == 0).all()


@pytest.mark.parametrize("value", [3.0, -1.0, 448.0, 1e-30, -1e30, 1.5 * 2.0 ** -126, 2.0 ** 100, 3e38])
@pytest.mark.parametrize("n", [1, 5, 128])
def test_constant_groups(value, n):
    x = torch.full((2, n), value)
    codes, scale, y = assert_state_invariants(x, E4M3, 128)
    _, code = unpack_scale(scale)
    assert (code == 255).all()  # the largest k, not inf or NaN
    assert torch.isfinite(y).all()
    # decodes to c, within the 2^-15 the code byte moves it
    assert ((y.double() - value).abs() <= 2.0 ** -15 * abs(value)).all()


def test_zero_element_does_not_collapse_k():
    gen = torch.Generator().manual_seed(20)
    base = torch.exp2(torch.empty(31).uniform_(-6, 0, generator=gen)) * torch.sign(torch.randn(31, generator=gen))
    _, s_ref = quantize_state(base.reshape(1, 31), E4M3, 32)
    for pos in (0, 7, 31):  # COAT's fault: a zero in the first element
        for z in (0.0, -0.0):
            x = torch.cat([base[:pos], torch.tensor([z]), base[pos:]]).reshape(1, 32)
            codes, s, y = assert_state_invariants(x, E4M3, 32)
            assert torch.equal(unpack_scale(s)[1], unpack_scale(s_ref)[1])
            assert k_of(unpack_scale(s)[1]).item() >= 2  # at most 6 octaves of range: k >= 14.8 / 6
            assert torch.equal(s, s_ref) and y[0, pos] == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_element_is_isolated(bad):
    gen = torch.Generator().manual_seed(21)
    x = structured(gen, (3, 100), decades=2)
    x_bad = x.clone()
    x_bad[1, 37] = bad
    x_zero = x.clone()
    x_zero[1, 37] = 0.0  # a zero does not enter the group statistics either
    c_bad, s_bad, y_bad = assert_state_invariants(x_bad, E4M3, 32)
    c_ref, s_ref, y_ref = codec(x_zero, E4M3, 32)
    assert torch.equal(s_bad, s_ref)  # not its own group's scale, nor any other
    if math.isnan(bad):
        assert torch.isnan(y_bad[1, 37]) and torch.isnan(c_bad.view(torch.float8_e4m3fn).float()[1, 37])
    else:  # saturates to the group's largest magnitude, keeping its sign
        group_max = y_ref[1, 32:64].abs().max()
        assert y_bad[1, 37].abs() == group_max and torch.signbit(y_bad[1, 37]) == (bad < 0)
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[1, 37] = False
    assert torch.equal(y_bad[keep], y_ref[keep]) and torch.equal(c_bad[keep], c_ref[keep])
    # a group of nothing but non-finite values: scale 0, all NaN, neighbours untouched
    x_all = x.clone()
    x_all[2, 64:96] = bad
    _, s_all, y_all = assert_state_invariants(x_all, E4M3, 32)
    assert s_all[2, 2] == 0  # no finite value: scale 0
    assert torch.isnan(y_all[2, 64:96]).all() if math.isnan(bad) else (y_all[2, 64:96] == 0).all()
    assert torch.equal(s_all[:, [0, 1, 3]], codec(x, E4M3, 32)[1][:, [0, 1, 3]])


def test_expansion_off_gives_k_one():
    x = structured(torch.Generator().manual_seed(22), (4, 200))
    _, scale, _ = assert_state_invariants(x, E4M3, 64, expansion=False)
    c, code = unpack_scale(scale)
    assert (code == K_ONE).all()
    amax = to_groups(x, 64).abs().amax(-1)
    assert torch.equal(c.view(torch.int32), (amax.view(torch.int32) & ~K_MASK) | K_ONE)  # the absmax, k's code
    _, scale_on, _ = codec(x, E4M3, 64)
    assert (unpack_scale(scale_on)[1] != K_ONE).any()


@pytest.mark.parametrize("shape", [(8, 300), (4, 6, 50), (5, 128), (9, 1)])
@pytest.mark.parametrize("g", [16, 128])
def test_sharding_invariance(shape, g):
    """FSDP2 shards dim 0: a shard's codes and scales are exactly the whole tensor's rows."""
    x = structured(torch.Generator().manual_seed(23), shape)
    codes, scale = quantize_state(x, E4M3, g)
    rows_per = math.prod(shape[1:-1]) if len(shape) > 2 else 1
    for a, b in [(0, 1), (1, 3), (2, shape[0])]:
        cs, ss = quantize_state(x[a:b].clone(), E4M3, g)
        assert torch.equal(cs, codes[a:b])
        assert torch.equal(ss, scale[a * rows_per:b * rows_per])
        assert torch.equal(dequantize_state(cs, ss, E4M3, g), dequantize_state(codes, scale, E4M3, g)[a:b])


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 1), (2, 129), (3, 5, 17)])
@pytest.mark.parametrize("g", [16, 128])
def test_small_and_odd_shapes(shape, g):
    x = structured(torch.Generator().manual_seed(24), shape if shape else (1,)).reshape(shape)
    codes, scale, y = assert_state_invariants(x, E4M3, g)
    assert scale.shape == num_groups(shape, g)
    if x.numel() == 1:  # one element: a constant group, decoded to c
        assert (y.double() - x.double()).abs().item() <= 2.0 ** -15 * x.abs().item()


def test_subnormal_absmax_groups_are_flushed_not_nan():
    """Regression: a group whose absmax is an fp32 subnormal below 2^-128 had 1/c = inf, and its zeros decoded
    as 0 * inf = NaN (Adam's m decays into such groups); the low byte was also most of c. Flushed to 0 now."""
    for amax in (1e-45, 1e-42, 1e-40, 2.9e-39, 1.1e-38):
        x = torch.tensor([[0.0, amax, -amax / 3, 0.0, -0.0]])
        codes, scale, y = assert_state_invariants(x, E4M3, 16)
        assert scale.item() == 0 and (y == 0).all()
        assert torch.equal(torch.signbit(y), torch.signbit(x))
    # the smallest normal absmax is kept
    x = torch.tensor([[0.0, 2.0 ** -126, -2.0 ** -127]])
    _, scale, y = assert_state_invariants(x, E4M3, 16)
    assert scale.item() > 0 and abs(y[0, 1].item() - 2.0 ** -126) <= 2.0 ** -141 and y[0, 2] != 0


def test_extreme_magnitudes():
    x = torch.tensor([[3.4e38, -3e38, 1e38, 0.0, 1.0], [1e-30, 1e30, -1.0, 1e-45, 1e-38]])
    codes, scale, y = assert_state_invariants(x, E4M3, 16)
    assert y[0, 0] == pytest.approx(3.4e38, rel=2.0 ** -15) and torch.isfinite(y).all()
    assert y[1, 1] == pytest.approx(1e30, rel=2.0 ** -15)


def test_encode_decode_groups_directly():
    g = structured(torch.Generator().manual_seed(25), (2, 3, 32)).reshape(2, 3, 32)
    q, scale = encode_groups(g, E4M3)
    assert torch.equal(round_to_grid(q, E4M3), q)  # grid values
    assert scale.shape == (2, 3)
    y = decode_groups(q, scale, E4M3)
    assert ((y - g).abs() <= 2.0 ** -4 * g.abs().amax(-1, keepdim=True)).all()
    assert inv_max(E4M3) == torch.tensor(1 / 448, dtype=torch.float32).item()


# ---- property-based -----------------------------------------------------------------------------------------------


@HYP
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 300)),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
       st.sampled_from([16, 32, 128]), st.booleans())
def test_state_codec_property_any_fp32(arr, g, expansion):
    """Arbitrary fp32 (hypothesis's arrays: mostly one fill value plus scattered extremes, subnormals, zeros,
    NaN and inf): constant groups, flushed groups, huge and tiny values all at once."""
    x = torch.from_numpy(arr)
    codes, scale, y = assert_state_invariants(x, E4M3, g, expansion)
    if expansion:
        assert_reencode_stable(y, codes, scale, E4M3, g)


KINDS = ["moments", "near_subnormal", "huge_range", "fp32_subnormal", "mixed"]


@st.composite
def state_inputs(draw):
    """Dense random tensors of one kind (seeded torch draws), with zeros, NaN and inf sprinkled by hypothesis."""
    rows = draw(st.integers(1, 3))
    n = draw(st.integers(1, 300))
    g = draw(st.sampled_from([16, 32, 128]))
    kind = draw(st.sampled_from(KINDS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (rows, n)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    base = draw(st.integers(-100, 100))
    if kind == "moments":
        e = base + 8 * u - 8
    elif kind == "near_subnormal":  # around 2^-9 / 448 of the group's top: E4M3's subnormals at k = 1
        e = base - 17.8 + 6 * u - 3
        e[:, ::g] = base  # a top element in every group
    elif kind == "huge_range":  # 1e-30 .. 1e30 in one group
        e = (200 * u - 100)
    elif kind == "fp32_subnormal":
        e = -149 + 30 * u  # 2^-149 .. 2^-119: subnormal and barely normal groups
    else:
        e = base + 40 * u - 20
    x = sign * torch.exp2(e) * (1 + torch.rand(shape, generator=gen, dtype=torch.float64))
    x = x.float()
    for value in draw(st.lists(st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf]), max_size=6)):
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, n - 1))] = value
    return x, g


@HYP
@given(state_inputs())
def test_state_codec_property_structured(inp):
    x, g = inp
    codes, scale, y = assert_state_invariants(x, E4M3, g)
    assert_reencode_stable(y, codes, scale, E4M3, g)
    # NaN/inf change nothing else: same scales and decoded values as with those elements set to 0
    finite = torch.isfinite(x)
    if not finite.all():
        _, s0, y0 = codec(torch.where(finite, x, 0.0), E4M3, g)
        assert torch.equal(scale, s0) and torch.equal(y[finite], y0[finite])
