"""4-bit optimizer states (state_bits=4): the codec against a float64 hand computation, packing, the fused
kernel against the reference (under the interpreter on the CPU, compiled on a GPU), the update bound on
tests/test_update_bound.py's streams, state bytes, exact resume, and torch AdamW import / export."""
import io
import math

import warnings

import pytest
import torch

import lpoptim
from lpoptim import quant
from lpoptim.kernels import adamw_step as kernel
from lpoptim.optim.reference import load_moment
from lpoptim.optim.state import StateLayout, init_state

from kernel_steps import kernel_and_reference, non_finite_grad

LAYOUT4 = StateLayout(quantized=True, state_bits=4)
SHAPES = [(48, 256), (5, 200), (1001,), (3, 7, 130), (16, 128), (6, 33)]


# ---- the codec ---------------------------------------------------------------------------------------------


def _hand(x: torch.Tensor, second: bool, group_size: int = 128) -> torch.Tensor:
    """The codec in float64, written from its definition: round(|x| / absmax · top) (ties to even) with m's
    integers 0..7 and v's 1..16, times absmax / top, sign kept."""
    g = quant.to_groups(x.double(), group_size)
    amax = g.abs().amax(-1, keepdim=True)
    top = 16.0 if second else 7.0
    q = torch.round(g.abs() / torch.where(amax > 0, amax, 1.0) * top)
    q = q.clamp(1, 16) if second else q.clamp(0, 7)
    return quant.from_groups(torch.copysign(q * amax / top, g), x.shape)


@pytest.mark.parametrize("shape", [(3, 300), (5, 129), (7,), (), (4, 1), (2, 3, 256), (0, 128)])
@pytest.mark.parametrize("second", [False, True])
def test_codec_matches_float64_hand_computation(shape, second):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    if second:
        x = x * x
    codes, scale = quant.quantize_state4(x, second)
    assert codes.dtype == torch.uint8 and codes.shape == quant.packed_shape(x.shape)
    assert scale.dtype == torch.float32 and scale.shape == quant.num_groups(x.shape, 128)
    got = quant.dequantize_state4(codes, scale, x.shape, second)
    want = _hand(x, second)
    # the same integers: fp32 differs from float64 only by the rounding of top/c and of the product (ulps)
    torch.testing.assert_close(got.double(), want, rtol=3e-7, atol=0)
    # the grid: |error| <= half a step (c / (2 top)) of the group, and v never 0 (below c/32 it takes c/16)
    if x.numel():
        step = quant.to_groups(x.abs(), 128).amax(-1, keepdim=True) / (16 if second else 7)
        err = quant.to_groups((got - x).abs(), 128)
        allowed = torch.where(quant.to_groups(x.abs(), 128) < step / 2, step, step / 2) if second else step / 2
        assert (err <= allowed * (1 + 1e-6)).all()
        if second:
            assert (got > 0).all()
    # stochastic rounding: floor(f + u), in float64 by hand, u given
    u = torch.rand(shape, generator=gen)
    codes, scale = quant.quantize_state4(x, second, noise=u)
    got = quant.dequantize_state4(codes, scale, x.shape, second)
    g = quant.to_groups(x.double(), 128)
    amax = g.abs().amax(-1, keepdim=True)
    top = 16.0 if second else 7.0
    q = torch.floor(g.abs() / torch.where(amax > 0, amax, 1.0) * top + quant.to_groups(u.double(), 128))
    q = q.clamp(1, 16) if second else q.clamp(0, 7)
    torch.testing.assert_close(got.double(), quant.from_groups(torch.copysign(q * amax / top, g), x.shape),
                               rtol=3e-7, atol=0)


def test_codec_nibbles_and_packing():
    x = torch.tensor([[7.0, -7.0, 3.0, -0.4, 0.6, 0.0, -3.5, 2.5]])  # absmax 7: q = x rounded, ties to even
    codes, scale = quant.quantize_state4(x, False)
    assert scale.tolist() == [[7.0]]
    nib = quant.unpack_codes4(codes, x.shape)
    assert nib.tolist() == [[7, 9, 3, 0, 1, 0, 12, 2]]  # two's complement; -0.4 -> 0; -3.5 -> -4; 2.5 -> 2
    assert codes.tolist() == [[7 | 9 << 4, 3 | 0 << 4, 1 | 0 << 4, 12 | 2 << 4]]
    v = torch.tensor([16.0, 0.0, 1e-9, 8.0, 8.4, 0.5])  # odd count packs into 3 bytes; 0 and tiny -> 1/16
    codes, scale = quant.quantize_state4(v[:5], True)
    assert codes.shape == (3,) and int(codes[2]) >> 4 == 0  # the odd row's last high nibble is 0
    assert quant.dequantize_state4(codes, scale, (5,), True).tolist() == [16.0, 1.0, 1.0, 8.0, 8.0]


def test_codec_special_values():
    m = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -2.0, 0.0])
    codes, scale = quant.quantize_state4(m, False)
    y = quant.dequantize_state4(codes, scale, m.shape, False)
    assert scale.item() == 2.0  # finite absmax: inf and NaN set no scale
    assert math.isnan(y[1]) and y[2] == 2.0 and y[3] == -2.0 and y[4] == -2.0 and y[5] == 0
    v = torch.tensor([1.0, float("nan"), float("inf"), 0.0])
    codes, scale = quant.quantize_state4(v, True)
    y = quant.dequantize_state4(codes, scale, v.shape, True)
    assert y.tolist() == [1.0, 1.0, 1.0, 1.0 / 16]  # saturated to the group's top; never 0
    for x in (torch.zeros(300), torch.full((300,), 1e-40)):  # all zero, or an fp32-subnormal absmax: flushed
        for second in (False, True):
            c, s = quant.quantize_state4(x, second)
            assert (s == 0).all() and (quant.dequantize_state4(c, s, x.shape, second) == 0).all()


def test_codec_scale_whose_reciprocal_overflows():
    """A scale just above fp32's smallest normal makes 16/c (and 7/c) overflow: a zero beside it is 0 * inf = NaN.
    The kernel's minimum drops that NaN to the top, so the reference does too: every code is a nibble (a NaN cast to
    int32 spilled into its neighbour's), zeros encode to the top (m: +7 by its sign bit, -7 for -0.0, as the kernel
    reads the sign), and the group still decodes within its scale."""
    c = torch.tensor(2e-38).item()  # as fp32 holds it
    assert torch.isinf(torch.tensor(7.0) / torch.tensor(c)) and c > quant.FP32_MIN_NORMAL
    v = torch.tensor([c, 0.0, c / 2, 0.0, 0.0, c])
    codes, scale = quant.quantize_state4(v, True, noise=torch.full_like(v, 0.5))
    nib = quant.unpack_codes4(codes, v.shape)
    assert ((nib >= 0) & (nib <= 15)).all() and scale.item() == c
    assert nib[1] == 15 and nib[3] == 15 and nib[0] == 15
    m = torch.tensor([c, 0.0, -0.0, -c])
    codes, scale = quant.quantize_state4(m, False)
    nib = quant.unpack_codes4(codes, m.shape).tolist()
    assert nib[1] == 7 and nib[2] == quant.int4_to_nibble(torch.tensor(-7)).item()
    y = quant.dequantize_state4(codes, scale, m.shape, False)
    assert (y.abs() <= c).all()


def test_codec_round_trip_is_a_fixed_point():
    """Decoding and encoding again reproduces the codes: a resumed, re-encoded state does not drift."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 384, generator=gen) * torch.exp(torch.randn(9, 384, generator=gen) * 4)
    for second, t in ((False, x), (True, x * x)):
        codes, scale = quant.quantize_state4(t, second)
        y = quant.dequantize_state4(codes, scale, t.shape, second)
        codes2, scale2 = quant.quantize_state4(y, second)
        assert torch.equal(codes, codes2) and torch.equal(scale, scale2)


def test_ratio_bound_matches_hand_computation_and_special_values():
    """Each group's largest m^2 / v of the exact moments (to fp32's rounding); 0 where m is 0, inf where v is 0
    beside a live m, NaN left out."""
    gen = torch.Generator().manual_seed(5)
    for shape in [(3, 300), (7,), (2, 3, 256), (0, 128)]:
        m = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
        v = m * m * torch.rand(shape, generator=gen).add(0.01).reciprocal()
        r2 = quant.state4_ratio_bound(m, v)
        assert r2.dtype == torch.float32 and r2.shape == quant.num_groups(shape, 128)
        want = quant.to_groups((m.double() ** 2 / v.double()), 128).amax(-1) if m.numel() else r2.double()
        torch.testing.assert_close(r2.double(), want, rtol=4e-7, atol=0)
    m = torch.tensor([0.0, 1.0, float("nan"), 2.0, 0.0, 3.0])
    v = torch.tensor([0.0, 4.0, 1.0, 1.0, 1.0, float("nan")])
    assert quant.state4_ratio_bound(m, v).float().item() == 4.0  # 2^2 / 1; NaNs left out
    assert quant.state4_ratio_bound(torch.tensor([1e-3, 0.0]), torch.tensor([0.0, 0.0])).float().item() == math.inf
    assert quant.state4_ratio_bound(torch.zeros(5), torch.zeros(5)).float().item() == 0.0
    assert quant.state4_ratio_bound(torch.tensor([1e30]), torch.tensor([1e-30])).float().item() == math.inf


def _per_element(r2, shape):
    return quant.from_groups(quant.to_groups(torch.zeros(shape, dtype=r2.dtype), 128) + r2.unsqueeze(-1), shape)


def _exact_moments(state, g, beta1, beta2):
    """The fp32 m and v that reference_adamw_step computes from a 4-bit ``state`` and ``g`` before encoding
    them (its arithmetic, Adam's bound at decode included)."""
    m0 = load_moment(state, "exp_avg", LAYOUT4, g.shape)
    v0 = torch.fmax(load_moment(state, "exp_avg_sq", LAYOUT4, g.shape),
                    m0 * m0 * quant.adam_bound_inv(state["step"], beta1, beta2))
    return m0 + (1 - beta1) * (g - m0), v0 * beta2 + (1 - beta2) * g * g


@pytest.mark.parametrize("shape", [(3, 300), (16, 256), (7,), (2, 3, 130), (0, 128)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_encode_raises_v_to_the_groups_ratio_bound(shape, stochastic):
    """quantize_state4_moments: m's codes and both scales are quantize_state4's; v's codes are at least its, and
    each is the smallest code (above the one rounding gave) whose decoded m^2 / v is within the group's r2 (up to
    the 2^-20 slack and fp32's roundings); without the raise some decoded ratios exceed r2."""
    gen = torch.Generator().manual_seed(len(shape) + 7 * stochastic)
    m = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen))
    v = m * m * torch.rand(shape, generator=gen).add(0.02).reciprocal() + 1e-3 * torch.rand(shape, generator=gen)
    noise = torch.rand(shape, generator=gen) if stochastic else None
    mc, ms, vc, vs = quant.quantize_state4_moments(m, v, noise=noise)
    mc0, ms0 = quant.quantize_state4(m, False)
    vc0, vs0 = quant.quantize_state4(v, True, noise=noise)
    assert torch.equal(mc, mc0) and torch.equal(ms, ms0) and torch.equal(vs, vs0)
    j = quant.unpack_codes4(vc, shape) + 1
    j0 = quant.unpack_codes4(vc0, shape) + 1
    assert (j >= j0).all()
    md = quant.dequantize_state4(mc, ms, shape, False).double()
    r2 = _per_element(quant.state4_ratio_bound(m, v).double(), shape)
    vd = quant.dequantize_state4(vc, vs, shape, True).double()
    assert (md * md / vd <= r2 * (1 + 1e-5)).all()
    # minimal: one code lower (where raised) would exceed the bound
    c = _per_element(vs.double(), shape)
    below = (j - 1).double() * c / 16
    raised = j > j0
    assert (md * md / below > r2 * (1 - 1e-5))[raised].all()
    if m.numel() > 1000:
        vd0 = quant.dequantize_state4(vc0, vs0, shape, True).double()
        assert raised.any() and (md * md / vd0 > r2 * (1 + 1e-5)).any()


def test_encode_ratio_bound_special_values():
    """No bound where r2 is 0 (m all 0) or inf (v = 0 beside a live m); NaN m or v: their own codes as without the
    bound (v NaN: 16), NaN left out of r2."""
    noise = torch.full((4, 128), 0.5)
    for m, v in [(torch.zeros(4, 128), torch.rand(4, 128)),  # r2 = 0
                 (torch.randn(4, 128), torch.cat([torch.zeros(4, 1), torch.rand(4, 127)], 1))]:  # r2 = inf
        _, _, vc, vs = quant.quantize_state4_moments(m, v, noise=noise)
        assert torch.equal(vc, quant.quantize_state4(v, True, noise=noise)[0])
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(4, 128, generator=gen)
    v = m * m * 4 + 1e-2
    m[0, 3] = float("nan")
    v[1, 5] = float("nan")
    mc, ms, vc, vs = quant.quantize_state4_moments(m, v, noise=noise)
    assert torch.isnan(quant.dequantize_state4(mc, ms, m.shape, False)[0, 3])
    assert quant.unpack_codes4(vc, m.shape)[1, 5] == 15
    r2 = quant.state4_ratio_bound(m, v)
    assert torch.isfinite(r2).all() and (r2 > 0).all()


# ---- the optimizer ------------------------------------------------------------------------------------------


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 193), torch.nn.GELU(), torch.nn.Linear(193, 129),
                               torch.nn.LayerNorm(129))


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 256, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def test_state_layout_and_bytes():
    model = _model()
    opt = lpoptim.AdamW(model.parameters(), lr=1e-3, state_bits=4)
    _train(model, opt, 2)
    w = model[0].weight
    st = opt.state[w]
    assert set(st) == {"step", "exp_avg_codes4", "exp_avg_scale", "exp_avg_sq_codes4", "exp_avg_sq_scale"}
    assert st["exp_avg_codes4"].shape == (193, 128) and st["exp_avg_codes4"].dtype == torch.uint8
    assert st["exp_avg_scale"].shape == (193, 2) and st["exp_avg_scale"].dtype == torch.float32
    assert opt.state[model[2].weight]["exp_avg_codes4"].shape == (129, 97)  # 193 wide: the last byte half used
    assert "exp_avg" in opt.state[model[0].bias]  # small tensors keep fp32 moments
    sb = lpoptim.state_bytes(opt)
    assert sb["quantized_bytes_per_param"] <= 1.1  # 193 and 129 wide: short groups cost more than at 128 wide
    # per moment: ceil(N/2) bytes a row, 4 a group (193-wide rows: 2 groups of a row, one short)
    ws = [model[0].weight, model[2].weight]
    want = sum(2 * (math.prod(quant.packed_shape(w.shape)) + 4 * math.prod(quant.num_groups(w.shape, 128))) for w in ws)
    assert sb["quantized_bytes_per_param"] == pytest.approx(want / sum(w.numel() for w in ws), abs=1e-12)
    # 128-wide rows, the layout the 1.0625 figure is for
    big = torch.nn.Linear(384, 64, bias=False)
    opt = lpoptim.AdamW(big.parameters(), state_bits=4)
    big(torch.randn(2, 384)).sum().backward()
    opt.step()
    assert lpoptim.state_bytes(opt)["quantized_bytes_per_param"] == 1.0625
    from lpoptim.memory import state_bytes
    assert state_bytes(big.weight, state_bits=4) == 1.0625 * big.weight.numel() + 4


def test_options_refused():
    with pytest.raises(ValueError, match="state_bits"):
        lpoptim.AdamW(_model().parameters(), state_bits=6)
    with pytest.raises(ValueError, match="state_bits"):
        lpoptim.AdamW(_model().parameters(), state_bits=True)
    with pytest.raises(ValueError, match="sqrt_exp_avg_sq"):
        lpoptim.AdamW(_model().parameters(), state_bits=4, sqrt_exp_avg_sq=True)


def test_per_group_state_bits_and_changing_it_after_a_step_is_refused():
    model = _model()
    opt = lpoptim.AdamW([{"params": model[0].parameters(), "state_bits": 4}, {"params": model[2].parameters()}],
                        lr=1e-3)
    _train(model, opt, 1)
    assert "exp_avg_codes4" in opt.state[model[0].weight] and "exp_avg_codes" in opt.state[model[2].weight]
    opt.param_groups[1]["state_bits"] = 4
    with pytest.raises(ValueError, match="state_bits=8.*set state_bits in the param_groups of its state_dict"):
        _train(model, opt, 1)


def test_loading_other_state_bits_than_built_with_warns_and_keeps_the_saved_ones():
    """A loaded group's options replace the optimizer's (torch's rule), so an optimizer built with state_bits=4
    that loads an FP8 state dict keeps FP8 states: it says so, and how to convert, instead of leaving the user
    believing the states are 4-bit."""
    a = _model()
    opt8 = lpoptim.AdamW(a.parameters(), lr=1e-3)
    _train(a, opt8, 2)
    b = _model()
    opt4 = lpoptim.AdamW(b.parameters(), lr=1e-3, state_bits=4)
    with pytest.warns(UserWarning, match=r"saved with state_bits=8 and keeps it .*param_groups\[0\]\['state_bits'\]"):
        opt4.load_state_dict(opt8.state_dict())
    assert opt4.param_groups[0]["state_bits"] == 8 and "exp_avg_codes" in opt4.state[b[0].weight]
    with warnings.catch_warnings():  # the same bits: nothing to say
        warnings.simplefilter("error")
        lpoptim.AdamW(_model().parameters(), lr=1e-3).load_state_dict(opt8.state_dict())


def test_reference_matches_torch_adamw_loosely():
    """4 bits move the update by about half its norm at worst (benchmarks/state_quant_error.py); the trajectory
    still follows torch's."""
    a, b = _model(), _model()
    opt_a = lpoptim.AdamW(a.parameters(), lr=1e-3, state_bits=4)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    _train(a, opt_a, 20)
    _train(b, opt_b, 20)
    for pa, pb, p0 in zip(a.parameters(), b.parameters(), _model().parameters()):
        da, db = pa.detach() - p0.detach(), pb.detach() - p0.detach()
        assert ((da - db).norm() / db.norm()).item() < 0.5
        assert torch.nn.functional.cosine_similarity(da.flatten(), db.flatten(), dim=0) > 0.85


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("opts", [dict(), dict(amsgrad=True, weight_decay=0.1)])
def test_resume_is_bit_exact(opts):
    a = _model()
    opt_a = lpoptim.AdamW(a.parameters(), lr=1e-3, state_bits=4, **opts)
    _train(a, opt_a, 3)
    sd = _save_load(opt_a.state_dict())
    assert all(t.dtype in (torch.uint8, torch.float32) for st in sd["state"].values() for t in st.values())
    b = _model()
    b.load_state_dict(a.state_dict())
    opt_b = lpoptim.AdamW(b.parameters(), lr=1e-3, state_bits=4, **opts)
    opt_b.load_state_dict(sd)
    _train(a, opt_a, 3, seed=5)
    _train(b, opt_b, 3, seed=5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_torch_export_and_import():
    a = _model()
    opt = lpoptim.AdamW(a.parameters(), lr=1e-3, state_bits=4)
    _train(a, opt, 3)
    tsd = opt.torch_state_dict()
    w = a[2].weight  # 193 wide: an odd packed row
    pid = [p is w for p in a.parameters()].index(True)
    layout = StateLayout.for_param(w, opt.param_groups[0])
    torch.testing.assert_close(tsd["state"][pid]["exp_avg"], load_moment(opt.state[w], "exp_avg", layout, w.shape))
    assert tsd["state"][pid]["exp_avg"].shape == w.shape
    # torch AdamW loads the export and steps; its state imported into a 4-bit optimizer is quantized
    t_opt = torch.optim.AdamW(a.parameters(), lr=1e-3)
    t_opt.load_state_dict(_save_load(tsd))
    _train(a, t_opt, 1)
    b = _model()
    opt_b = lpoptim.AdamW(b.parameters(), lr=1e-3, state_bits=4)
    opt_b.load_state_dict(t_opt.state_dict())
    st = opt_b.state[b[2].weight]
    assert "exp_avg_codes4" in st and st["exp_avg_codes4"].shape == (129, 97)
    want = t_opt.state[w]["exp_avg"]
    got = load_moment(st, "exp_avg", layout, w.shape)
    step = quant.to_groups(want.abs(), 128).amax(-1, keepdim=True) / 7
    assert (quant.to_groups((got - want).abs(), 128) <= step / 2 * (1 + 1e-6)).all()
    # v's codes raised to the groups' ratio bound of torch's exact moments (v to nearest: no noise on import)
    mc, ms, vc, vs = quant.quantize_state4_moments(want, t_opt.state[w]["exp_avg_sq"])
    assert torch.equal(st["exp_avg_codes4"], mc) and torch.equal(st["exp_avg_sq_codes4"], vc)
    assert torch.equal(st["exp_avg_sq_scale"], vs)
    _train(b, opt_b, 1)


def test_every_decoded_ratio_is_within_its_groups_exact_one_after_a_step():
    """After each step, every element's decoded m^2 / v is at most the largest m^2 / v its group's exact fp32
    moments had (what the step computed before encoding them), and the codes are quantize_state4_moments' of those
    moments with AdamW's noise; without the raise at encode some decoded ratios exceed it."""
    from lpoptim.optim.reference import reference_adamw_step
    from lpoptim.optim.stochastic_round import sr_key, uniform_noise

    gen = torch.Generator().manual_seed(2)
    p = torch.randn(64, 256, generator=gen)
    st = init_state(p, LAYOUT4, False)
    exceeded = 0
    for t in range(12):
        g = torch.randn(p.shape, generator=gen) * torch.exp(torch.randn(p.shape, generator=gen))
        m_exact, v_exact = _exact_moments(st, g, 0.9, 0.999)  # the step's, as the reference computes them
        reference_adamw_step(p, g, st, LAYOUT4, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                             amsgrad=False, maximize=False, state_salt=1)
        noise = uniform_noise(p.shape, sr_key(st["step"], 1))
        mc, ms, vc, vs = quant.quantize_state4_moments(m_exact, v_exact, noise=noise)
        assert torch.equal(st["exp_avg_codes4"], mc) and torch.equal(st["exp_avg_sq_codes4"], vc)
        m = load_moment(st, "exp_avg", LAYOUT4, p.shape).double()
        v = load_moment(st, "exp_avg_sq", LAYOUT4, p.shape).double()
        r2 = _per_element(quant.state4_ratio_bound(m_exact, v_exact).double(), p.shape)
        assert (m * m / v <= r2 * (1 + 1e-5)).all()
        v_plain = quant.dequantize_state4(*quant.quantize_state4(v_exact, True, noise=noise), p.shape, True).double()
        exceeded += int((m * m / v_plain > r2 * (1 + 1e-5)).sum())
    assert exceeded > 0  # 4-bit rounding alone does break it: the raise is doing something


def test_state_dicts_convert_between_state_bits():
    """An FP8 state loaded by a group asking for state_bits=4 (a state dict without the option: saved before it
    existed, or edited) is decoded and encoded in 4 bits, and back."""
    a = _model()
    opt8 = lpoptim.AdamW(a.parameters(), lr=1e-3)
    _train(a, opt8, 3)
    sd = opt8.state_dict()
    for g in sd["param_groups"]:
        g["state_bits"] = 4
    b = _model()
    opt4 = lpoptim.AdamW(b.parameters(), lr=1e-3, state_bits=4)
    opt4.load_state_dict(sd)
    w8, w4 = opt8.state[a[0].weight], opt4.state[b[0].weight]
    assert "exp_avg_codes4" in w4 and "exp_avg_codes" not in w4
    layout8 = StateLayout.for_param(a[0].weight, opt8.param_groups[0])
    layout4 = StateLayout.for_param(b[0].weight, opt4.param_groups[0])
    m8 = load_moment(w8, "exp_avg", layout8)
    m4 = load_moment(w4, "exp_avg", layout4, b[0].weight.shape)
    assert ((m4 - m8).norm() / m8.norm()).item() < 0.2
    _train(b, opt4, 1)
    sd4 = opt4.state_dict()
    for g in sd4["param_groups"]:
        g["state_bits"] = 8
    opt8b = lpoptim.AdamW(b.parameters(), lr=1e-3)
    opt8b.load_state_dict(sd4)
    assert "exp_avg_codes" in opt8b.state[b[0].weight]
    _train(b, opt8b, 1)


# ---- the fused kernel against the reference -------------------------------------------------------------------


@pytest.fixture
def _tiles(interpreter_friendly_tiles):  # conftest.py
    from lpoptim.kernels.grid import interpreted

    if not interpreted():  # CPU tensors need the interpreter; on a GPU machine the _gpu tests cover the kernel
        pytest.skip("runs under TRITON_INTERPRET=1")
    yield


def _run(device, dtype, steps=3, amsgrad=False, maximize=False, lr=1e-2, layout=LAYOUT4, grad_scale=None,
         found_inf=None, sr_salts=None, shapes=SHAPES):
    state_salts = sr_salts or [7 + i for i in range(len(shapes))]  # v's stochastic rounding, salted per tensor
    return kernel_and_reference(device, dtype, layout, shapes, steps, amsgrad, maximize, lr, grad_scale, found_inf,
                                sr_salts, state_salts)


def _compare(params, ref_p, states, ref_s, code_tol=0.0, exact=True):
    """Under the interpreter scales and codes exactly (measured: every one equal; the moments are the same fp32
    operations, only the parameter's update takes rcp there); on the GPU, where fused multiply-adds and rcp.approx
    move an fp32 moment by an ulp, scales but for a few and codes but for a few that such an ulp moved across a
    rounding boundary. Parameters to a few ulps plus 2^-13 of the update (adamw_step's tolerance)."""
    far = elements = 0
    for p, rp, s, rs in zip(params, ref_p, states, ref_s):
        assert torch.equal(s["step"], rs["step"])
        assert s.keys() == rs.keys()
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if name + "_scale" not in s:
                continue
            a, b = s[name + "_scale"], rs[name + "_scale"]
            close = (a - b).abs() <= 4e-7 * b.abs()
            assert torch.equal(a, b) if exact else close.float().mean() >= 0.98, f"{name} {tuple(p.shape)}: scales"
            ca = quant.unpack_codes4(s[name + "_codes4"], p.shape)
            cb = quant.unpack_codes4(rs[name + "_codes4"], p.shape)
            moved = (ca != cb).float().mean().item()
            assert moved <= code_tol, f"{name} {tuple(p.shape)}: {moved:.4%} of codes differ"
            # whole bytes, the padding nibbles of odd rows included (written as the reference writes them)
            moved_bytes = (s[name + "_codes4"] != rs[name + "_codes4"]).float().mean().item()
            assert moved_bytes <= 2 * code_tol
        eps = torch.finfo(p.dtype).eps
        tol = 4 * eps * rp.float().abs() + max(4 * eps, 2.0 ** -13) * 1e-2
        far += int(((p.float() - rp.float()).abs() > tol).sum())
        elements += p.numel()
    assert far <= max(2, 2e-3 * elements), f"{far} of {elements} parameters differ by more than a few ulps"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_interpreter(dtype, _tiles):
    _compare(*_run("cpu", dtype))


@pytest.mark.parametrize("opts", [dict(amsgrad=True), dict(maximize=True), dict(lr=torch.tensor(3e-3)),
                                  dict(layout=StateLayout(True, group_size=32, state_bits=4)),
                                  dict(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))])
def test_kernel_options_interpreter(opts, _tiles):
    _compare(*_run("cpu", torch.float32, steps=2, shapes=SHAPES[:3], **opts))


def test_kernel_found_inf_and_stochastic_rounding_interpreter(_tiles):
    params, ref_p, states, ref_s = _run("cpu", torch.float32, steps=2, found_inf=torch.tensor(1.0), shapes=SHAPES[:2])
    assert all(float(s["step"]) == 0 and int(s["exp_avg_codes4"].count_nonzero()) == 0 for s in states)
    assert all(torch.equal(p, rp) for p, rp in zip(params, ref_p))
    _compare(*_run("cpu", torch.bfloat16, steps=2, sr_salts=[3, 4, 5], shapes=SHAPES[:3]))


def test_kernel_raises_v_to_the_ratio_bound_as_the_reference(_tiles):
    """Heavy-tailed gradients, where the raise at encode moves many of v's codes: the kernel's codes are the
    reference's (and quantize_state4_moments' of the reference's exact moments), and some are raised."""
    from lpoptim.optim.reference import reference_adamw_step
    from lpoptim.optim.stochastic_round import sr_key, uniform_noise

    gen = torch.Generator().manual_seed(4)
    p = torch.randn(6, 256, generator=gen)
    s = init_state(p, LAYOUT4, False)
    rp, rs = p.clone(), {k: v.clone() for k, v in s.items()}
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    raised = 0
    for _ in range(4):
        g = torch.randn(p.shape, generator=gen) * torch.exp(2 * torch.randn(p.shape, generator=gen))
        _, v_exact = _exact_moments(rs, g, 0.9, 0.99)
        kernel.fused_adamw_step([(p, g, s, LAYOUT4)], state_salts=[3], **hyper)
        reference_adamw_step(rp, g, rs, LAYOUT4, state_salt=3, **hyper)
        assert s.keys() == rs.keys() and all(torch.equal(s[k], rs[k]) for k in s)
        noise = uniform_noise(p.shape, sr_key(rs["step"], 3))
        plain = quant.unpack_codes4(quant.quantize_state4(v_exact, True, noise=noise)[0], p.shape)
        raised += int((quant.unpack_codes4(s["exp_avg_sq_codes4"], p.shape) > plain).sum())
    assert raised > 0


def test_kernel_nan_gradient_stays_in_its_element(_tiles):
    _nan_gradient_stays_in_its_element("cpu")


@pytest.mark.gpu
def test_kernel_nan_gradient_stays_in_its_element_gpu():
    _nan_gradient_stays_in_its_element("cuda")


def _nan_gradient_stays_in_its_element(device):
    p = torch.randn(4, 256, device=device)
    s = init_state(p, LAYOUT4, False)
    g = torch.randn(4, 256, device=device) * 1e-3
    g[1, 5] = float("nan")
    g[2, 9] = float("inf")
    kernel.fused_adamw_step([(p, g, s, LAYOUT4)], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            amsgrad=False, maximize=False, state_salts=[0])
    bad = ~torch.isfinite(p)
    assert bad.sum() == 2 and bad[1, 5] and bad[2, 9]
    m = load_moment(s, "exp_avg", LAYOUT4, p.shape)
    assert torch.isnan(m).sum() == 1 and torch.isnan(m[1, 5]) and m[2, 9] > 0


@pytest.mark.parametrize("amsgrad", [False, True])
def test_kernel_non_finite_gradients_match_reference(amsgrad, _tiles):
    """Infinities and NaNs in the gradients (the finite absmax, NaN's codes, NaN decoded; a group whose only nonzero
    moment is a NaN; amsgrad's running maximum keeping a NaN, as torch.maximum does): codes and scales bit for bit
    the reference's, over steps that decode the NaN codes of the last one."""
    from lpoptim.optim.reference import reference_adamw_step

    gen = torch.Generator().manual_seed(5)
    p = torch.randn(8, 256, generator=gen)
    s = init_state(p, LAYOUT4, amsgrad)
    rp, rs = p.clone(), {k: v.clone() for k, v in s.items()}
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=False)
    for step in range(3):
        g = non_finite_grad(step, generator=gen)
        kernel.fused_adamw_step([(p, g, s, LAYOUT4)], state_salts=[2], **hyper)
        reference_adamw_step(rp, g, rs, LAYOUT4, state_salt=2, **hyper)
        assert all(torch.equal(s[k], rs[k]) for k in s), [k for k in s if not torch.equal(s[k], rs[k])]
        # parameters: the same non-finite elements; the rest within _compare's tolerance (the update takes rcp)
        assert torch.equal(p.isfinite(), rp.isfinite()) and torch.equal(p.isnan(), rp.isnan())
        torch.testing.assert_close(p, rp, rtol=4 * torch.finfo(p.dtype).eps, atol=2.0 ** -13 * 1e-2, equal_nan=True)
    m = load_moment(s, "exp_avg", LAYOUT4, p.shape)
    assert torch.isnan(m[1, 5]) and torch.isnan(m[6, 3]) and torch.isnan(m).sum() == 2  # in their elements


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_kernel_matches_reference_gpu(dtype, amsgrad):
    _compare(*_run("cuda", dtype, steps=4, amsgrad=amsgrad), code_tol=0.01, exact=False)


@pytest.mark.gpu
def test_optimizer_on_gpu_uses_the_kernel_and_resumes_exactly():
    a = _model().cuda()
    opt = lpoptim.AdamW(a.parameters(), lr=1e-3, state_bits=4, fused=True)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 256, generator=gen).cuda() for _ in range(6)]

    def steps(model, o, batch):
        for x in batch:
            o.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            o.step()
    steps(a, opt, xs[:3])
    sd = _save_load(opt.state_dict())
    b = _model().cuda()
    b.load_state_dict(a.state_dict())
    opt_b = lpoptim.AdamW(b.parameters(), lr=1e-3, state_bits=4, fused=True)
    opt_b.load_state_dict(sd)
    steps(a, opt, xs[3:])
    steps(b, opt_b, xs[3:])
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    assert lpoptim.state_bytes(opt)["quantized_bytes_per_param"] <= 1.1  # short groups: 1.0625 at 128-wide rows


# ---- the update bound -------------------------------------------------------------------------------------------

ADAM_FLAGS = {"default": {}, "amsgrad": dict(amsgrad=True), "weight decay": dict(weight_decay=0.1),
              "betas 0.9/0.95": dict(betas=(0.9, 0.95)), "maximize": dict(maximize=True)}


@pytest.mark.parametrize("flags", ADAM_FLAGS.values(), ids=ADAM_FLAGS.keys())
def test_adams_own_bound_always_holds(flags):
    """What Adam guarantees whatever the gradients, |m| / sqrt(v) <= sqrt(K_t) (quant.adam_bound_terms), holds for
    every element at every step of 4-bit states: |step| <= lr · sqrt(1 - b2^t) / (1 - b1^t) · sqrt(K_t) plus the
    weight decay's lr · wd · |p|, on every stream of tests/test_update_bound.py. (The 4-bit grids alone break it:
    v rounded down, or stochastically, beside its m; the decoder's bound restores it.)"""
    from test_update_bound import SHAPE, STREAMS

    b1, b2 = flags.get("betas", (0.9, 0.999))
    wd, lr = flags.get("weight_decay", 0.0), 1e-3
    for name, grads in STREAMS.items():
        p = torch.nn.Parameter(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).mul(0.01))
        opt = lpoptim.AdamW([p], lr=lr, min_quant_numel=0, fused=False, state_bits=4, **{"weight_decay": 0.0, **flags})
        for t, g in enumerate(grads, 1):
            before = p.detach().clone()
            p.grad = g.clone()
            opt.step()
            k = 1.0 / quant.adam_bound_inv(torch.tensor(float(t)), b1, b2).item()
            bound = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * math.sqrt(k)
            step = (p.detach() - before * (1 - lr * wd)).abs()
            assert (step <= bound * (1 + 1e-4) + 2 * torch.finfo(torch.float32).eps * before.abs()).all(), \
                f"{name}, step {t}: {step.max().item():.4g} > {bound:.4g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_parameter_dtypes_and_bf16_stochastic_rounding(dtype):
    """bf16 parameters with bf16_stochastic_round (the parameter's bits and v's from one salt, different keys)
    and float64 parameters (fp32 codes' scales, float64 arithmetic) train and resume bit-exactly."""
    opts = dict(bf16_stochastic_round=True) if dtype == torch.bfloat16 else {}
    a = _model().to(dtype)
    opt_a = lpoptim.AdamW(a.parameters(), lr=1e-3, state_bits=4, **opts)

    def train(model, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(16, 256, generator=gen).to(dtype)).float().square().mean().backward()
            opt.step()
    train(a, opt_a, 2, 1)
    b = _model().to(dtype)
    b.load_state_dict(a.state_dict())
    opt_b = lpoptim.AdamW(b.parameters(), lr=1e-3, state_bits=4, **opts)
    opt_b.load_state_dict(_save_load(opt_a.state_dict()))
    train(a, opt_a, 2, 2)
    train(b, opt_b, 2, 2)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    assert all(torch.isfinite(p).all() for p in a.parameters())
    assert a[0].weight.dtype == dtype and "exp_avg_codes4" in opt_a.state[a[0].weight]


def test_step_in_backward_with_4bit_states():
    """lpoptim.step_in_backward steps each parameter as its gradient is ready: the same result as opt.step()."""
    a, b = _model(), _model()
    opt_a = lpoptim.AdamW(a.parameters(), lr=1e-3, state_bits=4)
    opt_b = lpoptim.AdamW(b.parameters(), lr=1e-3, state_bits=4)
    handle = lpoptim.step_in_backward(opt_b)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 256, generator=gen)
        opt_a.zero_grad(set_to_none=True)
        a(x).square().mean().backward()
        opt_a.step()
        b(x).square().mean().backward()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    del handle
