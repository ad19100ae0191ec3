"""What a per-tensor quantizer pass is bound by: a stripped copy of _quant_tensor_kernel (bf16 x -> E4M3 rows and
transposed columns) with its division and the absmax that delayed scaling takes switched per variant.

    PYTHONPATH=$PWD python3 benchmarks/quant_division_probe.py

div: "div_rn" divides each element (what the quantizers did), "reciprocal" multiplies by 1/s (not always the
correctly rounded quotient), "div_rn_by" is kernels/grid.py's reciprocal with FMA corrections (the same bits as
div_rn). work: "plain", "+absmax" (the tile's finite absmax, relaxed atomic into one slot), "+atomic only" (an
atomic of a constant), "+row maxima stored" (no reduction across warps, no atomic). Per call, us (CUDA events
around 50 queued calls), on 16384 x 4096 and 16384 x 11008; and whether each division's codes equal div_rn's.
Measured on an H100: docs/results/quant/division_probe_h100.txt.
"""
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import back_to_back_ms, print_environment  # noqa: E402
from lpoptim.kernels.grid import div_rn_by, finite_abs  # noqa: E402

DIVS = {"div_rn": 0, "reciprocal": 1, "div_rn_by": 2}
WORK = {"plain": 0, "+absmax": 1, "+atomic only": 2, "+row maxima stored": 3}


@triton.jit
def _store(x_ptr, a, b, sa, sb, A, B, out_ptr, OUT_W, scale, DIV: tl.constexpr):
    t = tl.load(x_ptr + a[:, None].to(tl.int64) * sa + b[None, :].to(tl.int64) * sb,
                mask=(a[:, None] < A) & (b[None, :] < B), other=0.0).to(tl.float32)
    if DIV == 0:
        y = tl.math.div_rn(t, tl.broadcast_to(scale, t.shape))
    elif DIV == 1:
        y = t * tl.math.div_rn(1.0, scale)
    else:
        y = div_rn_by(t, scale)
    q = tl.clamp(y, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(out_ptr + a[:, None].to(tl.int64) * OUT_W + b[None, :], q, mask=(a[:, None] < A) & (b[None, :] < OUT_W))
    return t


@triton.jit
def _probe_kernel(x_ptr, amax_ptr, row_ptr, col_ptr, part_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr,
                  DIV: tl.constexpr, WORK: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    scale = tl.math.div_rn(tl.load(amax_ptr), 448.0)
    t = _store(x_ptr, rows, cols, C, 1, R, C, row_ptr, C, scale, DIV)
    if WORK == 1:
        m = tl.max(tl.max(finite_abs(t), axis=1), axis=0)
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + 1, m.to(tl.int32, bitcast=True), sem="relaxed")
    if WORK == 2:
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + 1, 5, sem="relaxed")
    if WORK == 3:
        tl.store(part_ptr + tl.program_id(1) * R + rows, tl.max(finite_abs(t), axis=1), mask=rows < R)
    _store(x_ptr, cols, rows, 1, C, C, R, col_ptr, R, scale, DIV)


def main():
    print_environment()
    out = []
    for R, C in ((16384, 4096), (16384, 11008)):
        x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
        x[0, :7] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-38, -3e-39, 0.0, -0.0])
        amax = torch.tensor([4.321, 0.0], device="cuda")  # a scale that is not a power of two
        rows = torch.empty(R, C, device="cuda", dtype=torch.float8_e4m3fn)
        cols = torch.empty(C, R, device="cuda", dtype=torch.float8_e4m3fn)
        for br, bc, nw in ((32, 256, 8), (32, 128, 4)):
            grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
            part = torch.zeros(grid[1] * R, device="cuda")
            row = {"shape": f"{R}x{C}", "tile": f"{br}x{bc}, {nw} warps"}
            ref = None
            for dname, div in DIVS.items():
                for wname, work in WORK.items():
                    row[f"{dname} {wname}"] = round(1e3 * back_to_back_ms(lambda: _probe_kernel[grid](
                        x, amax, rows, cols, part, R, C, BR=br, BC=bc, DIV=div, WORK=work, num_warps=nw), 50), 1)
                _probe_kernel[grid](x, amax, rows, cols, part, R, C, BR=br, BC=bc, DIV=div, WORK=0, num_warps=nw)
                codes = (rows.view(torch.uint8).clone(), cols.view(torch.uint8).clone())
                ref = ref or codes
                row[f"{dname} codes equal div_rn's"] = all(torch.equal(a, b) for a, b in zip(codes, ref))
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


if __name__ == "__main__":
    main()
