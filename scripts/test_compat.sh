#!/usr/bin/env bash
# Builds fusednorm against another torch and runs the core test subset with it:
#   scripts/test_compat.sh torch==2.1.2
# The tracked tree is copied to a scratch directory so that this build (CPU-only: old torch
# wheels want an older CUDA than the toolkit here) never mixes with the main one. The virtual
# environment is kept under ~/.cache/fusednorm, so torch is downloaded only once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SPEC="${1:?usage: scripts/test_compat.sh torch==VERSION [pytest args]}"
shift
NAME="${SPEC//[^A-Za-z0-9.]/_}"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
(cd "$ROOT" && git ls-files -z | xargs -0 tar cf - | tar xf - -C "$SCRATCH")

export FUSEDNORM_VENV="${FUSEDNORM_COMPAT_VENV:-$HOME/.cache/fusednorm/venv-$NAME}"
export FUSEDNORM_TORCH="$SPEC" FUSEDNORM_CUDA=0
# torch < 2.3 was built against NumPy 1.
export FUSEDNORM_EXTRA_PIP="${FUSEDNORM_EXTRA_PIP:-numpy<2}"
mkdir -p "$(dirname "$FUSEDNORM_VENV")"
# The venv must not see this machine's own torch or NumPy: no system site-packages.
if [ ! -x "$FUSEDNORM_VENV/bin/python" ]; then python3 -m venv "$FUSEDNORM_VENV"; fi
cd "$SCRATCH"
# shellcheck disable=SC1091
source scripts/setup_env.sh
python -m pytest tests/test_group_norm.py tests/test_instance_norm.py tests/test_fused.py tests/test_modules.py tests/test_integration.py -q -ra "$@"
