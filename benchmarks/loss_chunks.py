"""The chunked LM head + loss (lpoptim.nn.linear_cross_entropy) by chunk size, against the unfused head and loss
and against its own torch ops in place of the fused loss kernel (kernels/cross_entropy.py): forward + backward
time and the peak memory above the inputs and their gradients, on one GPU, bf16, for the heads of Gemma 2 9B
(with its logit softcap), Llama 3 8B, Qwen2.5 7B and Llama 2 7B.

    PYTHONPATH=$PWD python benchmarks/loss_chunks.py --out results/loss_chunks.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lpoptim.bench import environment  # noqa: E402
lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")  # (lpoptim.nn's attribute of that name: the function)
from lpoptim.nn.linear_cross_entropy import (default_chunk, keeps_logits_grad, linear_cross_entropy,  # noqa: E402
                                             logits_chunk)

HEADS = {"gemma2-9b": (256000, 3584, 30.0), "llama3-8b": (128256, 4096, None), "qwen2.5-7b": (152064, 3584, None),
         "llama2-7b": (32000, 4096, None)}


def measure(fn, h, w, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of fn().backward() and its peak GiB above what was allocated before."""
    for _ in range(2):
        h.grad = w.grad = None
        fn().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default="results/loss_chunks.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/loss_chunks.py needs a CUDA GPU")
    rows = []
    kernel = lce.use_kernel
    for name, (vocab, width, cap) in HEADS.items():
        torch.manual_seed(0)
        h = (torch.randn(args.tokens, width, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
        w = (torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        t = torch.randint(0, vocab, (args.tokens,), device="cuda")

        def unfused():
            logits = h @ w.t()
            if cap:
                logits = torch.tanh(logits / cap) * cap
            return F.cross_entropy(logits.float(), t)
        old = logits_chunk(vocab)  # the chunk before the 256-token floor
        # the defaults: the torch ops' chunk; the kernel's, larger where it writes into the kept logits gradient
        defaults = {"torch ops": default_chunk(vocab),
                    "kernel": default_chunk(vocab, in_place=keeps_logits_grad(args.tokens, width, 2, True))}
        runs = [(None, "unfused"), (defaults["torch ops"], "torch ops")]
        runs += [(c, "kernel") for c in sorted({old, 128, 256, 512, 1024, args.tokens})]
        for chunk, path in runs:
            fn = unfused if chunk is None else (lambda c=chunk: linear_cross_entropy(h, w, t, chunk=c, softcap=cap))
            lce.use_kernel = (lambda x: False) if path == "torch ops" else kernel
            try:
                seconds, peak = measure(fn, h, w)
            finally:
                lce.use_kernel = kernel
            label = "unfused" if chunk is None else f"{path}, chunk {chunk}" + (
                " (default)" if chunk == defaults[path] else " (64 MiB)" if chunk == old else "")
            rows.append(dict(head=name, vocab=vocab, width=width, softcap=cap, chunk=chunk, path=path,
                             default=chunk is not None and chunk == defaults[path], ms=seconds * 1e3, peak_gib=peak))
            print(f"{name:11s} {label:32s} {seconds * 1e3:7.2f} ms  peak +{peak:.2f} GiB", flush=True)
        h = w = t = None  # freed before the next head
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(info=dict(environment(), tokens=args.tokens,
                                                        command="python " + " ".join(sys.argv)), rows=rows),
                                          indent=1))


if __name__ == "__main__":
    main()
