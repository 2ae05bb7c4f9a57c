# Sourced by scripts/test.sh and scripts/main.sh: makes a virtual environment with torch, the test
# dependencies and fusednorm built into it, then activates it (so `python` is that environment's).
#
# On a machine whose python3 already has torch (the GPU machine, which has no network), that
# python and its torch are used as they are and nothing is downloaded. Elsewhere torch is
# installed into the venv from the package index: FUSEDNORM_TORCH (default torch==2.14.1) says
# which.
#
# Knobs: FUSEDNORM_PYTHON (default python3), FUSEDNORM_VENV (default .venv), FUSEDNORM_TORCH, FUSEDNORM_EXTRA_PIP (more packages to
# install beside torch), MAX_JOBS (default: all cores),
# TORCH_CUDA_ARCH_LIST, FUSEDNORM_CUDA (0: CPU-only build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${FUSEDNORM_PYTHON:-python3}"

if [ -z "${FUSEDNORM_VENV:-}" ] && "$PYTHON" -c "import torch" 2>/dev/null; then
  # This machine's python already has torch (the GPU machine): build against it, offline.
  echo "== using $(command -v "$PYTHON") and its torch"
  mkdir -p "$ROOT/build/bin"
  # A wrapper, not a symlink: a venv's python moved elsewhere by a link no longer finds its venv.
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v "$PYTHON")" > "$ROOT/build/bin/python"
  chmod +x "$ROOT/build/bin/python"
  export PATH="$ROOT/build/bin:$PATH"
  # fusednorm is installed (editable) beside that torch, even where the system marks its python
  # as externally managed.
  export PIP_BREAK_SYSTEM_PACKAGES=1
else
  VENV="${FUSEDNORM_VENV:-$ROOT/.venv}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  fi
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi

if ! python -c "import torch" 2>/dev/null; then
  echo "== installing ${FUSEDNORM_TORCH:-torch==2.14.1} ${FUSEDNORM_EXTRA_PIP:-}"
  # shellcheck disable=SC2086
  python -m pip install -q "${FUSEDNORM_TORCH:-torch==2.14.1}" ${FUSEDNORM_EXTRA_PIP:-}
fi
missing=$(python - <<'PY'
import importlib.util
wanted = {"pytest": "pytest", "hypothesis": "hypothesis", "numpy": "numpy", "ninja": "ninja",
          "setuptools": "setuptools>=64", "wheel": "wheel"}
print(" ".join(spec for mod, spec in wanted.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  echo "== installing $missing"
  # shellcheck disable=SC2086
  python -m pip install -q $missing
fi

echo "== building fusednorm against torch $(python -c 'import torch; print(torch.__version__)')"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
( cd "$ROOT" && python -m pip install -q --no-build-isolation --no-deps -e . )
python -c "import fusednorm, torch; print('fusednorm', fusednorm.__version__, 'loaded; CUDA kernels:', torch._C._dispatch_has_kernel_for_dispatch_key('fusednorm::group_norm_forward', 'CUDA'))"
