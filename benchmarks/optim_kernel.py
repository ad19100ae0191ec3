"""Variants of the fused AdamW kernel on the 1.24 B-parameter set: where does the time go?

    PYTHONPATH=$PWD python3 benchmarks/optim_kernel.py

Times kernel.fused_adamw_step alone (CUDA events, median) for launch settings and for the fp32-state path,
which moves more bytes but does no FP8 work: the gap between the two is the cost of the quantization math.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import timer  # noqa: E402
from benchmarks.optim_step import copy_bandwidth, llama_1b_shapes  # noqa: E402
from lpoptim.kernels import adamw_step as kernel  # noqa: E402
from lpoptim.optim.state import StateLayout, init_state  # noqa: E402


def bench(batch, steps=10):
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)
    return timer(lambda: kernel.fused_adamw_step(batch, **hyper), 1, steps, cuda=True)


def main():
    shapes = [s for s in llama_1b_shapes(False) if len(s) == 2]
    n = sum(a * b for a, b in shapes)
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}  {n / 1e9:.3f} B params  copy {bw / 1e12:.2f} TB/s")
    defaults = dict(kernel.TUNING)
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(s, device="cuda", dtype=dtype) * 0.02 for s in shapes]
        grads = [torch.randn(s, device="cuda", dtype=dtype) * 1e-3 for s in shapes]
        es = torch.finfo(dtype).bits // 8
        for quant in (True, False):
            layout = StateLayout(quantized=quant)
            states = [init_state(p, layout, False) for p in params]
            batch = [(p, g, s, layout) for p, g, s in zip(params, grads, states)]
            floor = n * (3 * es + (2 * 2 if quant else 2 * 8)) / bw * 1e3
            variants = [(2, 1, 8), (2, 1, 4), (4, 1, 4), (2, 2, 8)]
            for block, warps, loop in variants if quant else variants[:1]:
                kernel.TUNING.update(block_groups=block, num_warps=warps, loop=loop)
                kernel._plans.clear()
                ms = bench(batch)
                print(f"{str(dtype):15s} quant={quant!s:5s} groups={block:2d} warps={warps} loop={loop:2d} "
                      f"{ms:7.2f} ms  floor {floor:5.2f} ms  x{ms / floor:5.2f}", flush=True)
            del states, batch
        # the whole optimizer on the same tensors: what the step costs beyond the kernel
        import lpoptim
        kernel.TUNING.update(defaults)  # the shipped launch settings (the sweep above changed them)
        ps = [torch.nn.Parameter(p) for p in params]
        for p, g in zip(ps, grads):
            p.grad = g
        opt = lpoptim.AdamW(ps, lr=1e-3, weight_decay=0.1)
        print(f"{str(dtype):15s} lpoptim.AdamW.step {timer(opt.step, 1, 10, cuda=True):7.2f} ms", flush=True)
        del params, grads, ps, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
