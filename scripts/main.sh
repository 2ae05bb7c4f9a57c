#!/usr/bin/env bash
# The main job: sets up the environment and the build, runs every export example, then the
# benchmark on whatever device is present (results under results/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
for example in export_examples/[!_]*.py; do
  echo "== $example"
  python "$example"
done
python benchmarks/bench.py --out results "$@"
# End-to-end diffusers VAE decode and UNet step (eager, convert, compile, compile + fusion); says
# so and skips when diffusers is not installed.
python benchmarks/diffusers_bench.py --out results
