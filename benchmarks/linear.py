"""Low-bit linear layers: forward + backward time per layer at Llama-7B shapes, quantizer bandwidth, and a
training-quality run; against bf16 nn.Linear (eager and compiled) and torchao Float8Linear (if importable).

    PYTHONPATH=$PWD python3 benchmarks/linear.py --out results/linear.json     # an H100, one run (~5 min)
    PYTHONPATH=$PWD python3 benchmarks/linear.py --small --out /tmp/linear.json  # CPU smoke test

Times are medians of CUDA-event timings after warm-up, over inputs rotated through more memory than L2 holds.
The table printed last compares each recipe with compiled bf16 and with the targets (fp8 >= 1.45x, fp4 and
int4 >= 1.3x).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lpoptim.nn.operands as operands  # noqa: E402
from lpoptim.nn.operands import QuantSpec as S  # noqa: E402
from benchmarks.timing import back_to_back_ms, timer  # noqa: E402
from lpoptim.bench import environment  # noqa: E402
from lpoptim.nn import LowBitLinear  # noqa: E402

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]
SMALL_SHAPES = [(64, 64), (64, 128), (128, 64)]
RECIPES = [  # (label, recipe, overrides)
    ("lpoptim fp8 (row)", "fp8", {}),
    ("lpoptim fp8 (tensor)", "fp8_tensor", {}),
    ("lpoptim fp8 (tensor, fast accum fwd)", "fp8_tensor", {"fast_accum": True}),
    ("lpoptim fp8 (tensor, delayed scaling)", "fp8_delayed", {}),
    ("lpoptim fp4", "fp4", {}),
    ("lpoptim fp4 (delayed scaling)", "fp4", {"scaling": "delayed"}),
    ("lpoptim fp4 + DGE", "fp4", {"dge_k": 5.0}),
    ("lpoptim fp4, the paper's (OCC, DGE, bwd per row)", "fp4",
     {"occ_alpha": 0.99, "dge_k": 5.0, "bwd_granularity": "row"}),
    ("lpoptim int4 (fp8 bwd per tensor)", "int4", {}),
    ("lpoptim int4 (fp8 bwd per tensor, delayed scaling)", "int4", {"scaling": "delayed"}),
    ("lpoptim int4 (fp8 bwd per row)", "int4", {"bwd_granularity": "row"}),
]
TARGETS = {"fp8": 1.45, "fp4": 1.3, "int4": 1.3}
H100_PEAK = {"bf16": 989e12, "fp8": 1979e12, "hbm": 3.35e12}  # dense tensor-core peaks, HBM3 bandwidth


def make_inputs(m, k, n, dtype, device, l2_bytes=50 << 20):
    """Enough distinct (x, dy) pairs that one round exceeds L2; random normal values (never zeros)."""
    per = m * (k + n) * torch.tensor([], dtype=dtype).element_size()
    count = max(2, min(4, -(-2 * l2_bytes // per)))
    g = torch.Generator(device=device).manual_seed(0)
    return [(torch.randn(m, k, device=device, dtype=dtype, generator=g).requires_grad_(),
             torch.randn(m, n, device=device, dtype=dtype, generator=g)) for _ in range(count)]


def fwd_bwd_ms(layer, inputs, warmup, iters, cuda) -> tuple[float, float | None]:
    """(median ms of one step timed alone after a synchronize, which includes the host's work up to the GPU's
    first kernels; ms per step of ``iters`` steps queued back to back, as a training loop runs them, None on the
    CPU)."""
    state = {"i": 0}
    run = layer_step(layer, inputs)

    def step():
        state["i"] += 1
        run(state["i"])

    alone = timer(step, warmup, iters, cuda)
    return alone, back_to_back_ms(step, iters) if cuda else None


def layer_step(layer, inputs):
    """step(i): forward and backward of ``layer`` on the i-th (x, dy) pair of ``inputs`` (rotated), grads cleared."""
    def step(i):
        x, gy = inputs[i % len(inputs)]
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(gy)
    return step


def torchao_float8(base: nn.Linear, recipe: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    wrapper = nn.Sequential(copy.deepcopy(base))
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(wrapper, config=cfg)
    return wrapper


def layer_benchmarks(args, device, dtype, cuda):
    shapes = SMALL_SHAPES if args.small else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("->")) for s in args.shapes.split(",")]
    m = args.tokens
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        inputs = make_inputs(m, k, n, dtype, device)
        variants = [("bf16 nn.Linear eager", lambda: base)]
        if not args.small:
            variants.append(("bf16 nn.Linear compiled", lambda: torch.compile(copy.deepcopy(base))))
            for r in ("tensorwise", "rowwise"):
                variants.append((f"torchao Float8Linear {r} compiled",
                                 lambda r=r: torch.compile(torchao_float8(base, r))))
        for label, recipe, kw in RECIPES:
            variants.append((label, lambda recipe=recipe, kw=kw: LowBitLinear.from_linear(base, recipe, **kw)))
        if not args.small:  # the fp8 recipes compiled: Inductor generates and fuses their quantizers
            for label, recipe in (("lpoptim fp8 (row) compiled", "fp8"), ("lpoptim fp8 (tensor) compiled", "fp8_tensor")):
                # a fresh Dynamo per layer width: torch 2.11 cannot retrace these with symbolic feature dims
                variants.append((label, lambda recipe=recipe: (torch._dynamo.reset(), torch.compile(
                    LowBitLinear.from_linear(base, recipe)))[1]))
        for label, build in variants:
            if args.variants and not any(f in label for f in args.variants.split(",")) and not label.startswith("bf16"):
                continue
            row = {"shape": f"{k}->{n}", "tokens": m, "variant": label}
            try:
                layer = build()
                row["ms"], row["ms_back_to_back"] = fwd_bwd_ms(layer, inputs, args.warmup, args.iters, cuda)
                flops = 6.0 * m * k * n
                row["tflops"] = flops / row["ms"] / 1e9
                row["floor_ms_bf16_peak"] = flops / H100_PEAK["bf16"] * 1e3
                row["floor_ms_fp8_peak"] = flops / H100_PEAK["fp8"] * 1e3
            except ImportError as e:
                row["skipped"] = f"not importable: {e}"
            except Exception as e:  # keep measuring the others; the JSON says what failed
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return rows


def kernel_benchmarks(args, device, dtype, cuda):
    """The fused quantizer: achieved bandwidth = (bytes read once + bytes written) / time."""
    m = args.tokens
    rows = []
    k = 64 if args.small else 4096
    x = torch.randn(m, k, device=device, dtype=dtype)
    # the specs made once, outside the timed calls, as a layer's Recipe.specs are
    e4m3, e4m3_t, e5m2, e2m1 = S("e4m3"), S("e4m3", "tensor"), S("e5m2"), S("e2m1")
    int4_had = S("int4_sym", hadamard_block=64 if args.small else 128)
    cases = [
        ("e4m3 per row", lambda: operands.quantize(x, e4m3)),
        ("e4m3 per row, transposed (saved x for dW)", lambda: operands.quantize(x.t(), e4m3)),
        ("e4m3 per tensor, transposed", lambda: operands.quantize(x.t(), e4m3_t)),
        ("e5m2 per row (dy)", lambda: operands.quantize(x, e5m2)),
        ("e2m1 per row", lambda: operands.quantize(x, e2m1)),
        ("int4 + Hadamard 128 per row", lambda: operands.quantize(x, int4_had)),
        ("int4 + Hadamard 128, transposed", lambda: operands.quantize(x.t(), int4_had)),
        # x per row and per column in two passes (fp8 recipe: forward x and saved xᵀ, backward dy and dyᵀ); its
        # bytes: both copies written, x read once
        ("e4m3 rows and columns together (x and saved x for dW)", lambda: operands.quantize_pair(x, e4m3, e4m3)),
        ("e4m3 per tensor, rows and columns together", lambda: operands.quantize_pair(x, e4m3_t, e4m3_t)),
    ]
    for label, fn in cases:
        nbytes = x.numel() * (x.element_size() + (2 if "together" in label else 1))
        row = {"kernel": label, "shape": f"{m}x{k}", "dtype": str(dtype).replace("torch.", ""),
               "path": "triton" if cuda else "torch reference"}
        try:
            row["ms"] = timer(fn, args.warmup, args.iters, cuda)
            row["GB_per_s"] = nbytes / row["ms"] / 1e6
            row["floor_ms_hbm"] = nbytes / H100_PEAK["hbm"] * 1e3
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def quality(args, device, cuda):
    from lpoptim.train.data import CharData
    from lpoptim.train.loop import RunConfig, train
    data = CharData(device=device)
    kw = dict(steps=args.quality_steps, device=device)
    if cuda:  # bf16 autocast, as the training it stands for; 4 layers of 256 so the Hadamard block is 128
        kw.update(n_layer=4, n_head=4, n_embd=256, block_size=128, batch_size=32, lr=2e-3, eval_batches=20,
                  autocast_dtype=torch.bfloat16)
    out = {}
    for recipe in (None, "fp8", "fp8_delayed", "fp4", "int4"):
        t = time.perf_counter()
        try:
            run = train(RunConfig(recipe=recipe, **kw), data)
            out[recipe or "baseline"] = {"train": run["train"], "val": run["val"]}
        except Exception as e:
            out[recipe or "baseline"] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        out[recipe or "baseline"]["seconds"] = time.perf_counter() - t
        print(json.dumps({recipe or "baseline": out[recipe or "baseline"]}), flush=True)
    return out


def summary(layers, qual, kernels, fallbacks=()):
    lines = []
    by = {(r["shape"], r["variant"]): r.get("ms") for r in layers}
    shapes = list(dict.fromkeys(r["shape"] for r in layers))
    variants = list(dict.fromkeys(r["variant"] for r in layers))
    base = "bf16 nn.Linear compiled" if any(v == "bf16 nn.Linear compiled" for v in variants) else "bf16 nn.Linear eager"
    lines.append(f"fwd+bwd ms per layer ({layers[0]['tokens']} tokens); speed-up vs {base}; target")
    w = max(36, *map(len, variants))
    lines.append(f"{'variant':{w}s}" + "".join(f"{s:>22s}" for s in shapes) + "  target")
    for v in variants:
        cells = []
        for s in shapes:
            ms, b = by.get((s, v)), by.get((s, base))
            cells.append(f"{ms:8.3f} ({b / ms:4.2f}x)" if ms and b else f"{'n/a':>16s}")
        t = next((TARGETS[k] for k in TARGETS if f" {k}" in v and v.startswith("lpoptim")), None)
        lines.append(f"{v:{w}s}" + "".join(f"{c:>22s}" for c in cells) + (f"  >= {t}x" if t else ""))
    b2b = {(r["shape"], r["variant"]): r.get("ms_back_to_back") for r in layers}
    if any(b2b.values()):
        lines.append("")
        lines.append("the same, steps queued back to back (ms per step; speed-up vs the same baseline back to back)")
        for v in variants:
            cells = []
            for s in shapes:
                ms, b = b2b.get((s, v)), b2b.get((s, base))
                cells.append(f"{ms:8.3f} ({b / ms:4.2f}x)" if ms and b else f"{'n/a':>16s}")
            lines.append(f"{v:{w}s}" + "".join(f"{c:>22s}" for c in cells))
    lines.append("")
    lines.append("quantizer kernels: " + "; ".join(f"{k['kernel']}: {k.get('GB_per_s', float('nan')):.0f} GB/s"
                                                    for k in kernels))
    if qual:
        b = qual.get("baseline", {}).get("val")
        lines.append("quality (val loss, ratio to baseline; targets fp8 <= 1.01, fp4/int4 <= 1.03): " + ", ".join(
            f"{r} {q['val']:.4f}" + (f" ({q['val'] / b:.4f})" if b and r != "baseline" else "")
            for r, q in qual.items() if "val" in q))
    if fallbacks:
        lines.append("WARNING: torch._scaled_mm fell back to emulation: " + " | ".join(fallbacks))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/linear.json")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU: checks that the script runs")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--quality-steps", type=int, default=None)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--shapes", default=None, help="in->out pairs, comma-separated, e.g. 4096->4096 (default: all)")
    p.add_argument("--variants", default=None,
                   help="comma-separated substrings of the variants to time (the bf16 baselines always run)")
    p.add_argument("--skip-kernels", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.small
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32  # bf16 matmul on the CPU is slow and not what is measured
    args.tokens = args.tokens or (256 if args.small else 16384)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 5)
    args.iters = args.iters or (3 if args.small else 20)
    args.quality_steps = args.quality_steps or (20 if args.small else 1000)
    env = {**environment(), "python": platform.python_version(), "device": device}  # GPU, versions, command
    print(json.dumps(env), flush=True)
    with warnings.catch_warnings(record=True) as caught:  # the layers warn when torch._scaled_mm falls back
        warnings.simplefilter("always")
        layers = layer_benchmarks(args, device, dtype, cuda)
        kernels = [] if args.skip_kernels else kernel_benchmarks(args, device, dtype, cuda)
        qual = None if args.skip_quality else quality(args, device, cuda)
    fallbacks = sorted({str(w.message) for w in caught if "torch._scaled_mm failed" in str(w.message)})
    result = {"env": env, "layers": layers, "kernels": kernels, "quality": qual, "scaled_mm_fallbacks": fallbacks}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(summary(layers, qual, kernels, fallbacks))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
