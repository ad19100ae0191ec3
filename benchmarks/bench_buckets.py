"""lpoptim bench with step_in_backward's bucket size set: what the default bucket_mb was chosen by.

    PYTHONPATH=$PWD python3 benchmarks/bench_buckets.py --buckets 128,256,512 \
        --recipe lpoptim+bf16+fp8_tensor_fast+bwd+ce+sac55 --preset llama2-7b

Each bucket size runs lpoptim.bench.run (compiled blocks, 8 timed steps after 3 warm-up, as the README's 7B rows)
with step_in_backward's default bucket_mb replaced; prints peak GiB and tokens/s per size.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lpoptim import bench  # noqa: E402
from lpoptim.optim import in_backward  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--buckets", default="128,256,512", help="bucket sizes in MiB")
    ap.add_argument("--recipe", default="lpoptim+bf16+fp8_tensor_fast+bwd+ce+sac55")
    ap.add_argument("--preset", default="llama2-7b")
    args = ap.parse_args()
    batch, seq = bench.DEFAULT_SHAPE[args.preset]
    default = in_backward.step_in_backward.__defaults__
    for mb in (float(b) for b in args.buckets.split(",")):
        in_backward.step_in_backward.__defaults__ = (mb,)  # bench.build calls step_in_backward(opt)
        try:
            report = bench.run(args.preset, [args.recipe], batch, seq, 8, 3, "cuda", compile_blocks=True,
                               log=lambda s: None)
        finally:
            in_backward.step_in_backward.__defaults__ = default
        for r in report["results"]:
            print(f"bucket {mb:5.0f} MiB {r['recipe']:40s} peak {r.get('peak_bytes', 0) / 2**30:6.2f} GiB  "
                  f"{r.get('tokens_per_s', 0):8.0f} tok/s {r.get('error', '')}", flush=True)


if __name__ == "__main__":
    main()
