# Sourced by scripts/test.sh and scripts/main.sh: makes a virtual environment with torch, the test
# dependencies and fusednorm built into it, then activates it (so `python` is that environment's).
#
# On a machine whose python3 already has torch (the GPU machine, which has no network), that
# python and its torch are used as they are and nothing is downloaded. Elsewhere torch is
# installed into the venv from the package index: FUSEDNORM_TORCH (default torch==2.14.1) says
# which.
#
# The build is skipped when nothing it depends on changed since the last one (a stamp in
# build/: the hash of the native sources and build files, the torch version and the build
# knobs) and the installed fusednorm imports: the second of the two commands reuses the first
# one's build. FUSEDNORM_REBUILD=1 forces a build. While building, the compiler's progress is
# shown (ninja's [n/m] line as each translation unit finishes, and the time every minute); the
# full log is build/pip-install.log, whose tail is printed if the build fails.
#
# On a machine without a GPU, CUDA code is compiled for one architecture (sm_90) unless
# TORCH_CUDA_ARCH_LIST says otherwise, and to PTX without optimisation
# (FUSEDNORM_CUDA_COMPILE_CHECK=1, docs/install.md "Compile check"): the kernels cannot run there,
# so the compile only checks that they build, and each further architecture adds minutes on few
# cores.
#
# Knobs: FUSEDNORM_PYTHON (default python3), FUSEDNORM_VENV (default .venv), FUSEDNORM_TORCH, FUSEDNORM_EXTRA_PIP (more packages to
# install beside torch), MAX_JOBS (default: all cores),
# TORCH_CUDA_ARCH_LIST, FUSEDNORM_CUDA (0: CPU-only build), FUSEDNORM_CUDA_COMPILE_CHECK, FUSEDNORM_REBUILD (1: build even if
# the stamp matches).
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
  python -m pip install --progress-bar on "${FUSEDNORM_TORCH:-torch==2.14.1}" ${FUSEDNORM_EXTRA_PIP:-} \
    | grep --line-buffered -vE '^(Requirement already satisfied|Collecting|  Using cached|Using cached)' || true
  python -c "import torch" || { echo "== torch could not be installed" >&2; exit 1; }
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

# torch.compile and AOTInductor compile C++ with $CXX too: it must link the C++ runtime this python
# runs on, as the library's own compiler must (setup.py, _compiler_matching_the_runtime, which picks
# the system's otherwise). A package built by the GPU machine's /opt/gcc/bin/g++, which links a
# static libstdc++, crashed the export examples when loaded. The same choice for the whole job.
if [ -n "${CXX:-}" ]; then
  eval "$(cd "$ROOT" && python - <<'PY'
import contextlib, importlib.util, os, shlex, sys
spec = importlib.util.spec_from_file_location("fusednorm_setup", "setup.py")
setup_py = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup_py)
before = os.environ.get("CXX")
with contextlib.redirect_stdout(sys.stderr):
    setup_py._compiler_matching_the_runtime()
if os.environ.get("CXX") != before:
    print("export " + " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("CXX", "CC") if k in os.environ))
PY
  )"
fi

export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && [ "${FUSEDNORM_CUDA:-}" != 0 ] \
    && python -c "import sys, torch; sys.exit(0 if torch.version.cuda and not torch.cuda.is_available() else 1)"; then
  export TORCH_CUDA_ARCH_LIST=9.0 FUSEDNORM_CUDA_COMPILE_CHECK="${FUSEDNORM_CUDA_COMPILE_CHECK:-1}"
  echo "== no GPU visible: CUDA code compiled for sm_90 only, to PTX without optimisation, as a compile check (set TORCH_CUDA_ARCH_LIST for others, FUSEDNORM_CUDA_COMPILE_CHECK=0 for machine code)"
fi

# What the build depends on: the native sources and build files, the torch it is built against,
# the interpreter and the build knobs. The same stamp means the same library.
build_stamp() {
  (cd "$ROOT" && python - <<'PY'
import glob, hashlib, os, sys
import torch
h = hashlib.sha256()
files = sorted(set(glob.glob("csrc/**/*", recursive=True)) | {"setup.py", "pyproject.toml"})
for path in files:
    if os.path.isfile(path):
        h.update(path.encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
knobs = ("FUSEDNORM_CUDA", "FUSEDNORM_CUDA_COMPILE_CHECK", "TORCH_CUDA_ARCH_LIST", "FUSEDNORM_CPU_CAPABILITY", "CXX", "CC", "CUDA_HOME")
h.update(repr([sys.executable, torch.__version__, torch.version.cuda,
               [(k, os.environ.get(k)) for k in knobs]]).encode())
print(h.hexdigest())
PY
  )
}
# The installed fusednorm is this tree's (editable install) and its library loads.
installed_here() {
  python -c "import os, sys, fusednorm; sys.exit(0 if os.path.realpath(fusednorm.__file__).startswith(os.path.realpath(sys.argv[1])) else 1)" \
    "$ROOT/ops" 2>/dev/null
}

STAMP="$ROOT/build/fusednorm-build.stamp"
stamp="$(build_stamp)"
if [ "${FUSEDNORM_REBUILD:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp" ] && installed_here; then
  echo "== fusednorm is built and unchanged since the last build (build/fusednorm-build.stamp): not rebuilding"
else
  echo "== building fusednorm against torch $(python -c 'import torch; print(torch.__version__)') (MAX_JOBS=$MAX_JOBS; log: build/pip-install.log)"
  mkdir -p "$ROOT/build"
  rm -f "$STAMP"
  LOG="$ROOT/build/pip-install.log"
  started=$(date +%s)
  # A line a minute, so that a long compile (one translation unit can take minutes) is visibly alive.
  ( while sleep 60; do echo "   ... still compiling, $(( ($(date +%s) - started) / 60 )) min"; done ) &
  ticker=$!
  # -v streams the build's output: ninja's [n/m] line as each translation unit finishes, shortened
  # to the source's path here; everything goes to the log.
  set +e
  : > "$LOG"  # exists before tail opens it
  ( cd "$ROOT" && python -m pip install -v --no-build-isolation --no-deps -e . ) >> "$LOG" 2>&1 &
  pip_pid=$!
  tail -n +1 --pid="$pip_pid" -f "$LOG" \
    | grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\]|^ *fusednorm: ' \
    | sed -u -E 's#^ *(\[[0-9]+/[0-9]+\]).* -c ([^ ]+).*#   \1 \2#; s#^ *(\[[0-9]+/[0-9]+\]) ([^ ]*/)?(c\+\+|g\+\+|gcc|cc|ld)?[^ ]* .*-o ([^ ]+).*#   \1 linking \4#; s#^ *fusednorm: #   #; s#'"$ROOT"'/##g'
  wait "$pip_pid"
  status=$?
  kill "$ticker" 2>/dev/null
  wait "$ticker" 2>/dev/null
  set -e
  if [ "$status" != 0 ]; then
    echo "== the build failed (exit $status); the end of build/pip-install.log:" >&2
    tail -n 60 "$LOG" >&2
    exit "$status"
  fi
  echo "== built in $(( $(date +%s) - started )) s"
  echo "$stamp" > "$STAMP"
fi
python -c "import fusednorm, torch; print('fusednorm', fusednorm.__version__, 'loaded; CUDA kernels:', torch._C._dispatch_has_kernel_for_dispatch_key('fusednorm::group_norm_forward', 'CUDA'))"
