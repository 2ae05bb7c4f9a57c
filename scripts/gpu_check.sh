#!/usr/bin/env bash
# One call on the GPU machine: build against its preinstalled torch, run the whole suite (CUDA
# tests included, `large` ones too), then the compute-sanitizer subset. Logs go to $OUT (or
# results/). Usage: scripts/gpu_check.sh [pytest args]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/results}"
mkdir -p "$OUT"
cd "$ROOT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# shellcheck disable=SC1091
source scripts/setup_env.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
set +e
tail -3 "$OUT/build.log"
python -m pytest tests -q -ra -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
scripts/sanitize.sh 2>&1 | tee "$OUT/sanitizer.log" | tail -12
