#!/usr/bin/env bash
# The test command: sets up the environment and the build from nothing, then runs the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k group_norm).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python -m pytest tests -q -ra "$@"
