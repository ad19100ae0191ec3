"""The lpoptim command line.

    lpoptim train [--preset tiny|shakespeare|gpt2-113m] [--runs torch,lpoptim,...] [--steps N] [--text FILE] [--compile] [--out DIR]
    lpoptim bench [--preset tiny|tinyllama-1.1b|llama2-7b|...] [--batch B] [--seq S] [--recipes ...]
                  [--steps N] [--compile] [--profile] [--out DIR]

``train`` trains the small GPT on the bundled tinyshakespeare (or --text FILE) once per run, same seed, data and
schedule, prints final train/val loss and optimizer-state memory side by side, and writes train.json and
train_loss.png into --out. The preset defaults to tiny on the CPU (about a minute) and to nanoGPT's
shakespeare-char recipe on a GPU.

``bench`` times one training step of a Llama-shaped model (random init) under each recipe, prints peak memory by
component and tokens/s (with --profile, on CUDA, a step's GPU time by kind of kernel too), and writes bench.json
and bench.png into --out. The preset defaults to tiny on the CPU and tinyllama-1.1b on a GPU.

Runs and recipes share one vocabulary (``lpoptim bench --help`` lists it): an optimizer, then +parts.
Every argument is checked before any work; a bad one is refused with one line and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from . import __version__
from .stack import Stack, parse_stack, vocabulary
from .train.data import PYTHON_STDLIB, STDLIB_CHARS, is_glob

PRESETS = {
    # about a minute on 2 CPU cores
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16, steps=300, lr=3e-3, eval_every=100),
    # nanoGPT's shakespeare-char recipe
    "shakespeare": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2, steps=5000,
                        lr=1e-3, warmup=100, eval_every=500, eval_batches=40),
    # GPT-2-small widths, 16 layers deep so that a character vocabulary still makes 113 M parameters (GPT-2's
    # own count is mostly its 50k-token embedding), context 512, 16 k tokens a step: quality beyond the toy
    "gpt2-113m": dict(n_layer=16, n_head=12, n_embd=768, block_size=512, batch_size=32, steps=2000, lr=6e-4,
                      warmup=200, betas=(0.9, 0.95), eval_every=250, eval_batches=20),
}
# the length of a text built from files (--text python-stdlib or a glob): the whole standard library (10-30 M
# characters, as installed) for the quality preset, whose 2000 steps train on 33 M characters (on the small
# presets' 1.5 M it saw each character 20 times and every run overfit after step 750); the small presets keep the
# 1.5 M their published figures were measured on
STDLIB_CHARS_BY_PRESET = {"gpt2-113m": 40_000_000}
# the loop builds its own model, optimizer and data: these parts are bench's alone
TRAIN_PARTS = "an optimizer (torch, lpoptim), then any of +bf16, +s4, +act, +attn (with +act), +<linear recipe>"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block: the message names the argument
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _number(text: str, ok, what: str) -> float:
    """``text`` as a float that ``ok`` accepts; else argparse's error, saying ``what`` was expected."""
    try:
        x = float(text)
    except ValueError:
        x = None
    if x is None or not ok(x):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return x


def fraction(text: str) -> float:
    return _number(text, lambda x: 0 < x <= 1, "a number in (0, 1]")


def positive_float(text: str) -> float:
    return _number(text, lambda x: 0 < x < float("inf"), "a positive number")


def stack_list(text: str) -> list[Stack]:
    """A comma-separated list of recipe names, every one parsed (so a bad one is refused before any runs)."""
    try:
        return [parse_stack(name) for name in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def train_run(stack: Stack) -> dict:
    """The RunConfig fields of a train run; ValueError for parts only bench has."""
    if (stack.optimizer not in ("torch", "lpoptim") or stack.recompute or stack.in_backward or stack.chunked_loss
            or stack.activation_budget is not None or stack.cuda_graphs or stack.hf_checkpointing or stack.offload):
        raise ValueError(f"run {stack.name!r}: train takes {TRAIN_PARTS}")
    options = dict(state_bits=4) if stack.state_bits == 4 else {}
    return dict(optimizer=stack.optimizer, recipe=stack.linears, compress=stack.compress, attention=stack.attention,
                master=stack.master, optimizer_options=options)


def train_runs(text: str) -> list[tuple[str, dict]]:
    try:
        return [(s.name, train_run(s)) for s in stack_list(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def hf_config_arg(text: str) -> str:
    from .bench import hf_config_file

    try:
        hf_config_file(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def existing_file(text: str) -> Path | str:
    path = Path(text)
    if path.is_file():  # a file first: its name may hold '[' or '*'
        return path
    if text == PYTHON_STDLIB or is_glob(text):  # built where the results go, once the output folder is known
        return text
    raise argparse.ArgumentTypeError(f"no such file: {text}")


def resolve_device(ap: Parser, device: str | None) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def make_out_dir(ap: Parser, out: str) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {out}: {e.strerror}")
    return path


def progress_bar(label: str, steps: int):
    """The training loop's progress callback (called about 50 times a run) as a tqdm bar on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=steps, desc=label, file=sys.stderr, dynamic_ncols=True)

    def show(step, steps, loss):
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update(step - bar.n)
        if step == steps:
            bar.close()
    return show


def plot_curves(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

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
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_train(ap: Parser, args) -> int:
    from .bench import environment
    from .train.data import CharData, bundled_text_path, files_text, python_stdlib_text
    from .train.loop import RunConfig, train

    device = resolve_device(ap, args.device)
    preset = dict(PRESETS[args.preset or ("shakespeare" if device == "cuda" else "tiny")])
    if args.steps is not None:
        preset["steps"] = args.steps
        preset["eval_every"] = max(1, args.steps // 5)
    out_dir = make_out_dir(ap, args.out)  # first: a --text built from files is written there
    text = args.text or bundled_text_path()
    limit = STDLIB_CHARS_BY_PRESET.get(args.preset, STDLIB_CHARS)
    if isinstance(text, str) and is_glob(text):
        try:
            text = files_text(text, Path(args.out) / "text_from_files.txt", limit)
        except ValueError as e:
            ap.error(f"--text: {e}")
    elif text == PYTHON_STDLIB:
        text = python_stdlib_text(Path(args.out) / ("python_stdlib.txt" if limit == STDLIB_CHARS else
                                                    f"python_stdlib_{limit // 1_000_000}M.txt"), limit)
    try:
        data = CharData(text, device=device)
    except (OSError, UnicodeDecodeError) as e:
        ap.error(f"--text {text}: cannot read it as text ({e})")
    if len(data.val) <= preset["block_size"] + 1:
        ap.error(f"--text {text}: too short; its last 10% must hold more than {preset['block_size'] + 1} characters")
    results = []
    for name, run in args.runs:
        if args.compile:  # each run compiles afresh: FP8-activation runs bring hooks of their own, which Dynamo guards
            torch._dynamo.reset()  # on, and past its recompile limit it would run the blocks eagerly
        cfg = RunConfig(**run, **preset, seed=args.seed, device=device, compile=args.compile,
                        autocast_dtype=torch.bfloat16 if device == "cuda" else None)
        results.append(dict(train(cfg, data, progress_bar(name, cfg.steps)), run=name))
    base = results[0]
    gpu = f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""
    print(f"\ncharacter-level GPT ({preset['n_layer']} layers, {preset['n_embd']} dims, {preset['steps']} steps"
          f"{', blocks compiled' if args.compile else ''}) on {Path(text).name}, {device}{gpu}, torch "
          f"{torch.__version__}, seed {args.seed}")
    w = max(40, *(len(r["label"]) for r in results))  # the run column, as wide as its longest label
    print(f"| {'run':{w}s} | train loss | val loss | best val | val vs first | state B/param (quantized) | seconds |")
    print(f"|{'-' * (w + 2)}|-----------:|---------:|---------:|-------------:|--------------------------:|--------:|")
    for r in results:
        best = min(v for _, v in r["val_curve"])
        sb = r["state_bytes"]
        quant = f"{sb['bytes_per_param']:.2f} ({sb['quantized_bytes_per_param']:.3f})" if sb["quantized_params"] else f"{sb['bytes_per_param']:.2f}"
        print(f"| {r['label']:{w}s} | {r['train']:10.4f} | {r['val']:8.4f} | {best:8.4f} | "
              f"{100 * (r['val'] / base['val'] - 1):+11.2f}% | {quant:>25s} | {r['seconds']:7.1f} |")
    env = dict(environment(), device=device)
    report = dict(env=env, device=device, text=str(text), text_characters=len(data.train) + len(data.val),
                  preset=preset, compile=args.compile, results=results)
    (out_dir / "train.json").write_text(json.dumps(report, indent=1))
    plot_curves(results, f"small GPT on {Path(text).name}: same seed, data and schedule", out_dir / "train_loss.png")
    print(f"wrote {out_dir / 'train.json'} and {out_dir / 'train_loss.png'}")
    return 0


def cmd_bench(ap: Parser, args, argv) -> int:
    from . import bench

    device = resolve_device(ap, args.device)
    if args.memory_cap_gib is not None and device != "cuda":
        ap.error("--memory-cap-gib caps the CUDA allocator: it needs CUDA")
    hf_config = None
    if args.budget_gib is not None and args.budget_fraction is not None:
        ap.error("argument --budget-fraction: a budget is --budget-gib or --budget-fraction, not both")
    budget_arg = "--budget-gib" if args.budget_fraction is None else "--budget-fraction"
    budget_given = args.budget_gib is not None or args.budget_fraction is not None
    if budget_given and args.hf_config is None:
        ap.error(f"argument {budget_arg}: it is prepare's budget, for --hf-config")
    if args.budget_fraction is not None and device != "cuda":
        ap.error("argument --budget-fraction: it is a fraction of the GPU's memory: it needs CUDA")
    if args.profile and device != "cuda":
        ap.error("argument --profile: it times GPU kernels: it needs CUDA")
    # recipes asked for by name that cannot run with these arguments are refused (the default list skips them)
    cannot = [(r.name, bench.unavailable(r, device, args.compile, hf=args.hf_config is not None))
              for r in args.recipes or []]
    cannot = [f"{name}: {why}" for name, why in cannot if why]
    if cannot:
        ap.error(f"argument --recipes: {'; '.join(cannot)}")
    if args.hf_config is not None and args.n_layer is not None and args.n_layer < 2:
        ap.error("argument --n-layer: with --hf-config at least 2 (prepare finds the blocks as a stack of two or more)")
    if budget_given and args.recipes and not any(r.optimizer == "prepare" for r in args.recipes):
        ap.error(f"argument {budget_arg}: it is the prepare recipe's budget; no prepare recipe in --recipes")
    budget = (dict(max_memory_gib=args.budget_gib) if args.budget_gib is not None else
              dict(max_memory_fraction=args.budget_fraction) if args.budget_fraction is not None else None)
    if args.hf_config is not None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            ap.error("--hf-config needs transformers (pip install transformers)")
        try:
            hf_config = bench.load_hf_config(args.hf_config)
        except (ValueError, OSError, json.JSONDecodeError) as e:
            why = str(e).splitlines()[0].split(". Should contain one of")[0]  # not transformers' list of every type
            ap.error(f"argument --hf-config: {args.hf_config}: {why[:300]}")
        if not bench.is_causal_lm(hf_config):
            ap.error(f"argument --hf-config: {args.hf_config}: a {type(hf_config).__name__} is not a causal LM "
                     "(bench times transformers' AutoModelForCausalLM)")
        path = Path(args.hf_config)  # the model's name: a folder's, or a .json file's (config.json: its folder's)
        preset = (path.name if path.suffix != ".json" else
                  path.resolve().parent.name if path.name == "config.json" else path.stem)
        batch, seq = bench.HF_DEFAULT_SHAPE[device]
    else:
        preset = args.preset or ("tinyllama-1.1b" if device == "cuda" else "tiny")
        batch, seq = bench.DEFAULT_SHAPE[preset]
    batch, seq = args.batch or batch, args.seq or seq
    recipes = args.recipes or stack_list(",".join(bench.HF_DEFAULT_RECIPES if hf_config else bench.DEFAULT_RECIPES))
    out_dir = make_out_dir(ap, args.out)
    names = [s.name for s in recipes]
    print(f"lpoptim bench: {preset}, {batch} x {seq} tokens, {device}", file=sys.stderr)
    report = bench.run(preset, names, batch, seq, args.steps, args.warmup, device,
                       compile_blocks=args.compile, log=lambda s: print(s, file=sys.stderr, flush=True),
                       n_layer=args.n_layer, memory_cap_gib=args.memory_cap_gib, hf_config=hf_config,
                       budget=budget, profile=args.profile)
    report["command"] = shlex.join(["python", "-m", "lpoptim", *argv])
    paths = bench.write(report, out_dir)
    print("\n" + bench.table(report))
    print("wrote " + " and ".join(str(p) for p in paths))
    failed = [r["recipe"] for r in report["results"] if "error" in r]
    if failed:  # the figures of the others are written, but the command did not do what was asked
        print(f"lpoptim bench: {len(failed)} recipe(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def parser() -> Parser:
    from .bench import DEFAULT_RECIPES, DEFAULT_SHAPE, HF_DEFAULT_RECIPES

    raw = argparse.RawDescriptionHelpFormatter
    ap = Parser(prog="lpoptim", description=__doc__, formatter_class=raw)
    ap.add_argument("--version", action="version", version=f"lpoptim {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a small GPT with each run side by side", formatter_class=raw,
                       epilog=f"A run is {TRAIN_PARTS}; e.g. torch,lpoptim,lpoptim+fp8_delayed+act.\n\n{vocabulary()}")
    t.add_argument("--runs", type=train_runs, default=train_runs("torch,lpoptim"),
                   help="comma-separated runs (default: torch,lpoptim); the first is the baseline")
    t.add_argument("--preset", choices=sorted(PRESETS), help="model size and schedule (default: tiny on CPU, shakespeare on GPU)")
    t.add_argument("--steps", type=positive_int, help="override the preset's number of steps")
    t.add_argument("--text", type=existing_file, help="a text file (default: the bundled tinyshakespeare); python-stdlib: the Python standard "
                   "library's own source, a second real text every machine has; or a quoted glob of files, e.g. "
                   "'/usr/include/**/*.h', concatenated in path order; built texts are cut at 1.5 M characters "
                   "(40 M for gpt2-113m)")
    t.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--compile", action="store_true",
                   help="torch.compile each block of every run (the quality presets' steps in a fraction of the time)")
    t.add_argument("--out", default="results", help="folder for train.json and train_loss.png (default: results)")
    b = sub.add_parser("bench", help="memory and tokens/s of one training step of a Llama-shaped model per recipe",
                       formatter_class=raw, epilog=f"Recipes:\n{vocabulary()}\n\n"
                                                   f"e.g. lpoptim+bf16+fp8_delayed+bwd+ce+sac55 (with --compile)")
    model = b.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=list(DEFAULT_SHAPE),
                       help="model shape (default: tiny on CPU, tinyllama-1.1b on GPU)")
    b.add_argument("--batch", type=positive_int, help="sequences per step (default: tiny 2, tinyllama 4, larger 1)")
    b.add_argument("--seq", type=positive_int, help="tokens per sequence (default: tiny 64, others 2048)")
    model.add_argument("--hf-config", metavar="PATH", type=hf_config_arg,
                   help="a Hugging Face config.json (or a folder holding one, or a bundled name: tinyllama-1.1b, "
                        "llama3.2-3b, llama2-7b, llama3-8b, qwen2.5-7b, gemma2-9b, llama2-13b, llama-26b): that causal "
                        "LM, random init, no download, instead of --preset")
    b.add_argument("--recipes", type=stack_list,
                   help=f"comma-separated recipes (default: {','.join(DEFAULT_RECIPES)}; with --hf-config "
                        f"{','.join(HF_DEFAULT_RECIPES)}); the first is the baseline")
    b.add_argument("--steps", type=positive_int, default=5, help="timed steps (median), after --warmup")
    b.add_argument("--warmup", type=positive_int, default=2,
                   help="untimed steps first (kernel compilation, state allocation); the last measures memory")
    b.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    b.add_argument("--budget-gib", type=positive_float,
                   help="with --hf-config: the prepare recipe gets this memory budget (prepare(model, "
                        "max_memory_gib=..., tokens=batch x seq))")
    b.add_argument("--budget-fraction", type=fraction,
                   help="with --hf-config on CUDA: the prepare recipe's budget as a fraction of the GPU's memory "
                        "(prepare's max_memory_fraction)")
    b.add_argument("--n-layer", type=positive_int, help="override the preset's number of layers")
    b.add_argument("--memory-cap-gib", type=positive_float,
                   help="allow the CUDA allocator this many GiB (e.g. 79.6 to stand in for an 80 GB H100 on a larger GPU)")
    b.add_argument("--profile", action="store_true",
                   help="on CUDA: one more step per recipe, profiled: its GPU time by kind of kernel (GEMMs, attention, "
                        "FP8 casts, optimizer, ...) and the time no kernel ran, in the table, JSON and PNG")
    b.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    b.add_argument("--out", default="results", help="folder for bench.json and bench.png (default: results)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        return cmd_bench(ap, args, argv)
    return cmd_train(ap, args)


if __name__ == "__main__":
    sys.exit(main())
