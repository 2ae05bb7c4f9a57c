#!/usr/bin/env bash
# Which of the library's CUDA kernels a command launches, and which it never does: on a GPU
# machine, with fusednorm importable,
#     tools/kernel_coverage.sh python -m pytest tests -k cuda -n 16
# runs the command with tools/kernel_launches.c preloaded (every process it starts logs the
# kernels it launches), then compares them with the kernels in the library's machine code
# (cuobjdump: the CUDA toolkit's or Triton's) and prints the count and each kernel never launched,
# demangled. KERNEL_COVERAGE_OUT=FOLDER keeps launched.txt, all.txt and never.txt there.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d)"
OUTDIR="${KERNEL_COVERAGE_OUT:-$WORK}"
mkdir -p "$WORK/log" "$OUTDIR"
gcc -shared -fPIC -O2 -o "$WORK/kernel_launches.so" "$ROOT/tools/kernel_launches.c" -ldl -lpthread || exit 1
KERNEL_LAUNCH_DIR="$WORK/log" LD_PRELOAD="$WORK/kernel_launches.so" "$@"
rc=$?
# The library fusednorm loads, and cuobjdump as tools/compare_sass.py finds it.
read -r LIB CUOBJDUMP < <(PYTHONPATH="$ROOT/tools${PYTHONPATH:+:$PYTHONPATH}" python -c '
from compare_sass import cuobjdump
from fusednorm._library import library_path
print(library_path(), cuobjdump())')
"$CUOBJDUMP" -res-usage "$LIB" 2>/dev/null | sed -n 's/.*Function \([^:]*\):.*/\1/p' | sort -u > "$OUTDIR/all.txt"
cat "$WORK"/log/kernels.* 2>/dev/null | sort -u | comm -12 - "$OUTDIR/all.txt" > "$OUTDIR/launched.txt"
comm -23 "$OUTDIR/all.txt" "$OUTDIR/launched.txt" > "$OUTDIR/never.txt"
echo "kernel coverage: $(wc -l < "$OUTDIR/launched.txt") of $(wc -l < "$OUTDIR/all.txt") kernels of $LIB launched (command exit status $rc)"
if [ -s "$OUTDIR/never.txt" ]; then
  echo "never launched:"
  if command -v c++filt > /dev/null; then c++filt < "$OUTDIR/never.txt"; else cat "$OUTDIR/never.txt"; fi | sed 's/^/  /'
fi
exit $rc
