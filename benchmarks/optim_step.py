"""Optimizer step time and state memory on a Llama-3.2-1B-shaped parameter set (1.24 B parameters).

    PYTHONPATH=$PWD python3 benchmarks/optim_step.py --out results/optim_step.json   # on a GPU
    python benchmarks/optim_step.py --small                                        # a CPU smoke run

In one run it times lpoptim.AdamW, torch AdamW (fused and foreach) and, where installed, bitsandbytes AdamW8bit
and torchao AdamWFp8 / AdamW8bit: CUDA events around each step after warm-up and a synchronize, the median of
--steps steps (the step's host work is inside: the GPU waits for it), and the same steps queued back to back
(events between them, median interval; the host prepares a step while the GPU runs the previous one, as in
training),
gradients redrawn (never zeros) and larger than L2. It prints state bytes per parameter, step ms, the first
step's seconds (compilation included) and the ratio to the bandwidth floor: the bytes each step must move over
the measured device-to-device copy bandwidth.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lpoptim  # noqa: E402
from lpoptim.bench import optimizer_state_bytes  # noqa: E402  (one counting rule for every benchmark)

TARGETS_MS = {torch.float32: 7.5, torch.bfloat16: 5.0}  # targets on one H100


def llama_1b_shapes(small: bool) -> list[tuple[int, ...]]:
    if small:
        d, kv, ff, vocab, layers = 256, 64, 1024, 4096, 2
    else:
        d, kv, ff, vocab, layers = 2048, 512, 8192, 128256, 16
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff), (d,), (d,)]
    return shapes + [(d,)]


def copy_bandwidth(dev) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=dev).normal_()
    y = torch.empty_like(x)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del x, y
    return 2 * (1 << 28) * 4 / statistics.median(times)


def optimizers():
    yield "lpoptim.AdamW", lambda ps: lpoptim.AdamW(ps, lr=1e-3, weight_decay=0.1)
    # bf16 parameters only: the update rounded stochastically (bf16 master weights)
    yield "lpoptim.AdamW SR", lambda ps: lpoptim.AdamW(ps, lr=1e-3, weight_decay=0.1, bf16_stochastic_round=True)
    yield "lpoptim.AdamW 4-bit", lambda ps: lpoptim.AdamW(ps, lr=1e-3, weight_decay=0.1, state_bits=4)
    yield "lpoptim.AdamW 4-bit SR", lambda ps: lpoptim.AdamW(ps, lr=1e-3, weight_decay=0.1, state_bits=4,
                                                             bf16_stochastic_round=True)
    yield "torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True)
    yield "torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True)
    try:
        import bitsandbytes as bnb
        yield "bitsandbytes AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.1)
    except Exception as e:  # noqa: BLE001
        print(f"bitsandbytes unavailable: {e!r}")
    try:
        from torchao.optim import AdamW8bit, AdamWFp8
        yield "torchao AdamWFp8", lambda ps: AdamWFp8(ps, lr=1e-3, weight_decay=0.1)
        yield "torchao AdamW8bit", lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=0.1)
    except Exception as e:  # noqa: BLE001
        print(f"torchao unavailable: {e!r}")


def time_optimizer(make, shapes, dtype, dev, steps: int, warmup: int):
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=dtype, generator=gen) * 0.02) for s in shapes]
    grad_sets = [[torch.randn(s, device=dev, dtype=dtype, generator=gen) * 1e-3 for s in shapes] for _ in range(2)]
    opt = make(params)
    for p, g in zip(params, grad_sets[0]):
        p.grad = g
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    times = []
    for i in range(warmup + steps):
        for p, g in zip(params, grad_sets[i % 2]):  # two gradient sets, each far larger than L2
            p.grad = g
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        opt.step()
        e.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(s.elapsed_time(e))
    # back to back: steps queued without a synchronize between them, as in training, where the host prepares a
    # step while the GPU still runs the previous work; an event between consecutive steps, the median interval
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for i in range(steps):
        for p, g in zip(params, grad_sets[i % 2]):
            p.grad = g
        opt.step()
        marks[i + 1].record()
    torch.cuda.synchronize()
    back_to_back = statistics.median(a.elapsed_time(b) for a, b in zip(marks, marks[1:]))
    n = sum(p.numel() for p in params)
    result = dict(step_ms=statistics.median(times), back_to_back_ms=back_to_back, first_step_s=first,
                  state_bytes_per_param=optimizer_state_bytes(opt) / n, params=n,
                  finite=all(bool(torch.isfinite(p).all()) for p in params))
    del opt, params, grad_sets
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/optim_step.json")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a small parameter set (CPU smoke test without CUDA)")
    ap.add_argument("--only", default="", help="comma-separated substrings of optimizer names to run")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        return cpu_smoke(args)
    dev = torch.device("cuda")
    shapes = llama_1b_shapes(args.small)
    bw = copy_bandwidth(dev)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        esize = torch.finfo(dtype).bits // 8
        for name, make in optimizers():
            if args.only and not any(s in name for s in args.only.split(",")):
                continue
            if name.endswith(" SR") and dtype != torch.bfloat16:
                continue
            try:
                r = time_optimizer(make, shapes, dtype, dev, args.steps, args.warmup)
            except Exception as e:  # noqa: BLE001 - a competitor failing is a result, not a crash
                print(f"{name} {dtype}: failed: {e!r}")
                continue
            # bytes a step must move: read param+grad+state, write param+state
            floor_ms = r["params"] * (3 * esize + 2 * r["state_bytes_per_param"]) / bw * 1e3
            r.update(name=name, dtype=str(dtype).replace("torch.", ""), floor_ms=floor_ms,
                     x_floor=r["step_ms"] / floor_ms)
            if name.startswith("lpoptim.AdamW"):
                r["target_ms"] = TARGETS_MS[dtype]
            rows.append(r)
            print(f"{name:24s} {r['dtype']:9s} {r['step_ms']:8.2f} ms  back to back {r['back_to_back_ms']:8.2f} ms  "
                  f"first {r['first_step_s']:6.2f} s  "
                  f"{r['state_bytes_per_param']:.3f} B/param  floor {floor_ms:.2f} ms", flush=True)
    from lpoptim.bench import environment

    info = dict(environment(), copy_bandwidth_TBps=bw / 1e12,
                params=rows[0]["params"] if rows else 0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    print(f"\n{info['gpu']}, torch {info['torch']}, triton {info.get('triton')}, copy {bw / 1e12:.2f} TB/s, "
          f"{info['params'] / 1e9:.3f} B params")
    print("step ms: one step after a synchronize (its host work exposed); b2b ms: steps queued back to back")
    print(f"{'optimizer':24s} {'dtype':9s} {'B/param':>8s} {'step ms':>8s} {'b2b ms':>8s} {'first s':>8s} "
          f"{'floor ms':>8s} {'x floor':>8s} {'target':>7s}")
    for r in rows:
        tgt = f"{r['step_ms'] / r['target_ms']:.2f}x" if "target_ms" in r else ""
        print(f"{r['name']:24s} {r['dtype']:9s} {r['state_bytes_per_param']:8.3f} {r['step_ms']:8.2f} "
              f"{r['back_to_back_ms']:8.2f} {r['first_step_s']:8.2f} {r['floor_ms']:8.2f} {r['x_floor']:8.2f} {tgt:>7s}")


def cpu_smoke(args):
    """Without CUDA: step the small set once with lpoptim and torch AdamW, report state bytes, write ``--out``."""
    from lpoptim.bench import environment

    shapes = llama_1b_shapes(True)
    rows = []
    for name, make in optimizers():
        if name not in ("lpoptim.AdamW", "torch AdamW fused"):
            continue
        params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
        opt = make(params)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        t0 = time.perf_counter()
        opt.step()
        n = sum(p.numel() for p in params)
        rows.append(dict(name=name, dtype="float32", params=n, state_bytes_per_param=optimizer_state_bytes(opt) / n,
                         step_ms=1e3 * (time.perf_counter() - t0)))
        print(f"{name:24s} cpu  {rows[-1]['state_bytes_per_param']:.3f} B/param  step {rows[-1]['step_ms']:.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(info=dict(environment(), params=rows[0]["params"]), rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
