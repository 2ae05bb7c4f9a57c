#!/usr/bin/env bash
# The test command: sets up the environment and the build from nothing, then runs the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k group_norm).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# Optional test dependencies of tests/test_convert.py and tests/test_fusion.py (real diffusers and
# timm models), pinned beside the torch they match; never fatal: without them those tests skip
# and say why (the GPU machine is offline, the torch 2.1 venv has no matching torchvision).
if [ "${FUSEDNORM_TEST_EXTRAS:-1}" = 1 ] && ! python -c "import diffusers, timm" 2>/dev/null \
    && python -c "import sys, torch; sys.exit(0 if torch.__version__.startswith('2.14.') else 1)"; then
  echo "== installing the optional test dependencies (diffusers, timm)"
  python -m pip install -q diffusers==0.42.1 timm==1.0.31 torchvision==0.29.1 \
    || echo "== optional test dependencies unavailable: their tests will skip"
fi
# The suite in parallel processes, each taking whole test files (a file's fixtures are built once),
# where pytest-xdist is or can be installed: on 2 cores 329 -> 293 s. FUSEDNORM_TEST_WORKERS sets
# how many processes (default: the cores, at most 4; 1: one process, no pytest-xdist).
workers="${FUSEDNORM_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
if [ "$workers" -gt 1 ] && ! python -c "import xdist" 2>/dev/null; then
  python -m pip install -q --retries 0 --timeout 10 pytest-xdist 2>/dev/null \
    || echo "== pytest-xdist unavailable: the tests run in one process"
fi
parallel=()
if [ "$workers" -gt 1 ] && python -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile)
fi
python -m pytest tests -q -ra ${parallel[@]+"${parallel[@]}"} "$@"
