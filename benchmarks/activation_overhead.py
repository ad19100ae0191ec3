"""Host (CPU, Python) overhead of ``compress_activations`` per wrapped block, forward + backward.

    python benchmarks/activation_overhead.py                      # bf16 autocast over fp32 weights (as lpoptim bench)
    python benchmarks/activation_overhead.py --no-autocast --dtype bfloat16   # bf16 parameters
    python benchmarks/activation_overhead.py --profile            # + cProfile of the wrapped run (top functions)

A GPU profile of a TinyLlama-1.1B step showed the step host-bound with compression on: the Python in the
saved-tensor hooks (OpTracker.__torch_function__ on every torch call inside a block, pack's bookkeeping, derive's
records, the codec's wrappers) outran the GPU. This measures that host work alone: N Llama blocks
(lpoptim.train.llama.Block, grouped-query attention as TinyLlama) at tiny width on the CPU, so that the arithmetic
is small, but with every saved activation and weight at or above ``min_numel`` elements, so that every tensor
takes the path it takes at full size (derive, dedupe, pack) instead of the "small" early exit.

Printed, microseconds per block, forward and backward (each the best of --repeats timings of --iters steps; the
variants are interleaved):
  unwrapped            plain autograd
  wrapped              compress_activations(blocks), the CPU codec (lpoptim.quant's pure-torch reference: a
                       dozen small ops per pack, where the GPU runs one Triton kernel)
  wrapped, stub codec  the same with the codec replaced by a stand-in that holds the tensor: the hooks' own
                       work (Python, plus the torch ops they issue: replays of derived tensors, detaches)
and the overhead over unwrapped. Then what a GPU's host thread would issue per block, counted once (not timed):
torch ops reaching the dispatcher in forward and backward outside the codec (each costs the host ~5-10 us on a
GPU), codec kernel launches (packs in forward, decodes of packed tensors in backward; Triton launches cost
more), and strided copies (copies with a non-contiguous operand: on CUDA the slow elementwise_kernel<128,4>).
Bytes by kind (handle.record()) are printed too, so a change to the hooks can be checked to save exactly what
it saved before.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lpoptim.activations import codec, compress_activations, hooks  # noqa: E402
from lpoptim.train.llama import Block, LlamaConfig, rotary_tables  # noqa: E402


class _StubPacked:
    """Stands in for PackedActivation: holds the tensor, no arithmetic (bookkeeping-only timing)."""

    __slots__ = ("t", "nbytes", "uses")

    def __init__(self, t, granularity, group_size=16, fmt=None):
        self.t, self.uses = t.detach(), 0
        self.nbytes = codec.packed_nbytes(t, granularity, group_size, *((fmt,) if fmt is not None else ()))

    def unpack(self):
        return self.t


def _build(args):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, n_layer=args.blocks, d_model=args.d_model, ffn_dim=args.ffn,
                      n_head=args.heads, n_kv_head=args.kv_heads)
    dtype = getattr(torch, args.dtype)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(args.blocks)).to(dtype)
    x = torch.randn(args.batch, args.seq, args.d_model, dtype=dtype, requires_grad=True)
    cos, sin = rotary_tables(cfg, args.seq, "cpu")
    return blocks, x, cos, sin


def _forward_fn(blocks, x, cos, sin, autocast):
    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = x
            for b in blocks:
                y = b(y, cos, sin)
        return y.float().sum()
    return forward


def _time_chunk(forward, iters, n_blocks) -> tuple[float, float]:
    """(forward, backward) microseconds per block, averaged over ``iters`` steps."""
    fwd = bwd = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    return fwd / iters / n_blocks * 1e6, bwd / iters / n_blocks * 1e6


def _measure(blocks, forward, iters, repeats) -> dict[str, tuple[float, float]]:
    """(forward, backward) microseconds per block of each variant, each the best of ``repeats`` timings (what the
    code costs; a slower timing is the machine doing something else). The variants are interleaved within every
    repeat, so that a drift of the machine's speed moves them alike."""
    n = len(blocks)
    variants = ("unwrapped", "wrapped", "wrapped, stub codec")
    times = {v: [] for v in variants}
    real_pack = hooks.pack
    try:
        for r in range(repeats + 1):  # the first round warms up (allocator, dispatcher caches, lazy imports)
            for v in variants:
                handle = compress_activations(blocks) if v != "unwrapped" else None
                hooks.pack = _StubPacked if v == "wrapped, stub codec" else real_pack
                t = _time_chunk(forward, iters, n)
                if r:
                    times[v].append(t)
                if handle is not None:
                    handle.remove()
    finally:
        hooks.pack = real_pack
    return {v: (min(f for f, _ in ts), min(b for _, b in ts)) for v, ts in times.items()}


_COPIES = ("aten.copy_.default", "aten.clone.default", "aten._to_copy.default", "aten.contiguous.default")


class _CountOps(TorchDispatchMode):
    """Counts the torch ops that reach the dispatcher, and among them the copies with a non-contiguous operand
    (on CUDA the slow, non-vectorized elementwise_kernel<128,4>), except while ``paused`` (inside the codec,
    whose CPU reference issues a dozen ops where the GPU launches one kernel: counted as launches instead)."""

    def __init__(self):
        super().__init__()
        self.n, self.strided, self.paused = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.n += 1
            if str(func) in _COPIES and any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in args):
                self.strided += 1
        return func(*args, **(kwargs or {}))


def _count(forward, n_blocks) -> dict[str, float]:
    """Per block: torch ops in forward and backward outside the codec, codec packs and decodes (on a GPU, one
    Triton launch each), and strided copies (outside the codec, plus the codec's on a GPU: a non-contiguous
    tensor is made contiguous to be packed, and copied back to its strides when decoded, unless it is packed in
    memory order, codec.storage_rows, which copies neither way)."""
    calls = Counter()
    mode = [None]
    real_pack = hooks.pack
    cls = codec.PackedActivation
    real_decode = cls.decode

    def counted(name, fn, strided):
        def run(*a, **k):
            calls[name] += 1
            calls["strided"] += strided(a[0])
            m = mode[0]
            m.paused = True
            try:
                return fn(*a, **k)
            finally:
                m.paused = False
        return run

    hooks.pack = counted("pack", real_pack, lambda t: not t.is_contiguous() and codec.storage_rows(t) is None)
    cls.decode = counted("decode", real_decode, lambda p: not (p.contiguous or p.storage_order))
    try:
        with _CountOps() as fwd:
            mode[0] = fwd
            loss = forward()
        with _CountOps() as bwd:
            mode[0] = bwd
            loss.backward()
    finally:
        hooks.pack = real_pack
        cls.decode = real_decode
    return {"fwd ops": fwd.n / n_blocks, "bwd ops": bwd.n / n_blocks, "packs": calls["pack"] / n_blocks,
            "decodes": calls["decode"] / n_blocks,
            "strided": (fwd.strided + bwd.strided + calls["strided"]) / n_blocks}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=352)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)  # k, v weights 64 x 128: above min_numel too
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)  # 2 x 64 tokens x 128 = 16384 elements: above min_numel
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-autocast", dest="autocast", action="store_false",
                    help="run without bf16 autocast (default: autocast over the --dtype parameters, as lpoptim bench)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile the wrapped run and print the top functions")
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    blocks, x, cos, sin = _build(args)
    forward = _forward_fn(blocks, x, cos, sin, args.autocast)

    def step():
        forward().backward()

    res = _measure(blocks, forward, args.iters, args.repeats)
    counts = {"unwrapped": _count(forward, args.blocks)}
    handle = compress_activations(blocks)
    counts["wrapped"] = _count(forward, args.blocks)
    with handle.record() as stats:
        step()
    kinds = stats.bytes_by_kind()
    records = {k: v["count"] for k, v in stats.summary().items()}

    print(f"{args.blocks} Llama blocks, d_model {args.d_model}, ffn {args.ffn}, heads {args.heads}/{args.kv_heads}, "
          f"tokens {args.batch}x{args.seq}, {args.dtype} params{', bf16 autocast' if args.autocast else ''}, "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'us per block':<22}{'fwd':>8}{'bwd':>8}{'fwd+bwd':>9}{'overhead: fwd':>15}{'bwd':>7}{'fwd+bwd':>9}")
    f0, b0 = res["unwrapped"]
    for k, (f, b) in res.items():
        over = "" if k == "unwrapped" else f"{f - f0:>15.0f}{b - b0:>7.0f}{f + b - f0 - b0:>9.0f}"
        print(f"{k:<22}{f:>8.0f}{b:>8.0f}{f + b:>9.0f}{over}")
    print(f"{'per block':<22}" + "".join(f"{k:>10}" for k in counts["wrapped"]))
    for name, c in counts.items():
        print(f"{name:<22}" + "".join(f"{v:>10.1f}" for v in c.values()))
    print("saved per step (all blocks), bytes by kind:", dict(sorted(kinds.items())))
    print("records by kind:", dict(sorted(records.items())))

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            step()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.rows)
        print(s.getvalue())
    handle.remove()


if __name__ == "__main__":
    main()
