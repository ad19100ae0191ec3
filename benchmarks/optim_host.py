"""Host time of one optimizer step (the Python and launch work before the GPU has it all), 1.24 B parameters.

    PYTHONPATH=$PWD python3 benchmarks/optim_host.py

optim_step.py times a step with CUDA events after a synchronize, so the host work that precedes the step's big
kernel is inside its figure. This prints that host time (wall clock of opt.step() without a synchronize,
gradients alternating between two sets as in optim_step.py) for lpoptim.AdamW and torch's fused AdamW, then
where lpoptim's goes (cProfile, by own time).
"""
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lpoptim  # noqa: E402
from benchmarks.optim_step import llama_1b_shapes  # noqa: E402


def host_ms(opt, params, grad_sets, steps=20):
    times = []
    for i in range(steps):
        for p, g in zip(params, grad_sets[i % 2]):
            p.grad = g
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times[2:])


def main():
    shapes = llama_1b_shapes(False)
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in shapes]
        grad_sets = [[torch.randn(s, device="cuda", dtype=dtype) * 1e-3 for s in shapes] for _ in range(2)]
        for name, make in (("lpoptim.AdamW", lambda ps: lpoptim.AdamW(ps, lr=1e-3)),
                           ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))):
            opt = make(params)
            print(f"{name:18s} {str(dtype):15s} host {host_ms(opt, params, grad_sets):6.2f} ms per step "
                  f"({len(params)} tensors)", flush=True)
            if name == "lpoptim.AdamW" and dtype == torch.float32:
                prof = cProfile.Profile()
                prof.enable()
                host_ms(opt, params, grad_sets, steps=10)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            del opt
        del params, grad_sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
