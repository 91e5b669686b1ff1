#!/usr/bin/env bash
# One device call: GPU test subset and the benchmarks named on the command line, with logs
# under $OUT (the device tool's output folder) or ./gpu-out. Usage: scripts/gpu_check.sh PKG...
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONPATH=packages/fp8-quant/src:packages/fp8-optim/src:packages/fp8-activations/src:packages/coat-models/src
export PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
  date -u; } | tee "$out/device.txt"
for pkg in "$@"; do
  python3 -m pytest -q -m gpu "packages/$pkg/tests" -p no:cacheprovider -n 8 2>&1 | tail -30 > "$out/tests-$pkg.txt"
  tail -3 "$out/tests-$pkg.txt"
done
