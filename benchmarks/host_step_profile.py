"""Where the host time of an eager low-bit layer step goes: on 64 x 256 bf16 (the GPU keeps up, so the times are
the host's own), perf_counter around forward and backward over 300 steps, then a cProfile of 300 steps.

    PYTHONPATH=$PWD python3 benchmarks/host_step_profile.py [recipe [tokens features [steps]]]
                                                      # default fp8_delayed 64 256 300
At large shapes keep steps x launches a step under the launch queue's depth (about 1000), so that the host never
waits for the GPU: e.g. 16384 4096 30.

Measured on an H100 host: docs/results/host/host_pieces_ninth_h100.txt.
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import print_environment  # noqa: E402
from lpoptim.nn import LowBitLinear  # noqa: E402


def main(recipe: str = "fp8_delayed", tokens: int = 64, features: int = 256, n: int = 300):
    print_environment()
    dev = "cuda"
    lin = torch.nn.Linear(features, features, bias=False, device=dev, dtype=torch.bfloat16)
    m = LowBitLinear.from_linear(lin, recipe)
    x = torch.randn(tokens, features, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(tokens, features, device=dev, dtype=torch.bfloat16)
    for _ in range(20):
        m(x).backward(gy)
        x.grad = m.weight.grad = None
    torch.cuda.synchronize()
    f = b = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        y = m(x)
        t1 = time.perf_counter()
        y.backward(gy)
        t2 = time.perf_counter()
        f += t1 - t0
        b += t2 - t1
        x.grad = m.weight.grad = None  # each backward writes its gradients afresh (no accumulation add)
        if i % 10 == 9:
            torch.cuda.synchronize()
    print(f"{recipe}: forward {f / n * 1e6:.1f} us, backward {b / n * 1e6:.1f} us (host, per step)")
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    for i in range(n):
        pr.enable()
        m(x).backward(gy)
        pr.disable()
        x.grad = m.weight.grad = None
        if i % 10 == 9:
            torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
    print(s.getvalue())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fp8_delayed", *map(int, sys.argv[2:5]))
