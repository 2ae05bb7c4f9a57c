"""Compares the machine code (SASS) of the CUDA kernels of two builds of the library, kernel by
kernel, and lists those that differ. A CUDA change meant to leave the kernels alone (a
refactor) is proven so without a GPU when no kernel differs (where instantiations were added or
removed, it lists them and compares the kernels both builds have):

    python tools/compare_sass.py before/_C.so gpu_build/_C.so

Kernels are paired by name, the hash of the source file that names of the anonymous namespace
carry left out (it differs between builds of different sources, and kernels move between
translation units); where the names do not pair up one to one, in the order cuobjdump lists
them. Needs cuobjdump: the CUDA toolkit's, or the copy Triton ships (found through the `triton`
package).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys


def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(bundled):
            return bundled
    except ImportError:
        pass
    sys.exit("cuobjdump not found: install the CUDA toolkit or triton")


def demangle(name):
    """The kernel's C++ signature where c++filt is present, else its mangled name."""
    filt = shutil.which("c++filt")
    if filt is None:
        return name
    return subprocess.run([filt, name], capture_output=True, text=True).stdout.strip() or name


def stable_name(name):
    """The mangled name without the per-file hash of an anonymous namespace: nvcc names one
    `<length>_GLOBAL__N__<hash>_<length>_<file>_<hash>_<id>`, the leading length counting the rest."""
    out, at = [], 0
    for m in re.finditer(r"(\d+)_GLOBAL__N__", name):
        if m.start() < at:
            continue
        out.append(name[at:m.start()] + "_GLOBAL__N_")
        at = m.end(1) + int(m.group(1))
    return "".join(out) + name[at:]


def pairs(a, b):
    """[(name, instructions before, instructions after), ...]: by stable name where the names pair
    up one to one, else in order."""
    by_name_a = {stable_name(n): i for n, i in a}
    by_name_b = {stable_name(n): i for n, i in b}
    if len(by_name_a) == len(a) and by_name_a.keys() == by_name_b.keys():
        return [(n, by_name_a[stable_name(n)], by_name_b[stable_name(n)]) for n, _ in a]
    print("kernel names do not pair up one to one: pairing in cuobjdump's order")
    return [(na, ia, ib) for (na, ia), (_, ib) in zip(a, b)]


def kernels(library):
    """[(mangled name, [instruction, ...]), ...] in cuobjdump's order."""
    out = subprocess.run([cuobjdump(), "-sass", library], capture_output=True, text=True, check=True).stdout
    result = []
    for line in out.splitlines():
        if "Function :" in line:
            result.append((line.split("Function :")[1].strip(), []))
        elif result:
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
            if m:
                result[-1][1].append(m.group(1).strip())
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    a, b = kernels(args.before), kernels(args.after)
    names_a, names_b = {stable_name(n) for n, _ in a}, {stable_name(n) for n, _ in b}
    if len(a) != len(b) or names_a != names_b:
        if len(names_a) < len(a) or len(names_b) < len(b):
            print(f"{len(a)} kernels against {len(b)}: the instantiations changed")
            return 1
        # Instantiations added or removed: compare the kernels both builds have.
        for label, only in (("only before", names_a - names_b), ("only after", names_b - names_a)):
            for name in sorted(only):
                print(f"{label}: {demangle(name)}")
        a = [(n, i) for n, i in a if stable_name(n) in names_b]
        b = [(n, i) for n, i in b if stable_name(n) in names_a]
    differ = [(name, len(ia), len(ib)) for name, ia, ib in pairs(a, b) if ia != ib]
    for name, na, nb in differ:
        print(f"differs: {demangle(name)} ({na} -> {nb} instructions)")
    print(f"{len(a)} kernels in both, {len(differ)} differ")
    return 1 if differ or names_a != names_b else 0


if __name__ == "__main__":
    sys.exit(main())
