#!/usr/bin/env bash
# Downloads into .whl/ (ignored) the pure-Python wheels a device call carries, as the GPU machine
# has no network: Liger-Kernel for bench.py's Liger column, pytest-xdist and execnet to spread
# the suite over its cores, diffusers (with importlib_metadata and zipp, the only requirements the
# H200 machine's image lacked on 2026-12-02) for benchmarks/diffusers_bench.py
# (tools/gpu_prebuilt.sh installs them there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
mkdir -p "$ROOT/.whl"
"$PY" -m pip download -q --no-deps -d "$ROOT/.whl" liger-kernel==0.8.5 pytest-xdist==3.6.1 execnet==2.1.2 \
  diffusers==0.42.1 importlib_metadata==10.2.0 zipp==4.1.2
ls "$ROOT/.whl"
