"""Host time of lpoptim.step_in_backward's flushes (opt.step_params on ~128 MiB buckets): 4 Llama-7B layers, bf16 parameters
with stochastic rounding, fresh gradients each step.  PYTHONPATH=$PWD python3 benchmarks/flush_host.py"""
import sys, time, statistics, cProfile, pstats
import torch
import lpoptim
print(lpoptim.__file__)
shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)] + [(4096,)] * 2
layers = 4
params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(layers) for s in shapes]
opt = lpoptim.AdamW(params, lr=1e-4, bf16_stochastic_round=True)
limit = 128 * 2**20
def step():
    bucket, nbytes, flushes = [], 0, 0
    for p in params:
        p.grad = torch.randn_like(p) if False else torch.empty_like(p).normal_()
        bucket.append(p); nbytes += p.numel() * 2
        if nbytes >= limit:
            opt.step_params(bucket, opt.param_groups[0]); flushes += 1
            for q in bucket: q.grad = None
            bucket, nbytes = [], 0
    if bucket:
        opt.step_params(bucket, opt.param_groups[0]); flushes += 1
        for q in bucket: q.grad = None
    return flushes
for _ in range(3): step()
torch.cuda.synchronize()
# host time of the flushes alone: time step_params calls only
ts = []
orig = opt.step_params
def timed(*a, **k):
    t0 = time.perf_counter(); orig(*a, **k); ts.append(time.perf_counter() - t0)
opt.step_params = timed
for _ in range(10):
    n = step()
torch.cuda.synchronize()
print(f"flushes per step {n}, host per flush median {statistics.median(ts)*1e6:.1f} us, mean {statistics.mean(ts)*1e6:.1f} us")
opt.step_params = orig
pr = cProfile.Profile(); pr.enable()
for _ in range(5): step()
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
