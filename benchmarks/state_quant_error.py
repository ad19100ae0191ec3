"""How much do FP8 optimizer states lose? Measured on real gradient streams, to choose lpoptim's defaults.

    python benchmarks/state_quant_error.py            # CPU, about two minutes; writes results/state_quant_error.json

A small GPT trains on the bundled tinyshakespeare with torch.optim.AdamW (fp32 states, betas 0.9/0.99 as the
nanoGPT shakespeare recipe). At several steps the exact m and v of every matrix are snapshotted; each storage
scheme then rounds them trip through its format, and we measure the relative L2 error of m, of v, and of the
bias-corrected update m / (sqrt(v) + eps), which is what the parameters feel. Schemes:

- plain per-group E4M3 (absmax scale, no expansion), v stored as v or as sqrt(v);
- COAT's formula: continuous k = ln(448 / 2^-9) / ln(max / min) per group (min over non-zero elements, k not
  clamped), with COAT's three fp32 numbers per group;
- lpoptim: k on a grid of 1/16 (an 8-bit code inside the fp32 scale) chosen so the group's minimum lands on
  E4M3's smallest subnormal (or normal), v as v or sqrt(v), E4M3 or E5M2, group sizes 32 / 128 / 512.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lpoptim import quant  # noqa: E402
from lpoptim.formats import E4M3, get_format, round_to_grid  # noqa: E402
from lpoptim.train.data import CharData  # noqa: E402
from lpoptim.train.gpt import GPT, GPTConfig  # noqa: E402


def record_states(steps: int, snapshots: list[int], seed: int = 0):
    torch.manual_seed(seed)
    data = CharData()
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=128)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(1, steps + 1):
        x, y = data.batch("train", 16, cfg.block_size, gen)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step in snapshots:
            for p in model.parameters():
                if p.numel() >= 4096:
                    st = opt.state[p]
                    out.append((step, st["exp_avg"].clone(), st["exp_avg_sq"].clone()))
    return out


def coat_roundtrip(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """COAT's dynamic range expansion as published: continuous k from the group's max/min ratio."""
    g = quant.to_groups(x.float(), group_size)
    a = g.abs()
    amax = a.amax(-1, keepdim=True)
    amin = torch.where(a > 0, a, torch.full_like(a, float("inf"))).amin(-1, keepdim=True)
    k = math.log(448 / 2**-9) / torch.log(amax / amin)
    k = torch.where(torch.isfinite(k) & (k > 0), k, torch.ones_like(k))  # guard only what would be NaN here
    f = torch.sign(g) * (a / amax.clamp_min(1e-38)) ** k
    q = round_to_grid(f * 448, E4M3) / 448
    y = torch.sign(q) * q.abs() ** (1 / k) * amax
    return quant.from_groups(y, x.shape)


def lp_roundtrip(x, fmt, group_size, expansion, target):
    fmt = get_format(fmt)
    g = quant.to_groups(x.float(), group_size)
    q, scale = quant.encode_groups(g, fmt, expansion, target=target)
    return quant.from_groups(quant.decode_groups(q, scale, fmt), x.shape)


def schemes():
    plain = ("e4m3", 128, False, "subnormal")
    yield "E4M3 per-group, no expansion, v", dict(m=plain, v=plain, sqrt=False)
    yield "E4M3 per-group, no expansion, sqrt v", dict(m=plain, v=plain, sqrt=True)
    yield "COAT formula (3 fp32 per group), v", dict(coat=True, sqrt=False)
    for target in ("subnormal", "normal"):
        for sqrt in (False, True):
            yield f"lpoptim k-code, floor {target}, {'sqrt v' if sqrt else 'v'}", dict(
                m=("e4m3", 128, True, target), v=("e4m3", 128, True, target), sqrt=sqrt)
    yield "lpoptim k-code, v in E5M2", dict(m=("e4m3", 128, True, "subnormal"), v=("e5m2", 128, True, "subnormal"), sqrt=False)
    for gs in (32, 512):
        yield f"lpoptim k-code, v, G={gs}", dict(m=("e4m3", gs, True, "subnormal"), v=("e4m3", gs, True, "subnormal"), sqrt=False)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def evaluate(states, scheme):
    errs = {"m": [], "v": [], "update": []}
    for step, m, v in states:
        if scheme.get("coat"):
            m_hat = coat_roundtrip(m, 128)
            v_hat = coat_roundtrip(v.sqrt(), 128) ** 2 if scheme["sqrt"] else coat_roundtrip(v, 128)
        else:
            fm, gm, em, tm = scheme["m"]
            fv, gv, ev, tv = scheme["v"]
            m_hat = lp_roundtrip(m, fm, gm, em, tm)
            v_hat = lp_roundtrip(v.sqrt(), fv, gv, ev, tv) ** 2 if scheme["sqrt"] else lp_roundtrip(v, fv, gv, ev, tv)
        bc1, bc2 = 1 - 0.9 ** step, 1 - 0.99 ** step
        u = (m / bc1) / ((v / bc2).sqrt() + 1e-8)
        u_hat = (m_hat / bc1) / ((v_hat / bc2).sqrt() + 1e-8)
        errs["m"].append(rel(m_hat, m))
        errs["v"].append(rel(v_hat, v))
        errs["update"].append(rel(u_hat, u))
    return {k: sum(e) / len(e) for k, e in errs.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="results/state_quant_error.json")
    args = ap.parse_args(argv)
    snaps = sorted({s for s in (10, 50, 100, 200, 300, 400, args.steps) if s <= args.steps})
    states = record_states(args.steps, snaps)
    rows = []
    for name, scheme in schemes():
        r = evaluate(states, scheme)
        r["scheme"] = name
        rows.append(r)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(snapshots=snaps, tensors=len(states), rows=rows), indent=1))
    print(f"relative L2 error, mean over {len(states)} (tensor, step) snapshots at steps {snaps}")
    print(f"| {'scheme':44s} | {'m':>7s} | {'v':>7s} | {'update':>7s} |")
    print(f"|{'-' * 46}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for r in rows:
        print(f"| {r['scheme']:44s} | {r['m']:7.4f} | {r['v']:7.4f} | {r['update']:7.4f} |")


if __name__ == "__main__":
    main()
