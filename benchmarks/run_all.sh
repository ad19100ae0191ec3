#!/usr/bin/env bash
# Everything the GPU must check and time, in one call (the device tool runs it from the repository root):
#   bash benchmarks/run_all.sh [what...]      what: tests optim activations linear train bench records
#                                            (default: the first four)
# Installs carried wheels (.whl/, bitsandbytes and torchao) into /tmp/site when present, writes JSON under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
what=${*:-tests optim activations linear}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for w in $what; do
  echo "=== $w"
  case $w in
    tests) { python3 -m pytest -q -m gpu tests; python3 -m pytest -q tests/test_dge_kernel.py; } > "$OUT/gpu_tests.txt" 2>&1
           tail -25 "$OUT/gpu_tests.txt" ;;  # test_dge_kernel runs on whichever device there is
    profile) python3 benchmarks/profile_step.py --out "$OUT" ;;
    optim) python3 benchmarks/optim_step.py --out "$OUT/optim_step.json" ;;
    activations) [ -f benchmarks/activations.py ] && python3 benchmarks/activations.py --out "$OUT/activations.json" ;;
    linear) [ -f benchmarks/linear.py ] && python3 benchmarks/linear.py --out "$OUT/linear.json" ;;
    train) python3 -m lpoptim train --out "$OUT" ;;
    bench) python3 -m lpoptim bench --out "$OUT" ;;
    records)  # README's bench rows with their baselines (about 8 minutes on an H100)
      python3 -m lpoptim bench --preset tinyllama-1.1b --compile --steps 8 --out "$OUT/tinyllama" \
        --recipes torch,lpoptim+bf16+bwd+ce+sac70,lpoptim+bf16+fp8_tensor+bwd+ce+sac100
      python3 -m lpoptim bench --preset llama2-7b --compile --steps 8 --warmup 3 --out "$OUT/llama2_7b" \
        --recipes torch+bf16,lpoptim+bf16+fp8_tensor_fast+bwd+ce+sac55
      python3 -m lpoptim bench --preset llama2-13b --compile --steps 6 --out "$OUT/llama2_13b" \
        --recipes lpoptim+bf16+fp8_tensor_fast+bwd+ce+sac60 ;;
    *) python3 $w ;;
  esac
done
