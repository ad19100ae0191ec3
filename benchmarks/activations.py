"""Saved activations and fwd+bwd time of one Llama-7B decoder block (d=4096, ffn 11008, 32 heads), 4 x 2048 tokens.

    PYTHONPATH=$PWD python3 benchmarks/activations.py --out results/activations.json    # one H100
    python benchmarks/activations.py --small                                          # CPU smoke run

In one run, on the same block and inputs (bf16 parameters and activations):
  bf16 eager | bf16 torch.compile | bf16 full recompute (torch.utils.checkpoint, non-reentrant) |
  lpoptim.compress_activations: default (attention kept bf16, COAT's choice), attention in FP8, recompute=True,
  compile-then-wrap | with lpoptim.nn.convert_linears(recipe=--linear-recipe, default fp8_tensor) when importable:
  linears alone (eager and compiled), + activations, + activations + compile.
Saved MiB: allocator bytes held after forward (output excluded), on CUDA; "hooks MiB" is what the saved-tensor
hooks saw (lpoptim's accounting: lpoptim.activations.record_saved for the unwrapped variants, handle.record() for
the wrapped ones). Time: CUDA events around forward+backward after warm-up, median of --iters, two inputs
alternated (64 MiB each: larger than L2), random output gradients; "b2b": the same steps queued back to back,
ms per step (a model of many blocks, whose host runs ahead of the GPU: host work the GPU would wait on in a
step timed alone is hidden unless the host is the slower). Floor: the block's GEMM and attention FLOPs
over the dense bf16 (or FP8 for the GEMMs of FP8 variants) rate measured on an H100.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._functorch import config as functorch_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lpoptim.activations import compress_activations, record_saved  # noqa: E402
from benchmarks.timing import back_to_back_ms, profile_steps, timer  # noqa: E402
from lpoptim.bench import environment  # noqa: E402

TARGET_SAVED_MIB = 500.0
TARGET_TIME_RATIO = 1.05  # vs bf16 eager, measured in the same run
TARGET_FP8_MS = 13.0
BF16_TFLOPS, FP8_TFLOPS = 770.0, 1300.0  # dense GEMM rates measured on an H100


# ---- a plain-torch Llama decoder block, op for op as transformers' LlamaDecoderLayer (eager, SDPA) ---------

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, d, ff, heads):
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(d)
        self.post_attention_layernorm = RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        hd = d // self.heads
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, self.heads, hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def rope(t, hd, device, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    f = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]


def make_block(impl, d, ff, heads, t, device, dtype):
    torch.manual_seed(0)
    if impl == "hf":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        cfg = LlamaConfig(hidden_size=d, intermediate_size=ff, num_attention_heads=heads, num_key_value_heads=heads,
                          num_hidden_layers=1, max_position_embeddings=t, vocab_size=32)
        cfg._attn_implementation = "sdpa"
        block = LlamaDecoderLayer(cfg, layer_idx=0)
    else:
        block = LlamaBlock(d, ff, heads)
    for m in block.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    block = block.to(device=device, dtype=dtype)
    cos, sin = rope(t, d // heads, device, dtype)
    if impl == "hf":
        extra = {"position_embeddings": (cos[0], sin[0])}
    else:
        extra = {"cos": cos, "sin": sin}
    return block, extra


# ---- measurement ----------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(run, params, xs, dy, extra, device, warmup, iters):
    """(saved MiB by the allocator or None, peak MiB during fwd+bwd or None, median ms of a step synchronized
    alone, ms per step queued back to back (CUDA only: a model of many blocks, whose host runs ahead) or None,
    first-call s)."""
    def step(x):
        for p in params:
            p.grad = None
        x.grad = None
        y = run(x, **extra)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(dy)

    t0 = time.perf_counter()
    step(xs[0])
    sync(device)
    first_s = time.perf_counter() - t0
    for i in range(warmup):
        step(xs[i % len(xs)])
    saved = peak = None
    if device.type == "cuda":
        for p in params:
            p.grad = None
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = run(xs[0], **extra)
        y = y[0] if isinstance(y, tuple) else y
        torch.cuda.synchronize()
        saved = (torch.cuda.memory_allocated() - before - y.numel() * y.element_size()) / 2**20
        y.backward(dy)
        del y
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    turn = itertools.count()  # the inputs alternate across calls (the timers call without arguments)
    ms = timer(lambda: step(xs[next(turn) % len(xs)]), 0, iters, device.type == "cuda")
    b2b = back_to_back_ms(lambda: step(xs[next(turn) % len(xs)]), iters) if device.type == "cuda" else None
    return saved, peak, ms, b2b, first_s


def hooks_mib(run, block, x, extra, handle=None):
    """MiB the saved-tensor hooks saw in one forward (and kinds, for wrapped variants). A wrapped compiled block
    packs inside its graphs: what they save is the handle's graph plan (one forward's worth, one graph here)."""
    if handle is not None:
        with handle.record() as stats:
            y = run(x, **extra)
        stats.records += handle.graph_stats().records
    else:
        with record_saved(block) as stats:
            y = run(x, **extra)
    del y
    kinds = {k: round(v / 2**20, 2) for k, v in stats.bytes_by_kind().items()}
    return stats.stored_bytes / 2**20, kinds


def profile_variant(run, params, xs, dy, extra, out_dir: Path, name: str, steps: int = 3) -> dict:
    """Profile ``steps`` fwd+bwd steps: wall time against the GPU's busy time (their gap is host overhead the GPU
    waits on), and the kernels by self CUDA time, written to profile_<name>.txt and the top ones printed."""
    def step(i):
        for p in params:
            p.grad = None
        y = run(xs[i % len(xs)], **extra)
        (y[0] if isinstance(y, tuple) else y).backward(dy)

    wall_ms, gpu_ms, events = profile_steps(step, steps)
    table = events.table(sort_by="self_cuda_time_total", row_limit=40)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"profile_{name.replace(' ', '_').replace('+', 'and')}.txt").write_text(
        f"{name}: per step {wall_ms:.2f} ms wall (profiled), {gpu_ms:.2f} ms of GPU kernels\n\n{table}\n"
        f"\n{events.table(sort_by='self_cpu_time_total', row_limit=25)}\n")
    print(f"--- {name}: {wall_ms:.2f} ms wall per step (profiled), {gpu_ms:.2f} ms GPU kernels")
    print(events.table(sort_by="self_cuda_time_total", row_limit=14))
    return {"wall_ms": round(wall_ms, 3), "gpu_kernels_ms": round(gpu_ms, 3)}


def flop_floor_ms(b, t, d, ff, heads, fp8_gemm):
    tokens = b * t
    gemm = 2 * tokens * (4 * d * d + 3 * d * ff) * 3  # forward + two backward GEMMs each
    attn = 4 * b * heads * t * t * (d // heads) / 2 * 3.5  # causal; flash backward ~2.5x forward
    return (gemm / (FP8_TFLOPS if fp8_gemm else BF16_TFLOPS) + attn / BF16_TFLOPS) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/activations.json")
    ap.add_argument("--small", action="store_true", help="a tiny block on the CPU (smoke test)")
    ap.add_argument("--impl", choices=["plain", "hf"], default="plain", help="plain-torch block or transformers'")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--linear-recipe", default="fp8_tensor", help="convert_linears recipe of the FP8-linear variants")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 3 steps per variant: wall vs GPU-busy time, top kernels (profile_<variant>.txt)")
    args = ap.parse_args(argv)

    if args.small:
        device, dtype = torch.device("cpu"), torch.bfloat16
        b, t, d, ff, heads = 2, 128, 256, 688, 4
        iters = args.iters or 3
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --small for a CPU smoke run)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        b, t, d, ff, heads = 4, 2048, 4096, 11008, 32
        iters = args.iters or 30
    block, extra = make_block(args.impl, d, ff, heads, t, device, dtype)
    g = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(b, t, d, device=device, dtype=dtype, generator=g).requires_grad_(True) for _ in range(2)]
    dy = torch.randn(b, t, d, device=device, dtype=dtype, generator=g)

    try:
        from lpoptim.nn import convert_linears
    except Exception as e:  # noqa: BLE001
        convert_linears = None
        print(f"lpoptim.nn.convert_linears not importable ({e}); FP8-linear variants skipped")

    def fp8_block(recipe=None):
        blk = copy.deepcopy(block)
        convert_linears(blk, recipe=recipe or args.linear_recipe)
        return blk

    def fast_block():  # the forward GEMM with Hopper's fast FP8 accumulation, as torchao's default
        return fp8_block("fp8_tensor_fast")

    def compiled(make):  # a block from ``make``, compiled, unwrapped
        return lambda: (lambda m: (torch.compile(m), m, None))(make())

    # name: (build -> (callable, module holding the parameters, handle or None), FP8 GEMMs?)
    def v_eager():
        return block, block, None

    def v_compiled():
        return torch.compile(block), block, None

    def v_checkpoint():
        from torch.utils.checkpoint import checkpoint
        return (lambda x, **kw: checkpoint(block, x, use_reentrant=False, **kw)), block, None

    def v_lp(blk=None, compile_=False, **opts):
        def build():
            m = blk() if callable(blk) else block
            run = torch.compile(m) if compile_ else m
            return run, m, compress_activations(run, **opts)
        return build

    variants = {
        "bf16 eager": (v_eager, False),
        "bf16 compiled": (v_compiled, False),
        "bf16 full recompute": (v_checkpoint, False),
        "lpoptim": (v_lp(), False),
        "lpoptim attn fp8": (v_lp(attention="fp8"), False),
        # replays and decodes one kernel each (before fused_replay.py; the CPU's default)
        "lpoptim op-by-op replays": (v_lp(fuse_replays=False), False),
        "lpoptim attn fp8 op-by-op replays": (v_lp(attention="fp8", fuse_replays=False), False),
        "lpoptim no derive": (v_lp(derive=False), False),
        "lpoptim recompute": (v_lp(recompute=True), False),
        "lpoptim compiled": (v_lp(compile_=True), False),
        "lpoptim compiled attn fp8": (v_lp(compile_=True, attention="fp8"), False),
    }
    if convert_linears is not None:
        variants |= {
            "fp8 linears": ((lambda: (lambda m: (m, m, None))(fp8_block())), True),
            "fp8 linears compiled": (compiled(fp8_block), True),
            "fp8 linears + lpoptim": (v_lp(fp8_block), True),
            "fp8 linears + lpoptim compiled": (v_lp(fp8_block, compile_=True), True),
            "fp8 linears + lpoptim compiled attn fp8": (v_lp(fp8_block, compile_=True, attention="fp8"), True),
            "fp8 fast linears compiled": (compiled(fast_block), True),
            "fp8 fast linears + lpoptim compiled": (v_lp(fast_block, compile_=True), True),
            "fp8 linears + lpoptim recompute": (v_lp(fp8_block, recompute=True), True),
        }
        # Inductor's partitioner told to keep NN% of what the compiled block would save and recompute the cheapest
        # rest (torch._functorch.config.activation_memory_budget; lpoptim bench's +sacNN): torch's own trade
        for pct in (70, 50):
            variants[f"fp8 linears compiled sac{pct}"] = variants["fp8 linears compiled"]
    for pct in (70, 50):
        variants[f"bf16 compiled sac{pct}"] = (v_compiled, False)
    try:
        from torchao.float8 import convert_to_float8_training

        def v_torchao():  # torchao's float8 training (tensorwise), compiled: the off-the-shelf comparison
            blk = convert_to_float8_training(copy.deepcopy(block))
            return torch.compile(blk), blk, None

        variants["torchao float8 compiled"] = (v_torchao, True)
    except Exception as e:  # noqa: BLE001
        print(f"torchao float8 not importable ({type(e).__name__}: {e}); its variant skipped")
    if args.no_compile:
        variants = {k: v for k, v in variants.items() if "compiled" not in k}
    if args.only:
        keep = set(args.only.split(","))
        variants = {k: v for k, v in variants.items() if k in keep}

    results = {}
    for name, (build, fp8_gemm) in variants.items():
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = {"floor_ms": round(flop_floor_ms(b, t, d, ff, heads, fp8_gemm), 2)}
        handle = None
        budget = re.search(r" sac(\d+)$", name)  # patched while the first call compiles: the partition is made then
        with (functorch_config.patch(activation_memory_budget=int(budget.group(1)) / 100) if budget
              else contextlib.nullcontext()):
            try:
                run, mod, handle = build()
                params = [p for p in mod.parameters() if p.requires_grad]
                saved, peak, ms, b2b, first = measure(run, params, xs, dy, extra, device, args.warmup, iters)
                hm, kinds = hooks_mib(run, mod, xs[0], extra, handle)
                if args.profile:
                    row["profile"] = profile_variant(run, params, xs, dy, extra, Path(args.out).parent, name)
                row |= {"saved_mib": None if saved is None else round(saved, 1),
                        "peak_mib": None if peak is None else round(peak, 1), "ms": round(ms, 3),
                        "ms_back_to_back": None if b2b is None else round(b2b, 3),
                        "first_call_s": round(first, 2), "hooks_mib": round(hm, 1), "hooks_by_kind": kinds}
            except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            finally:  # unwrap even after a failure, or every later variant finds the block still wrapped
                if handle is not None:
                    handle.remove()
                handle = run = mod = None
        results[name] = row
        print(name, json.dumps(row), flush=True)

    base = results.get("bf16 eager", {})
    base_saved = base.get("saved_mib") or base.get("hooks_mib")
    base_ms = base.get("ms")
    for name, row in results.items():
        if "error" in row:
            continue
        s = row["saved_mib"] if row["saved_mib"] is not None else row["hooks_mib"]
        row["saved_vs_target"] = round(s / TARGET_SAVED_MIB, 3)
        if base_saved:
            row["saved_vs_bf16_eager"] = round(s / base_saved, 3)
        if base_ms:
            row["time_vs_bf16_eager"] = round(row["ms"] / base_ms, 3)
        if base.get("ms_back_to_back") and row.get("ms_back_to_back"):
            row["back_to_back_vs_bf16_eager"] = round(row["ms_back_to_back"] / base["ms_back_to_back"], 3)
        if name.startswith("fp8 linears"):
            row["time_vs_fp8_target"] = round(row["ms"] / TARGET_FP8_MS, 3)

    env = {**environment(), "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "shape": {"batch": b, "seq": t, "d": d, "ffn": ff, "heads": heads, "dtype": str(dtype), "impl": args.impl},
           "targets": {"saved_mib": TARGET_SAVED_MIB, "time_vs_bf16_eager": TARGET_TIME_RATIO,
                       "fp8_linears_ms": TARGET_FP8_MS}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "results": results}, indent=2))

    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}; block d={d} ffn={ff} heads={heads}, "
          f"{b}x{t} tokens, {dtype}")
    print(f"targets: saved <= {TARGET_SAVED_MIB:.0f} MiB, time <= {TARGET_TIME_RATIO}x bf16 eager, "
          f"FP8 linears <= {TARGET_FP8_MS} ms")
    hdr = (f"{'variant':<34}{'saved MiB':>10}{'hooks MiB':>10}{'/500':>7}{'peak MiB':>10}{'ms':>9}{'x eager':>9}"
           f"{'b2b ms':>9}{'x eager':>9}{'floor ms':>9}")
    print(hdr)
    print("-" * len(hdr))
    for name, row in results.items():
        if "error" in row:
            print(f"{name:<34}  error: {row['error'][:80]}")
            continue
        def f(v, spec):
            return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])
        print(f"{name:<34}{f(row['saved_mib'], '10.1f')}{f(row['hooks_mib'], '10.1f')}"
              f"{f(row.get('saved_vs_target'), '7.2f')}{f(row['peak_mib'], '10.1f')}{row['ms']:9.2f}"
              f"{f(row.get('time_vs_bf16_eager'), '9.3f')}{f(row.get('ms_back_to_back'), '9.2f')}"
              f"{f(row.get('back_to_back_vs_bf16_eager'), '9.3f')}{row['floor_ms']:9.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
