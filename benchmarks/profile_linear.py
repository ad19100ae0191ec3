"""Where one low-bit linear layer's forward + backward time goes: wall time per step against the GPU's kernel
time (their gap is host work the GPU waits on), and the kernels by time.

    PYTHONPATH=$PWD python3 benchmarks/profile_linear.py --shape 4096,4096 --recipes fp8_tensor,int4@delayed [--compile]

Same layer and inputs as benchmarks/linear.py (16384 tokens, bf16); 10 steps profiled after 5 warm-up.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.linear import warm_layer_steps  # noqa: E402
from benchmarks.timing import enqueue_ms, host_profile, profile_steps, print_environment  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096,4096", help="in,out features")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--recipes", default="bf16,fp8_tensor")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--host", action="store_true", help="also cProfile the host side of 20 steps (Python functions)")
    args = ap.parse_args()
    print_environment()
    k, n = (int(v) for v in args.shape.split(","))
    for name, step in warm_layer_steps(args.shape, args.tokens, args.recipes, args.compile):
        # back to back, no sync between steps: the host's enqueue time per step, and the time per step once the
        # GPU is the limit (or the host, where enqueueing is slower than the kernels)
        host, b2b = enqueue_ms(step, 20)
        if args.host:
            print(host_profile(step))
        wall, gpu, ev = profile_steps(step, args.steps)
        print(f"=== {name}{' compiled' if args.compile else ''} {k}->{n}: {wall:.3f} ms wall per step (profiled), "
              f"{gpu:.3f} ms of GPU kernels; unprofiled back to back: {b2b:.3f} ms per step, of which "
              f"the host took {host:.3f} ms to enqueue")
        print(ev.table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
