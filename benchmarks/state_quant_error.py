"""How FP8 optimizer states change Adam's updates: mean error AND worst case, for candidate state formats.

    python benchmarks/state_quant_error.py      # CPU, a few minutes; writes results/state_quant_error.json
    python benchmarks/state_quant_error.py --bits 4 --out results/state_quant_error_4bit.json   # 4-bit candidates

Each candidate runs Adam along a gradient stream with its moments rounded through the format after every step
(the update itself uses the fresh fp32 moments, as lpoptim.AdamW's), beside exact fp32 Adam on the same stream:

- worst step ratio: the largest over steps of max|update| / torch's max|update| at that step (torch.optim.AdamW
  takes the exact one); lpoptim promises at most 2;
- mean update error: relative L2 error of the update, averaged over steps and tensors.

Real streams: every matrix of a small GPT (2 layers, 128 wide, context 64) trained 200 steps with torch AdamW on
two unrelated texts (the bundled tinyshakespeare, and the Python standard library's own source, which every
machine has); betas (0.9, 0.99) as the nanoGPT recipe, and (0.9, 0.999) as torch's default. Synthetic streams:
shrinking, spiking, heavy-tailed, outliers, zeros, groups spanning 1e4 / 1e8, extreme scales.

``--bits 4`` runs 4-bit candidates (CANDIDATES_4BIT) on the same simulation: the synthetic streams first, then
the real ones for the candidates not in SYNTHETIC_ONLY_4BIT (cut as dominated after the synthetic pass), in two
worker processes; each row also gives the state's bytes per parameter (codes and scales of m and v together).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lpoptim.bench import environment  # noqa: E402
from lpoptim import quant  # noqa: E402
from lpoptim.formats import E2M1, E4M3, E5M2, round_to_grid  # noqa: E402
from lpoptim.optim.stochastic_round import sr_key, uniform_noise  # noqa: E402
from lpoptim.train.data import CharData, python_stdlib_text  # noqa: E402
from lpoptim.train.gpt import GPT, GPTConfig  # noqa: E402

EPS = 1e-8


def variant_roundtrip(x, fmt=E4M3, floor_exp=-9, k_min=1.0, zero_free=False):
    """A candidate codec, continuous k rounded down onto 1/32 of its binade (the shipped grid's resolution):
    k = log2(max / 2^floor_exp) / log2(amax / amin) clamped to [k_min, 15.75]; ``zero_free``: a non-zero value
    never rounds to 0 (it takes the smallest subnormal instead)."""
    g = quant.to_groups(x.float(), 128)
    amax, amin = quant.group_stats(g)
    valid = (amax > 0) & torch.isfinite(amin)
    span = math.log2(fmt.max) - floor_exp
    k = span / (torch.log2(torch.where(valid, amax, 1.0)) - torch.log2(torch.where(valid, amin, 1.0))).clamp_min(1e-6)
    k = k_on_grid(k, k_min)
    k = torch.where(valid, k, torch.ones_like(k)).unsqueeze(-1)
    c = torch.where(valid, amax, torch.ones_like(amax)).unsqueeze(-1)
    q = round_to_grid(fmt.max * (g.abs() / c).clamp(max=1) ** k, fmt)
    if zero_free:
        q = torch.where((q == 0) & (g != 0), torch.full_like(q, fmt.min_subnormal), q)
    y = torch.where(valid.unsqueeze(-1), (q / fmt.max) ** (1 / k) * c, torch.zeros_like(q))
    return quant.from_groups(torch.copysign(y, g), x.shape)


def lpoptim_roundtrip(x):
    """The shipped codec (quant.quantize_state / dequantize_state)."""
    return quant.dequantize_state(*quant.quantize_state(x), group_size=128)


def lpoptim_roundtrip4(m, v, step, salt=2):
    """The shipped 4-bit codec (quant.quantize_state4_moments / dequantize_state4): m to nearest, v rounded
    stochastically with the noise lpoptim.AdamW draws (stochastic_round.uniform_noise under sr_key of the step and a
    salt), its code raised to the group's ratio bound at encode."""
    noise = uniform_noise(v.shape, sr_key(torch.tensor(float(step)), salt))
    mc, ms, vc, vs = quant.quantize_state4_moments(m, v, noise=noise)
    return quant.dequantize_state4(mc, ms, m.shape, False), quant.dequantize_state4(vc, vs, v.shape, True)


def group_ratio_inv(m, v, slack=1.0, bf16=False):
    """Per element, 1 / (slack · r2) of its group, r2 the group's largest m^2 / v (quant.state4_ratio_bound;
    ``bf16``: r2 rounded up to bf16 as a 2-byte alternative); 0 where r2 is 0 or inf (no bound)."""
    r2 = quant.state4_ratio_bound(m, v)
    if bf16:
        bits = r2.contiguous().view(torch.int32)
        r2 = torch.where(bits > 0x7F7F0000, 0x7F800000, (bits + 0xFFFF) & ~0xFFFF).view(torch.float32)
    r2 = r2 * slack
    inv = torch.where(r2 > 0, (1.0 / torch.where(r2 > 0, r2, 1.0).double()).float(), torch.zeros_like(r2))
    return quant.from_groups(quant.to_groups(torch.zeros(m.shape), 128) + inv.unsqueeze(-1), m.shape)


SUBNORMAL_K1 = dict(floor_exp=-9)  # lpoptim 0.1: COAT's target, k >= 1
CANDIDATES = {
    "k >= 1 onto the smallest subnormal, v (lpoptim 0.1)": dict(m=SUBNORMAL_K1, v=SUBNORMAL_K1),
    "  the same, sqrt(v) stored": dict(m=SUBNORMAL_K1, v=SUBNORMAL_K1, sqrt=True),
    "  the same, v in E5M2": dict(m=SUBNORMAL_K1, v=dict(fmt=E5M2, floor_exp=-16)),
    "  the same, v grid without zero": dict(m=SUBNORMAL_K1, v=dict(SUBNORMAL_K1, zero_free=True)),
    "  the same, Adam's bound at decode": dict(m=SUBNORMAL_K1, v=SUBNORMAL_K1, bound=True),
    "k >= 1 onto the smallest normal, sqrt(v) stored": dict(m=dict(floor_exp=-6), v=dict(floor_exp=-6), sqrt=True),
    "k < 1 allowed, onto the smallest subnormal": dict(m=dict(k_min=1 / 16), v=dict(k_min=1 / 16)),
    "k < 1 allowed, onto 2^-7": dict(m=dict(k_min=1 / 16, floor_exp=-7), v=dict(k_min=1 / 16, floor_exp=-7)),
    "k < 1 allowed, onto the smallest normal": dict(m=dict(k_min=1 / 16, floor_exp=-6),
                                                    v=dict(k_min=1 / 16, floor_exp=-6)),
    "lpoptim: k < 1 onto the smallest normal + Adam's bound at decode": dict(shipped=True, bound=True),
}


def simulate(grads, cand, beta1=0.9, beta2=0.99):
    """[(max |u|, max |u_exact|, relative L2 error of u)] per step, u the bias-corrected update."""
    m = v = me = ve = torch.zeros_like(grads[0])
    ratio, coef = quant.adam_bound_terms(beta1, beta2)
    series, out = 0.0, []
    for t, g in enumerate(grads, 1):
        if cand.get("bound") and series > 0:
            v = torch.maximum(v, m * m * (coef / series))
        m, v = m + (1 - beta1) * (g - m), v * beta2 + (1 - beta2) * g * g
        me, ve = me + (1 - beta1) * (g - me), ve * beta2 + (1 - beta2) * g * g
        bc1, bc2 = 1 - beta1 ** t, math.sqrt(1 - beta2 ** t)
        u = m / bc1 / (v.sqrt() / bc2 + EPS)
        ue = me / bc1 / (ve.sqrt() / bc2 + EPS)
        out.append((u.abs().max().item(), ue.abs().max().item(), ((u - ue).norm() / ue.norm().clamp_min(1e-30)).item()))
        series = 1 + ratio * series
        # the group's ratio bound: from the exact moments before rounding, applied at the next decode (here right
        # after the round trip: the decoder's maxima commute); "at encode" (what state_bits=4 ships): v's code is
        # rounded up to it instead, nothing stored
        inv_g = group_ratio_inv(m, v, cand.get("ratio_slack", 1.0), cand.get("ratio_bf16", False)) \
            if cand.get("ratio") or cand.get("ratio_at_encode") else None
        if cand.get("shipped"):
            m, v = lpoptim_roundtrip(m), lpoptim_roundtrip(v)
        elif cand.get("shipped4"):
            m, v = lpoptim_roundtrip4(m, v, t)
        else:
            m = roundtrip(m, cand["m"], t, salt=1)
            vspec = dict(cand["v"], at_least=m * m * inv_g) if cand.get("ratio_at_encode") else cand["v"]
            v = roundtrip(v.sqrt(), vspec, t, salt=2) ** 2 if cand.get("sqrt") else roundtrip(v, vspec, t, salt=2)
        if cand.get("ratio"):
            v = torch.fmax(v, m * m * inv_g)
    return out


def roundtrip(x, spec, step=None, salt=0):
    """x through the candidate codec ``spec``: variant_roundtrip's keywords, or a 4-bit codec under "codec"; a
    stochastically rounding one (``sr``) draws its noise from (element index, ``step``, ``salt``)."""
    spec = dict(spec)
    if spec.pop("sr", False):
        spec["noise"] = uniform_noise(x.shape, sr_key(torch.tensor(float(step)), salt))
    return spec.pop("codec", variant_roundtrip)(x, **spec)


# ---- 4-bit candidates (--bits 4) -----------------------------------------------------------------------------
# Codes: 4 bits per element (0.5 B/param per moment). A group's metadata: "fp32" its absmax with an 8-bit code
# (k, or the log grid's range) in the low mantissa byte, as the FP8 codec; "bf16" the absmax rounded up to bf16
# plus a byte of code (3 bytes; 2 without the code); "e8m0" a power of two >= absmax / grid top, no code (1 byte, MX-style).
META_BYTES = {"fp32": 4, "bf16": 3, "bf16, no code": 2, "e8m0": 1}
TOP = {"e2m1": E2M1.max, "int4": 7.0, "lin0": 16.0}  # the grid's largest value: E2M1, INT4 0..7, 1..16 (no zero)


def k_on_grid(k, k_min=1 / 16, k_max=15.75):
    """k rounded down onto the shipped k grid ((1 + i/32) 2^e)."""
    return torch.exp2(torch.floor(torch.log2(k) * 32) / 32).clamp(k_min, k_max)


def group_scale(amax, scale, top):
    if scale == "fp32":
        return amax
    if scale.startswith("bf16"):  # rounded up: |x| / c <= 1
        return ((amax.contiguous().view(torch.int32) + 0xFFFF) & ~0xFFFF).view(torch.float32)
    return top * torch.exp2(torch.ceil(torch.log2(amax / top)))  # e8m0


def roundtrip4(x, grid="e2m1", group_size=128, floor=1.0, compand=True, scale="fp32", zero=True, noise=None,
               round_up_below=0.0, at_least=None):
    """A 4-bit group codec, per group of ``group_size`` along the last dim, sign kept apart (15 magnitudes + 0):

    - "e2m1" / "int4" / "lin0": ``top · (|x|/c)^k`` rounded onto E2M1 (0, .5, 1, 1.5, 2, 3, 4, 6), the integers
      0..7 (INT4 with zero) or 1..16 (a linear grid without zero: Li et al.'s j/16 for v, zeros included); with
      ``compand`` k is the FP8 codec's (the group's smallest magnitude onto ``floor``, k < 1 allowed, on the k
      grid), otherwise k = 1 (plain absmax scaling);
    - "log": 15 magnitudes (16 where not ``zero``) evenly spaced in log2 from c down to the group's smallest
      magnitude, log2 of that range rounded up onto an 8-bit float grid ((1 + i/32) 2^e, e in [-1, 6]); rounded in
      log; with ``zero`` an exact 0 stays 0.

    ``noise`` (uniform [0, 1) of x's shape, "int4" / "lin0" only): stochastic rounding, floor(f + noise) in place
    of round(f): unbiased, so an EMA increment below half a grid step is kept in expectation instead of lost.
    ``round_up_below`` (integer grids, not companded): f below it rounds up (ceil), not to nearest or at random.
    ``at_least`` (of x's shape; integer grids, not companded): the code is raised to the first grid point at or
    above it (within the grid).
    """
    g = quant.to_groups(x.float(), group_size)
    amax, amin = quant.group_stats(g)
    valid = ((amax > 0) & torch.isfinite(amin)).unsqueeze(-1)
    top = TOP.get(grid, 1.0)
    c = group_scale(torch.where(valid[..., 0], amax, 1.0), scale, top).unsqueeze(-1)
    amin = torch.where(valid[..., 0], amin, 1.0).unsqueeze(-1)
    a = (g.abs() / c).clamp(max=1)
    if grid == "log":
        n = 15 if zero else 16
        span = torch.log2(c / amin).clamp_min(0.5)
        span = torch.exp2(torch.ceil(torch.log2(span) * 32) / 32).clamp(max=126)  # 8-bit grid, rounded up
        j = (-torch.log2(a) / span * (n - 1)).round().clamp(0, n - 1)
        y = c * torch.exp2(-j * span / (n - 1))
        if zero:
            y = torch.where(g == 0, 0.0, y)
    else:
        k = k_on_grid(math.log2(top / floor) / torch.log2(c / amin).clamp_min(1e-6)) if compand else torch.ones_like(c)
        f = top * a ** k
        if noise is not None:
            assert grid in ("int4", "lin0"), "stochastic rounding: integer grids only"
            q = torch.floor(f + quant.to_groups(noise, group_size)).clamp(1 if grid == "lin0" else 0, top)
        else:
            q = round_to_grid(f, E2M1) if grid == "e2m1" else f.round().clamp(1 if grid == "lin0" else 0, top)
        if round_up_below:
            q = torch.where(f < round_up_below, torch.ceil(f).clamp(1 if grid == "lin0" else 0, top), q)
        if at_least is not None:
            need = torch.ceil(quant.to_groups(at_least, group_size) / c * top * (1 - 2 ** -20))
            q = torch.maximum(q, need.clamp(max=top))
        y = c * (q / top) ** (1 / k)
    y = torch.where(valid, torch.copysign(y, g), torch.zeros_like(y))
    return quant.from_groups(y, x.shape)


def rank1_roundtrip(x):
    """Li et al.'s rank-1 normalization for v >= 0: x_ij / min(row max_i, column max_j), then the linear grid
    without zero (j/16, j = 1..16). Metadata: one fp32 per row and per column."""
    a = x.float().reshape(-1, x.shape[-1])
    n = torch.minimum(a.amax(1, keepdim=True), a.amax(0, keepdim=True))
    n = torch.where(n > 0, n, torch.ones_like(n))
    return ((a / n * 16).round().clamp(1, 16) / 16 * n).reshape(x.shape)


def state_bytes(spec):
    """Bytes per parameter of one moment's state (rank-1: at a 4096 x 4096 matrix)."""
    if spec.get("codec") is rank1_roundtrip:
        return 0.5 + 2 * 4 / 4096
    return 0.5 + META_BYTES[spec.get("scale", "fp32")] / spec.get("group_size", 128)


def e2m1(**kw):
    return dict(codec=roundtrip4, grid="e2m1", **kw)


def log4(**kw):
    return dict(codec=roundtrip4, grid="log", **kw)


INT4_M = dict(codec=roundtrip4, grid="int4", compand=False)  # plain INT4 with zero, absmax per 128
LIN0 = dict(codec=roundtrip4, grid="lin0")
RANK1 = dict(codec=rank1_roundtrip)
CANDIDATES_4BIT = {
    "E2M1, k < 1 onto the smallest normal (1)": dict(m=e2m1(), v=e2m1()),
    "E2M1, k < 1 onto the smallest subnormal (.5)": dict(m=e2m1(floor=0.5), v=e2m1(floor=0.5)),
    "E2M1 (normal), sqrt(v) stored": dict(m=e2m1(), v=e2m1(), sqrt=True),
    "E2M1 (normal), sqrt(v), + Adam's bound at decode": dict(m=e2m1(), v=e2m1(), sqrt=True, bound=True),
    "E2M1 (normal), sqrt(v), G=64 (bf16 scale + k byte)": dict(m=e2m1(group_size=64, scale="bf16"),
                                                                v=e2m1(group_size=64, scale="bf16"), sqrt=True),
    "E2M1 (normal), sqrt(v), m in MXFP4 (G=32, e8m0, no k)": dict(
        m=e2m1(group_size=32, scale="e8m0", compand=False), v=e2m1(), sqrt=True),
    "log grid, m with zero, v without": dict(m=log4(), v=log4(zero=False)),
    "log grid, sqrt(v) stored": dict(m=log4(), v=log4(zero=False), sqrt=True),
    "log grid, sqrt(v), + Adam's bound at decode": dict(m=log4(), v=log4(zero=False), sqrt=True, bound=True),
    "log grid, sqrt(v), G=64 (bf16 scale + range byte)": dict(m=log4(group_size=64, scale="bf16"),
                                                               v=log4(group_size=64, scale="bf16", zero=False),
                                                               sqrt=True),
    "m INT4 (zero), v linear without zero, companded": dict(m=INT4_M, v=LIN0),
    "m INT4, v linear without zero, companded, sqrt(v)": dict(m=INT4_M, v=LIN0, sqrt=True),
    "m INT4, v linear without zero, not companded (Li et al.'s B128 v)": dict(m=INT4_M, v=dict(LIN0, compand=False)),
    "m INT4 B128, v rank-1 + linear without zero (Li et al.)": dict(m=INT4_M, v=RANK1),
    "Li et al., sqrt(v) stored": dict(m=INT4_M, v=RANK1, sqrt=True),
    "Li et al., + Adam's bound at decode": dict(m=INT4_M, v=RANK1, bound=True),
    "m E2M1 companded, v rank-1 (Li et al.), sqrt(v)": dict(m=e2m1(), v=RANK1, sqrt=True),
    # m kept linear with zero (a small m rounding to 0 only shortens its step), v zero-free
    "m INT4 B128, v Li et al.'s B128 + Adam's bound at decode": dict(m=INT4_M, v=dict(LIN0, compand=False), bound=True),
    "m INT4 B128, v log grid": dict(m=INT4_M, v=log4(zero=False), bound=False),
    "m INT4 B128, v log grid + Adam's bound at decode": dict(m=INT4_M, v=log4(zero=False), bound=True),
    "m INT4 B128, v log grid, sqrt(v)": dict(m=INT4_M, v=log4(zero=False), sqrt=True),
    "m INT4 B128, v log grid, sqrt(v), + Adam's bound at decode": dict(m=INT4_M, v=log4(zero=False), sqrt=True,
                                                                       bound=True),
    "m INT4 G=64 (bf16 scale), v log grid, sqrt(v), + bound": dict(
        m=dict(INT4_M, group_size=64, scale="bf16, no code"), v=log4(zero=False), sqrt=True, bound=True),
    "m MXFP4 (E2M1, G=32, e8m0), v log grid, sqrt(v), + bound": dict(
        m=e2m1(group_size=32, scale="e8m0", compand=False), v=log4(zero=False), sqrt=True, bound=True),
    "m INT4 B128, v E2M1 companded, sqrt(v), + bound": dict(m=INT4_M, v=e2m1(), sqrt=True, bound=True),
    # stochastic rounding (floor(f + u), u from a hash of (index, step, salt)) of the recommended codec
    "m INT4 B128, v Li et al.'s B128 + bound, stochastic rounding of m and v": dict(
        m=dict(INT4_M, sr=True), v=dict(LIN0, compand=False, sr=True), bound=True),
    "m INT4 B128, v Li et al.'s B128 + bound, stochastic rounding of m": dict(
        m=dict(INT4_M, sr=True), v=dict(LIN0, compand=False), bound=True),
    "m INT4 B128, v Li et al.'s B128 + bound, stochastic rounding of v": dict(
        m=INT4_M, v=dict(LIN0, compand=False, sr=True), bound=True),
    # ... and what keeps its worst step: v never decodes more than its group's exact largest m^2 / v below m^2
    "the same, + the group's ratio bound at decode (fp32 per 128)": dict(
        m=INT4_M, v=dict(LIN0, compand=False, sr=True), bound=True, ratio=True, extra_bytes=4 / 128),
    "the same, + the group's ratio bound at decode (bf16 per 128, rounded up)": dict(
        m=INT4_M, v=dict(LIN0, compand=False, sr=True), bound=True, ratio=True, ratio_bf16=True, extra_bytes=2 / 128),
    "the same, + the ratio bound x1.21 (slack: steps up to 1.1x the group's)": dict(
        m=INT4_M, v=dict(LIN0, compand=False, sr=True), bound=True, ratio=True, ratio_slack=1.21, extra_bytes=4 / 128),
    "the same, + the ratio bound x0.81 (tighter than the group's: steps at most 0.9x)": dict(
        m=INT4_M, v=dict(LIN0, compand=False, sr=True), bound=True, ratio=True, ratio_slack=0.81, extra_bytes=4 / 128),
    "the same, v's code rounded up to the group's ratio bound at encode (nothing stored)": dict(
        m=INT4_M, v=dict(LIN0, compand=False, sr=True), bound=True, ratio_at_encode=True),
    "the same, v rounded up (not at random) below 2/16 of its absmax (no ratio bound)": dict(
        m=INT4_M, v=dict(LIN0, compand=False, sr=True, round_up_below=2.0), bound=True),
    # what ships, through lpoptim's own codec (quant.quantize_state4_moments: the ratio bound at encode), not this
    # file's candidate arithmetic
    "lpoptim: state_bits=4 (quant.quantize_state4_moments, v rounded stochastically, its code raised to the "
    "group's ratio bound at encode, Adam's bound)":
        dict(m=dict(INT4_M), v=dict(LIN0, compand=False), shipped4=True, bound=True),
}
# dominated after the synthetic pass (worse worst case and mean than a kept relative), not run on the real streams
SYNTHETIC_ONLY_4BIT = {
    "E2M1, k < 1 onto the smallest normal (1)", "E2M1, k < 1 onto the smallest subnormal (.5)",
    "E2M1 (normal), sqrt(v), G=64 (bf16 scale + k byte)", "E2M1 (normal), sqrt(v), m in MXFP4 (G=32, e8m0, no k)",
    "log grid, m with zero, v without", "log grid, sqrt(v), G=64 (bf16 scale + range byte)",
    "m INT4 (zero), v linear without zero, companded", "m INT4, v linear without zero, companded, sqrt(v)",
    "Li et al., sqrt(v) stored", "m E2M1 companded, v rank-1 (Li et al.), sqrt(v)",
}
assert SYNTHETIC_ONLY_4BIT <= set(CANDIDATES_4BIT)


def synthetic_streams(seed=0, shape=(32, 256)):
    gen = torch.Generator().manual_seed(seed)

    def n():
        return torch.randn(shape, generator=gen)

    def spread(decades):
        return torch.exp(torch.rand(shape, generator=gen) * decades * math.log(10)) * torch.sign(n())

    g, h, s4, s8 = n(), n(), spread(4), spread(8)
    return {
        "the same N(0,1) gradient x6": [g] * 6,
        "N(0,1) halved each step, 8": [g * 0.5 ** i for i in range(8)],
        "N(0,1) divided by 10 each step, 6": [h * 0.1 ** i for i in range(6)],
        "|g| spans 1e4 in a group, then x0.01": [s4] * 5 + [s4 * 0.01] * 5,
        "|g| spans 1e8 in a group, then x1e-3": [s8] * 5 + [s8 * 1e-3] * 5,
        "Cauchy, 20": [n() / n() for _ in range(20)],
        "0.1% outliers x1e4, then gone": [n() * torch.where(torch.rand(shape, generator=gen) < 1e-3, 1e4, 1.0)
                                          for _ in range(10)] + [n() for _ in range(10)],
        "a x1e3 spike, then x1e-3": [n() for _ in range(5)] + [n() * 1e3] + [n() * 1e-3 for _ in range(8)],
        "half zeros": [n() * (torch.rand(shape, generator=gen) < 0.5) for _ in range(10)],
        "warm-up ends: x1 then x0.01": [n() for _ in range(10)] + [n() * 1e-2 for _ in range(20)],
    }


def record_streams(text, steps, seed=0):
    """Every matrix's gradient at every step of a small GPT trained with torch AdamW on ``text``."""
    torch.manual_seed(seed)
    data = CharData(text)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=128))
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)
    mats = [p for p in model.parameters() if p.numel() >= 4096]
    streams = [[] for _ in mats]
    for _ in range(steps):
        x, y = data.batch("train", 16, 64, gen)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for s, p in zip(streams, mats):
            s.append(p.grad.detach().clone())
        opt.step()
    return streams


def synthetic_row(name, cands, synthetic, with_mean=False):
    runs = [simulate(grads, cands[name], beta2=0.999) for grads in synthetic.values()]
    row = {"candidate": name.strip(), "synthetic_worst": max(max(a / b for a, b, _ in r) for r in runs)}
    if with_mean:
        row["synthetic_mean"] = sum(e for r in runs for *_, e in r) / sum(len(r) for r in runs)
    return row


def real_cells(name, cands, text, streams, beta2):
    runs = [simulate(s, cands[name], beta2=beta2) for s in streams]
    return {f"{text} b2={beta2} mean": sum(e for r in runs for *_, e in r) / sum(len(r) for r in runs),
            f"{text} b2={beta2} worst": max(a / b for r in runs for a, b, _ in r)}


_WORK = {}  # what the 4-bit mode's worker processes read (inherited through fork)


def _real_task(task):
    torch.set_num_threads(1)
    name, text, beta2 = task
    return name, real_cells(name, CANDIDATES_4BIT, text, _WORK[text], beta2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps recorded per text")
    ap.add_argument("--out", default="results/state_quant_error.json")
    ap.add_argument("--bits", type=int, choices=(8, 4), default=8,
                    help="8: the FP8 candidates (CANDIDATES); 4: the 4-bit ones (CANDIDATES_4BIT)")
    ap.add_argument("--synthetic-only", action="store_true", help="--bits 4: only the synthetic pass")
    ap.add_argument("--workers", type=int, default=2, help="--bits 4: processes for the real streams")
    ap.add_argument("--only", nargs="+", metavar="SUBSTRING",
                    help="--bits 4: only the candidates whose name contains one of these")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    print(json.dumps(environment()), flush=True)
    if args.bits == 4:
        return main_4bit(args)
    texts = {"tinyshakespeare": None, "python stdlib": python_stdlib_text(Path(args.out).parent / "python_stdlib.txt")}
    real = {name: record_streams(path, args.steps) for name, path in texts.items()}
    synthetic = synthetic_streams()
    rows = []
    for name in CANDIDATES:
        row = synthetic_row(name, CANDIDATES, synthetic)
        for text, streams in real.items():
            for beta2 in (0.99, 0.999):
                row.update(real_cells(name, CANDIDATES, text, streams, beta2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(env=environment(), steps=args.steps, rows=rows), indent=1))
    print_table(rows)


def print_table(rows):
    cols = [k for k in rows[0] if k != "candidate"]
    print("\n| candidate | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['candidate']} | " + " | ".join(
            "-" if c not in r else f"{r[c]:.4f}" if "mean" in c else f"{r[c]:.3g}" for c in cols) + " |")


def main_4bit(args):
    synthetic = synthetic_streams()
    rows = {}
    names = [n for n in CANDIDATES_4BIT if not args.only or any(o in n for o in args.only)]
    for name in names:
        cand = CANDIDATES_4BIT[name]
        rows[name] = dict(synthetic_row(name, CANDIDATES_4BIT, synthetic, with_mean=True),
                          bytes_per_param=state_bytes(cand["m"]) + state_bytes(cand["v"]) + cand.get("extra_bytes", 0))
        print(json.dumps(rows[name]), flush=True)
    if not args.synthetic_only:
        texts = {"tinyshakespeare": None,
                 "python stdlib": python_stdlib_text(Path(args.out).parent / "python_stdlib.txt")}
        _WORK.update({text: record_streams(path, args.steps) for text, path in texts.items()})
        tasks = [(name, text, beta2) for name in names if name not in SYNTHETIC_ONLY_4BIT
                 for text in texts for beta2 in (0.99, 0.999)]
        with multiprocessing.get_context("fork").Pool(args.workers) as pool:
            for name, cells in pool.imap_unordered(_real_task, tasks):
                rows[name].update(cells)
                print(json.dumps(dict(candidate=name.strip(), **cells)), flush=True)
    order = ["bytes_per_param", "synthetic_worst", "synthetic_mean"] + [
        f"{t} b2={b} {w}" for t in ("tinyshakespeare", "python stdlib") for b in (0.99, 0.999) for w in ("worst", "mean")]
    rows = [dict(candidate=r["candidate"], **{c: r[c] for c in order if c in r}) for r in rows.values()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(
        env=environment(), steps=args.steps, synthetic_only=sorted(n.strip() for n in SYNTHETIC_ONLY_4BIT),
        rows=rows), indent=1))
    print_table(rows)

if __name__ == "__main__":
    main()
