"""lpoptim.formats against float64 brute force, torch's own fp8 casts and hand-checked values (CPU, fast)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from lpoptim.formats import (E2M1, E4M3, E5M2, FORMATS, INT4, INT4_SYM, FloatFormat, IntFormat, get_format,
                             pack_4bit, pack_nibbles, round_to_grid, stochastic_noise, to_fp8, unpack_4bit)

FLOAT8 = [E4M3, E5M2]
ALL = [E4M3, E5M2, E2M1, INT4, INT4_SYM]
HYP = settings(max_examples=60, deadline=None)


# ---- float64 references ---------------------------------------------------------------------------------------


def signed_grid(fmt) -> torch.Tensor:
    """Every value of the format, ascending, float64 (one zero)."""
    if isinstance(fmt, IntFormat):
        return torch.arange(fmt.qmin, fmt.qmax + 1, dtype=torch.float64)
    g = fmt.grid()
    return torch.cat([-g.flip(0)[:-1], g])


def nearest_ref(x: torch.Tensor, fmt) -> torch.Tensor:
    """Brute-force nearest grid point in float64, ties to the even code, saturating; NaN stays NaN.

    Float formats: the magnitude's nearest point of ``fmt.grid()``; index i in that grid has mantissa i mod 2^m
    (2^m zero/subnormal values, then 2^m per binade), so "even mantissa" is "even index". Integers: even value.
    """
    x64 = x.double()
    if isinstance(fmt, IntFormat):
        g = signed_grid(fmt)
        a = x64.clamp(fmt.qmin, fmt.qmax)
        parity = g.abs().remainder(2)
    else:
        g = fmt.grid()
        a = x64.abs().clamp(max=fmt.max)  # inf -> max
        parity = torch.arange(len(g)).remainder(2).double()
    d = (a.unsqueeze(-1) - g).abs()
    cand = d == d.amin(-1, keepdim=True)
    pick = torch.where(cand, parity, torch.full_like(parity, 2.0)).argmin(-1)  # an even candidate if tied
    r = g[pick]
    if isinstance(fmt, FloatFormat):
        r = torch.copysign(r, x64)
    return torch.where(torch.isnan(x64), x64, r)


def neighbours(x: torch.Tensor, fmt):
    """(lo, hi): the grid points around |x| (float ones) or around x (int ones), float64, lo <= . <= hi."""
    g = signed_grid(fmt) if isinstance(fmt, IntFormat) else fmt.grid()
    a = x.double() if isinstance(fmt, IntFormat) else x.double().abs()
    a = a.clamp(g[0].item(), g[-1].item())
    i = torch.searchsorted(g, a, right=True).clamp(max=len(g) - 1)
    lo = g[(i - 1).clamp(min=0)]
    hi = torch.where(g[i - 1] == a, a, g[i])
    return lo, hi


def log_uniform(n: int, lo_exp: float, hi_exp: float, gen: torch.Generator) -> torch.Tensor:
    e = torch.empty(n, dtype=torch.float64).uniform_(lo_exp, hi_exp, generator=gen)
    s = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return (s * torch.exp2(e)).float()


def in_range_probe(fmt: FloatFormat, gen: torch.Generator) -> torch.Tensor:
    """Random in-range values, every grid point, every midpoint and its fp32 neighbours, both signs."""
    g = fmt.grid()
    mid = (g[1:] + g[:-1]) / 2  # exact in fp32: one bit more than the format's mantissa
    assert torch.equal(mid.float().double(), mid)
    mid32 = mid.float()
    around = torch.cat([torch.nextafter(mid32, torch.tensor(0.0)), torch.nextafter(mid32, torch.tensor(math.inf))])
    rnd = log_uniform(20000, math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max), gen)
    pos = torch.cat([g.float(), mid32, around, rnd.abs(), torch.tensor([fmt.max, 1e-40, 1e-45])])
    return torch.cat([pos, -pos])


# ---- facts about the formats --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, mx, mn, ms", [(E4M3, 448.0, 2**-6, 2**-9), (E5M2, 57344.0, 2**-14, 2**-16),
                                             (E2M1, 6.0, 1.0, 0.5)])
def test_format_limits(fmt, mx, mn, ms):
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == (mx, mn, ms)
    g = fmt.grid()
    assert g[0] == 0 and g[1] == ms and g[-1] == mx and (g[1:] > g[:-1]).all()
    assert mn in g.tolist()


@pytest.mark.parametrize("fmt", FLOAT8)
def test_grid_is_every_finite_value_of_the_torch_dtype(fmt):
    v = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).double()
    v = v[torch.isfinite(v) & (v >= 0)].unique()  # unique sorts and merges +0/-0
    assert torch.equal(v, fmt.grid())


def test_e2m1_grid_and_int_ranges():
    assert E2M1.grid().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert (INT4.qmin, INT4.qmax, INT4.max) == (-8, 7, 7.0)
    assert (INT4_SYM.qmin, INT4_SYM.qmax) == (-7, 7)
    # every E2M1 value and every integer in -8..7 is exact in E4M3: 4-bit operands are held in fp8 (docs/linear.md)
    vals = torch.cat([signed_grid(E2M1), signed_grid(INT4)]).float()
    assert torch.equal(vals.to(torch.float8_e4m3fn).float(), vals)
    assert torch.equal(round_to_grid(vals, E4M3), vals)


def test_get_format():
    for name, f in FORMATS.items():
        assert get_format(name) is f and get_format(f) is f
    with pytest.raises(ValueError):
        get_format("e3m4")


# ---- round to nearest even ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FLOAT8)
def test_rne_matches_torch_cast_and_brute_force(fmt):
    x = in_range_probe(fmt, torch.Generator().manual_seed(1))
    r = round_to_grid(x, fmt)
    torch_cast = x.to(fmt.dtype).float()
    assert torch.equal(r, torch_cast)
    assert torch.equal(torch.signbit(r), torch.signbit(torch_cast))  # -0.0 where torch gives -0.0
    assert torch.equal(r.double(), nearest_ref(x, fmt))
    assert torch.equal(to_fp8(x, fmt).float(), torch_cast) and to_fp8(x, fmt).dtype == fmt.dtype


@pytest.mark.parametrize("fmt", FLOAT8)
def test_rne_ties_go_to_even(fmt):
    g = fmt.grid()
    mid = ((g[1:] + g[:-1]) / 2).float()
    r = round_to_grid(mid, fmt).double()
    lo, hi = g[:-1], g[1:]
    even_lo = torch.arange(len(lo)) % 2 == 0  # index parity = mantissa parity
    assert torch.equal(r, torch.where(even_lo, lo, hi))
    # and just off the midpoint it goes to the nearer side
    assert torch.equal(round_to_grid(torch.nextafter(mid, torch.tensor(0.0)), fmt).double(), lo)
    assert torch.equal(round_to_grid(torch.nextafter(mid, torch.tensor(1e9)), fmt).double(), hi)


@pytest.mark.parametrize("fmt", ALL)
def test_rne_brute_force_random_and_grid(fmt):
    gen = torch.Generator().manual_seed(2)
    lo_exp = -12 if isinstance(fmt, IntFormat) else math.log2(fmt.min_subnormal) - 3
    x = torch.cat([log_uniform(5000, lo_exp, math.log2(fmt.max) + 1, gen), signed_grid(fmt).float(),
                   ((signed_grid(fmt)[1:] + signed_grid(fmt)[:-1]) / 2).float()])
    r = round_to_grid(x, fmt)
    assert torch.equal(r.double(), nearest_ref(x, fmt))
    assert torch.equal(round_to_grid(signed_grid(fmt).float(), fmt).double(), signed_grid(fmt))  # fixed points


def test_e2m1_and_int4_hand_checked():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0, -0.25, -5.0, -0.1])
    assert round_to_grid(x, E2M1).tolist() == [0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 6, -0.0, -4, -0.0]
    assert torch.signbit(round_to_grid(x, E2M1))[-1]
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 7.4, 7.6, -8.4, -9.0, 100.0, -100.0, 3.49])
    assert round_to_grid(y, INT4).tolist() == [0, 2, 2, -0.0, -2, 7, 7, -8, -8, 7, -8, 3]
    assert round_to_grid(y, INT4_SYM).tolist() == [0, 2, 2, -0.0, -2, 7, 7, -7, -7, 7, -7, 3]


@pytest.mark.parametrize("fmt", ALL)
def test_saturation_nan_inf_and_negative_zero(fmt):
    big = [fmt.max * (1.3 if isinstance(fmt, IntFormat) else 1.01), fmt.max * 1.5, fmt.max * 3, 1e30, 3.4e38, math.inf]
    x = torch.tensor(big + [-b for b in big] + [math.nan, -0.0, 0.0, -1e-40, 1e-45])
    r = round_to_grid(x, fmt)
    n = len(big)
    lo = fmt.qmin if isinstance(fmt, IntFormat) else -fmt.max
    assert (r[:n] == fmt.max).all() and (r[n:2 * n] == lo).all()
    assert torch.isfinite(r[:2 * n]).all()
    assert torch.isnan(r[2 * n])
    assert r[2 * n + 1:].abs().max() == 0
    if isinstance(fmt, FloatFormat):  # float formats keep the sign of zero; fp32 subnormals round to ±0
        assert torch.signbit(r[2 * n + 1:]).tolist() == [True, False, True, False]
    noise = torch.full_like(x, 0.999)
    rn = round_to_grid(x, fmt, noise)
    assert torch.equal(rn[:2 * n], r[:2 * n]) and torch.isnan(rn[2 * n])


@pytest.mark.parametrize("fmt", FLOAT8)
def test_saturation_agrees_with_torch_just_beyond_max(fmt):
    # between max and the midpoint to the next binade step torch's cast rounds to max too
    x = torch.tensor([fmt.max, fmt.max * (1 + 2.0 ** -(fmt.man_bits + 3))])
    assert torch.equal(round_to_grid(x, fmt), x.to(fmt.dtype).float())


def test_input_dtypes_and_layout():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=gen) * 30
    ref = round_to_grid(x.contiguous(), E4M3)
    assert torch.equal(round_to_grid(x.t(), E4M3), ref.t())  # non-contiguous input
    assert torch.equal(round_to_grid(x[:, ::3], E4M3), ref[:, ::3])
    xb = x.bfloat16()
    assert torch.equal(round_to_grid(xb, E4M3), round_to_grid(xb.float(), E4M3))
    assert round_to_grid(x.double(), E4M3).dtype == torch.float32
    assert round_to_grid(torch.tensor(3.3), "e2m1").shape == () and round_to_grid(torch.tensor(3.3), "e2m1") == 3


def test_to_fp8_rejects_formats_without_dtype():
    for fmt in (E2M1, INT4, "int4_sym"):
        with pytest.raises(ValueError):
            to_fp8(torch.ones(4), fmt)


@HYP
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32)))
def test_rne_property_any_fp32(arr):
    x = torch.from_numpy(arr)
    for fmt in ALL:
        r = round_to_grid(x, fmt)
        assert torch.equal(r.double().nan_to_num(7.5), nearest_ref(x, fmt).nan_to_num(7.5))
        assert torch.equal(torch.isnan(r), torch.isnan(x))
        if isinstance(fmt, FloatFormat):
            assert torch.equal(torch.signbit(r)[~torch.isnan(x)], torch.signbit(x)[~torch.isnan(x)])
            if fmt.dtype is not None:
                ok = x.abs() <= fmt.max
                assert torch.equal(r[ok], x[ok].to(fmt.dtype).float())


# ---- stochastic rounding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL)
def test_stochastic_rounding_neighbours_and_unbiased(fmt):
    gen = torch.Generator().manual_seed(4)
    g = signed_grid(fmt)
    # 160 points strictly between neighbours (both signs, all binades incl. subnormal), P(round up) in [.05, .95]
    j = torch.randint(0, len(g) - 1, (160,), generator=gen)
    p = torch.empty(160, dtype=torch.float64).uniform_(0.05, 0.95, generator=gen)
    x = (g[j] + p * (g[j + 1] - g[j])).float()
    lo, hi = neighbours(x, fmt)
    sign = torch.where(torch.signbit(x), -1.0, 1.0).double()
    if isinstance(fmt, IntFormat):
        sign = torch.ones_like(sign)
    draws = 4096
    xs = x.repeat(draws, 1)
    r = round_to_grid(xs, fmt, stochastic_noise(xs, gen)).double() * sign
    # every result is one of the two neighbours
    assert ((r == lo) | (r == hi)).all()
    assert ((r == hi).any(0) & (r == lo).any(0)).all()  # both occur
    # unbiased: mean of draws-many Bernoulli(p) choices of (hi - lo); its std is (hi-lo)·sqrt(p(1-p)/draws).
    # 5 standard deviations: a false failure has probability below 1e-6 per point (the seed is fixed anyway),
    # while a biased rounding (e.g. round-to-nearest, or floor(y + u) with u in (0, 1]) misses by ~(hi-lo)/2.
    a = x.double() * sign
    pp = (a - lo) / (hi - lo)
    sd = (hi - lo) * torch.sqrt(pp * (1 - pp) / draws)
    err = r.mean(0) - a
    assert (err.abs() <= 5 * sd).all(), (err.abs() / sd).max()
    # and all points together: the normalised bias is ~N(0, 1/sqrt(160)) after dividing by sd
    assert abs((err / sd).mean()) <= 5 / math.sqrt(160)


@pytest.mark.parametrize("fmt", ALL)
def test_stochastic_rounding_noise_edges_and_grid_points_stay(fmt):
    g = signed_grid(fmt).float()
    # a value on the grid never moves, whatever the noise, up to u = 1 - 2^-24 (fp32's largest below 1)
    for u in (0.0, 0.5, 0.999, 1 - 2.0 ** -24):
        assert torch.equal(round_to_grid(g, fmt, torch.full_like(g, u)), g)
    # off the grid: u = 0 rounds the magnitude down (floor), u -> 1 rounds it up
    gen = torch.Generator().manual_seed(5)
    j = torch.randint(0, len(g) - 1, (500,), generator=gen)
    x = (g[j].double() + torch.rand(500, generator=gen, dtype=torch.float64).clamp(0.01, 0.99)
         * (g[j + 1] - g[j]).double()).float()
    lo, hi = neighbours(x, fmt)
    sign = 1.0 if isinstance(fmt, IntFormat) else torch.where(torch.signbit(x), -1.0, 1.0).double()
    assert torch.equal(round_to_grid(x, fmt, torch.zeros_like(x)).double() * sign, lo)
    assert torch.equal(round_to_grid(x, fmt, torch.full_like(x, 1 - 2.0 ** -24)).double() * sign, hi)


def test_stochastic_rounding_probability_is_exact_fraction():
    # x = 1 + 3/64 in E4M3 (neighbours 1 and 1.125, P(up) = 3/8): u >= 5/8 rounds up, exactly
    x = torch.full((5,), 1 + 3 / 64)
    u = torch.tensor([0.0, 0.625 - 2.0 ** -24, 0.625, 0.9, 1 - 2.0 ** -24])
    assert round_to_grid(x, E4M3, u).tolist() == [1, 1, 1.125, 1.125, 1.125]
    assert round_to_grid(torch.full((5,), 2.375), INT4, u).tolist() == [2, 2, 3, 3, 3]


# ---- 4-bit packing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E2M1, INT4, INT4_SYM])
@pytest.mark.parametrize("shape", [(2,), (16,), (3, 8), (2, 5, 6), (1, 130)])
def test_pack_unpack_round_trip(fmt, shape):
    gen = torch.Generator().manual_seed(6)
    g = signed_grid(fmt).float()
    if fmt is E2M1:
        g = torch.cat([g, torch.tensor([-0.0])])
    q = g[torch.randint(0, len(g), shape, generator=gen)]
    b = pack_4bit(q, fmt)
    assert b.dtype == torch.uint8 and b.shape == (*shape[:-1], shape[-1] // 2)
    u = unpack_4bit(b, fmt)
    assert u.dtype == torch.float32 and torch.equal(u, q)
    assert torch.equal(torch.signbit(u), torch.signbit(q))  # E2M1 keeps -0.0


def test_pack_every_code_and_layout():
    # all 16 E2M1 nibbles, first element in the low nibble (as torch's float4_e2m1fn_x2)
    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])
    b = pack_4bit(vals, "e2m1")
    assert b.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(torch.signbit(unpack_4bit(b, "e2m1")), torch.signbit(vals))
    assert pack_4bit(torch.tensor([0.5, -6.0]), E2M1).tolist() == [0xF1]
    ints = torch.arange(-8, 8).float()
    bi = pack_4bit(ints, INT4)
    assert bi.tolist() == [0x98, 0xBA, 0xDC, 0xFE, 0x10, 0x32, 0x54, 0x76]
    assert torch.equal(unpack_4bit(bi, INT4), ints)
    assert pack_4bit(torch.tensor([-8.0, 7.0]), INT4).tolist() == [0x78]
    # every byte decodes and re-encodes to itself
    every = torch.arange(256, dtype=torch.uint8)
    for fmt in (E2M1, INT4):
        assert torch.equal(pack_4bit(unpack_4bit(every, fmt), fmt), every)


def test_pack_errors():
    for fmt in (E2M1, INT4):
        with pytest.raises(ValueError):
            pack_4bit(torch.zeros(3), fmt)
        with pytest.raises(ValueError):
            pack_4bit(torch.zeros(2, 5), fmt)
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(ValueError):  # off the E2M1 grid
        pack_4bit(torch.tensor([0.7, 1.0]), E2M1)
    with pytest.raises(ValueError):
        pack_4bit(torch.tensor([8.0, 1.0]), E2M1)


@HYP
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 20).map(lambda k: 2 * k)),
                  elements=st.floats(-20, 20, width=32)))
def test_pack_after_rounding_property(arr):
    x = torch.from_numpy(arr)
    for fmt in (E2M1, INT4):
        q = round_to_grid(x, fmt)
        assert torch.equal(unpack_4bit(pack_4bit(q, fmt), fmt), q)
