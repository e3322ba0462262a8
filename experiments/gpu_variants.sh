#!/usr/bin/env bash
# The 806M bench step (d_model 2048, 16 layers, bf16, cuDNN, batch 8 x 2048) on one GPU
# under what the activations a step keeps depend on: remat none (the GPU default), remat
# dots, and unrolled layers (model.scan_layers=false, no stacked buffers to copy into).
# Prints bench.py's table per variant; results in $OUT_DIR (default experiments/results/gpu).
#     bash experiments/gpu_variants.sh [OUT_DIR]     # QUICK=1: tiny sizes (checks the paths)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-experiments/results/gpu}
py=${PYTHON:-python}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [[ ${QUICK:-0} == 1 ]]; then
  shape=(--layers 2 --batch-size 2 --seq-len 128 --rounds 2 --steps-per-round 1)
  model=(model.d_model=128 model.num_heads=2 model.d_ff=512 model.max_seq_len=128 attention.impl=xla)
else
  shape=(--layers 16 --batch-size 8 --seq-len 2048 --rounds 3 --steps-per-round 3)
  model=(model.d_model=2048 model.num_heads=16 model.d_ff=8192 model.max_seq_len=2048
         attention.impl=cudnn)
fi
for variant in "model.remat=none" "model.remat=dots" "model.remat=none model.scan_layers=false"; do
  label=$(echo "$variant" | tr ' =.' '-__')
  echo "== 806M, $variant" | tee -a "$out/variants.txt"
  # shellcheck disable=SC2086  # the variant is one or two KEY=VALUE words
  $py experiments/bench.py --device-counts 1 --precision bf16 --depth '' --no-profile \
    "${shape[@]}" --set "${model[@]}" $variant --out "$out/variant_$label" 2>&1 \
    | tee -a "$out/variants.txt"
done
