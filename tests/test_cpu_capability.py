"""The CPU kernels' run-time dispatch by CPU capability (docs/design.md, 'CPU capabilities').

The kernels are built once per capability (portable, AVX2, AVX-512 on x86-64) and the one ATen
chooses is used: ATEN_CPU_CAPABILITY moves both. Each capability this machine can run is forced
in a subprocess (ATen reads the variable once, at its first use), which checks that
`_cpu_capability()` names the forced build and, for each narrower than ATen's own choice (whose
kernels the rest of the suite runs), forward and backward against the float64 reference.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fusednorm  # noqa: F401  (loads the ops)
from fusednorm import _library

# Narrowest first, as ATen orders them; the names ATEN_CPU_CAPABILITY takes.
CAPABILITIES = ["default", "avx2", "avx512"]
HERE = os.path.dirname(os.path.abspath(__file__))


def run_python(args, capability):
    """Runs this file's checks in a fresh interpreter with ATEN_CPU_CAPABILITY=`capability`
    (None: unset); returns stdout and stderr, failing the test on a non-zero exit."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, proc.stderr


def reported(capability):
    """(ATen's capability, fusednorm's) under ATEN_CPU_CAPABILITY=`capability`, lower-case."""
    out, _ = run_python(["--report"], capability)
    aten, ours = out.split()
    return aten, ours


def aten_name(name):
    """torch.backends.cpu.get_cpu_capability()'s name as ATEN_CPU_CAPABILITY spells it."""
    name = name.upper()
    return "avx512" if name == "AVX512" else "avx2" if name == "AVX2" else "default"


# What ATen chooses without the variable (the machine's best), and what fusednorm then uses
# (lower if the build was capped with FUSEDNORM_CPU_CAPABILITY).
NATURAL = None


def natural():
    global NATURAL
    if NATURAL is None:
        NATURAL = reported(None)
    return NATURAL


def machine_capabilities():
    aten, _ = natural()
    return CAPABILITIES[:CAPABILITIES.index(aten) + 1]


def expected_for(forced):
    """The build used when ATen runs `forced`: that one, or the widest built if it is narrower."""
    _, widest_used = natural()
    return CAPABILITIES[min(CAPABILITIES.index(forced), CAPABILITIES.index(widest_used))]


def test_op_names_the_capability_in_use():
    name = torch.ops.fusednorm._cpu_capability()
    assert name in CAPABILITIES
    aten = aten_name(torch.backends.cpu.get_cpu_capability())
    # Never wider than ATen's choice (the build may be capped narrower).
    assert CAPABILITIES.index(name) <= CAPABILITIES.index(aten)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_forced_capability_runs_and_matches_reference(capability):
    if capability not in machine_capabilities():
        pytest.skip(f"this CPU runs ATen at {natural()[0]}, not {capability}")
    expected = expected_for(capability)
    if capability == natural()[0]:
        # ATen's own choice: the rest of the suite runs these kernels already; forcing it must
        # change nothing (the kernel checks would repeat theirs, a minute on 2 cores).
        assert reported(capability) == natural()
        return
    out, _ = run_python(["--check", expected], capability)
    assert f"ok {expected}" in out, out


def test_invalid_capability_is_ignored_as_aten_ignores_it():
    # ATen warns and keeps the CPU's own choice; so does fusednorm.
    aten, ours = reported("no-such-capability")
    assert (aten, ours) == natural()


# Mnemonics of VEX / EVEX encoded instructions (AVX and later) and of the AVX-512 mask registers'.
VEX = re.compile(r"^\s*[0-9a-f]+:\s+(v[a-z0-9]+|k(mov|and|or|xor|not|test|ortest|shift|add|unpck)[a-z]*)\b")
EVEX_ONLY = re.compile(r"%zmm|%k[1-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("objdump") is None,
                    reason="needs objdump (binutils) and an ELF library")
def test_no_avx_code_outside_the_capability_builds():
    # docs/design.md, 'CPU capabilities': inline functions of torch's and the standard library's
    # headers that the AVX2 / AVX-512 builds emit get names of their own at build time, so that
    # the linker never lets portable code call a copy compiled for a wider capability. Checked on
    # the built library: a function with AVX instructions is in an AVX2 / AVX512 namespace
    # (fusednorm::cpu::AVX2, at::vec::AVX2, ...) or carries the build's suffix, and one with
    # AVX-512 instructions names AVX512.
    if torch.ops.fusednorm._cpu_capability() == "default" and "avx2" not in machine_capabilities():
        pytest.skip("not an x86-64 CPU with AVX2")
    library = _library.library_path()
    disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], capture_output=True,
                                 text=True, check=True).stdout
    function = None
    avx, avx512 = set(), set()
    for line in disassembly.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
            continue
        if function is None or "@plt" in function:
            continue
        if VEX.match(line):
            avx.add(function)
            if EVEX_ONLY.search(line):
                avx512.add(function)
    assert avx, "no AVX instruction anywhere: were the AVX2 / AVX-512 kernels built?"

    def tagged(name, tags):
        return any(re.search(tag, name) for tag in tags)

    avx_tags = [r"\d+AVX2", r"\d+AVX512", r"\.fusednorm_AVX2", r"\.fusednorm_AVX512"]
    leaked = sorted(f for f in avx if not tagged(f, avx_tags))
    assert not leaked, f"{len(leaked)} functions outside the AVX builds use AVX: {leaked[:10]}"
    leaked = sorted(f for f in avx512 if not tagged(f, [r"\d+AVX512", r"\.fusednorm_AVX512"]))
    assert not leaked, f"{len(leaked)} functions outside the AVX-512 build use AVX-512: {leaked[:10]}"


def check_kernels(expected):
    """Forward and backward of a spread of cases against the float64 reference (test_fused's
    check), under the capability this process runs."""
    sys.path.insert(0, HERE)
    from test_fused import check_fused

    assert torch.ops.fusednorm._cpu_capability() == expected, (
        torch.ops.fusednorm._cpu_capability(), expected, torch.backends.cpu.get_cpu_capability())
    torch.manual_seed(0)
    cases = [
        ((2, 6, 5, 3), 3),      # tails shorter than any vector
        ((3, 96, 17, 9), 6),    # odd spatial size: partial vectors at every row's end
        ((2, 8, 70, 70), 2),    # groups of several 4096-element blocks (Chan merges)
        ((4, 40), 5),           # one element per channel
        ((2, 20, 3, 4, 5), 4),  # rank 5
    ]
    operand_sets = [[], ["scale", "shift", "residual", "multiplier"]]
    for (shape, groups) in cases:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            for layout in ("contiguous", "channels_last"):
                for activation in (None, "silu", "gelu", "mish"):
                    for names in operand_sets:
                        check_fused(shape, groups, dtype, layout, names, activation, "cpu")
    print(f"ok {expected}")


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        print(aten_name(torch.backends.cpu.get_cpu_capability()), torch.ops.fusednorm._cpu_capability())
    elif sys.argv[1] == "--check":
        check_kernels(sys.argv[2])
