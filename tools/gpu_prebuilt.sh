#!/usr/bin/env bash
# One device call on a library built here by tools/build_for_gpu_machine.sh (no build on the
# GPU machine: ~200 s of device time saved a call). Carry `gpu_build` and `.whl` (the wheels of
# tools/device_wheels.sh; the GPU machine has no network), then run on the device:
#     tools/gpu_prebuilt.sh test [ARGS...]   # the whole suite (or pytest ARGS: -k, files),
#                                              # spread over the cores with pytest-xdist when
#                                              # its wheel is carried; stopped by
#                                              # PYTEST_TIMEOUT, it lists the tests it did not
#                                              # finish in unfinished.txt (ARGS of a next call)
#     tools/gpu_prebuilt.sh sanitize         # tools/sanitize.sh (memcheck, racecheck)
#     tools/gpu_prebuilt.sh bench FILTER S   # bench.py on the cases matching FILTER, S seconds
#     tools/gpu_prebuilt.sh paths ARGS...    # tools/compare_paths.py ARGS
#     tools/gpu_prebuilt.sh py FILE ARGS...  # any script, with fusednorm and benchmarks/ importable
#     tools/gpu_prebuilt.sh ncu SPEC...      # Nsight Compute metrics (bytes, L2 sectors, warps,
#                                              # occupancy limits) of the kernels of each
#                                              # tools/profile_kernels.py argument list SPEC
# GPU_BUILD=DIR takes DIR/_C.so instead of gpu_build's (a second build carried for an A/B run).
# Logs and results go to $OUT (the device tool's output folder) or results/. Each subcommand fits
# one call of 600 s (every subcommand was run on an H100 this way).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/results}"
mkdir -p "$OUT"
cd "$ROOT"
BUILD="${GPU_BUILD:-gpu_build}"  # another folder of a build: A/B runs in one call
USAGE="usage: tools/gpu_prebuilt.sh test [ARGS...] | sanitize | bench FILTER SECONDS | paths ARGS... | py FILE ARGS... | ncu SPEC..."
# Both checks before the copy below, which replaces this tree's ops/_C.so with the GPU machine's.
case "${1:-}" in
  test | sanitize | bench | paths | py | ncu) ;;
  *) echo "$USAGE" >&2; exit 2 ;;
esac
command -v nvidia-smi > /dev/null || { echo "no nvidia-smi: this runs on the GPU machine (it puts $BUILD's library in ops/)" >&2; exit 1; }
[ -f "$BUILD/_C.so" ] || { echo "no $BUILD/_C.so: run tools/build_for_gpu_machine.sh and carry $BUILD" >&2; exit 1; }
export CXX=/usr/bin/g++ CC=/usr/bin/gcc PYTHONUNBUFFERED=1  # as scripts/setup_env.sh picks: the machine's CXX links a static libstdc++
cp "$BUILD/_C.so" gpu_build/_build_info.py ops/
# fusednorm importable without installing it: a folder whose `fusednorm` is this tree's ops/.
SHIM="$(mktemp -d)"
ln -s "$ROOT/ops" "$SHIM/fusednorm"
WHEELS="$(mktemp -d)"
if compgen -G ".whl/*.whl" > /dev/null; then
  python -m pip install -q --no-deps --target "$WHEELS" .whl/*.whl > /dev/null 2>&1
fi
export PYTHONPATH="$SHIM:$ROOT/benchmarks:$WHEELS"
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, fusednorm; print('torch', torch.__version__)" || exit 1

case "${1:-}" in
  test)
    shift
    workers=()
    python -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-12}")
    SECONDS=0
    targets=("$@")
    [ ${#targets[@]} -gt 0 ] || targets=(tests)
    # -v: a line a test, so that a run the timeout stops still says which tests it finished.
    # The tests that take a `device` run on the GPU alone (CI runs their CPU variants), unless
    # FUSEDNORM_TEST_DEVICES says otherwise (tests/conftest.py).
    export FUSEDNORM_TEST_DEVICES="${FUSEDNORM_TEST_DEVICES-cuda}"
    CI=true timeout "${PYTEST_TIMEOUT:-420}" python -m pytest "${targets[@]}" -v -ra -p no:cacheprovider \
      "${workers[@]}" --durations=15 > "$OUT/pytest.log" 2>&1
    rc=$?
    echo "pytest exit code $rc after $SECONDS s"
    # The summary, not -v's line a test (xdist's "[gwN] ..." or "tests/...").
    grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest.log" | grep -v -E "^(\[gw|tests/)" | tail -15
    if [ "$rc" -eq 124 ]; then
      # Stopped by the timeout: the tests it had not finished (running or not started), to run
      # in the next call.
      CI=true python -m pytest "${targets[@]}" --collect-only -q -p no:cacheprovider 2> /dev/null |
        grep "::" > "$OUT/collected.txt"
      python - "$OUT/pytest.log" "$OUT/collected.txt" "$OUT/unfinished.txt" << 'PY'
import re
import sys

log, collected, unfinished = sys.argv[1:]
# A test's line: "ID STATUS [ n%]", or under xdist "[gwN] [ n%] STATUS ID" (IDs may hold spaces).
status = "(?:PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)"
done = set()
for line in open(log):
    m = re.match(rf"(tests/\S.*?) {status}\b", line) or re.match(rf"\[gw\d+\] \[ *\d+%\] {status} (tests/.*?)\s*$", line)
    if m:
        done.add(m.group(1))
left = [t.strip() for t in open(collected) if t.strip() and t.strip() not in done]
open(unfinished, "w").write("".join(t + "\n" for t in left))
print(f"timed out: {len(done)} tests reported, {len(left)} unfinished (unfinished.txt):")
print("\n".join(left[:30]) + ("\n..." if len(left) > 30 else ""))
PY
    fi
    ;;
  sanitize)
    timeout "${SANITIZER_TIMEOUT:-540}" tools/sanitize.sh > "$OUT/sanitizer.log" 2>&1
    echo "sanitizer exit code: $?"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases done" "$OUT/sanitizer.log"
    ;;
  bench)
    python benchmarks/bench.py --out "$OUT" --filter "${2:-}" --budget "${3:-300}" 2>&1 | grep -vi warning | tail -70
    ;;
  paths)
    shift
    python tools/compare_paths.py "$@" 2>&1 | grep -vi warning
    ;;
  py)
    shift
    python "$@" 2>&1 | grep -vi warning
    ;;
  ncu)
    shift
    metrics=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum
    metrics+=,lts__t_sectors_srcunit_tex_op_write.sum,gpu__time_duration.sum
    metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed
    metrics+=,launch__registers_per_thread,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers
    metrics+=,launch__grid_size
    i=0
    for spec in "$@"; do
      i=$((i + 1))
      echo "== ncu $i: $spec"
      eval ncu --profile-from-start off --clock-control none --metrics "$metrics" \
        python tools/profile_kernels.py "$spec" > "$OUT/ncu_$i.txt" 2>&1
      grep -E "^  [a-z_]+.*\(|dram__|lts__|gpu__time|warps_active|registers|occupancy_limit|grid_size" "$OUT/ncu_$i.txt" | head -60
    done
    ;;
  *)
    echo "$USAGE" >&2
    exit 2
    ;;
esac
