"""Where a synchronized low-bit linear step leaves the GPU idle: one step after a synchronize, traced by
torch.profiler, its kernels in GPU order with the idle time before each (host work the GPU waited on).

    PYTHONPATH=$PWD python3 benchmarks/step_gaps.py [--recipes fp8_tensor,fp4_fast] [--shape 4096,4096]

The profiler slows the host (its gaps are larger than unprofiled ones); where they fall is what it shows.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import print_environment  # noqa: E402
from benchmarks.linear import warm_layer_steps  # noqa: E402


def kernel_gaps(step, steps: int = 3) -> list[list[tuple[str, float, float]]]:
    """Per traced step: (kernel name, idle µs before it, its µs), in GPU order; the first kernel's idle time counts
    from the step's first host op (the host's lead-in: what the GPU waits for before anything runs)."""
    from torch.profiler import ProfilerActivity, profile
    out = []
    for i in range(steps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(i)
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = json.load(open(f.name))["traceEvents"]
        kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset")), key=lambda e: e["ts"])
        host_ops = [e["ts"] for e in events if e.get("cat") == "cpu_op"]
        rows, end = [], min(host_ops) if host_ops else None
        for e in kernels:
            rows.append((e["name"][:48], 0.0 if end is None else e["ts"] - end, e["dur"]))
            end = e["ts"] + e["dur"]
        out.append(rows)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="fp8_tensor,fp4_fast,int4")
    ap.add_argument("--shape", default="4096,4096")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    print_environment()
    k, n = (int(v) for v in args.shape.split(","))
    for name, step in warm_layer_steps(args.shape, args.tokens, args.recipes):
        rows = kernel_gaps(step)[-1]
        busy, idle = sum(r[2] for r in rows), sum(r[1] for r in rows)
        print(f"=== {name} {k}->{n}: kernels {busy:.0f} us, idle between them {idle:.0f} us")
        for kname, gap, dur in rows:
            print(f"  idle {gap:7.1f} us before {dur:7.1f} us  {kname}")


if __name__ == "__main__":
    main()
