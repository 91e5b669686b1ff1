#!/usr/bin/env bash
# Device runs of the benchmarks on a 2-GPU host (the device tool's nvidia-h200-x2), results under
# $OUT (or ./gpu-out) packed into one all.tgz, summaries on stdout. Phases:
#   scripts/gpu_bench.sh single  GPU 0: bench_e2e.py (llama2-7b, one GPU);
#                                GPU 1: GPU tests, Llama layer bench + profile, quantize sweep,
#                                CoatAdamW bench (one after another)
#   scripts/gpu_bench.sh multi   both GPUs: bench_fsdp.py; then GPU 0: bench_vila.py
#   scripts/gpu_bench.sh check   one GPU: GPU tests, bench_quantize.py (every quantizer), the
#                                CoatAdamW bench, the layer host profile (profile_host.py)
# Carried wheels (.whl/*.whl, .whl/bnb) are put on PYTHONPATH when present.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
r=$out/r
mkdir -p "$r"
P=$PWD/packages
export PYTHONPATH=$P/fp8-quant/src:$P/fp8-optim/src:$P/fp8-activations/src:$P/coat-models/src
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
[ -d .whl/bnb ] && export PYTHONPATH=$PWD/.whl/bnb:$PYTHONPATH
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
B=packages/coat-models/benchmarks
start=$SECONDS
left() { echo $((${1} - SECONDS + start)); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
  git log --oneline -1 2>/dev/null; date -u; } > "$r/device.txt" 2>&1
cat "$r/device.txt"

case "${1:-single}" in
s5)  # session 5: CoatAdamW kernel (tile order, no barriers, fewer instructions)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-optim/tests \
    > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/optim.json timeout 120 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    -k "${OPTIM_K:-not torchao and not bitsandbytes and not error}" > "$r/optim.txt" 2>&1
  timeout $(left 560) python3 packages/fp8-optim/benchmarks/sweep_adamw_gpu.py --out "$r" \
    --budget-s 150 > "$r/sweep_adamw.log" 2>&1
  tail -3 "$r/tests.txt"; grep "^E " "$r/tests.txt" | head -20
  grep -A8 "^optimizer" "$r/optim.txt"; cat "$r/sweep_adamw.txt" 2>/dev/null | head -12
  tail -5 "$r/sweep_adamw.log"
  ;;
s5i)  # session 5: the CoatAdamW bench with every optimizer, final kernel (carry .whl)
  BENCH_OUT=$r/optim.json timeout 240 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    > "$r/optim.txt" 2>&1
  grep -A20 "^optimizer" "$r/optim.txt"; tail -2 "$r/optim.txt"
  ;;
s5h)  # session 5, final: every GPU test
  timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-quant/tests \
    packages/fp8-optim/tests packages/fp8-activations/tests packages/coat-models/tests tests \
    > "$r/tests.txt" 2>&1
  tail -2 "$r/tests.txt"; grep -E "^(E |FAILED)" "$r/tests.txt" | head -30
  ;;
s5g)  # session 5: count fix (tl.atomic_add), even/odd chunk split: fp8-optim tests, bench, sweep
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-optim/tests \
    -rA > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/optim.json timeout 150 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    -k "not torchao and not bitsandbytes and not error" > "$r/optim.txt" 2>&1
  timeout 150 python3 packages/fp8-optim/benchmarks/sweep_adamw_gpu.py --out "$r" \
    --budget-s 100 > "$r/sweep_adamw.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)" "$r/tests.txt"; tail -1 "$r/tests.txt"
  grep -E "^E " "$r/tests.txt" | head -20
  grep -A10 "^optimizer" "$r/optim.txt"; cat "$r/sweep_adamw.txt" 2>/dev/null | head -12
  ;;
s5f)  # session 5: fp8-optim GPU tests (non-finite policy of the compiled kernel; formats)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-optim/tests \
    -rA > "$r/tests.txt" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)" "$r/tests.txt"; tail -2 "$r/tests.txt"
  grep -E "^E " "$r/tests.txt" | head -30
  ;;
s5e)  # session 5, last: every GPU test; layer bench (carry .whl); 7B end-to-end at mb 2 and 16
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-quant/tests \
    packages/fp8-optim/tests packages/fp8-activations/tests packages/coat-models/tests tests \
    > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 150 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "torchao or test_llama2_7b_layer[coat] or coat_graphed" > "$r/layer.txt" 2>&1
  BENCH_OUT=$r/e2e.json timeout $(left 580) python3 $B/bench_e2e.py --micro-batches 2,16 \
    --variants bf16,coat --budget-s 200 --steps 4 > "$r/e2e.txt" 2>&1
  tail -3 "$r/tests.txt"; grep -E "^(E |FAILED)" "$r/tests.txt" | head -30
  grep -A8 "^variant" "$r/layer.txt"; tail -4 "$r/layer.txt"; tail -16 "$r/e2e.txt"
  ;;
s5d)  # session 5: gradient accumulators made before recording (graphs tests, 125m CLI run,
      # layer bench against torchao: carry .whl)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 3 \
    packages/coat-models/tests/test_train.py packages/coat-models/tests/test_cli_vl.py \
    packages/coat-models/tests/test_graphs.py > "$r/tests.txt" 2>&1
  timeout 150 python3 -m coat_models.cli --preset 125m --mode coat --steps 60 --eval-every 60 \
    --eval-batches 2 --device cuda --no-progress --out "$r/cli-graphs" --cuda-graphs \
    > "$r/cli-graphs.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 200 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "torchao or test_llama2_7b_layer[coat] or coat_graphed" > "$r/layer.txt" 2>&1
  tail -3 "$r/tests.txt"; grep -E "^(E |FAILED)" "$r/tests.txt" | head -30
  echo "AccumulateGrad warnings: tests $(grep -c AccumulateGrad "$r/tests.txt"), cli $(grep -c AccumulateGrad "$r/cli-graphs.txt")"
  grep -E "tokens/s|peak memory|done in" "$r/cli-graphs.txt"
  grep -A8 "^variant" "$r/layer.txt"; tail -4 "$r/layer.txt"
  ;;
s5c)  # session 5: coat-train --cuda-graphs (GPU tests; a 125m run with and without)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 3 \
    packages/coat-models/tests/test_train.py packages/coat-models/tests/test_cli_vl.py \
    packages/coat-models/tests/test_graphs.py > "$r/tests.txt" 2>&1
  for g in "" --cuda-graphs; do
    timeout 150 python3 -m coat_models.cli --preset 125m --compare bf16,coat --steps 60 \
      --eval-every 60 --eval-batches 2 --device cuda --no-progress --out "$r/cli${g:+-graphs}" $g \
      > "$r/cli${g:+-graphs}.txt" 2>&1
  done
  tail -3 "$r/tests.txt"; grep -E "^(E |FAILED)" "$r/tests.txt" | head -30
  tail -12 "$r/cli.txt"; tail -12 "$r/cli-graphs.txt"
  ;;
s5b)  # session 5: every GPU test, then the CoatAdamW bench with its peers (carry .whl)
  timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-quant/tests \
    packages/fp8-optim/tests packages/fp8-activations/tests packages/coat-models/tests tests \
    > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/optim.json timeout $(left 570) python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    > "$r/optim.txt" 2>&1
  tail -3 "$r/tests.txt"; grep -E "^(E |FAILED)" "$r/tests.txt" | head -30
  grep -A16 "^optimizer" "$r/optim.txt"; tail -3 "$r/optim.txt"
  ;;
s4f)  # session 4, last: graphs and train GPU tests, layer bench, VILA bf16 vs coat-graphs
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 2 \
    packages/coat-models/tests/test_graphs.py packages/coat-models/tests/test_train.py \
    > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 150 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "torchao or test_llama2_7b_layer[coat] or coat_graphed" > "$r/layer.txt" 2>&1
  BENCH_VILA_VARIANTS=coat-graphs BENCH_VILA_CASES=${VILA_CASES:-1x1,2x2} BENCH_OUT=$r/vila.json \
    timeout $(left 420) python3 $B/bench_vila.py > "$r/vila.txt" 2>&1
  tail -3 "$r/tests.txt"; grep "^E " "$r/tests.txt" | head -20
  grep -A8 "^variant" "$r/layer.txt"; tail -8 "$r/vila.txt"
  ;;
s4e)  # session 4: GPU tests after the fixes, layer bench, VILA bf16 vs coat-graphs
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 \
    packages/fp8-activations/tests packages/coat-models/tests tests > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 150 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "torchao or test_llama2_7b_layer[coat] or coat_graphed" > "$r/layer.txt" 2>&1
  BENCH_VILA_VARIANTS=${VILA_VARIANTS:-coat-graphs} BENCH_OUT=$r/vila.json \
    timeout $(left 585) python3 $B/bench_vila.py > "$r/vila.txt" 2>&1
  tail -3 "$r/tests.txt"; grep -A25 "_ test_gpu_graphed" "$r/tests.txt" | grep "^E " | head -30
  grep -A8 "^variant" "$r/layer.txt"; tail -14 "$r/vila.txt"
  ;;
s4d)  # session 4: GPU tests, layer bench, CoatAdamW bench, VILA with CUDA graphs
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 \
    packages/fp8-activations/tests packages/coat-models/tests tests > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 150 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "torchao or test_llama2_7b_layer[coat] or coat_graphed" > "$r/layer.txt" 2>&1
  BENCH_OUT=$r/optim.json timeout 100 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    -k "not torchao and not bitsandbytes and not error" > "$r/optim.txt" 2>&1
  BENCH_VILA_VARIANTS=${VILA_VARIANTS:-coat-nocache,coat-graphs} BENCH_OUT=$r/vila.json \
    timeout $(left 585) python3 $B/bench_vila.py > "$r/vila.txt" 2>&1
  tail -3 "$r/tests.txt"; grep -B2 -A12 "test_graphs" "$r/tests.txt" | head -60
  grep -A8 "^variant" "$r/layer.txt"; grep -A8 "^optimizer" "$r/optim.txt"; tail -14 "$r/vila.txt"
  ;;
s4c)  # session 4: GPU tests, layer, CoatAdamW and VILA benchmarks after the changes
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-quant/tests \
    packages/fp8-optim/tests packages/fp8-activations/tests packages/coat-models/tests tests \
    > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 200 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "${LAYER_K:-torchao or test_llama2_7b_layer[coat] or coat_graphed}" > "$r/layer.txt" 2>&1
  timeout 60 python3 $B/profile_layer.py --variants coat --out "$r/profile.txt" > /dev/null 2>&1
  BENCH_OUT=$r/optim.json timeout 120 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    -k "not torchao and not bitsandbytes and not error" > "$r/optim.txt" 2>&1
  BENCH_OUT=$r/vila.json timeout $(left 570) python3 $B/bench_vila.py > "$r/vila.txt" 2>&1
  tail -3 "$r/tests.txt"; grep -A8 "^variant" "$r/layer.txt"; head -16 "$r/profile.txt"
  grep -A8 "^optimizer" "$r/optim.txt"; tail -14 "$r/vila.txt"
  ;;
s4b)  # session 4: re-form tile sweep, layer profile and bench, CoatAdamW sweep again
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-activations/tests \
    packages/fp8-optim/tests > "$r/tests.txt" 2>&1
  timeout 90 python3 packages/fp8-activations/benchmarks/sweep_reform_t.py --out "$r/reform.txt" \
    > "$r/reform.log" 2>&1
  timeout 90 python3 $B/profile_layer.py --variants coat --out "$r/profile.txt" > /dev/null 2>&1
  BENCH_OUT=$r/layer.json timeout 200 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "${LAYER_K:-torchao or test_llama2_7b_layer[coat] or coat_graphed}" > "$r/layer.txt" 2>&1
  timeout 110 python3 packages/fp8-optim/benchmarks/sweep_adamw_gpu.py --out "$r" --budget-s 80 \
    --only default-8x16,4x16 > "$r/sweep_adamw.log" 2>&1
  tail -3 "$r/tests.txt"; cat "$r/reform.txt"; tail -3 "$r/reform.log"; head -30 "$r/profile.txt"
  grep -A8 "^variant" "$r/layer.txt"; head -6 "$r/sweep_adamw.txt"
  ;;
s4)  # session 4: CoatAdamW kernel/host changes, the graphed layer, the layer profile
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-optim/tests \
    > "$r/tests.txt" 2>&1
  timeout 110 python3 packages/fp8-optim/benchmarks/sweep_adamw_gpu.py --out "$r" --budget-s 80 \
    > "$r/sweep_adamw.log" 2>&1
  BENCH_OUT=$r/optim.json timeout 120 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    -k "not torchao and not bitsandbytes and not error" > "$r/optim.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 150 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py \
    -k "${LAYER_K:-test_llama2_7b_layer[coat] or coat_graphed}" > "$r/layer.txt" 2>&1
  timeout 90 python3 $B/profile_layer.py --variants coat --out "$r/profile.txt" > /dev/null 2>&1
  tail -3 "$r/tests.txt"; cat "$r/sweep_adamw.txt" 2>/dev/null | head -12; tail -5 "$r/sweep_adamw.log"
  grep -A8 "^optimizer" "$r/optim.txt"; grep -A8 "^variant" "$r/layer.txt"; tail -15 "$r/layer.txt"
  head -40 "$r/profile.txt"
  ;;
single)
  (CUDA_VISIBLE_DEVICES=0 BENCH_OUT=$r/e2e.json timeout 480 python3 $B/bench_e2e.py \
     --micro-batches 1,2,4,8,12,16,24 --budget-s 360 --steps 3 > "$r/e2e.txt" 2>&1) &
  export CUDA_VISIBLE_DEVICES=1
  timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-quant/tests \
    packages/fp8-optim/tests packages/fp8-activations/tests packages/coat-models/tests tests \
    > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/layer.json timeout 150 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only $B/bench_llama_layer.py > "$r/layer.txt" 2>&1
  timeout 60 python3 $B/profile_layer.py --variants coat --out "$r/profile.txt" > /dev/null 2>&1
  timeout 80 python3 packages/fp8-quant/benchmarks/sweep_quantize_gpu.py --out "$r" \
    --budget-s 40 > "$r/sweep_quantize.log" 2>&1
  BENCH_OUT=$r/optim.json timeout $(left 480) python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    -k "not torchao and not bitsandbytes and not error" > "$r/optim.txt" 2>&1
  wait
  tail -4 "$r/tests.txt"; grep -A8 "^variant" "$r/layer.txt"; head -25 "$r/profile.txt"
  grep "^best\|default" "$r/sweep_quantize.txt"; grep -A8 "^optimizer" "$r/optim.txt"
  sed -n '/largest-mb/,$p' "$r/e2e.txt" | head -30
  ;;
multi)
  BENCH_OUT=$r/fsdp.json timeout 240 torchrun --standalone --nproc-per-node 2 $B/bench_fsdp.py \
    --micro-batches "${FSDP_MB:-6,8,16,20,24}" --budget-s 180 2>&1 | grep -v "^\[rank1\]" > "$r/fsdp.txt"
  (CUDA_VISIBLE_DEVICES=0 BENCH_OUT=$r/vila.json timeout $(left 440) python3 $B/bench_vila.py \
    > "$r/vila.txt" 2>&1) &
  export CUDA_VISIBLE_DEVICES=1
  if [ -z "${SKIP_CHECKS:-}" ]; then  # SKIP_CHECKS=1: GPU 1 only profiles the layer
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-quant/tests \
      packages/fp8-optim/tests packages/fp8-activations/tests > "$r/tests.txt" 2>&1
    BENCH_OUT=$r/optim.json timeout 90 python3 -m pytest -s -q -p no:cacheprovider \
      -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
      -k "not torchao and not bitsandbytes and not error" > "$r/optim.txt" 2>&1
  fi
  timeout $(left 440) python3 $B/profile_layer.py --variants coat --out "$r/profile.txt" \
    > "$r/profile.log" 2>&1
  wait
  sed -n '/^FSDP2/,$p' "$r/fsdp.txt"; tail -14 "$r/vila.txt"; tail -2 "$r/tests.txt" 2>/dev/null
  grep -A6 "^optimizer" "$r/optim.txt" 2>/dev/null; head -30 "$r/profile.txt"; tail -5 "$r/profile.log"
  ;;
check)
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 packages/fp8-quant/tests \
    packages/fp8-optim/tests packages/fp8-activations/tests packages/coat-models/tests tests \
    > "$r/tests.txt" 2>&1
  BENCH_OUT=$r/quantize.json timeout 120 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-quant/benchmarks/bench_quantize.py \
    > "$r/quantize.txt" 2>&1
  BENCH_OUT=$r/optim.json timeout 100 python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only packages/fp8-optim/benchmarks/bench_adamw.py \
    -k "not torchao and not bitsandbytes and not error" > "$r/optim.txt" 2>&1
  timeout 150 python3 $B/profile_host.py --variants coat,bf16_eager --batches 1,4 \
    --out "$r/host.txt" > "$r/host.log" 2>&1
  tail -4 "$r/tests.txt"; sed -n '/^fp8-quant on/,$p' "$r/quantize.txt" | head -30
  grep -A6 "^optimizer" "$r/optim.txt"; grep "^==\|syncs" "$r/host.txt"; tail -3 "$r/host.log"
  ;;
esac
tar czf "$out/all.tgz" -C "$out" r && rm -rf "$r"
