"""Builds fusednorm's native library.

One shared library, ``fusednorm/_C*.so``, defines and registers every op.  It does not link
against Python (no Python.h): the package loads it with ``torch.ops.load_library``.

CUDA sources are compiled whenever torch is a CUDA build and a CUDA toolkit is found, with or
without a visible GPU.  Environment knobs:

* ``FUSEDNORM_CUDA=0`` / ``=1``: force a CPU-only build / fail unless CUDA can be built.
* ``TORCH_CUDA_ARCH_LIST``: architectures to build (default: the visible GPUs, else ``DEFAULT_ARCHS``).
* ``MAX_JOBS``: parallel compile jobs (honoured by torch's ninja build).
* ``CUDA_HOME``: the toolkit; found from ``nvcc`` when unset.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

DEFAULT_ARCHS = "8.0;8.6;8.9;9.0+PTX"
HERE = os.path.dirname(os.path.abspath(__file__))


def _toolkit_from_nvcc():
    """The toolkit directory of the nvcc on PATH.

    ``nvcc`` may be a wrapper script outside the toolkit, which is why torch's own guess
    (the parent of nvcc's directory) can be wrong; nvcc's dry run prints the real one as TOP=.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.*)$", out.stdout + out.stderr, re.M)
    return os.path.realpath(m.group(1).strip()) if m else None


def _want_cuda(torch):
    flag = os.environ.get("FUSEDNORM_CUDA", "").strip()
    if flag == "0":
        return False
    if torch.version.cuda is None:
        if flag == "1":
            sys.exit("FUSEDNORM_CUDA=1 but the installed torch is not a CUDA build")
        return False
    if not os.environ.get("CUDA_HOME"):
        toolkit = _toolkit_from_nvcc()
        if toolkit:
            os.environ["CUDA_HOME"] = toolkit
    if os.environ.get("CUDA_HOME") or shutil.which("nvcc"):
        return True
    if flag == "1":
        sys.exit("FUSEDNORM_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME)")
    return False


def _pip_cuda_include_dirs():
    """Headers of the pip-installed CUDA libraries (cuBLAS, cuSPARSE...) that ATen's CUDA
    headers include; a toolkit that holds only the compiler lacks them."""
    dirs = []
    for path in sys.path:
        dirs += glob.glob(os.path.join(path, "nvidia", "*", "include"))
        dirs += glob.glob(os.path.join(path, "nvidia", "*", "*", "include"))
    return sorted({d for d in dirs if os.path.isdir(d)})


def _host_cpu_flags():
    """at::vec flags for the CPU kernels.

    Source builds target the host, like ATen's own kernels, which it dispatches by CPU: 512-bit
    vectors with AVX512 (F, BW, VL, DQ), else 256-bit ones with AVX2 and FMA. On a 2-core AVX512
    machine the AVX512 build took the fused GN+SiLU forward on (8, 320, 32, 32) float32 from 0.71
    to 0.53 ms. FUSEDNORM_CPU_CAPABILITY=avx2 or =default builds narrower (portable) code.
    """
    capability = os.environ.get("FUSEDNORM_CPU_CAPABILITY", "").lower()
    if capability == "default":
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(re.findall(r"^flags\s*:(.*)$", f.read(), re.M)[0].split())
    except (OSError, IndexError):
        return []
    if capability != "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= flags:
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma", "f16c"} <= flags:
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def _cxx_standard(torch):
    """The C++ standard this torch's headers need (C++20 from torch 2.10 on, C++17 before)."""
    aten_h = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")
    try:
        with open(aten_h) as f:
            return "c++20" if "C++20" in f.read() else "c++17"
    except OSError:
        return "c++17"


def _extension():
    import torch
    from torch.utils import cpp_extension

    with_cuda = _want_cuda(torch)
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    std = "-std=" + _cxx_standard(torch)
    # ATen's at::parallel_for is an OpenMP region inlined into the caller: without -fopenmp the
    # CPU kernels would silently run on one thread.
    cxx_flags = ["-O3", std, "-fopenmp", "-fdiagnostics-color=always"] + _host_cpu_flags()
    extra = {"cxx": cxx_flags}
    include_dirs = [os.path.join(HERE, "csrc")]
    if with_cuda:
        # Reload so that CUDA_HOME (possibly set above) is what torch's build helpers use.
        import importlib
        cpp_extension = importlib.reload(cpp_extension)
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
        sources += sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True)) + sorted(
            glob.glob("csrc/cuda/**/*.cpp", recursive=True))
        extra["nvcc"] = ["-O3", std, "-lineinfo", "--expt-relaxed-constexpr"]
        include_dirs += _pip_cuda_include_dirs()
        ext_cls = cpp_extension.CUDAExtension
        print(f"fusednorm: building with CUDA (CUDA_HOME={os.environ.get('CUDA_HOME')}, "
              f"archs={os.environ.get('TORCH_CUDA_ARCH_LIST')})")
    else:
        ext_cls = cpp_extension.CppExtension
        print("fusednorm: building CPU-only")
    ext = ext_cls(
        name="fusednorm._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
        py_limited_api=True,
    )
    return ext, cpp_extension.BuildExtension


def _compiler_matching_the_runtime():
    """Builds with a C++ compiler that links the libstdc++ this process runs on, dynamically.

    The GPU machine sets CXX=/opt/gcc/bin/g++, a wrapper whose library path finds a libstdc++.a
    first: the library then carries a second, uninitialised copy of parts of the C++ runtime,
    and formatting a number into an error message crashed the process.  A compiler
    whose libstdc++ is another build than the loaded one has the same hazard.  When $CXX is such
    a compiler, fall back to the system's.
    """
    cxx = os.environ.get("CXX")
    if not cxx or not os.path.exists("/proc/self/maps"):
        return
    import torch  # noqa: F401  (maps the libstdc++ torch runs on)

    with open("/proc/self/maps") as f:
        loaded = {os.path.realpath(line.split()[-1]) for line in f if "libstdc++.so" in line}

    def run(compiler, *args):
        try:
            return subprocess.run([compiler, *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None

    def links_runtime_statically(compiler):
        # Link a tiny shared library that formats a number and ask whether the library itself
        # defines the stream inserter (copied in from a libstdc++.a) instead of importing it.
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
            with open(src, "w") as f:
                f.write("#include <sstream>\n#include <string>\n"
                        "std::string probe(long x) { std::ostringstream s; s << x; return s.str(); }\n")
            built = run(compiler, "-shared", "-fPIC", "-O1", src, "-o", lib)
            if built is None or built.returncode != 0:
                return False
            symbols = run(shutil.which("nm") or "nm", "-D", "--defined-only", lib)
            return symbols is not None and "_ZNSo9_M_insertIlEERSoT_" in symbols.stdout

    def runtime_of(compiler):
        res = run(compiler, "-print-file-name=libstdc++.so.6")
        out = res.stdout.strip() if res is not None else ""
        return os.path.realpath(out) if os.path.isabs(out) else None

    def suitable(compiler):
        return not links_runtime_statically(compiler) and (not loaded or runtime_of(compiler) in loaded)

    if suitable(cxx):
        return
    for candidate in ("/usr/bin/g++", "/usr/bin/c++", shutil.which("g++"), shutil.which("c++")):
        if candidate and os.path.realpath(candidate) != os.path.realpath(cxx) and suitable(candidate):
            print(f"fusednorm: CXX={cxx} does not link the C++ runtime torch runs on "
                  f"({', '.join(sorted(loaded))}) dynamically: building with {candidate} instead")
            os.environ["CXX"] = candidate
            cc = candidate.replace("g++", "gcc").replace("c++", "cc")
            if os.path.exists(cc):
                os.environ["CC"] = cc
            return
    print(f"fusednorm: warning: CXX={cxx} links the C++ runtime statically or links another "
          "libstdc++ than torch's, and no other compiler was found; errors raised by the library "
          "may crash the process")


def _write_build_info():
    """Records the torch the library is built against, so that importing fusednorm under
    another torch fails with a message naming both versions instead of a symbol error."""
    import torch

    with open(os.path.join(HERE, "ops", "_build_info.py"), "w") as f:
        f.write("# Generated by setup.py; do not edit.\n")
        f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        f.write(f"CUDA_VERSION = {torch.version.cuda!r}\n")


_compiler_matching_the_runtime()
_write_build_info()
ext, build_ext = _extension()
setup(
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext.with_options(no_python_abi_suffix=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
