"""CI check: every C++ host source and header under csrc/ compiles on its own (`-fsyntax-only`).

Builds with few jobs compile the host sources as one generated unit (setup.py, host_sources_unit)
and builds with many compile them one each; CI builds with two jobs, so a source that leans on an
#include of the file before it in that unit would pass CI and fail a 16-core build. Headers are
checked alone too (a unit of one #include each): each must include what it uses. The CPU kernel
headers are checked for the portable capability, as their wrappers define it. CUDA sources are not
covered (nvcc has no syntax-only mode cheap enough to run on every file).

    python .ci/compile_alone.py   # from the repository root, with torch importable; exits 1 on a failure
"""

import concurrent.futures
import glob
import importlib.util
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_setup_py():
    spec = importlib.util.spec_from_file_location("fusednorm_setup", os.path.join(ROOT, "setup.py"))
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)
    return setup_py


def compiler_flags(setup_py):
    # torch's C++ include folders, as torch.utils.cpp_extension.include_paths() gives them for a
    # CPU build (importing that module warns on machines without CUDA).
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    includes = [os.path.join(ROOT, "csrc"), torch_include, os.path.join(torch_include, "torch", "csrc", "api", "include")]
    return (["-fsyntax-only", "-std=" + setup_py._cxx_standard(torch), "-fopenmp"]
            + ["-I" + p for p in includes] + setup_py._host_cpu_flags())


def units():
    """(label, source text, extra flags) for each host source and header."""
    portable = ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]
    groups = [("*.cpp", []), ("cpu/*.cpp", []), ("*.h", []), ("cpu/*.h", []), ("cpu/kernels/*.h", portable)]
    return [(os.path.relpath(path, ROOT), f'#include "{path}"\n', extra)
            for pattern, extra in groups
            for path in sorted(glob.glob(os.path.join(ROOT, "csrc", pattern)))]


def check(cxx, flags, folder, unit):
    label, text, extra = unit
    src = os.path.join(folder, label.replace(os.sep, "_") + ".cpp")
    with open(src, "w") as f:
        f.write(text)
    res = subprocess.run([cxx, *flags, *extra, src], capture_output=True, text=True)
    return label, res.returncode, res.stderr


def main():
    cxx = os.environ.get("CXX", "c++")
    setup_py = load_setup_py()
    flags = compiler_flags(setup_py)
    jobs = setup_py._build_jobs()  # MAX_JOBS, else the cores, as the build itself
    todo, failed = units(), []
    with tempfile.TemporaryDirectory() as folder, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for label, rc, err in pool.map(lambda u: check(cxx, flags, folder, u), todo):
            if rc != 0:
                failed.append(label)
                print(f"compile_alone: {label} does not compile on its own:\n{err[-4000:]}")
    print(f"compile_alone: {len(todo) - len(failed)} of {len(todo)} host sources and headers compile on their own")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
