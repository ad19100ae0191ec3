"""One Llama-7B block (4 x 2048 tokens) with compiled fp8_tensor_fast linears, without and with
compress_activations, twice each: steps back to back (no sync between them: a model whose host runs ahead), the
GPU's forward and backward time from CUDA events around each phase, the step synchronized alone (as
benchmarks/activations.py times it), the profiler's kernel sum, and with --kernels the kernels by time.

    PYTHONPATH=$PWD python3 benchmarks/activations_b2b.py [--kernels]      # one H100: about a minute
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.activations import make_block  # noqa: E402
from benchmarks.timing import kernel_events, profile_steps, timer  # noqa: E402
from lpoptim.activations import compress_activations  # noqa: E402
from lpoptim.nn import convert_linears  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", action="store_true", help="print the 30 longest kernels of each variant")
    args = ap.parse_args()
    block, extra = make_block("plain", 4096, 11008, 32, 2048, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(4, 2048, 4096, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
          for _ in range(2)]
    dy = torch.randn(4, 2048, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for wrap in (False, True, False, True):
        torch._dynamo.reset()
        m = copy.deepcopy(block)
        convert_linears(m, recipe="fp8_tensor_fast")
        run = torch.compile(m)
        handle = compress_activations(run) if wrap else None
        events = []

        def step(i, record=False):
            for p in m.parameters():
                p.grad = None
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if record else None
            if record:
                ev[0].record()
            y = run(xs[i % 2], **extra)
            if record:
                ev[1].record()
            y.backward(dy)
            if record:
                ev[2].record()
                events.append(ev)

        for i in range(5):
            step(i)
        torch.cuda.synchronize()
        for i in range(30):
            step(i, True)
        torch.cuda.synchronize()
        fwd = statistics.median(a.elapsed_time(b) for a, b, _ in events[5:])
        bwd = statistics.median(b.elapsed_time(c) for _, b, c in events[5:])
        turn = iter(range(1000))
        synced = timer(lambda: step(next(turn)), 0, 30, True)
        _, kernels_ms, ev = profile_steps(step, 3)
        print(f"wrapped={wrap}: back to back GPU fwd {fwd:.2f} + bwd {bwd:.2f} = {fwd + bwd:.2f} ms; synchronized "
              f"per step {synced:.2f} ms; profiled kernel sum {kernels_ms:.2f} ms", flush=True)
        if args.kernels:
            for e in sorted(kernel_events(ev), key=lambda e: -e.self_device_time_total)[:30]:
                print(f"   {e.self_device_time_total / 3e3:8.3f} ms  x{e.count // 3}  {e.key[:120]}")
        if handle is not None:
            handle.remove()


if __name__ == "__main__":
    main()
