"""How FP8 optimizer states change Adam's updates: mean error AND worst case, for candidate state formats.

    python benchmarks/state_quant_error.py      # CPU, a few minutes; writes results/state_quant_error.json

Each candidate runs Adam along a gradient stream with its moments rounded through the format after every step
(the update itself uses the fresh fp32 moments, as lpoptim.AdamW's), beside exact fp32 Adam on the same stream:

- worst step ratio: the largest over steps of max|update| / torch's max|update| at that step (torch.optim.AdamW
  takes the exact one); lpoptim promises at most 2;
- mean update error: relative L2 error of the update, averaged over steps and tensors.

Real streams: every matrix of a small GPT (2 layers, 128 wide, context 64) trained 200 steps with torch AdamW on
two unrelated texts (the bundled tinyshakespeare, and the Python standard library's own source, which every
machine has); betas (0.9, 0.99) as the nanoGPT recipe, and (0.9, 0.999) as torch's default. Synthetic streams:
shrinking, spiking, heavy-tailed, outliers, zeros, groups spanning 1e4 / 1e8, extreme scales.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lpoptim.bench import environment  # noqa: E402
from lpoptim import quant  # noqa: E402
from lpoptim.formats import E4M3, E5M2, round_to_grid  # noqa: E402
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
    k = torch.exp2(torch.floor(torch.log2(k) * 32) / 32).clamp(k_min, 15.75)
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
        if cand.get("shipped"):
            m, v = lpoptim_roundtrip(m), lpoptim_roundtrip(v)
        else:
            m = variant_roundtrip(m, **cand["m"])
            v = variant_roundtrip(v.sqrt(), **cand["v"]) ** 2 if cand.get("sqrt") else variant_roundtrip(v, **cand["v"])
    return out


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps recorded per text")
    ap.add_argument("--out", default="results/state_quant_error.json")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    print(json.dumps(environment()), flush=True)
    texts = {"tinyshakespeare": None, "python stdlib": python_stdlib_text(Path(args.out).parent / "python_stdlib.txt")}
    real = {name: record_streams(path, args.steps) for name, path in texts.items()}
    synthetic = synthetic_streams()
    rows = []
    for name, cand in CANDIDATES.items():
        row = {"candidate": name.strip(), "synthetic_worst": max(
            max(a / b for a, b, _ in simulate(grads, cand, beta2=0.999)) for grads in synthetic.values())}
        for text, streams in real.items():
            for beta2 in (0.99, 0.999):
                runs = [simulate(s, cand, beta2=beta2) for s in streams]
                row[f"{text} b2={beta2} mean"] = sum(e for r in runs for *_, e in r) / sum(len(r) for r in runs)
                row[f"{text} b2={beta2} worst"] = max(a / b for r in runs for a, b, _ in r)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(env=environment(), steps=args.steps, rows=rows), indent=1))
    cols = [k for k in rows[0] if k != "candidate"]
    print("\n| candidate | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['candidate']} | " + " | ".join(f"{r[c]:.4f}" if "mean" in c else f"{r[c]:.3g}" for c in cols) + " |")


if __name__ == "__main__":
    main()
