"""Dump the fused AdamW kernel's SASS (or PTX) and count its instructions, per variant.

    python3 benchmarks/kernel_sass.py --out results      # on a GPU
    python3 benchmarks/kernel_sass.py --offline          # compiled for sm_90 here, no GPU needed (SASS by the
                                                         # ptxas and nvdisasm Triton ships, else PTX)

On the H200 the step was bound by instruction issue (README); on the H100, after the instruction cuts, it runs
near its bandwidth floor. This shows where the instructions go. For each variant
(fp32 / bf16 / bf16 with stochastic rounding) it steps one 4096 x 4096 tensor, takes the compiled kernel of
that launch, keeps its SASS (from nvdisasm through Triton, else PTX) and prints the opcode counts of the whole
kernel: the table loads once, the loop body once (it is not unrolled), which handles BLOCK_G groups with each
thread holding BLOCK_G * G / (32 * num_warps) elements; so roughly, instructions per element and thread = total
divided by that (a warp issues each instruction once for its 32 threads).
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lpoptim  # noqa: E402
from lpoptim.kernels import adamw_step as kernel  # noqa: E402
from lpoptim.optim.adamw import LPOPTIM_DEFAULTS  # noqa: E402


def histogram(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def offline_ptx(dtype: torch.dtype, stochastic: bool) -> dict:
    """The kernel compiled here for sm_90 (PTX, and a cubin where ptxas is at hand), without a GPU (Triton's
    compiler needs none): the launch settings
    of the default optimizer step on a contiguous, 16-byte aligned tensor with whole groups."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel._adamw_kernel
    consts = dict(PARAM_DTYPE=kernel._TL_DTYPES[dtype], G=LPOPTIM_DEFAULTS["group_size"],
                  BLOCK_G=kernel.TUNING["block_groups"], LOOP=kernel.TUNING["loop"],
                  **kernel._format_args("e4m3", "M"), **kernel._format_args("e4m3", "V"), QUANT=True, EXPANSION=True,
                  SQRT_V=False, AMSGRAD=False, MAXIMIZE=False, LR_IS_TENSOR=False, HAS_GRAD_SCALE=False,
                  HAS_FOUND_INF=False, EVEN_ROWS=True, ON_GPU=True, STOCHASTIC=stochastic, ALIGNED=True)
    pointers = {"ptrs": "*i64", "dims": "*i32", "blocks": "*i32", "salt_ptr": "*i32"}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "*fp32") if n in pointers or n.endswith("_ptr")
           else "fp32" for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=kernel.TUNING["num_warps"], enable_fp_fusion=True))
    return compiled.asm


def offline_sass(asm: dict) -> str | None:
    """SASS from the offline cubin by the nvdisasm Triton ships (None where it is missing)."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if "cubin" not in asm or not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--offline", action="store_true", help="compile PTX for sm_90 here, without a GPU")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    group = LPOPTIM_DEFAULTS["group_size"]
    elems = kernel.TUNING["loop"] * kernel.TUNING["block_groups"] * group
    per_thread = kernel.TUNING["block_groups"] * group / (32 * kernel.TUNING["num_warps"])  # elements per loop pass
    dump = []
    for name, dtype, sr in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                            ("bf16_sr", torch.bfloat16, True)):
        if args.offline:
            asm = offline_ptx(dtype, sr)
            text, kind = offline_sass(asm), "sass"
            if text is None:
                text, kind = asm["ptx"], "ptx"
        else:
            p = torch.nn.Parameter(torch.randn(4096, 4096, device="cuda", dtype=dtype))
            p.grad = torch.randn_like(p)
            opt = lpoptim.AdamW([p], bf16_stochastic_round=sr)
            opt.step()
            asm = kernel.LAST_LAUNCH.asm
            text, kind = asm.get("sass"), "sass"
            if not text:
                text, kind = asm["ptx"], "ptx"
        dump.append(f"##### {name} ({kind})\n{text}")
        ops = histogram(text) if kind == "sass" else collections.Counter(
            m.group(1) for m in re.finditer(r"^\s+([a-z][a-z0-9]*)[.\s]", text, re.M))
        total = sum(ops.values())
        print(f"{name}: {kind}, {total} instructions in the kernel ({elems} elements per program, "
              f"~{total / per_thread:.0f} per element per thread); top: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(25)))
    (args.out / "adamw_kernel_asm.txt").write_text("\n\n".join(dump))  # one file: the device returns few


if __name__ == "__main__":
    main()
