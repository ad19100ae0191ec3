"""Host time of lpoptim.step_in_backward's flushes: opt.step_params on 128 MiB buckets of 4 Llama-7B layers' parameters
(bf16, stochastic rounding), fresh gradients each step, as stepping in backward sees them.

    PYTHONPATH=$PWD python3 benchmarks/flush_host.py

Prints the host time per flush (median, wall clock of step_params without a synchronize) and a cProfile by own time.
"""
import cProfile
import pstats
import statistics
import time

import torch

import lpoptim

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)] + [(4096,)] * 2  # one layer
BUCKET = 128 * 2**20  # step_in_backward's bucket_mb before it became 256


def main(layers: int = 4):
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(layers) for s in SHAPES]
    opt = lpoptim.AdamW(params, lr=1e-4, bf16_stochastic_round=True)
    group = opt.param_groups[0]
    times = []

    def flush(bucket, timed):
        t0 = time.perf_counter()
        opt.step_params(bucket, group)
        if timed:
            times.append(time.perf_counter() - t0)
        for q in bucket:
            q.grad = None

    def step(timed=False):
        bucket, nbytes, flushes = [], 0, 0
        for p in params:
            p.grad = torch.empty_like(p).normal_()
            bucket.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= BUCKET:
                flush(bucket, timed)
                bucket, nbytes, flushes = [], 0, flushes + 1
        if bucket:
            flush(bucket, timed)
            flushes += 1
        return flushes

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    for _ in range(10):
        n = step(timed=True)
    torch.cuda.synchronize()
    print(f"flushes per step {n}, host per flush median {statistics.median(times) * 1e6:.1f} us, "
          f"mean {statistics.mean(times) * 1e6:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
