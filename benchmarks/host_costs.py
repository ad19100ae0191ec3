"""What the host spends issuing one low-bit linear step: per-call costs of the pieces (a Triton launch through
JITFunction.run and through lpoptim's cached launcher, torch._scaled_mm against torch.mm, small
allocations, an autograd Function) and a cProfile of whole layer steps.

    PYTHONPATH=$PWD python3 benchmarks/host_costs.py [--recipes fp8_tensor,int4,fp4_fast] [--out F.txt]

Per-call figures are host time only: calls are queued without synchronizing, on tensors small enough that the
GPU keeps up (the large GEMMs: 20 calls, fewer than the launch queue holds).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.linear import warm_layer_steps  # noqa: E402
from benchmarks.timing import enqueue_ms, host_profile  # noqa: E402
from lpoptim.bench import environment  # noqa: E402


def per_call_us(fn, n=200) -> float:
    """Host time of one call of ``fn`` (us), after five warm-up calls: timing.enqueue_ms's host figure."""
    for _ in range(5):
        fn()
    return enqueue_ms(lambda i: fn(), n)[0] * 1e3


def primitive_costs() -> dict:
    from lpoptim.kernels import linear_quant as lq
    dev = "cuda"
    small = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    amax = lq.finite_absmax(small)
    rows = (torch.empty((64, 256), device=dev, dtype=torch.float8_e4m3fn), torch.empty((), device=dev))
    cols = (torch.empty((256, 64), device=dev, dtype=torch.float8_e4m3fn), torch.empty((), device=dev))
    out = {}
    out["torch.empty"] = per_call_us(lambda: torch.empty((64, 256), device=dev, dtype=torch.float8_e4m3fn))
    out["torch.zeros(())"] = per_call_us(lambda: torch.zeros((), device=dev, dtype=torch.int32))
    out["finite_absmax (zeros + launch)"] = per_call_us(lambda: lq.finite_absmax(small))
    out["quantize_tensor_rows_cols (wrapper)"] = per_call_us(
        lambda: lq.quantize_tensor_rows_cols(small, "e4m3", "e4m3", 256, 64, amax))
    tune = lq.TUNING["tensor"]
    e4m3 = lq.get_format("e4m3")
    # the quantizer's own launch: current scaling (no history: its pointer and slots are placeholders)
    kw = dict(**lq._tensor_constexprs(e4m3, e4m3, 0, tune["block_r"], tune["block_c"], False), DELAYED=False,
              REDO=False, num_warps=tune["num_warps"])
    args = (small, amax, *rows, *cols, 64, 256, 64, 256, small.stride(0), small.stride(1), small, 0, 0, 0)
    grid = (-(-256 // tune["block_r"]), -(-256 // tune["block_c"]))
    out["JITFunction launch (kernel[grid](...))"] = per_call_us(lambda: lq._quant_tensor_kernel[grid](*args, **kw))
    # lpoptim's cached launcher (kernels/launch.py): its key, then the compiled kernel's own launcher
    from lpoptim.kernels.launch import launcher
    run = launcher(lq._quant_tensor_kernel)
    out["launch.launcher (cached)"] = per_call_us(lambda: run(grid, *args, **kw))
    a = torch.randn(16384, 4096, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(4096, 4096, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    out["_scaled_mm 16384x4096x4096 (20 calls)"] = per_call_us(
        lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), n=20)
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    out["torch.mm bf16 same shape (20 calls)"] = per_call_us(lambda: ab @ bb.t(), n=20)
    sa, sb = torch.ones((16, 1), device=dev), torch.ones((1, 16), device=dev)
    a16, b16 = a[:16, :16].contiguous(), b[:16, :16].contiguous()
    out["_scaled_mm 16x16x16"] = per_call_us(
        lambda: torch._scaled_mm(a16, b16.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    out["_scaled_mm 16x16x16 row scales"] = per_call_us(
        lambda: torch._scaled_mm(a16, b16.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))

    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    xs = small.clone().requires_grad_()
    out["autograd.Function.apply (identity)"] = per_call_us(lambda: Ident.apply(xs))
    # an activation's eager packing (groups of 16, power-of-two scales): the graph op against the direct launch
    from lpoptim.kernels import act_quant as aq
    codes, exps = aq.quantize_groups_pow2_eager(small, 16)
    out["act pack: quantize_groups_pow2 op"] = per_call_us(lambda: aq.quantize_groups_pow2(small, 16))
    out["act pack: direct launch (eager)"] = per_call_us(lambda: aq.quantize_groups_pow2_eager(small, 16))
    out["act unpack: dequantize_groups_pow2 op"] = per_call_us(
        lambda: aq.dequantize_groups_pow2(codes, exps, torch.bfloat16))
    out["act unpack: direct launch (eager)"] = per_call_us(
        lambda: aq.dequantize_groups_pow2_eager(codes, exps, torch.bfloat16))
    return out


def profile_layer(name: str, step, k: int, n: int, top: int) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # a step that waits for the GPU would hide in the enqueue time
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(0)
    torch.cuda.set_sync_debug_mode(0)
    syncs = sorted({str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)})
    host3 = enqueue_ms(step, 3)[0]  # a few steps: the launch queue cannot be full yet
    host, b2b = enqueue_ms(step, 20)
    return (f"=== {name} {k}->{n}: back to back {b2b:.3f} ms per step, host enqueue {host:.3f} ms per step "
            f"(over 3 steps: {host3:.3f}); synchronizing calls in a step: {syncs or 'none'}\n"
            + host_profile(step, 20, top))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="bf16,fp8_tensor,int4,fp4_fast")
    ap.add_argument("--shape", default="4096,4096")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [json.dumps(environment()), "per-call host time, us:"]
    lines += [f"  {k:45s} {v:.1f}" for k, v in primitive_costs().items()]
    k, n = (int(v) for v in args.shape.split(","))
    for name, step in warm_layer_steps(args.shape, args.tokens, args.recipes):
        lines.append(profile_layer(name, step, k, n, args.top))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
