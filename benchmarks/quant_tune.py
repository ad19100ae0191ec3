"""Tile shapes of the operand quantizer (lpoptim/kernels/linear_quant.py TUNING): achieved bandwidth per shape.

    PYTHONPATH=$PWD python3 benchmarks/quant_tune.py [--modes rows,from_max,tensor,hadamard,absmax,whole,delayed]

Times quantize_rows per row ("rows"), the one-pass column quantizer with known scales ("from_max", as
quantize_rows_and_cols runs it) and the per-tensor quantizer writing x and xᵀ ("tensor",
quantize_tensor_rows_cols, its absmax pass included), INT4 after a block Hadamard of 128 ("hadamard"), and the finite absmax pass alone ("absmax", x read once) on bf16 tensors of the fp8 linears' sizes (x: 16384 x 4096,
dy: 16384 x 11008), CUDA events: rows, from_max, tensor and hadamard the median of 20 calls each timed alone;
absmax, whole and delayed the mean of calls queued back to back (short kernels); bandwidth counts x read once
and the fp8 copies written.
"delayed" times the per-tensor quantizer with delayed scaling (nn/delayed.py) against current scaling, per
programs-per-SM of its second launch: the history covering x (one pass and a launch that ends at once) and a fresh
history every call (both launches quantize; the fresh history's allocation included), the transposed copy alone
(int4's saved x), and the delayed pass per tile (TUNING["delayed"]).
"""
import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import back_to_back_ms, timer, print_environment  # noqa: E402
from lpoptim.formats import E4M3  # noqa: E402
from lpoptim.kernels import linear_quant as lq  # noqa: E402


# (rows per program, columns per tile) swept per mode
TILES = {"rows": ((16, 32, 64), (128, 256, 512)), "from_max": ((16, 32, 64), (128, 256, 512)),
         "tensor": ((32, 64, 128), (64, 128, 256)),
         "hadamard": ((16, 32, 64, 128), (128,)),  # INT4 after a Hadamard of 128: the tile's width is the block
         "absmax": ((8, 16, 32, 64), (128, 256, 512, 1024))}


DELAYED_TILES = ((32, 256, 8), (32, 128, 4), (64, 64, 4), (64, 128, 8), (64, 256, 8))


def delayed(x):
    from lpoptim.nn.delayed import X, AmaxHistory, new_history

    def fresh():
        return AmaxHistory(new_history(16, "cuda"), [0, 0, 0], X)

    R, C = x.shape
    big = x * 1.5  # recorded first, so that the history covers x
    ms = {"current": back_to_back_ms(lambda: lq.quantize_tensor_rows_cols(x, "e4m3", "e4m3", C, R), 50)}
    saved = dict(lq.TUNING["redo"])
    for per_sm in (1, 2, 4, 8):
        lq.TUNING["redo"]["per_sm"] = per_sm
        lq._redo_programs.cache_clear()
        h = fresh()
        lq.quantize_tensor_rows_cols(big, "e4m3", "e4m3", C, R, history=h)
        ms[f"delayed covered, {per_sm}/SM"] = back_to_back_ms(
            lambda: lq.quantize_tensor_rows_cols(x, "e4m3", "e4m3", C, R, history=h), 50)
        ms[f"delayed redone, {per_sm}/SM"] = back_to_back_ms(
            lambda: lq.quantize_tensor_rows_cols(x, "e4m3", "e4m3", C, R, history=fresh()), 20)
    lq.TUNING["redo"] = saved
    lq._redo_programs.cache_clear()
    saved = dict(lq.TUNING["delayed"])
    for br, bc, nw in DELAYED_TILES:  # the delayed pass's tile (it also reduces each tile to its absmax)
        lq.TUNING["delayed"] = dict(block_r=br, block_c=bc, num_warps=nw)
        h = fresh()
        lq.quantize_tensor_rows_cols(big, "e4m3", "e4m3", C, R, history=h)
        ms[f"delayed covered, tile {br}x{bc} {nw} warps"] = back_to_back_ms(
            lambda: lq.quantize_tensor_rows_cols(x, "e4m3", "e4m3", C, R, history=h), 50)
        h = fresh()
        lq.quantize_tensor_rows_cols(big, None, "e4m3", None, R, history=h)
        ms[f"xT alone delayed, tile {br}x{bc} {nw} warps"] = back_to_back_ms(
            lambda: lq.quantize_tensor_rows_cols(x, None, "e4m3", None, R, history=h), 50)
    lq.TUNING["delayed"] = saved
    ms["transposed copy alone, current"] = back_to_back_ms(
        lambda: lq.quantize_tensor_rows_cols(x, None, "e4m3", None, R), 50)
    h = fresh()
    lq.quantize_tensor_rows_cols(big, None, "e4m3", None, R, history=h)
    ms["transposed copy alone, delayed covered"] = back_to_back_ms(
        lambda: lq.quantize_tensor_rows_cols(x, None, "e4m3", None, R, history=h), 50)
    for k, v in ms.items():
        print(f"delayed {R}x{C} {k:40s} {v * 1e3:8.1f} us", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="rows,from_max,tensor")
    modes = ap.parse_args().modes.split(",")
    print_environment()
    saved = {k: dict(v) for k, v in lq.TUNING.items()}
    for m, k in ((16384, 4096), (16384, 11008)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        col_max = torch.zeros(k, device="cuda", dtype=torch.int32)
        lq.quantize_rows(x, E4M3, "row", None, k, col_max=col_max)  # the column maxima the column pass reads
        if "whole" in modes:  # rows held whole (TUNING["whole_rows"]) against the two-pass kernel, per format
            for fmt in ("e2m1", "e4m3"):
                fn = lambda: lq.quantize_rows(x, fmt, "row", None, k)  # noqa: E731
                configs = [(None, None)] + list(itertools.product((4096, 8192, 16384), (4, 8, 16)))
                for elems, nw in configs:
                    if elems is not None and elems < k:
                        continue
                    saved_whole = dict(lq.TUNING["whole_rows"])
                    lq.TUNING["whole_rows"].update(enabled=elems is not None, max_width=16384, **(
                        dict(elems=elems, num_warps=nw) if elems else {}))
                    ms = back_to_back_ms(fn, 20)
                    lq.TUNING["whole_rows"] = saved_whole
                    label = "two-pass" if elems is None else f"whole elems={elems:5d} warps={nw:2d}"
                    print(f"{m}x{k} whole {fmt:8s} {label:28s} {ms:7.3f} ms  "
                          f"{x.numel() * 3 / ms / 1e6:6.0f} GB/s", flush=True)
        if "delayed" in modes:
            delayed(x)
        for mode in (md for md in modes if md not in ("whole", "delayed")):
            for br, bc, nw in itertools.product(*TILES[mode], (4, 8)):
                if br * bc // (32 * nw) > 128:  # fp32 tile elements per thread: beyond this it spills
                    continue
                lq.TUNING[mode] = dict(block_r=br, block_c=bc, num_warps=nw)
                lq.TUNING["whole_rows"] = {**saved["whole_rows"], "enabled": False}  # the two-pass kernel's tiles
                nbytes = x.numel() * (4 if mode == "tensor" else 2 if mode == "absmax" else 3)
                if mode == "absmax":  # a short kernel: 20 calls back to back between two events, not one alone
                    ms = back_to_back_ms(lambda: lq.finite_absmax(x), 20)
                    print(f"{m}x{k} {mode:8s} block_r={br:3d} block_c={bc:4d} warps={nw}  {ms:7.3f} ms  "
                          f"{nbytes / ms / 1e6:6.0f} GB/s", flush=True)
                    lq.TUNING.update({k2: dict(v) for k2, v in saved.items()})
                    continue
                if mode == "rows":
                    fn = lambda: lq.quantize_rows(x, E4M3, "row", None, k)  # noqa: E731
                elif mode == "hadamard":
                    fn = lambda: lq.quantize_rows(x, "int4_sym", "row", 128, k)  # noqa: E731
                elif mode == "tensor":
                    fn = lambda: lq.quantize_tensor_rows_cols(x, E4M3, E4M3, k, m)  # noqa: E731
                else:
                    fn = lambda: lq.quantize_rows(x.t(), E4M3, "row", None, m, col_max=col_max, from_max=True)  # noqa: E731
                ms = timer(fn, 1, 20, cuda=True)
                print(f"{m}x{k} {mode:8s} block_r={br:3d} block_c={bc:3d} warps={nw}  {ms:7.3f} ms  {nbytes / ms / 1e6:6.0f} GB/s",
                      flush=True)
                lq.TUNING.update({k2: dict(v) for k2, v in saved.items()})


if __name__ == "__main__":
    main()
