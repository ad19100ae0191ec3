"""The lpoptim command line.

    lpoptim train [--preset tiny|shakespeare] [--runs torch,lpoptim,...] [--steps N] [--out DIR]
    lpoptim bench [--preset tiny|tinyllama-1.1b|llama2-7b|llama2-13b] [--batch B] [--seq S] [--recipes ...]
                  [--steps N] [--compile] [--out DIR]

``train`` trains the small GPT on the bundled tinyshakespeare (or --text FILE) once per run, same seed, data and
schedule, and prints final train/val loss and optimizer-state memory side by side; it writes JSON and a PNG of
the loss curves into --out. Runs: torch (torch.optim.AdamW), lpoptim (lpoptim.AdamW), lpoptim+fp8 / +fp4 / +int4
(low-bit linears), lpoptim+fp8+act (and FP8 activations), +bf16 (bf16 parameters, no fp32 master: torch rounds
to nearest, lpoptim stochastically). The preset defaults to tiny on the CPU (about a
minute) and to nanoGPT's shakespeare-char recipe on a GPU.

``bench`` times one training step of a Llama-shaped model (random init) under each recipe: bf16 (torch AdamW),
lpoptim, lpoptim+act, lpoptim+fp8+act / +fp4+act / +int4+act, and bnb / torchao where importable; it prints
peak memory by component and tokens/s, and writes bench.json and bench.png into --out. The preset defaults to
tiny on the CPU and tinyllama-1.1b on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from . import bench
from .bench import STACKS

PRESETS = {
    # a couple of minutes on 2 CPU cores
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16, steps=300, lr=3e-3, eval_every=100),
    # nanoGPT's shakespeare-char recipe (DESIGN.md §6)
    "shakespeare": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2, steps=5000,
                        lr=1e-3, warmup=100, eval_every=500, eval_batches=40),
}


# as lpoptim bench names them
LINEAR_ALIASES = {"fp8t": "fp8_tensor", "fp8tf": "fp8_tensor_fast", "fp8d": "fp8_delayed", "fp4f": "fp4_fast"}


def parse_run(name: str) -> dict:
    parts = name.split("+")
    if parts[0] not in ("torch", "lpoptim"):
        raise SystemExit(f"run {name!r}: must start with 'torch' or 'lpoptim'")
    run = dict(optimizer=parts[0], recipe=None, compress=False)
    for p in parts[1:]:
        if p in ("fp8", "fp4", "int4"):
            run["recipe"] = p
        elif p in LINEAR_ALIASES:
            run["recipe"] = LINEAR_ALIASES[p]
        elif p == "act":
            run["compress"] = True
        elif p == "bf16":
            run["master"] = "bf16"
        else:
            raise SystemExit(f"run {name!r}: unknown part {p!r} (fp8, fp8t, fp8tf, fp8d, fp4, fp4f, int4, act, bf16)")
    return run


def progress_printer(label: str):
    def show(step, steps, loss):  # the loop calls it about 50 times a run
        bar = "#" * int(30 * step / steps)
        print(f"\r  {label:40s} [{bar:30s}] {step}/{steps} loss {loss:.4f}", end="", file=sys.stderr, flush=True)
        if step == steps:
            print(file=sys.stderr)
    return show


def plot_curves(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        curve = torch.tensor(r["curve"])
        k = max(1, len(curve) // 100)  # smooth the per-step train loss for reading
        smooth = curve.unfold(0, k, k).mean(1) if len(curve) >= k else curve
        line, = ax.plot([(i + 0.5) * k for i in range(len(smooth))], smooth, label=f"{r['label']} (train)", alpha=0.8)
        steps, vals = zip(*r["val_curve"])
        ax.plot(steps, vals, "o--", color=line.get_color(), label=f"{r['label']} (val)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("small GPT on tinyshakespeare: same seed, data and schedule")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def cmd_train(args) -> int:
    from .train.data import CharData
    from .train.loop import RunConfig, train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = dict(PRESETS[args.preset or ("shakespeare" if device == "cuda" else "tiny")])
    if args.steps:
        preset["steps"] = args.steps
        preset["eval_every"] = max(1, args.steps // 5)
    data = CharData(args.text, device=device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.runs.split(","):
        cfg = RunConfig(**parse_run(name), **preset, seed=args.seed, device=device,
                        autocast_dtype=torch.bfloat16 if device == "cuda" else None)
        results.append(train(cfg, data, progress_printer(cfg.label)))
    base = results[0]
    print(f"\ncharacter-level GPT ({preset['n_layer']} layers, {preset['n_embd']} dims, {preset['steps']} steps) on "
          f"{Path(args.text).name if args.text else 'tinyshakespeare'}, {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if device == 'cuda' else ''}, torch {torch.__version__}, seed {args.seed}")
    w = max(40, *(len(r["label"]) for r in results))  # the run column, as wide as its longest label
    print(f"| {'run':{w}s} | train loss | val loss | best val | val vs first | state B/param (quantized) | seconds |")
    print(f"|{'-' * (w + 2)}|-----------:|---------:|---------:|-------------:|--------------------------:|--------:|")
    for r in results:
        best = min(v for _, v in r["val_curve"])
        sb = r["state_bytes"]
        quant = f"{sb['bytes_per_param']:.2f} ({sb['quantized_bytes_per_param']:.3f})" if sb["quantized_params"] else f"{sb['bytes_per_param']:.2f}"
        print(f"| {r['label']:{w}s} | {r['train']:10.4f} | {r['val']:8.4f} | {best:8.4f} | "
              f"{100 * (r['val'] / base['val'] - 1):+11.2f}% | {quant:>25s} | {r['seconds']:7.1f} |")
    env = dict(bench.environment(), device=device)
    (out_dir / "train.json").write_text(json.dumps(dict(env=env, device=device, preset=preset, results=results), indent=1))
    if plot_curves(results, out_dir / "train_loss.png"):
        print(f"wrote {out_dir / 'train.json'} and {out_dir / 'train_loss.png'}")
    return 0


def cmd_bench(args, argv) -> int:
    import shlex

    from . import bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("tinyllama-1.1b" if device == "cuda" else "tiny")
    batch, seq = bench.DEFAULT_SHAPE[preset]
    recipes = args.recipes.split(",")
    for name in recipes:
        try:
            bench.stack_of(name)
        except KeyError as e:
            raise SystemExit(e.args[0]) from None
    print(f"lpoptim bench: {preset}, {args.batch or batch} x {args.seq or seq} tokens, {device}", file=sys.stderr)
    report = bench.run(preset, recipes, args.batch or batch, args.seq or seq, args.steps, args.warmup, device,
                       compile_blocks=args.compile, log=lambda s: print(s, file=sys.stderr, flush=True),
                       n_layer=args.n_layer, memory_cap_gib=args.memory_cap_gib)
    report["command"] = shlex.join(["python", "-m", "lpoptim", *argv])
    paths = bench.write(report, Path(args.out))
    print("\n" + bench.table(report))
    print("wrote " + " and ".join(str(p) for p in paths))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lpoptim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a small GPT with each run side by side")
    t.add_argument("--runs", default="torch,lpoptim", help="comma-separated: torch, lpoptim, lpoptim+fp8, lpoptim+fp8+act, ...")
    t.add_argument("--preset", choices=sorted(PRESETS), help="model size and schedule (default: tiny on CPU, shakespeare on GPU)")
    t.add_argument("--steps", type=int, help="override the preset's number of steps")
    t.add_argument("--text", help="a text file (default: the bundled tinyshakespeare)")
    t.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="results", help="folder for train.json and train_loss.png")
    b = sub.add_parser("bench", help="memory and tokens/s of one training step of a Llama-shaped model per recipe")
    b.add_argument("--preset", choices=list(bench.DEFAULT_SHAPE),
                   help="model shape (default: tiny on CPU, tinyllama-1.1b on GPU)")
    b.add_argument("--batch", type=int, help="sequences per step (default: tiny 2, tinyllama 4, 7B/13B 1)")
    b.add_argument("--seq", type=int, help="tokens per sequence (default: tiny 64, others 2048)")
    b.add_argument("--recipes", default=",".join(STACKS),
                   help="comma-separated subset of the default; with --compile each may end in +sacNN (Inductor keeps NN%% of the activations, recomputes the rest)")
    b.add_argument("--steps", type=int, default=5, help="timed steps (median), after --warmup")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps first (kernel compilation, state allocation)")
    b.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    b.add_argument("--n-layer", type=int, help="override the preset's number of layers (to find the largest model)")
    b.add_argument("--memory-cap-gib", type=float,
                   help="allow the CUDA allocator this many GiB (e.g. 79.6 to stand in for an 80 GB H100 on a larger GPU)")
    b.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    b.add_argument("--out", default="results", help="folder for bench.json and bench.png")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        return cmd_bench(args, argv)
    return cmd_train(args)


if __name__ == "__main__":
    sys.exit(main())
