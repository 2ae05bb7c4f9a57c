#!/usr/bin/env bash
# One call on the GPU machine: build, then Nsight Compute reports of fusednorm's kernels on
# benchmark cases. Each argument is one profile_kernels.py argument list, e.g.
#   tools/gpu_profile.sh '--filter "VAE GN+SiLU" --shape 1,128,512,512' '--filter "problem 3"'
# Reports go to $OUT/ncu_<i>.txt (or results/).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/results}"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONUNBUFFERED=1
if [ "${CXX:-}" = /opt/gcc/bin/g++ ] && [ -x /usr/bin/g++ ]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc  # as scripts/setup_env.sh picks: the machine's CXX links a static libstdc++
fi
if ! python -c "import fusednorm" 2>/dev/null; then
  # shellcheck disable=SC1091
  source scripts/setup_env.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  set +e
fi
NCU=(ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy
     --section LaunchStats --section MemoryWorkloadAnalysis)
i=0
for spec in "$@"; do
  i=$((i + 1))
  echo "== ncu $i: $spec" | tee "$OUT/ncu_$i.txt"
  eval "${NCU[*]} python tools/profile_kernels.py $spec" >> "$OUT/ncu_$i.txt" 2>&1
  # The summary lines that matter most, per kernel.
  grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Grid Size" "$OUT/ncu_$i.txt" | head -80
done
