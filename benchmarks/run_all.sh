#!/usr/bin/env bash
# Everything a GPU should check and time, in one call, from the repository root:
#   bash benchmarks/run_all.sh [what...]      what: tests optim activations linear train bench records,
#                                            or a script's path (default: the first four)
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
    optim) python3 benchmarks/optim_step.py --out "$OUT/optim_step.json" ;;
    activations) python3 benchmarks/activations.py --out "$OUT/activations.json" ;;
    linear) python3 benchmarks/linear.py --out "$OUT/linear.json" ;;
    train) python3 -m lpoptim train --out "$OUT" ;;
    bench) python3 -m lpoptim bench --out "$OUT" ;;
    records)  # README's bench rows with their baselines, as README and docs/prepare.md give the commands
      H="python3 -m lpoptim bench --hf-config"
      $H llama2-7b --compile --steps 8 --warmup 3 --out "$OUT/hf_7b" --recipes torch+bf16,torch+bf16+ckpt,prepare+bf16,lpoptim+bf16+fp8_delayed+bwd+ce+sac60,lpoptim+bf16+fp8_delayed+act+bwd+ce,lpoptim+bf16+fp8_delayed+act+attn+bwd+ce
      $H llama2-7b --compile --steps 8 --warmup 3 --out "$OUT/hf_7b_budget30" --recipes torch+bf16,prepare+bf16 --budget-gib 30
      $H llama2-7b --compile --steps 8 --warmup 3 --out "$OUT/hf_7b_cuda_graphs" --recipes torch+bf16,torch+bf16+cg,prepare+bf16,prepare+bf16+cg,lpoptim+bf16+fp8_delayed+act+attn+bwd+ce+cg
      $H llama2-7b --steps 5 --warmup 2 --out "$OUT/hf_7b_eager" --recipes torch+bf16,torch+bf16+ckpt,lpoptim+bf16+bwd+ce,prepare+bf16,lpoptim+bf16+fp8_delayed+bwd+ce,lpoptim+bf16+act+bwd+ce
      $H llama2-7b --compile --steps 8 --warmup 3 --out "$OUT/hf_7b_s4_budget24" --recipes torch+bf16,prepare+bf16+s4,prepare+bf16+s4+cg --budget-gib 24
      $H llama2-7b --compile --batch 4 --steps 5 --warmup 2 --out "$OUT/hf_7b_batch4" --recipes torch+bf16+ckpt,prepare+bf16,lpoptim+bf16+fp8_delayed+act+bwd+ce
      $H llama2-7b --compile --batch 4 --steps 5 --warmup 2 --out "$OUT/hf_7b_batch4_budget40" --recipes torch+bf16+ckpt,prepare+bf16 --budget-gib 40
      $H llama2-13b --compile --steps 5 --warmup 2 --out "$OUT/hf_13b" --recipes torch+bf16+ckpt,prepare+bf16,lpoptim+bf16+fp8_delayed+bwd+ce+sac50
      $H llama2-13b --compile --steps 5 --warmup 2 --out "$OUT/hf_13b_s4" --recipes torch+bf16+ckpt,prepare+bf16+s4
      $H llama2-13b --compile --steps 5 --warmup 2 --out "$OUT/hf_13b_s4_budget44" --recipes prepare+bf16,prepare+bf16+s4 --budget-gib 44
      $H llama-26b --compile --steps 3 --warmup 2 --out "$OUT/hf_26b_s4" --recipes prepare+bf16+s4 --budget-gib 78
      python3 -m lpoptim bench --preset tinyllama-1.1b --compile --steps 8 --out "$OUT/tinyllama" \
        --recipes torch,lpoptim+bf16+fp8_tensor+bwd+ce+sac100 ;;
    *) python3 $w ;;
  esac
done
