#!/usr/bin/env bash
# The main job: sets up the environment and the build (reused when nothing changed), runs every
# export example, then the benchmarks on whatever device is present. Results, under results/:
# bench_<device>.{md,json,svg} (the kernel suite: table, data, chart), peer_cuda.txt (on a GPU:
# against the simple Triton design) and diffusers_<device>.json (end-to-end models, when diffusers
# is installed). Extra arguments go to benchmarks/bench.py,
# e.g. scripts/main.sh --no-compile --filter "VAE".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
for example in export_examples/[!_]*.py; do
  echo "== $example"
  python "$example"
done
echo "== benchmarks/bench.py $*"
python benchmarks/bench.py --out results "$@"
# On a GPU: fusednorm against torch.compile and the simple Triton two-pass design, GN+SiLU rows.
if python -c "import sys, torch, triton; sys.exit(not torch.cuda.is_available())" 2> /dev/null; then
  echo "== benchmarks/peer_bench.py"
  python benchmarks/peer_bench.py | tee results/peer_cuda.txt
fi
# End-to-end diffusers models: SD VAE decode at 512 and 1024 px, SD1.5 UNet step at batch 2 and 8,
# HunyuanVideo VAE decode (eager, convert, compile, compile + fusion, and on a GPU both compiles
# with CUDA graphs); says so and skips when diffusers is not installed, and says so when it runs
# tiny configs on a CPU. All of it takes long on a GPU (every compiled variant compiles anew): its
# --workloads / --variants run a part (see its docstring); the JSON is rewritten after each workload.
echo "== benchmarks/diffusers_bench.py"
python benchmarks/diffusers_bench.py --out results
