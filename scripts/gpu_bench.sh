#!/usr/bin/env bash
# The GPU tests and benchmarks in one call on a CUDA host, from the repository root, with the
# packages of this checkout on PYTHONPATH. Logs and JSON under $OUT (or ./gpu-out), packed into
# $OUT/all.tgz; summaries on stdout. BENCHMARKS.md says which phase made which numbers.
#
#   scripts/gpu_bench.sh single  2 GPUs. GPU 0: bench_e2e.py (llama2-7b, micro-batches 1..24).
#                                GPU 1, one after another: every GPU test, the Llama layer bench
#                                and its profile, the quantize sweep, the CoatAdamW bench and
#                                its launch-shape sweep.
#   scripts/gpu_bench.sh multi   2 GPUs. bench_fsdp.py on both; then GPU 0: bench_vila.py;
#                                GPU 1: the fp8 packages' GPU tests, the CoatAdamW bench, the
#                                layer profile.
#   scripts/gpu_bench.sh speed-accum  1 GPU. Training speed through coat-train at small steps: the
#                                125m preset and Llama-2-7B at micro-batch 1 x grad-accum 4, each
#                                twice, bf16 vs coat in one process: as coat-train runs it (CUDA
#                                graphs on by default), then with --no-cuda-graphs (eager); first
#                                a host probe.
#   scripts/gpu_bench.sh speed-batch  1 GPU. Llama-2-7B at micro-batch 2: bf16 vs coat (default),
#                                coat eager, torchao float8 + compile (bench_e2e; carry its wheel);
#                                coat at micro-batch 8 (the best-vs-best row).
#   scripts/gpu_bench.sh speed-plans  1 GPU (an H200: bf16 at 7B), ~4 min. Launch plans
#                                (--launch-plans), bf16 vs coat in one process: Llama-2-7B at
#                                micro-batch 1 x 4 and 2, torchao float8 + compile at 2 (carry
#                                its wheel), coat at micro-batch 8 (best vs bf16's 2, same call),
#                                the 125m preset; then one layer's host time at batch 1 and 2
#                                (eager, planned, graphed), and whether its step repeats its
#                                bits (bench_llama_layer repeat); first a host probe.
#   scripts/gpu_bench.sh speed-compile 1 GPU, ~7 min. coat-train --compile against eager
#                                (--no-cuda-graphs): bf16 vs coat in one process, both compiled
#                                or both eager, at the 125m preset and Llama-2-7B micro-batch
#                                1 x 4; first a host probe.
#   scripts/gpu_bench.sh speed-fsdp 1 GPU, ~7 min. coat alone, --compile against eager
#                                (--no-launch-plans) and launch plans (FSDP2's default): Llama-2-7B
#                                2 x 2 with --activation-checkpointing, then FSDP2 on one GPU
#                                under torchrun (7B 1 x 4), the three once each; first a host
#                                probe. (Two phases: each fits one 10-minute device call.)
#   scripts/gpu_bench.sh speed-ddp 1 GPU, ~6 min. The 125m preset under torchrun --ddp (one
#                                process), bf16 vs coat in one run, eager (--no-launch-plans),
#                                launch plans (DDP's default), --cuda-graphs; first a host probe.
#   scripts/gpu_bench.sh accuracy     1 GPU, ~5 min. The 125m preset trained 2000 steps with bf16
#                                and coat (bench_e2e_accuracy.py), checked against the golden
#                                loss curves; exit status 1 when a check fails. ACC_SEEDS=3:
#                                seeds 0-2, the gap target on their mean (~4 min a seed).
#   scripts/gpu_bench.sh check   1 GPU. Every GPU test, fp8-quant's benches (every quantizer), the
#                                CoatAdamW bench, coat-models' RoPE and cross-entropy kernel
#                                benches, the host-time profile of a layer; with CLI=1
#                                also coat-train's 125m preset, bf16 vs coat, with and without
#                                --cuda-graphs.
#
# Knobs (environment): OPTIM_K, LAYER_K: pytest -k filters of the CoatAdamW and layer benches
# (OPTIM_K='' runs bitsandbytes and torchao too: carry their wheels); FSDP_MB: bench_fsdp's
# micro-batches; VILA_VARIANTS, VILA_CASES: bench_vila's BENCH_VILA_VARIANTS / _CASES;
# SKIP_CHECKS=1: multi's GPU 1 only profiles the layer. Wheels carried in .whl/*.whl (and a
# .whl/bnb folder) are put on PYTHONPATH. pytest-xdist, where installed, runs tests 4 at a time.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-}
case "$phase" in
single | multi | check | speed-accum | speed-batch | speed-plans | speed-compile | speed-fsdp | speed-ddp | accuracy) ;;
*)
  echo "usage: scripts/gpu_bench.sh single|multi|check|speed-accum|speed-batch|speed-plans|speed-compile|speed-fsdp|speed-ddp|accuracy (see the top)" >&2
  exit 2
  ;;
esac
command -v nvidia-smi >/dev/null || { echo "gpu_bench.sh: error: no nvidia-smi: run it on a CUDA host" >&2; exit 2; }

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
unset TRITON_INTERPRET # compiled kernels, not the interpreter
B=packages/coat-models/benchmarks
ALL_TESTS="packages/fp8-quant/tests packages/fp8-optim/tests packages/fp8-activations/tests packages/coat-models/tests tests"
FP8_TESTS="packages/fp8-quant/tests packages/fp8-optim/tests packages/fp8-activations/tests"
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n 4"
OPTIM_K=${OPTIM_K-not torchao and not bitsandbytes and not error}
LAYER_K=${LAYER_K-}
start=$SECONDS
left() { echo $((${1} - SECONDS + start)); } # seconds left of a budget of $1 for this phase

gpu_tests() { # gpu_tests TIMEOUT DIRS...
  local t=$1
  shift
  # shellcheck disable=SC2086  # XDIST is empty or two words
  timeout "$t" python3 -m pytest -q -m gpu -p no:cacheprovider $XDIST "$@" > "$r/tests.txt" 2>&1
}
bench() { # bench NAME TIMEOUT FILE [-k FILTER]: a pytest-benchmark suite, JSON to $r/NAME.json
  local name=$1 t=$2 file=$3
  shift 3
  BENCH_OUT=$r/$name.json timeout "$t" python3 -m pytest -s -q -p no:cacheprovider \
    -o python_files='bench_*.py' --benchmark-only "$file" "$@" > "$r/$name.txt" 2>&1
}
optim_bench() { # optim_bench TIMEOUT
  if [ -n "$OPTIM_K" ]; then
    bench optim "$1" packages/fp8-optim/benchmarks/bench_adamw.py -k "$OPTIM_K"
  else
    bench optim "$1" packages/fp8-optim/benchmarks/bench_adamw.py
  fi
}
layer_bench() { # layer_bench TIMEOUT
  if [ -n "$LAYER_K" ]; then
    bench layer "$1" $B/bench_llama_layer.py -k "$LAYER_K"
  else
    bench layer "$1" $B/bench_llama_layer.py
  fi
}
test_summary() { tail -3 "$r/tests.txt"; grep -E "^(E |FAILED)" "$r/tests.txt" | head -30; }

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
  git log --oneline -1 2>/dev/null
  date -u
} > "$r/device.txt" 2>&1
cat "$r/device.txt"

case "$phase" in
single)
  (CUDA_VISIBLE_DEVICES=0 BENCH_OUT=$r/e2e.json timeout 480 python3 $B/bench_e2e.py \
    --micro-batches 1,2,4,8,12,16,24 --budget-s 360 --steps 3 > "$r/e2e.txt" 2>&1) &
  export CUDA_VISIBLE_DEVICES=1
  # shellcheck disable=SC2086  # ALL_TESTS is a list of folders
  gpu_tests 170 $ALL_TESTS
  layer_bench 150
  timeout 60 python3 $B/bench_llama_layer.py kernels --variants coat --out "$r/profile.txt" > /dev/null 2>&1
  timeout 80 python3 packages/fp8-quant/benchmarks/sweep_quantize_gpu.py --out "$r" \
    --budget-s 40 > "$r/sweep_quantize.log" 2>&1
  optim_bench 100
  timeout "$(left 560)" python3 packages/fp8-optim/benchmarks/sweep_adamw_gpu.py --out "$r" \
    --budget-s 80 > "$r/sweep_adamw.log" 2>&1
  wait
  test_summary
  grep -A8 "^variant" "$r/layer.txt"
  head -25 "$r/profile.txt"
  grep "^best\|default" "$r/sweep_quantize.txt"
  grep -A8 "^optimizer" "$r/optim.txt"
  head -12 "$r/sweep_adamw.txt" 2>/dev/null
  sed -n '/largest-mb/,$p' "$r/e2e.txt" | head -30
  ;;
multi)
  BENCH_OUT=$r/fsdp.json timeout 240 torchrun --standalone --nproc-per-node 2 $B/bench_fsdp.py \
    --micro-batches "${FSDP_MB:-6,8,16,20,24}" --budget-s 180 2>&1 | grep -v "^\[rank1\]" > "$r/fsdp.txt"
  vila_env=(CUDA_VISIBLE_DEVICES=0 "BENCH_OUT=$r/vila.json") # bench_vila's defaults unless set
  [ -n "${VILA_VARIANTS:-}" ] && vila_env+=("BENCH_VILA_VARIANTS=$VILA_VARIANTS")
  [ -n "${VILA_CASES:-}" ] && vila_env+=("BENCH_VILA_CASES=$VILA_CASES")
  (env "${vila_env[@]}" timeout "$(left 440)" python3 $B/bench_vila.py > "$r/vila.txt" 2>&1) &
  export CUDA_VISIBLE_DEVICES=1
  if [ -z "${SKIP_CHECKS:-}" ]; then
    # shellcheck disable=SC2086
    gpu_tests 120 $FP8_TESTS
    optim_bench 90
  fi
  timeout "$(left 440)" python3 $B/bench_llama_layer.py kernels --variants coat --out "$r/profile.txt" \
    > "$r/profile.log" 2>&1
  wait
  sed -n '/^FSDP2/,$p' "$r/fsdp.txt"
  tail -14 "$r/vila.txt"
  [ -f "$r/tests.txt" ] && test_summary
  grep -A6 "^optimizer" "$r/optim.txt" 2>/dev/null
  head -30 "$r/profile.txt"
  tail -5 "$r/profile.log"
  ;;
speed-accum | speed-batch | speed-plans | speed-compile | speed-fsdp | speed-ddp)
  G=(--eval-batches 1 --log-every 3 --no-progress --no-export)
  train() { # train NAME TIMEOUT ARGS...: coat-train into $r/NAME.txt
    local name=$1 t=$2
    shift 2
    timeout "$t" python3 -m coat_models.train.cli "$@" --out "/tmp/speed-$name" > "$r/$name.txt" 2>&1
  }
  L=(--preset llama2-7b)
  if [ "$phase" = speed-accum ]; then
    timeout 60 python3 $B/bench_e2e.py probe > "$r/probe.txt" 2>&1
    S125=(--preset 125m --compare bf16,coat --steps 60 --eval-batches 2 --no-progress --no-export)
    train s125 100 "${S125[@]}"
    train s125_eager 80 "${S125[@]}" --no-cuda-graphs
    train ga4 170 "${L[@]}" --compare bf16,coat --batch-size 1 --grad-accum 4 --steps 12 "${G[@]}"
    train ga4_eager 150 "${L[@]}" --compare bf16,coat --no-cuda-graphs --batch-size 1 --grad-accum 4 --steps 12 "${G[@]}"
    runs="s125 s125_eager ga4 ga4_eager"
  elif [ "$phase" = speed-plans ]; then
    timeout 60 python3 $B/bench_e2e.py probe > "$r/probe.txt" 2>&1
    P=("${L[@]}" --launch-plans --steps 12 "${G[@]}")
    train ga4_plans 150 "${P[@]}" --compare bf16,coat --batch-size 1 --grad-accum 4
    train mb2_plans 120 "${P[@]}" --compare bf16,coat --batch-size 2
    timeout 150 python3 $B/bench_e2e.py --variants torchao --micro-batches 2 --steps 8 > "$r/torchao.txt" 2>&1
    train mb8_plans 100 "${L[@]}" --launch-plans --mode coat --batch-size 8 --steps 8 "${G[@]}"
    train s125_plans 100 --preset 125m --compare bf16,coat --steps 60 --eval-batches 2 \
      --no-progress --no-export --launch-plans
    timeout 150 python3 $B/bench_llama_layer.py host --variants coat,coat_planned,coat_graphed \
      --batches 1,2 --out "$r/host.txt" > "$r/host.log" 2>&1
    # Does a layer step repeat its bits (a plan's check compares them)?
    timeout 90 python3 $B/bench_llama_layer.py repeat --batch 1 --out "$r/repeat.txt" \
      > "$r/repeat.log" 2>&1
    runs="ga4_plans mb2_plans mb8_plans s125_plans"
  elif [ "$phase" = speed-compile ]; then
    timeout 60 python3 $B/bench_e2e.py probe > "$r/probe.txt" 2>&1
    S125=(--preset 125m --compare bf16,coat --steps 60 --eval-batches 2 --no-progress --no-export)
    train s125_compile 150 "${S125[@]}" --compile
    train s125_eager 100 "${S125[@]}" --no-cuda-graphs
    GA4=("${L[@]}" --compare bf16,coat --batch-size 1 --grad-accum 4 --steps 12 "${G[@]}")
    train ga4_compile 200 "${GA4[@]}" --compile
    train ga4_eager 170 "${GA4[@]}" --no-cuda-graphs
    runs="s125_compile s125_eager ga4_compile ga4_eager"
  elif [ "$phase" = speed-fsdp ]; then
    timeout 60 python3 $B/bench_e2e.py probe > "$r/probe.txt" 2>&1
    AC=("${L[@]}" --mode coat --steps 8 "${G[@]}" --activation-checkpointing --batch-size 2 --grad-accum 2)
    train ac_eager 110 "${AC[@]}" --no-cuda-graphs
    train ac_compile 110 "${AC[@]}" --compile
    # FSDP2 on one GPU under torchrun: compiled, eager and planned, once each (runs of one
    # setting have moved by more than compile's difference to eager: read with care).
    F=("${L[@]}" --fsdp --mode coat --batch-size 1 --grad-accum 4 --steps 10 "${G[@]}")
    for i in 1; do
      for v in compile eager plans; do
        flag=(--compile)
        [ "$v" = eager ] && flag=(--no-launch-plans)
        [ "$v" = plans ] && flag=()
        timeout 80 torchrun --standalone --nproc-per-node 1 -m coat_models.train.cli "${F[@]}" \
          "${flag[@]}" --out "/tmp/speed-fsdp$i-$v" > "$r/fsdp${i}_$v.txt" 2>&1
      done
    done
    runs="ac_eager ac_compile"
    runs="$runs fsdp1_compile fsdp1_eager fsdp1_plans"
  elif [ "$phase" = speed-ddp ]; then
    timeout 60 python3 $B/bench_e2e.py probe > "$r/probe.txt" 2>&1
    D=(--ddp --preset 125m --compare bf16,coat --steps 60 --eval-batches 2 --no-progress --no-export)
    for v in eager plans graphs; do
      flag=()
      [ "$v" = eager ] && flag=(--no-launch-plans)
      [ "$v" = graphs ] && flag=(--cuda-graphs)
      timeout 150 torchrun --standalone --nproc-per-node 1 -m coat_models.train.cli "${D[@]}" \
        "${flag[@]}" --out "/tmp/speed-ddp-$v" > "$r/ddp_$v.txt" 2>&1
    done
    runs="ddp_eager ddp_plans ddp_graphs"
  else
    train mb2 150 "${L[@]}" --compare bf16,coat --batch-size 2 --steps 12 "${G[@]}"
    train mb2_eager 90 "${L[@]}" --mode coat --no-cuda-graphs --batch-size 2 --steps 12 "${G[@]}"
    timeout 150 python3 $B/bench_e2e.py --variants torchao --micro-batches 2 --steps 8 > "$r/torchao.txt" 2>&1
    train mb8 90 "${L[@]}" --mode coat --batch-size 8 --steps 8 "${G[@]}"
    runs="mb2 mb2_eager mb8"
  fi
  [ -f "$r/probe.txt" ] && cat "$r/probe.txt"
  for f in $runs; do
    echo "== $f"
    grep -E "^coat-train: |tokens/s|peak memory|launch plans|out of memory|rror" "$r/$f.txt" | cut -c1-160
  done
  [ -f "$r/host.txt" ] && grep "^==" "$r/host.txt"
  [ -f "$r/repeat.txt" ] && cat "$r/repeat.txt"
  if [ "$phase" = speed-batch ] || [ "$phase" = speed-plans ]; then
    echo "== torchao"
    grep -E "^torchao|host probe|rror" "$r/torchao.txt" | head -4
  fi
  ;;
accuracy)
  # The run stays out of all.tgz (no models exported: the losses are the same); its curves and
  # summary go in.
  seeds=${ACC_SEEDS:-1}
  BENCH_OUT=$r/accuracy.json timeout $((560 * seeds)) python3 $B/bench_e2e_accuracy.py \
    --out /tmp/accuracy --seeds "$seeds" --no-export > "$r/accuracy.txt" 2>&1
  status=$?
  for m in bf16 coat; do cp /tmp/accuracy/$m/metrics.jsonl "$r/accuracy-$m.jsonl"; done
  cp /tmp/accuracy/summary.json "$r/accuracy-summary.json"
  grep -vE "^(step|\[)" "$r/accuracy.txt" | tail -n 30
  ;;
check)
  # shellcheck disable=SC2086
  gpu_tests 240 $ALL_TESTS
  bench quantize 120 packages/fp8-quant/benchmarks
  optim_bench 100
  bench rope 90 $B/bench_rope.py
  bench cross_entropy 150 $B/bench_cross_entropy.py
  timeout 150 python3 $B/bench_llama_layer.py host --variants coat,bf16_eager --batches 1,4 \
    --out "$r/host.txt" > "$r/host.log" 2>&1
  if [ -n "${CLI:-}" ]; then
    for g in no-cuda-graphs cuda-graphs; do
      timeout 150 python3 -m coat_models.train.cli --preset 125m --compare bf16,coat --steps 60 \
        --eval-every 60 --eval-batches 2 --device cuda --no-progress --out "$r/cli-$g" \
        "--$g" > "$r/cli-$g.txt" 2>&1
    done
  fi
  test_summary
  sed -n '/^fp8-quant on/,$p' "$r/quantize.txt" | head -30
  grep -A6 "^optimizer" "$r/optim.txt"
  grep -A8 -E "^(RoPE|cross entropy)" "$r/rope.txt" "$r/cross_entropy.txt"
  grep "^==\|syncs" "$r/host.txt"
  tail -3 "$r/host.log"
  for f in "$r/cli-no-cuda-graphs.txt" "$r/cli-cuda-graphs.txt"; do [ -f "$f" ] && tail -12 "$f"; done
  ;;
esac
tar czf "$out/all.tgz" -C "$out" r && rm -rf "$r" || exit 1
exit "${status:-0}"
