"""The functions of a shared object whose machine code calls libc's exit().

    python tools/exit_calls.py LIBRARY   # prints them; status 1 if there are any

nvcc compiles host code that calls a __device__-only template into a silent exit(1) (docs/design.md,
"Build"); the library's own code never calls exit(). `tools/build_for_gpu_machine.sh` refuses such a
build and `tests/test_library.py` checks the loaded library. Needs objdump (binutils).
"""
import re
import subprocess
import sys


def functions_calling_exit(library):
    """The sorted names of the functions of `library` that call exit() (objdump's disassembly)."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], capture_output=True, text=True,
                             check=True).stdout
    found, function = set(), None
    for line in listing.splitlines():
        head = re.match(r"[0-9a-f]+ <(.*)>:$", line)
        if head:
            function = head.group(1)
        elif re.search(r"\bcall.*<exit@plt>", line):
            found.add(function)
    return sorted(found)


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: python tools/exit_calls.py LIBRARY")
    found = functions_calling_exit(argv[1])
    for name in found:
        print(name)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
