"""Builds fusednorm's native library.

One shared library, ``fusednorm/_C*.so``, defines and registers every op.  It does not link
against Python (no Python.h): the package loads it with ``torch.ops.load_library``.  It is
compiled against the installed torch and only loads under that torch, which is why torch is not a
build requirement and the built package requires exactly that torch (docs/install.md).

CUDA sources are compiled whenever torch is a CUDA build and a CUDA toolkit of the same CUDA major
version is found, with or without a visible GPU.  Environment knobs:

* ``FUSEDNORM_CUDA=0`` / ``=1``: force a CPU-only build / fail unless CUDA can be built.
* ``TORCH_CUDA_ARCH_LIST``: architectures to build (default: the visible GPUs; without one, every
  architecture both the toolkit and torch support, PTX for the newest; see ``default_arch_list``).
* ``MAX_JOBS``: parallel compile jobs (honoured by torch's ninja build).
* ``CUDA_HOME``: the toolkit; found from ``nvcc`` when unset.

Metadata-only commands (``egg_info``, ``dist_info``, ``sdist``) work without torch; building the
library without torch stops at once with one sentence saying what to do.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import setuptools
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The architecture list when neither nvcc nor torch can say which they support.
FALLBACK_ARCHS = "8.0;8.6;8.9;9.0+PTX"
# The oldest architecture the kernels compile for: the team kernels' barrier loads are
# ld.acquire.gpu, an sm_70 instruction (csrc/cuda/team_grid.cuh, team_load_acquire).
MIN_CUDA_ARCH = (7, 0)
LICENSE_EXPRESSION = "BSD-3-Clause"

# setup.py commands that compile the library, hence need torch (the others only write metadata
# or an sdist).
_BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist", "bdist_egg", "editable_wheel",
                   "develop", "install"}
NO_TORCH_MESSAGE = (
    "fusednorm: torch is not importable in this build environment, and fusednorm's native "
    "library must be compiled against the very torch it will run with, so install torch first "
    "and then build without pip's isolated build environment: "
    "pip install --no-build-isolation ."
)


def _import_torch_or_exit(argv):
    """torch, or None for commands that need no compiler; exits with NO_TORCH_MESSAGE when a
    command that compiles cannot import torch (pip's isolated build environment has none)."""
    try:
        import torch
    except ImportError:
        if _BUILD_COMMANDS.intersection(argv[1:]):
            sys.exit(NO_TORCH_MESSAGE)
        return None
    return torch


def torch_requirement(torch_version):
    """The requirement a built package puts on torch: exactly the release it was compiled
    against (the library's C++ ABI is that torch's; fusednorm/_library.py refuses any other)."""
    if torch_version is None:
        return "torch>=2.1"
    return "torch==" + torch_version.split("+")[0]


def license_options(setuptools_version):
    """setup() keywords declaring the BSD-3-Clause license: PEP 639's License-Expression where
    setuptools supports it (>= 77), the older License field otherwise (kept so that the build
    works with the setuptools already installed; pyproject.toml marks the license dynamic)."""
    major = int(re.match(r"\d+", setuptools_version).group())
    if major >= 77:
        return {"license_expression": LICENSE_EXPRESSION, "license_files": ["LICENSE"]}
    return {"license": LICENSE_EXPRESSION, "license_files": ["LICENSE"]}


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


def _run(*cmd):
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout + res.stderr if res.returncode == 0 else None


def _nvcc():
    home = os.environ.get("CUDA_HOME")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def toolkit_cuda_version(nvcc_version_output):
    """'13.0' from ``nvcc --version``'s output ("Cuda compilation tools, release 13.0, V13.0.88")."""
    m = re.search(r"release (\d+)\.(\d+)", nvcc_version_output or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def cuda_build_decision(flag, torch_cuda, toolkit_found, toolkit_cuda):
    """(build CUDA?, error message or None) from FUSEDNORM_CUDA's value, torch.version.cuda, whether
    a toolkit was found and its version (None when unknown).

    A toolkit whose CUDA major differs from torch's is an error, not a silent CPU-only build: a
    user who has a GPU and gets no CUDA kernels would only find out at run time, while the error
    names both versions and the two ways out (docs/install.md, "CUDA toolkit and torch").
    """
    flag = (flag or "").strip()
    if flag == "0":
        return False, None
    if torch_cuda is None:
        if flag == "1":
            return False, "FUSEDNORM_CUDA=1 but the installed torch is not a CUDA build"
        return False, None
    if not toolkit_found:
        if flag == "1":
            return False, "FUSEDNORM_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME)"
        return False, None
    if toolkit_cuda is not None and toolkit_cuda.split(".")[0] != torch_cuda.split(".")[0]:
        return False, (
            f"fusednorm: the CUDA toolkit found is CUDA {toolkit_cuda} but torch "
            f"was built with CUDA {torch_cuda}, and extensions cannot be built across CUDA major "
            f"versions: point CUDA_HOME at a CUDA {torch_cuda.split('.')[0]}.x toolkit, or build "
            "CPU-only with FUSEDNORM_CUDA=0"
        )
    return True, None


def _want_cuda(torch):
    """Whether to build CUDA; may set CUDA_HOME, exits with cuda_build_decision's error."""
    flag = os.environ.get("FUSEDNORM_CUDA", "")
    if flag.strip() != "0" and torch.version.cuda is not None and not os.environ.get("CUDA_HOME"):
        toolkit = _toolkit_from_nvcc()
        if toolkit:
            os.environ["CUDA_HOME"] = toolkit
    nvcc = _nvcc()
    found = bool(os.environ.get("CUDA_HOME") or nvcc)
    version = toolkit_cuda_version(_run(nvcc, "--version")) if nvcc else None
    with_cuda, error = cuda_build_decision(flag, torch.version.cuda, found, version)
    if error:
        sys.exit(error)
    if not with_cuda and torch.version.cuda is not None and flag.strip() != "0":
        print("fusednorm: torch is a CUDA build but no CUDA toolkit was found (set CUDA_HOME): "
              "building CPU-only")
    return with_cuda


def _parse_archs(names, prefix):
    """{(major, minor)} of names like 'sm_120' / 'compute_90' (family-specific ones such as
    'sm_90a' or 'compute_100f' are not portable targets and are left out)."""
    archs = set()
    for name in names:
        m = re.fullmatch(prefix + r"_(\d+)", name.strip())
        if m:
            archs.add(divmod(int(m.group(1)), 10))
    return archs


def toolkit_archs(list_gpu_arch_output):
    """The architectures ``nvcc --list-gpu-arch`` says it can build (empty when unknown)."""
    return _parse_archs((list_gpu_arch_output or "").split(), "compute")


def torch_archs(torch):
    """The architectures torch's own kernels were compiled for. torch.cuda.get_arch_list() is
    empty without a visible GPU in older torch; the flags behind it are not."""
    try:
        names = torch._C._cuda_getArchFlags().split()
    except (AttributeError, RuntimeError):
        names = torch.cuda.get_arch_list()
    return _parse_archs(names, "sm")


def _format_archs(archs):
    names = [f"{major}.{minor}" for major, minor in sorted(archs)]
    names[-1] += "+PTX"  # forward compatibility: the newest also as PTX, JIT-compiled on newer GPUs
    return ";".join(names)


def default_arch_list(toolkit, torch_built_for, min_arch=MIN_CUDA_ARCH):
    """The TORCH_CUDA_ARCH_LIST of a build without a visible GPU: every architecture that the
    toolkit can build and torch ships kernels for (torch's list already leaves out those whose
    code another one's runs, e.g. sm_89 runs sm_86's), PTX for the newest. Either set alone
    when the other is unknown or they share nothing; FALLBACK_ARCHS when both are unknown."""
    toolkit = {a for a in toolkit if a >= min_arch}
    torch_built_for = {a for a in torch_built_for if a >= min_arch}
    archs = (toolkit & torch_built_for) or toolkit or torch_built_for
    return _format_archs(archs) if archs else FALLBACK_ARCHS


def visible_gpu_arch_list(capabilities, supported):
    """TORCH_CUDA_ARCH_LIST for the visible GPUs (as torch's extension builder picks it): their
    capabilities, each clamped to the newest of ``supported``, PTX for the newest."""
    newest = max(supported) if supported else None
    archs = {min(tuple(c), newest) if newest else tuple(c) for c in capabilities}
    return _format_archs(archs)


def _cuda_arch_list(torch):
    """TORCH_CUDA_ARCH_LIST as given, else the default for this machine (docs/install.md,
    "GPU architectures")."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if given:
        return given
    nvcc = _nvcc()
    toolkit = toolkit_archs(_run(nvcc, "--list-gpu-arch")) if nvcc else set()
    built_for = torch_archs(torch)
    if torch.cuda.is_available():
        supported = (toolkit & built_for) or toolkit or built_for
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        return visible_gpu_arch_list(caps, supported)
    return default_arch_list(toolkit, built_for)


def _pip_cuda_include_dirs():
    """Headers of the pip-installed CUDA libraries (cuBLAS, cuSPARSE...) that ATen's CUDA
    headers include; a toolkit that holds only the compiler lacks them."""
    dirs = []
    for path in sys.path:
        dirs += glob.glob(os.path.join(path, "nvidia", "*", "include"))
        dirs += glob.glob(os.path.join(path, "nvidia", "*", "*", "include"))
    return sorted({d for d in dirs if os.path.isdir(d)})


# CPU kernels: compiled once per CPU capability, chosen at run time (docs/design.md, 'CPU
# capabilities'). As ATen's kernels in aten/src/ATen/native/cpu, every source in
# csrc/cpu/kernels/ is compiled once for each capability below, through a generated wrapper that
# defines CPU_CAPABILITY (at::vec's vector width and the kernels' namespace follow it), with that
# capability's instruction-set flags; csrc/cpu/capability.cpp picks one at run time from ATen's
# own choice, so ATEN_CPU_CAPABILITY steers both. The flags are ATen's own for each capability.
CPU_CAPABILITY_FLAGS = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
CPU_KERNEL_SOURCES = "csrc/cpu/kernels/*.cpp"

# Where wider capabilities are built beside it (x86-64), the portable kernels serve only CPUs
# without AVX2 and ATEN_CPU_CAPABILITY=default, and compile at -O2: their generic at::vec code,
# a loop over the lanes for every vector operation, made them the build's slowest CPU units at -O3
# (2 cores: backward 63 -> 42 s, forward 29 -> 21 s) for no speed that matters (docs/design.md,
# "CPU capabilities"). Results are bitwise the same (no FMA without -mfma, no reassociation at
# either level). Where they are the only capability (ARM), they keep -O3.
PORTABLE_BESIDE_WIDER_FLAGS = ["-O2"]


def capability_flags(name, capabilities):
    """The compiler flags of CPU capability `name`'s kernels in a build of `capabilities`."""
    flags = list(CPU_CAPABILITY_FLAGS[name])
    if name == "DEFAULT" and len(capabilities) > 1:
        flags += PORTABLE_BESIDE_WIDER_FLAGS
    return flags


def _cpu_capabilities():
    """The CPU capabilities to build kernels for, portable first.

    All three on x86-64, whatever the build machine has: a wheel runs on any x86-64 CPU. Only the
    portable one elsewhere. FUSEDNORM_CPU_CAPABILITY=avx2 or =default caps the list (a shorter
    build for development; the run-time choice then never goes above it).
    """
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return ["DEFAULT"]
    names = list(CPU_CAPABILITY_FLAGS)
    cap = os.environ.get("FUSEDNORM_CPU_CAPABILITY", "").strip().upper()
    if cap:
        if cap not in CPU_CAPABILITY_FLAGS:
            sys.exit(f"FUSEDNORM_CPU_CAPABILITY={cap.lower()}: expected one of "
                     f"{', '.join(n.lower() for n in names)}")
        names = names[:names.index(cap) + 1]
    return names


def _host_cpu_flags():
    """Defines telling csrc/cpu/capability.cpp which capabilities' kernels are linked in."""
    return [f"-DFUSEDNORM_CPU_{name}" for name in _cpu_capabilities()]


def _capability_wrappers(build_temp):
    """Writes one wrapper source per (kernel source, capability) under build_temp; returns
    {wrapper path: capability}, portable capabilities first (see _link_portable_copies_first)."""
    out_dir = os.path.abspath(os.path.join(build_temp, "cpu_capability"))
    os.makedirs(out_dir, exist_ok=True)
    wrappers = {}
    for name in _cpu_capabilities():
        for src in sorted(glob.glob(os.path.join(HERE, CPU_KERNEL_SOURCES))):
            rel = os.path.relpath(src, os.path.join(HERE, "csrc"))
            path = os.path.join(out_dir, f"{os.path.splitext(os.path.basename(src))[0]}.{name}.cpp")
            text = (f"// Generated by setup.py: {rel} for CPU capability {name}.\n"
                    f"#define CPU_CAPABILITY {name}\n#define CPU_CAPABILITY_{name}\n#include \"{rel}\"\n")
            old = open(path).read() if os.path.exists(path) else None
            if old != text:  # rewritten only when it changes, so that rebuilds stay incremental
                with open(path, "w") as f:
                    f.write(text)
            wrappers[path] = name
    return wrappers


def _run_tool(*args):
    return subprocess.run(list(args), capture_output=True, text=True, check=True).stdout


def _link_portable_copies_first(obj, capability):
    """A copy of `obj` (a kernel object built for `capability`) whose inline functions from
    headers (torch's, the standard library's) cannot stand in for anyone else's.

    Every translation unit that calls an inline function out of line emits its own copy as a
    weak symbol in a COMDAT group, and the linker keeps one copy per name for the whole library:
    the AVX-512 kernels' copy of, say, std::vector<double>'s constructor could then serve the
    portable code and fault on an AVX2 machine. The kernels' own code is in namespaces of their
    capability (fusednorm::cpu::AVX512, at::vec::AVX512), so this concerns header inlines only.
    Here each weak or local function, and the COMDAT group of each, gets the capability as a suffix
    (e.g. `..._M_fill_insert.fusednorm_AVX512`), which no other object refers to. Data (static
    locals of inline functions, vtables, guard variables) keeps its name, so that there is still
    one copy of each object; the capability objects are linked after the portable ones, so a
    vtable or other data that both emit is the portable object's.
    """
    out = obj + ".dispatch.o"
    # Remade when the object or these rules (this file) change.
    if os.path.exists(out) and os.path.getmtime(out) >= max(
            os.path.getmtime(obj), os.path.getmtime(os.path.join(HERE, "setup.py"))):
        return out
    suffix = ".fusednorm_" + capability
    try:
        symbols = {}
        for line in _run_tool("nm", "-P", "--defined-only", obj).splitlines():
            fields = line.split()
            if len(fields) >= 2:
                symbols[fields[0]] = fields[1]
        groups = re.findall(r"^COMDAT group section \[\s*\d+\] `\.group' \[(.*)\] contains",
                            _run_tool("readelf", "-gW", obj), re.M)
        data = {name for name, kind in symbols.items() if kind in "VvuBbDdRr"}
        # Constructors and destructors sit in groups named after their C5 / D5 variant, which
        # is not a defined symbol of its own: any group not named by a data symbol is code. Local
        # functions (the compiler's clones of inline functions: .isra, .constprop) link to nothing
        # else, but get the suffix too, so that the library's disassembly says where all code
        # comes from (tests/test_cpu_capability.py checks it).
        rename = ({name for name, kind in symbols.items() if kind in "Wt"} | set(groups)) - data
        table = out + ".syms"
        with open(table, "w") as f:
            f.writelines(f"{name} {name}{suffix}\n" for name in sorted(rename))
        _run_tool("objcopy", f"--redefine-syms={table}", obj, out)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"fusednorm: warning: could not give {os.path.basename(obj)}'s inline functions names "
              f"of their own ({e}); relying on the link order alone (portable objects first)")
        return obj
    return out


def order_compile_edges(manifest, sources):
    """`manifest`, a ninja file torch's builder wrote, with its compile edges in the order of
    `sources` (absolute paths; the edges of other sources after them) and every other line after
    the first edge moved behind the edges, in its order. distutils sorts the sources by name
    before the file is written, and ninja starts the edges it has no past durations for in the
    file's order: on 2 cores the compile-check unit (~90 s) then started after every CPU kernel
    unit and ended the build alone on one core for ~50 s (docs/design.md, "Source layout")."""
    lines = manifest.split("\n")
    rank = {src: i for i, src in enumerate(sources)}
    head, edges, rest = [], [], []
    in_edge = False
    for line in lines:
        m = re.match(r"build .*: (?:cuda_)?compile (.*)$", line)
        if m:
            edges.append((m.group(1).replace("$ ", " "), [line]))
            in_edge = True
        elif in_edge and line.startswith("  "):
            edges[-1][1].append(line)  # the edge's own variables
        else:
            in_edge = False
            (rest if edges else head).append(line)
    order = sorted(range(len(edges)), key=lambda i: (rank.get(edges[i][0], len(rank)), i))
    return "\n".join(head + [line for i in order for line in edges[i][1]] + rest)


def _build_ext_class(cpp_extension):
    """torch's BuildExtension, plus csrc/cpu/kernels/ compiled once per CPU capability.

    torch compiles every source with one flag set; the capability wrappers get their own flags
    per source: through the per-edge variables of ninja's build file (ninja builds), or added
    to the compile command of each wrapper (builds without ninja).
    """

    class BuildExtension(cpp_extension.BuildExtension):
        def build_extension(self, ext):
            wrappers = _capability_wrappers(self.build_temp)
            capabilities = _cpu_capabilities()
            flags = {path: capability_flags(name, capabilities) for path, name in wrappers.items()}
            ext.sources = [s for s in ext.sources if s not in wrappers] + list(wrappers)

            write_ninja_file = cpp_extension._write_ninja_file

            def write_ninja_file_with_capability_flags(*args, **kwargs):
                write_ninja_file(*args, **kwargs)
                path = kwargs["path"] if "path" in kwargs else args[0]
                with open(path) as f:
                    lines = f.read().split("\n")
                out = []
                for line in lines:
                    out.append(line)
                    m = re.match(r"build .*: compile (.*)$", line)
                    src = m.group(1).replace("$ ", " ") if m else None
                    if src in flags and flags[src]:
                        out.append("  post_cflags = $post_cflags " + " ".join(flags[src]))
                text = order_compile_edges("\n".join(out), [os.path.abspath(src) for src in ext.sources])
                with open(path, "w") as f:
                    f.write(text)

            compile_one = self.compiler._compile

            def compile_one_with_capability_flags(obj, src, ext_, cc_args, extra_postargs, pp_opts):
                extra = flags.get(os.path.abspath(src), [])
                if extra:
                    if isinstance(extra_postargs, dict):
                        extra_postargs = dict(extra_postargs, cxx=list(extra_postargs["cxx"]) + extra)
                    else:
                        extra_postargs = list(extra_postargs) + extra
                return compile_one(obj, src, ext_, cc_args, extra_postargs, pp_opts)

            link = self.compiler.link_shared_object

            def link_with_capability_objects(objects, *args, **kwargs):
                by_object = {os.path.abspath(o): name for o, name in zip(
                    self.compiler.object_filenames(list(wrappers), output_dir=self.build_temp),
                    wrappers.values())}
                rank = list(CPU_CAPABILITY_FLAGS)
                # build_ext sorts the sources by name: put the portable objects first again.
                objects = sorted(objects, key=lambda o: rank.index(by_object.get(os.path.abspath(o), "DEFAULT")))
                objects = [_link_portable_copies_first(o, by_object[os.path.abspath(o)])
                           if by_object.get(os.path.abspath(o), "DEFAULT") != "DEFAULT" else o
                           for o in objects]
                return link(objects, *args, **kwargs)

            cpp_extension._write_ninja_file = write_ninja_file_with_capability_flags
            self.compiler._compile = compile_one_with_capability_flags
            self.compiler.link_shared_object = link_with_capability_objects
            try:
                super().build_extension(ext)
            finally:
                cpp_extension._write_ninja_file = write_ninja_file
                self.compiler._compile = compile_one
                self.compiler.link_shared_object = link

    return BuildExtension


def _cxx_standard(torch):
    """The C++ standard this torch's headers need (C++20 from torch 2.10 on, C++17 before)."""
    aten_h = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")
    try:
        with open(aten_h) as f:
            return "c++20" if "C++20" in f.read() else "c++17"
    except OSError:
        return "c++17"


def _build_jobs() -> int:
    """The compile jobs the build runs at once: MAX_JOBS, as torch's build helpers read it, or the
    cores this process may use."""
    try:
        return max(1, int(os.environ.get("MAX_JOBS", "")))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# From this many parallel jobs on, the kernels are compiled one translation unit per path and
# dtype (csrc/cuda/kernels/<dtype>_<path>.cu) and the host sources one unit each; below it, the
# kernels one unit per dtype (kernels/<dtype>.cu, which includes the same files) and the host
# sources one unit in all: each translation unit pays ~20 s of headers, which few cores would pay
# serially (docs/design.md, "Source layout").
PER_PATH_UNITS_FROM_JOBS = 8


def _cuda_sources(jobs: int, compile_check: bool = False) -> list:
    """The CUDA translation units: the kernels per path and dtype or per dtype, by the number of
    parallel jobs (both layouts compile the same kernels), then the registration and shared files;
    for a compile check, one unit that includes them all (compile_check_unit)."""
    if compile_check:
        return [compile_check_unit(_cuda_sources(1), os.path.join(HERE, "build", "compile_check"))]
    kernels = sorted(glob.glob("csrc/cuda/kernels/*.cu"))
    per_dtype = [k for k in kernels if "_" not in os.path.basename(k)]  # half.cu, ..., double.cu
    if jobs >= PER_PATH_UNITS_FROM_JOBS:
        # Each per-dtype file that has per-path files gives way to them (double.cu has none).
        split = {os.path.basename(k).split("_")[0] for k in kernels if k not in per_dtype}
        kernels = [k for k in kernels if k not in per_dtype or os.path.basename(k)[:-3] not in split]
        # The longest translation units first, as ninja starts them in this order.
        kernels.sort(key=lambda k: (not k.endswith(("_one_pass.cu", "_team.cu")), k))
    else:
        kernels = per_dtype
    return kernels + sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))


def _write_unit(path, comment, sources):
    """Writes the translation unit `path`: `comment`, then an #include of each of `sources` (paths
    under csrc/, which is on the include path); rewritten only when that changes, so that ninja
    need not rebuild it. Returns `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = [comment] + [f'#include "{os.path.relpath(src, "csrc")}"' for src in sources]
    text = "\n".join(lines) + "\n"
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
        with open(path, "w") as f:
            f.write(text)
    return path


def compile_check_unit(sources, folder):
    """The one translation unit of a compile check (FUSEDNORM_CUDA_COMPILE_CHECK=1), written in
    `folder`: an #include of each of `sources` (paths under csrc/). Each unit pays ~20 s of headers
    on the host and device front ends, while the unoptimised kernels themselves take little: on 2
    cores the six units took 205 s of compile time, the one unit 99 s (docs/install.md, "Compile
    check"). Returns its path."""
    return _write_unit(os.path.join(folder, "cuda_sources.cu"),
                       "// Generated by setup.py for a compile check: every CUDA source in one translation unit.",
                       sources)


def _host_sources(jobs: int) -> list:
    """The C++ translation units besides the CPU kernels: the schemas, autograd, argument checks,
    planner and CPU registration (csrc/*.cpp, csrc/cpu/*.cpp), one unit each from
    PER_PATH_UNITS_FROM_JOBS parallel jobs on; below, one generated unit that includes them all
    (host_sources_unit)."""
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    if jobs >= PER_PATH_UNITS_FROM_JOBS:
        return sources
    return [host_sources_unit(sources, os.path.join(HERE, "build", "host_sources"))]


def host_sources_unit(sources, folder):
    """The one translation unit of the host sources on few cores, written in `folder`: an #include
    of each of `sources`. Each of the seven files parses torch's headers again, which is most of
    their work: on 2 cores they took 89 s of compile time as seven units, 29-38 s as one (the CI
    build 186 -> 176 s; docs/design.md, "Source layout"). Their registrations (TORCH_LIBRARY_IMPL
    blocks) take unique names in one unit as in several; their anonymous namespaces become one, so
    two files' helpers of one name clash (an error), and an overload of another file's helper
    would be chosen silently (none exists: keep helpers' names distinct across these files). Each
    file must still compile alone, as builds with many jobs compile it: CI checks that
    (.ci/compile_alone.py). Returns its path."""
    return _write_unit(os.path.join(folder, "host_sources.cpp"),
                       "// Generated by setup.py for a build with few cores: every host source in one translation unit.",
                       sources)


def _arch_entries(arch_list):
    """The entries of a TORCH_CUDA_ARCH_LIST ("7.5;12.0+PTX", "8.0 9.0"), as written."""
    return [e for e in re.split(r"[;\s]+", arch_list.strip()) if e]


def compile_check_gencode(arch_list):
    """nvcc's -gencode flags for PTX alone of each architecture in a TORCH_CUDA_ARCH_LIST
    ("9.0", "7.5;12.0+PTX"); SystemExit for an entry that is not a number."""
    flags = []
    for entry in _arch_entries(arch_list):
        m = re.fullmatch(r"(\d+)\.(\d+)(\+PTX)?", entry)
        if not m:
            sys.exit(f"FUSEDNORM_CUDA_COMPILE_CHECK=1 needs TORCH_CUDA_ARCH_LIST of numbers such as "
                     f"9.0 or 12.0+PTX, not {entry!r}")
        arch = f"{m.group(1)}{m.group(2)}"
        flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    return flags


def cuda_targets(arch_list):
    """The code targets nvcc compiles for a TORCH_CUDA_ARCH_LIST: one machine code an entry, PTX
    besides for an entry with +PTX ("8.0;9.0+PTX": 3)."""
    entries = _arch_entries(arch_list)
    return len(entries) + sum(e.endswith("+PTX") for e in entries)


# nvcc compiles a translation unit's architectures one after another unless given --threads. With
# many cores the build ends on its longest units, each compiling for every architecture alone
# while the other cores idle: from PER_PATH_UNITS_FROM_JOBS jobs on, each unit compiles up to this
# many targets at once (flash-attention's default; NVCC_THREADS overrides). Few cores have no
# idle ones to give.
NVCC_THREADS = 4


def nvcc_threads(arch_list, jobs):
    """nvcc's --threads for a build of TORCH_CUDA_ARCH_LIST `arch_list` running `jobs` compile jobs
    at once (1: no flag)."""
    given = os.environ.get("NVCC_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    if jobs < PER_PATH_UNITS_FROM_JOBS:
        return 1
    return max(1, min(NVCC_THREADS, cuda_targets(arch_list)))


def _compile_check():
    return os.environ.get("FUSEDNORM_CUDA_COMPILE_CHECK", "").strip() == "1"


def _compile_check_flags():
    """With FUSEDNORM_CUDA_COMPILE_CHECK=1 (docs/install.md, "Compile check"), for machines that
    have no GPU and build only to check the CUDA code: PTX alone, device code unoptimised
    (-Xcicc -O0), which makes nvcc ~3x faster (no ptxas; bfloat16_team.cu 73 -> 23 s), host code
    unoptimised too, all in one translation unit (compile_check_unit). Errors of the front end and
    of NVVM still fail the build; ptxas's (registers, inline PTX of an architecture) do not. Given
    -gencode flags, torch's builder adds none of its own."""
    if not _compile_check():
        return []
    return ["-Xcicc", "-O0", "-Xcompiler", "-O0"] + compile_check_gencode(os.environ["TORCH_CUDA_ARCH_LIST"])


def _extension():
    import torch
    from torch.utils import cpp_extension

    with_cuda = _want_cuda(torch)
    sources = _host_sources(_build_jobs())
    std = "-std=" + _cxx_standard(torch)
    # ATen's at::parallel_for is an OpenMP region inlined into the caller: without -fopenmp the
    # CPU kernels would silently run on one thread.
    # -g0: Python's CFLAGS, which torch's builder passes on, carry -g; debug information for the
    # kernels' templates made the CPU units 1.7x slower to compile and 16x larger (backward.cpp,
    # portable capability: 101 -> 60 s, 26 -> 1.6 MB) and is stripped from wheels anyway.
    cxx_flags = ["-O3", "-g0", std, "-fopenmp", "-fdiagnostics-color=always"] + _host_cpu_flags()
    extra = {"cxx": cxx_flags}
    include_dirs = [os.path.join(HERE, "csrc")]
    if with_cuda:
        # Reload so that CUDA_HOME (possibly set above) is what torch's build helpers use.
        import importlib
        cpp_extension = importlib.reload(cpp_extension)
        os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list(torch)
        # The CUDA units first, the longest of the build (ninja starts them first: order_compile_edges).
        sources = _cuda_sources(_build_jobs(), _compile_check()) + sources
        # -lineinfo: source lines for profilers (Nsight Compute), not in a compile check's PTX.
        lineinfo = [] if _compile_check() else ["-lineinfo"]
        extra["nvcc"] = ["-O3", std, *lineinfo, "--expt-relaxed-constexpr"] + _compile_check_flags()
        threads = 1 if _compile_check() else nvcc_threads(os.environ["TORCH_CUDA_ARCH_LIST"], _build_jobs())
        if threads > 1:
            extra["nvcc"] += ["--threads", str(threads)]
        include_dirs += _pip_cuda_include_dirs()
        ext_cls = cpp_extension.CUDAExtension
        check = ", a compile check: PTX, unoptimised" if _compile_check() else ""
        print(f"fusednorm: building with CUDA (CUDA_HOME={os.environ.get('CUDA_HOME')}, "
              f"archs={os.environ.get('TORCH_CUDA_ARCH_LIST')}{check})")
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
    return ext, _build_ext_class(cpp_extension), with_cuda


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


def _write_build_info(with_cuda):
    """Records what the library is built for: the torch (so that importing fusednorm under another
    torch fails with a message naming both versions instead of a symbol error), and for
    ``python -m fusednorm`` whether CUDA kernels were compiled, for which architectures and with
    which toolkit."""
    import torch

    nvcc = _nvcc() if with_cuda else None
    info = {
        "TORCH_VERSION": torch.__version__,
        "CUDA_VERSION": torch.version.cuda,  # the CUDA torch was built with
        "WITH_CUDA": with_cuda,
        "CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None,
        "CUDA_TOOLKIT_VERSION": toolkit_cuda_version(_run(nvcc, "--version")) if nvcc else None,
        "CUDA_COMPILE_CHECK": with_cuda and _compile_check(),
    }
    with open(os.path.join(HERE, "ops", "_build_info.py"), "w") as f:
        f.write("# Generated by setup.py; do not edit.\n")
        for name, value in info.items():
            f.write(f"{name} = {value!r}\n")


# setuptools runs this file as __main__; tests import it to check the functions above.
if __name__ == "__main__":
    torch = _import_torch_or_exit(sys.argv)
    options = dict(
        license_options(setuptools.__version__),
        install_requires=[torch_requirement(torch.__version__ if torch is not None else None)],
    )
    if torch is None:  # metadata or sdist: nothing is compiled
        setup(**options)
    else:
        _compiler_matching_the_runtime()
        ext, build_ext, with_cuda = _extension()
        _write_build_info(with_cuda)
        setup(
            ext_modules=[ext],
            cmdclass={"build_ext": build_ext.with_options(no_python_abi_suffix=True)},
            options={"bdist_wheel": {"py_limited_api": "cp39"}},
            **options,
        )
