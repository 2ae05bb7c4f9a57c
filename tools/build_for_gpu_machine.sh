#!/usr/bin/env bash
# Builds fusednorm's native library here, on a machine without a GPU, for the project's GPU
# machine. A device call then carries it instead of spending ~200 s of device time on the build.
#
# It builds the current working tree's tracked files against pip's wheel of the GPU machine's
# torch: FUSEDNORM_DEVICE_TORCH, default 2.11.0, whose wheel is 2.11.0+cu130 like the one there.
# It builds for sm_90 only, with AVX2 CPU code (the GPU host's CPU is not known to have AVX512).
# Output: gpu_build/_C.so (debug information stripped) and gpu_build/_build_info.py. On the GPU
# machine (carry gpu_build), before importing fusednorm:
#     cp gpu_build/_C.so gpu_build/_build_info.py ops/
# Needs nvcc (CUDA 13) and the project's .venv. That venv's nvidia/cu13 wheel provides libcudart,
# and its packages provide torch's Python requirements.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${FUSEDNORM_DEVICE_TORCH:-2.11.0}"
WORK="${TMPDIR:-/tmp}/fusednorm-gpu-build"
VENV="$WORK/venv-torch-$TORCH_VERSION"
PROJECT_PY="$ROOT/.venv/bin/python"
[ -x "$PROJECT_PY" ] || { echo "no $PROJECT_PY: run scripts/test.sh once first" >&2; exit 1; }
command -v nvcc > /dev/null || { echo "nvcc not found" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "== torch==$TORCH_VERSION into $VENV"
  "$("$PROJECT_PY" -c 'import sys; print(sys.executable)')" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps "torch==$TORCH_VERSION"
  # torch's own requirements from the project's venv (and the system site-packages that venv
  # sees, where they may be), searched after this venv's torch.
  "$PROJECT_PY" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith('site-packages')))" \
    > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_project.pth"
fi

# libcudart.so for the linker (the nvidia wheel ships only libcudart.so.13, the soname the
# library then needs, as a build on the GPU machine does).
CUDART_DIR="$("$PROJECT_PY" -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13', 'lib'))")"
mkdir -p "$WORK/link"
ln -sf "$CUDART_DIR/libcudart.so.13" "$WORK/link/libcudart.so"

# Over the previous copy: a file whose bytes differ from the copy's is copied anew, its
# modification time now, the others left alone, so that ninja (whose build folder stays there)
# recompiles exactly the translation units whose sources changed. (A copy with the files' own
# times missed a source edited while the previous build ran: its objects, newer than the edit,
# were kept.)
echo "== copying the tracked files of $ROOT"
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z | while IFS= read -r -d '' f; do
  if ! cmp -s "$f" "$WORK/src/$f"; then
    mkdir -p "$WORK/src/$(dirname "$f")"
    cp "$f" "$WORK/src/$f"
  fi
done)
# Sources no longer tracked must not stay behind (setup.py globs csrc/).
(cd "$WORK/src" && find csrc -type f | grep -vxF -f <(git -C "$ROOT" ls-files csrc) | xargs -r rm -f) || true

echo "== building against torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
(cd "$WORK/src" && LIBRARY_PATH="$WORK/link${LIBRARY_PATH:+:$LIBRARY_PATH}" FUSEDNORM_CUDA=1 \
  FUSEDNORM_CPU_CAPABILITY=avx2 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "$VENV/bin/python" setup.py -q build_ext --inplace > "$WORK/build.log" 2>&1) ||
  { tail -30 "$WORK/build.log"; exit 1; }

mkdir -p "$ROOT/gpu_build"
strip -g -o "$ROOT/gpu_build/_C.so" "$WORK"/src/ops/_C*.so
cp "$WORK/src/ops/_build_info.py" "$ROOT/gpu_build/"
# Host code calling a __device__-only template becomes exit(1) under nvcc, which ends the GPU
# run without a message (docs/design.md, "Build"): say so before a device call.
if ! callers="$(python3 "$ROOT/tools/exit_calls.py" "$ROOT/gpu_build/_C.so")"; then
  echo "gpu_build/_C.so calls exit(): host code calls a __device__ function (docs/design.md, \"Build\"):" >&2
  echo "$callers" | head -5 >&2
  exit 1
fi
ls -la "$ROOT/gpu_build"
