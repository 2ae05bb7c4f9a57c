#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over a representative subset of the CUDA kernels
# (tools/sanitizer_cases.py: every layout, dtype, parameter combination and split path once).
# Needs the environment of scripts/setup_env.sh (or any python with fusednorm installed).
# racecheck over the whole list took over 530 s in one process on an H100, and 298 s as six
# processes in parallel (H100): it runs as RACE_SHARDS (default 6)
# processes, each every N-th case (sanitizer_cases.py --shard). With the fourth backward mask
# (300 units) the whole list no longer fits one call (H200: memcheck and two of eight racecheck
# shards in 416 s; the 120 fused units' memcheck, then racecheck in 10 shards, not done in 238 s).
# SANITIZER_CASE_ARGS passes sanitizer_cases.py options: --fused-only, or
# --shared-memory-backwards (the one-CTA and team fused backwards, racecheck ~50 s).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="$(mktemp -d)"
status=0
echo "== compute-sanitizer --tool memcheck"
compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
  python "$ROOT/tools/sanitizer_cases.py" ${SANITIZER_CASE_ARGS:-} || status=1
shards="${RACE_SHARDS:-6}"
echo "== compute-sanitizer --tool racecheck ($shards shards in parallel)"
pids=()
for ((i = 0; i < shards; i++)); do
  compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 20 \
    python "$ROOT/tools/sanitizer_cases.py" --shard "$i/$shards" ${SANITIZER_CASE_ARGS:-} > "$LOGS/racecheck_$i.log" 2>&1 &
  pids+=($!)
done
for ((i = 0; i < shards; i++)); do
  wait "${pids[$i]}" || status=1
  cat "$LOGS/racecheck_$i.log"
done
rm -rf "$LOGS"
exit $status
