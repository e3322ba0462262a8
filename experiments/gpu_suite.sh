#!/usr/bin/env bash
# One GPU's figures for docs/results/gpu.md, in one run, by section (SECTIONS="..." runs
# those, in the order given; default: all, in this order):
#   headline  the 806M GPT (d_model 2048, 16 layers) and the 944M one (d_model 2560, 12
#             layers) in bf16 and with fp8 matmuls (precision.matmul=fp8), beside the
#             hand-written jax.jit step on shardlib's attention kernel (bench.py), each
#             row in both MFU conventions; model.scan_layers=auto (the default) unrolls
#             these 12-16 layer models on one GPU;
#   fp8       the 944M step with fp8 matmuls, traced (where its time goes, by kernel kind,
#             beside the hand-written bf16 step's), and again with XLA's Triton GEMMs
#             off (every GEMM to cuBLAS / cuBLASLt);
#   scan      the 806M step with its layers scanned, bf16 and fp8, and with remat dots;
#   moe       the dropless MoE layer's grouped matmul timed on the GPU: the tile scan
#             against tokamax's Mosaic GPU and Triton kernels and ragged_dot at 8, 64,
#             256 experts, each kernel's loss and gradients held against the tile scan's
#             (moe_gmm_gpu.py --time; tokamax, and jax-triton for Triton, beside jax);
#   trace     the 806M step traced (its kernels and HLO in OUT_DIR/trace);
#   small     a ~350M GPT (d_model 1024, 24 layers) with each attention kernel;
#   attention the attention kernels alone (xla, chunked, cudnn), bf16, forward + backward;
#   decode    KV-cache decode against the no-cache window path (decode_bench.py).
# On an H200 each bench row takes 1.3-1.8 minutes (compile, both steps, timing), headline
# about 6, moe under 1 (a session's device time is 15 minutes, one command at most 10: run
# a few sections per command). Everything it prints also lands in $OUT_DIR (default
# experiments/results/gpu).
#     bash experiments/gpu_suite.sh [OUT_DIR]        # QUICK=1: tiny sizes (checks the paths)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-experiments/results/gpu}
py=${PYTHON:-python}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS-}   # decode_bench defaults to cpu
if [[ ${QUICK:-0} == 1 ]]; then
  seqs=128,256; shape=(--layers 2 --batch-size 2 --seq-len 128 --rounds 2 --steps-per-round 1)
  m350=(model.d_model=128 model.num_heads=2 model.d_ff=256 model.max_seq_len=128)
  m1b=(model.d_model=128 model.num_heads=2 model.d_ff=512 model.max_seq_len=128)
  m944=("${m1b[@]}"); shape1b=("${shape[@]}"); shape944=("${shape[@]}"); kernels=xla,chunked
  decode=(--model tiny --window 64 --long 24); decode2=(--model tiny --window 32 --long 12)
  moe=(--quick --seq 256)
else
  seqs=2048,4096,8192
  shape=(--layers 24 --batch-size 8 --seq-len 2048 --rounds 3 --steps-per-round 3)
  m350=(model.d_model=1024 model.num_heads=8 model.d_ff=4096 model.max_seq_len=2048)
  m1b=(model.d_model=2048 model.num_heads=16 model.d_ff=8192 model.max_seq_len=2048)
  m944=(model.d_model=2560 model.num_heads=20 model.d_ff=10240 model.max_seq_len=2048)
  shape1b=(--layers 16 --batch-size 8 --seq-len 2048 --rounds 3 --steps-per-round 3)
  shape944=(--layers 12 --batch-size 8 --seq-len 2048 --rounds 3 --steps-per-round 3)
  kernels=xla,chunked,cudnn; decode=(--model small --window 512)
  decode2=(--model medium --window 1024); moe=()
fi
sections=${SECTIONS:-headline fp8 scan moe trace small attention decode}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $py -c "import jax, jaxlib, flax, optax, sys; print('python', sys.version.split()[0], \
'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', \
optax.__version__); print(jax.devices())"; } 2>&1 | tee "$out/versions.txt"
bench() {  # bench LABEL KERNEL SHAPE_ARRAY_NAME MODEL_ARRAY_NAME [bench.py options]
  local -n sh=$3 md=$4
  echo "== $1, attention.impl=$2" | tee -a "$out/bench.txt"
  $py experiments/bench.py --device-counts 1 --precision bf16 --depth '' "${@:5}" \
    "${sh[@]}" --set "${md[@]}" attention.impl=$2 --out "$out/$1_$2" 2>&1 | tee -a "$out/bench.txt"
}
first=${kernels##*,}   # cudnn on a GPU
fp8=(--set precision.matmul=fp8)
for section in $sections; do
  case $section in
    headline)
      bench 1b "$first" shape1b m1b --no-profile
      bench 1b_fp8 "$first" shape1b m1b --no-profile "${fp8[@]}"
      bench 944m "$first" shape944 m944 --no-profile
      bench 944m_fp8 "$first" shape944 m944 --no-profile "${fp8[@]}" ;;
    fp8)
      bench 944m_fp8_profile "$first" shape944 m944 "${fp8[@]}"
      (export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false"
       bench 944m_fp8_cublas "$first" shape944 m944 --no-profile "${fp8[@]}") ;;
    scan)
      bench 1b_scanned "$first" shape1b m1b --no-profile --set model.scan_layers=true
      bench 1b_scanned_fp8 "$first" shape1b m1b --no-profile --set model.scan_layers=true \
        "${fp8[@]}"
      bench 1b_dots "$first" shape1b m1b --no-profile --set model.remat=dots ;;
    moe)
      echo "== MoE grouped matmul, timed" | tee "$out/moe.txt"
      $py experiments/moe_gmm_gpu.py --time \
        --impls tile_scan,tokamax_mosaic,tokamax_triton,ragged_dot \
        "${moe[@]}" 2>&1 | tee -a "$out/moe.txt"
      cp experiments/results/moe_gmm_gpu_time.csv "$out/" 2>/dev/null ;;
    trace) bench 1b_trace "$first" shape1b m1b --trace-dir "$out/trace" ;;
    small)
      for k in ${kernels//,/ }; do bench 350m "$k" shape m350 --no-profile; done ;;
    attention)
      echo "== attention kernels alone" | tee "$out/attention.txt"
      $py experiments/attention_bench.py --kernels "$kernels" --dtype bfloat16 --heads 16 \
        --head-dim 128 --seq-lens "$seqs" 2>&1 | tee -a "$out/attention.txt" ;;
    decode)
      echo "== decode" | tee "$out/decode.txt"
      $py experiments/decode_bench.py "${decode[@]}" 2>&1 | tee -a "$out/decode.txt"
      $py experiments/decode_bench.py "${decode2[@]}" 2>&1 | tee -a "$out/decode.txt" ;;
    *) echo "unknown section $section (headline fp8 scan moe trace small attention decode)" >&2 ;;
  esac
done
