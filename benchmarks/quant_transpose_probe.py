"""How to write the transposed copy of a per-tensor quantizer: a stripped kernel (bf16 x -> E4M3 rows and
transposed columns, one scale) per tile shape, against a plain bf16 copy (the bandwidth bound).

    PYTHONPATH=$PWD python3 benchmarks/quant_transpose_probe.py

"reload" is _quant_tensor_kernel's way (the columns' tile loaded again, transposed, from L1/L2, and quantized
again); "trans" quantizes once and transposes the codes with tl.trans ("trans8": as int8); "+max" adds delayed
scaling's tile absmax and relaxed atomic. us per call (CUDA events around 50 queued calls) on 16384 x 4096,
16384 x 11008 and 4096 x 16384; "equal": the same codes as the first variant. Measured on an H100:
docs/results/quant/transpose_probe_tenth_h100.txt (reload beats tl.trans by ~2x; with the max, 32 x 128 / 4 warps
beats 32 x 256 / 8 warps: hence TUNING["delayed"])."""
import json
import sys
from pathlib import Path
import torch
import triton
import triton.language as tl
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import back_to_back_ms, print_environment  # noqa: E402
from lpoptim.kernels.grid import div_rn_by, finite_abs  # noqa: E402


@triton.jit
def _q(t, scale):
    y = div_rn_by(t, scale)
    return tl.clamp(y, -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _k(x_ptr, amax_ptr, row_ptr, col_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr, MODE: tl.constexpr,
       MAX: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    scale = tl.math.div_rn(tl.load(amax_ptr), 448.0)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    t = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    q = _q(t, scale)
    tl.store(row_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=m)
    if MODE == 0:  # reload transposed
        t2 = tl.load(x_ptr + cols[:, None].to(tl.int64) + rows[None, :].to(tl.int64) * C,
                     mask=(cols[:, None] < C) & (rows[None, :] < R), other=0.0).to(tl.float32)
        q2 = _q(t2, scale)
        tl.store(col_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], q2,
                 mask=(cols[:, None] < C) & (rows[None, :] < R))
    elif MODE == 1:  # transpose the codes
        q2 = tl.trans(q)
        tl.store(col_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], q2,
                 mask=(cols[:, None] < C) & (rows[None, :] < R))
    elif MODE == 2:  # transpose as bytes via int8 bitcast
        q2 = tl.trans(q.to(tl.int8, bitcast=True))
        tl.store(col_ptr.to(tl.pointer_type(tl.int8)) + cols[:, None].to(tl.int64) * R + rows[None, :], q2,
                 mask=(cols[:, None] < C) & (rows[None, :] < R))
    if MAX:
        mx = tl.max(tl.max(finite_abs(t), axis=1), axis=0)
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + 1, mx.to(tl.int32, bitcast=True), sem="relaxed")


def main():
    print_environment()
    res = []
    for R, C in ((16384, 4096), (16384, 11008), (4096, 16384)):
        x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
        amax = torch.tensor([4.321, 0.0], device="cuda")
        rows = torch.empty(R, C, device="cuda", dtype=torch.float8_e4m3fn)
        cols = torch.empty(C, R, device="cuda", dtype=torch.float8_e4m3fn)
        y = torch.empty_like(x)
        row = {"shape": f"{R}x{C}", "copy_us": round(1e3 * back_to_back_ms(lambda: y.copy_(x), 50), 1)}
        ref = None
        for br, bc, nw in ((32, 256, 8), (32, 128, 4), (64, 128, 8), (64, 64, 4), (64, 256, 8), (128, 128, 8),
                           (128, 64, 8), (32, 64, 4), (128, 128, 4)):
            grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
            for mode, name in ((0, "reload"), (1, "trans"), (2, "trans8")):
                for mx in (0, 1):
                    key = f"{br}x{bc}w{nw} {name}{'+max' if mx else ''}"
                    try:
                        row[key] = round(1e3 * back_to_back_ms(lambda: _k[grid](
                            x, amax, rows, cols, R, C, BR=br, BC=bc, MODE=mode, MAX=mx, num_warps=nw), 50), 1)
                        rows.zero_(); cols.zero_()
                        _k[grid](x, amax, rows, cols, R, C, BR=br, BC=bc, MODE=mode, MAX=mx, num_warps=nw)
                        codes = (rows.view(torch.uint8).clone(), cols.view(torch.uint8).clone())
                        if ref is None:
                            ref = codes
                            assert torch.equal(codes[1], codes[0].t()), "cols are not rows transposed"
                        row[key + " equal"] = bool(torch.equal(codes[0], ref[0]) and torch.equal(codes[1], ref[1]))
                    except Exception as e:  # noqa: BLE001
                        row[key] = f"error {type(e).__name__}: {str(e)[:100]}"
        res.append(row)
        print(json.dumps(row, indent=0), flush=True)
    for row in res:
        best = sorted(((v, k) for k, v in row.items() if isinstance(v, float) and k != "copy_us"))[:6]
        print(row["shape"], "copy", row["copy_us"], "best:", best)


if __name__ == "__main__":
    main()
