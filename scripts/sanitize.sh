#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over a representative subset of the CUDA kernels
# (scripts/sanitizer_cases.py: every layout, dtype, parameter combination and split path once).
# Needs the environment of scripts/setup_env.sh (or any python with fusednorm installed).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
status=0
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
    python "$ROOT/scripts/sanitizer_cases.py" || status=1
done
exit $status
