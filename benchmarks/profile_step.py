"""Where one training step's time goes, per recipe: torch.profiler's op and kernel tables.

    python3 benchmarks/profile_step.py --preset tinyllama-1.1b --recipes bf16,lpoptim+act --out results/profile

For each recipe of ``lpoptim bench`` (same model, data and step) it runs --warmup steps, then profiles one,
and writes ``profile_<recipe>.txt``: the ops by self CUDA time and by self CPU time. Printed: step wall time,
GPU busy time (sum of kernel times) and the top ops, so host overhead (GPU idle while Python runs) shows as
the gap between the two.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import kernel_events, profile_steps  # noqa: E402
from lpoptim.bench import DEFAULT_SHAPE, autocast_loss, build, stack_context, stack_of, unavailable  # noqa: E402
from lpoptim.train.llama import PRESETS  # noqa: E402


def profile_one(args, name, stack, cfg, batch, seq):
    model, opt, _handle = build(stack, cfg, "cuda", args.compile)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        autocast_loss(model, tokens[:, :-1], tokens[:, 1:], "cuda").backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    wall_ms, gpu_ms, events = profile_steps(lambda _i: step())
    by_gpu = events.table(sort_by="self_cuda_time_total", row_limit=args.rows)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=args.rows)
    (args.out / f"profile_{name.replace('+', '_')}.txt").write_text(f"wall {wall_ms:.1f} ms (profiled), kernels {gpu_ms:.1f} ms\n\n"
                                                  f"{by_gpu}\n\n{by_cpu}\n")
    print(f"=== {name}: profiled step {wall_ms:.1f} ms wall, GPU kernels {gpu_ms:.1f} ms")
    print("    by kind (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in kernel_kinds(events).items()))
    print(events.table(sort_by="self_cuda_time_total", row_limit=15))


# by kernel name, the first kind with a matching pattern (attention before GEMM: cuDNN's SDPA kernels are named
# sm90 too). Inductor names a fused kernel after the ops in it: the fp8 casts and maxima that feed a _scaled_mm
# carry "scaled_mm" or "amax"; a cast fused into something else stays in "other"
KINDS = (("attention", ("flash", "fmha", "sdpa", "attention")), ("GEMM", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
         ("optimizer", ("adamw", "multi_tensor")), ("quantize (amax, fp8 casts)", ("amax", "scaled_mm", "quant")))


def kernel_kinds(events) -> dict:
    """GPU kernel time per step by kind, from the kernels' names (the first kind whose pattern a name holds);
    'other' is the rest (norms, activations, residual adds, copies)."""
    out = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    for e in kernel_events(events):
        name = e.key.lower()
        kind = next((k for k, pats in KINDS if any(p in name for p in pats)), "other")
        out[kind] += e.self_device_time_total / 1e3
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tinyllama-1.1b", choices=sorted(PRESETS))
    ap.add_argument("--recipes", default="bf16,lpoptim+act")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--n-layer", type=int, help="override the preset's number of layers (a shorter profile)")
    ap.add_argument("--out", type=Path, default=Path("results/profile"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = PRESETS[args.preset]
    if args.n_layer:
        cfg = dataclasses.replace(cfg, n_layer=args.n_layer)
    batch, seq = args.batch or DEFAULT_SHAPE[args.preset][0], args.seq or DEFAULT_SHAPE[args.preset][1]
    for name in args.recipes.split(","):
        why = unavailable(name, "cuda", args.compile)
        if why:  # a +sacNN recipe without --compile would be profiled without its budget
            print(f"=== {name}: skipped ({why})")
            continue
        stack = stack_of(name)
        with stack_context(stack, args.compile):  # as lpoptim bench: fresh Dynamo, the stack's budget
            profile_one(args, name, stack, cfg, batch, seq)
        torch.cuda.empty_cache()  # the recipe's model and optimizer went with profile_one's frame


if __name__ == "__main__":
    main()
