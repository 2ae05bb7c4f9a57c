#!/usr/bin/env bash
# One call on the GPU machine: build against its preinstalled torch, run the whole suite (CUDA
# tests included, `large` ones too), then the compute-sanitizer subset. Logs go to $OUT (or
# results/). Usage: tools/gpu_check.sh [pytest args]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/results}"
mkdir -p "$OUT"
cd "$ROOT"
export CI=true PYTHONUNBUFFERED=1
# setup_env.sh (sourced below) replaces a $CXX that links another C++ runtime than torch's (the
# GPU machine's /opt/gcc/bin/g++) for the build, torch.compile and AOTInductor alike.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# shellcheck disable=SC1091
source scripts/setup_env.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
set +e
tail -3 "$OUT/build.log"
# Probe: a CPU kernel raising an error used to segfault here when the extension was compiled by
# a g++ whose libstdc++ differs from the one torch loads (setup.py now picks a matching one).
python -c "
import torch, fusednorm
try:
    torch.ops.fusednorm.group_norm_forward(torch.randn(2, 6, 4), 4, None, None, 1e-5)
except RuntimeError as e:
    print('probe: CPU error raised cleanly:', str(e)[:80])
"
echo "probe exit code: $?" | tee "$OUT/probe.txt"
timeout "${PYTEST_TIMEOUT:-420}" python -m pytest tests -q -ra -p no:cacheprovider --durations=15 "$@" > "$OUT/pytest.log" 2>&1
echo "pytest exit code: $?"
tail -45 "$OUT/pytest.log"
[ "${SKIP_SANITIZER:-0}" = 1 ] && exit 0
timeout "${SANITIZER_TIMEOUT:-480}" tools/sanitize.sh > "$OUT/sanitizer.log" 2>&1
echo "sanitizer exit code: $?"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|==" "$OUT/sanitizer.log" | tail -8
