"""fusednorm as a package: what setup.py decides (torch missing, CUDA toolkit versions, GPU
architectures), the metadata it writes, the sdist, a wheel built from that sdist by
tools/build_wheel.sh, ``python -m fusednorm``, the ``"fusednorm"`` torch.compile backend found
through its entry point, and the modules' own docstrings."""

import importlib.metadata
import importlib.util
import os
import pathlib
import pydoc
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch

import fusednorm
from fusednorm import __main__ as diagnostics
from fusednorm import _version

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = (".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu")
# The sdist-to-wheel build takes minutes of CPU: on by default where there is no GPU (CI), off
# on a GPU machine, whose time is for the GPU tests; FUSEDNORM_SLOW_TESTS=1 / =0 forces either.
RUN_SLOW = os.environ.get("FUSEDNORM_SLOW_TESTS", "0" if torch.cuda.is_available() else "1") != "0"


def installed_or_skip():
    """fusednorm's installed distribution (its metadata and entry points), or a skip where the
    package is used from a source folder on sys.path without being installed."""
    try:
        return importlib.metadata.distribution("fusednorm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fusednorm is imported from a source folder, not installed: no metadata or entry points")


def load_setup():
    """setup.py as a module (its setup() call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("fusednorm_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETUP = load_setup()


def copy_source(dest):
    """The source tree without build products: git's view of it where there is one."""
    dest.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            if name and (ROOT / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest / name)
    else:
        shutil.copytree(ROOT, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("build", "*.so", "*.egg-info", "__pycache__", "_build_info.py"))
    return dest


def run_setup_py(cwd, args, hide_torch=False, env=None):
    """``python setup.py ARGS`` in ``cwd``, with torch not importable when ``hide_torch`` (as in
    pip's isolated build environment)."""
    prelude = "import sys; sys.modules['torch'] = None; " if hide_torch else "import sys; "
    code = (prelude + f"sys.argv = ['setup.py'] + {list(args)!r}; __file__ = 'setup.py'; "
            "exec(compile(open('setup.py').read(), 'setup.py', 'exec'), {'__name__': '__main__', '__file__': 'setup.py'})")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600)


# -- torch missing (pip's build isolation) -------------------------------------------------------


def test_building_without_torch_stops_at_once_with_one_sentence(tmp_path):
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    for command in ("bdist_wheel", "build_ext", "editable_wheel", "develop"):
        res = run_setup_py(tmp_path, [command], hide_torch=True)
        assert res.returncode == 1, res.stdout + res.stderr
        assert res.stderr.strip() == SETUP.NO_TORCH_MESSAGE
    message = SETUP.NO_TORCH_MESSAGE
    assert "\n" not in message and message.count(". ") == 0  # one sentence
    assert "pip install --no-build-isolation" in message and "install torch first" in message
    assert "compiled against the very torch it will run with" in message  # why
    assert not (tmp_path / "ops").exists() and not (tmp_path / "build").exists()  # nothing built


def test_metadata_without_torch_requires_any_supported_torch(tmp_path):
    src = copy_source(tmp_path / "src")
    res = run_setup_py(src, ["-q", "dist_info", "--output-dir", str(tmp_path)], hide_torch=True)
    assert res.returncode == 0, res.stdout + res.stderr
    metadata = next(tmp_path.glob("fusednorm-*.dist-info")).joinpath("METADATA").read_text()
    assert "Requires-Dist: torch>=2.1" in metadata


# -- metadata ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    """METADATA and entry_points.txt that setup.py writes with this torch (CPU-only: the CUDA
    decision is tested on its own)."""
    tmp = tmp_path_factory.mktemp("metadata")
    src = copy_source(tmp / "src")
    res = run_setup_py(src, ["-q", "dist_info", "--output-dir", str(tmp)],
                       env=dict(os.environ, FUSEDNORM_CUDA="0"))
    assert res.returncode == 0, res.stdout + res.stderr
    info = next(tmp.glob("fusednorm-*.dist-info"))
    return info.joinpath("METADATA").read_text(), info.joinpath("entry_points.txt").read_text()


def test_metadata_pins_the_torch_built_against(metadata):
    text, _ = metadata
    assert f"Requires-Dist: torch=={torch.__version__.split('+')[0]}\n" in text
    assert SETUP.torch_requirement("2.1.2+cu121") == "torch==2.1.2"
    assert SETUP.torch_requirement("2.15.0.dev20260101+cpu") == "torch==2.15.0.dev20260101"
    assert SETUP.torch_requirement(None) == "torch>=2.1"


def test_metadata_license_urls_classifiers_version(metadata):
    text, _ = metadata
    assert re.search(r"^(License-Expression|License): BSD-3-Clause$", text, re.M)
    assert re.search(r"^License-File: LICENSE$", text, re.M)
    assert f"Version: {_version.__version__}\n" in text
    assert "Project-URL: Repository, https://github.com/fusednorm/fusednorm" in text
    assert "Classifier: Typing :: Typed" in text
    assert "Requires-Python: >=3.9" in text
    assert "Copyright (c) 2026, the fusednorm authors" in (ROOT / "LICENSE").read_text()
    assert SETUP.license_options("84.2.1") == {"license_expression": "BSD-3-Clause", "license_files": ["LICENSE"]}
    assert SETUP.license_options("65.5.0") == {"license": "BSD-3-Clause", "license_files": ["LICENSE"]}


def test_metadata_declares_the_dynamo_backend(metadata):
    _, entry_points = metadata
    assert re.search(r"\[torch_dynamo_backends\]\s+fusednorm = fusednorm\.fusion:dynamo_backend", entry_points)


def test_one_version_everywhere():
    assert fusednorm.__version__ == _version.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert not re.search(r"^version\s*=\s*\"", pyproject, re.M) and 'attr = "fusednorm._version.__version__"' in pyproject
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{_version.__version__}]" in changelog and "## [Unreleased]" in changelog


def test_installed_metadata_has_the_version():
    assert installed_or_skip().version == _version.__version__


def test_package_is_typed():
    assert (pathlib.Path(fusednorm.__file__).parent / "py.typed").is_file()


# -- CUDA: toolkit and torch versions, architectures ---------------------------------------------


@pytest.mark.parametrize("flag, torch_cuda, found, toolkit, expected", [
    ("", "12.1", True, "12.4", True),       # same major: minor differences are torch's to warn about
    ("", "13.0", True, "13.0", True),
    ("", "13.0", True, None, True),         # version unknown: torch's own check decides
    ("1", "12.8", True, "12.8", True),
    ("0", "12.1", True, "13.0", False),     # asked for CPU-only: no error even across majors
    ("", None, True, "13.0", False),        # a CPU-only torch
    ("", "12.1", False, None, False),       # no toolkit: CPU-only (setup.py says so)
])
def test_cuda_build_decision(flag, torch_cuda, found, toolkit, expected):
    assert SETUP.cuda_build_decision(flag, torch_cuda, found, toolkit) == (expected, None)


@pytest.mark.parametrize("flag, torch_cuda, found, toolkit, needle", [
    ("", "12.1", True, "13.0", "CUDA 13.0 but torch was built with CUDA 12.1"),
    ("1", "12.1", True, "13.0", "CUDA 13.0 but torch was built with CUDA 12.1"),
    ("", "13.0", True, "12.9", "CUDA 12.9 but torch was built with CUDA 13.0"),
    ("1", None, True, "13.0", "FUSEDNORM_CUDA=1 but the installed torch is not a CUDA build"),
    ("1", "12.1", False, None, "FUSEDNORM_CUDA=1 but no CUDA toolkit was found"),
])
def test_cuda_build_decision_errors(flag, torch_cuda, found, toolkit, needle):
    with_cuda, error = SETUP.cuda_build_decision(flag, torch_cuda, found, toolkit)
    assert not with_cuda and needle in error
    if "but torch was built with" in needle:
        assert "FUSEDNORM_CUDA=0" in error and f"CUDA {torch_cuda.split('.')[0]}.x toolkit" in error


def test_toolkit_version_parsing():
    out = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
    assert SETUP.toolkit_cuda_version(out) == "13.0"
    assert SETUP.toolkit_cuda_version("Cuda compilation tools, release 12.1, V12.1.105") == "12.1"
    assert SETUP.toolkit_cuda_version("") is None and SETUP.toolkit_cuda_version(None) is None


@pytest.mark.skipif(torch.version.cuda is None, reason="the mismatch check runs only for a CUDA torch")
def test_toolkit_of_another_cuda_major_stops_the_build(tmp_path):
    """setup.py with an nvcc of another CUDA major on PATH: one clear error, before anything is
    built or written."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    other = int(torch.version.cuda.split(".")[0]) - 1
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {other}.8, V{other}.8.61'\n")
    nvcc.chmod(0o755)
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    (tmp_path / "ops").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "FUSEDNORM_CUDA", "CXX")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    res = run_setup_py(tmp_path, ["--name"], env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"CUDA {other}.8 but torch was built with CUDA {torch.version.cuda}" in res.stderr
    assert "FUSEDNORM_CUDA=0" in res.stderr
    assert not (tmp_path / "ops" / "_build_info.py").exists()


CUDA13_ARCHS = ("compute_75 compute_80 compute_86 compute_87 compute_88 compute_89 compute_90 "
                "compute_100 compute_110 compute_103 compute_120 compute_121")
CUDA121_ARCHS = "compute_50 compute_52 compute_53 compute_60 compute_61 compute_62 compute_70 compute_72 " \
                "compute_75 compute_80 compute_86 compute_87 compute_89 compute_90"


class FakeTorch:
    """What torch_archs reads: the arch flags torch was compiled with."""

    def __init__(self, flags):
        self._C = type("C", (), {"_cuda_getArchFlags": staticmethod(lambda: flags)})


def test_default_arch_list_follows_toolkit_and_torch():
    cu130_torch = SETUP.torch_archs(FakeTorch("sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"))
    assert cu130_torch == {(7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0)}
    toolkit = SETUP.toolkit_archs(CUDA13_ARCHS)
    assert (12, 1) in toolkit and (10, 3) in toolkit
    # Both: what both support, PTX for the newest (sm_100 / sm_120 included).
    assert SETUP.default_arch_list(toolkit, cu130_torch) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    # A toolkit older than torch's: the newest it can build carries the PTX.
    cu128_torch = SETUP.torch_archs(FakeTorch("sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 sm_90a"))
    assert SETUP.default_arch_list(SETUP.toolkit_archs(CUDA121_ARCHS), cu128_torch) == "7.0;7.5;8.0;8.6;9.0+PTX"
    # Either alone when the other is unknown; the fallback when both are.
    assert SETUP.default_arch_list(set(), cu130_torch) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    assert SETUP.default_arch_list(SETUP.toolkit_archs("compute_80 compute_90a compute_100f"), set()) == "8.0+PTX"
    assert SETUP.default_arch_list(set(), set()) == SETUP.FALLBACK_ARCHS
    assert SETUP.default_arch_list(SETUP.toolkit_archs(""), SETUP.torch_archs(FakeTorch(""))) == SETUP.FALLBACK_ARCHS


def test_visible_gpu_arch_list():
    supported = {(8, 0), (9, 0), (12, 0)}
    assert SETUP.visible_gpu_arch_list([(9, 0), (9, 0)], supported) == "9.0+PTX"
    # A GPU newer than anything buildable: the newest buildable, as PTX.
    assert SETUP.visible_gpu_arch_list([(8, 6), (12, 1)], supported) == "8.6;12.0+PTX"
    assert SETUP.visible_gpu_arch_list([(8, 9)], set()) == "8.9+PTX"


def test_compile_check_gencode():
    """FUSEDNORM_CUDA_COMPILE_CHECK=1: PTX alone of each listed architecture (no machine code,
    so no ptxas), whatever the +PTX suffix says; anything but numbers is refused."""
    assert SETUP.compile_check_gencode("9.0") == ["-gencode=arch=compute_90,code=compute_90"]
    assert SETUP.compile_check_gencode("7.5;12.0+PTX") == [
        "-gencode=arch=compute_75,code=compute_75", "-gencode=arch=compute_120,code=compute_120"]
    assert SETUP.compile_check_gencode(" 8.0 9.0 ") == [
        "-gencode=arch=compute_80,code=compute_80", "-gencode=arch=compute_90,code=compute_90"]
    with pytest.raises(SystemExit, match="not 'Hopper'"):
        SETUP.compile_check_gencode("8.0;Hopper")


def test_cuda_targets_and_nvcc_threads(monkeypatch):
    assert SETUP.cuda_targets("9.0") == 1
    assert SETUP.cuda_targets("7.5;8.0;8.6;9.0;10.0;12.0+PTX") == 7
    assert SETUP.cuda_targets(" 8.0 9.0+PTX ") == 3
    monkeypatch.delenv("NVCC_THREADS", raising=False)
    many = SETUP.PER_PATH_UNITS_FROM_JOBS
    assert SETUP.nvcc_threads("9.0", 16) == 1  # one target: nothing to run in parallel
    assert SETUP.nvcc_threads("8.0;9.0+PTX", many) == 3
    assert SETUP.nvcc_threads("7.5;8.0;8.6;9.0;10.0;12.0+PTX", 16) == SETUP.NVCC_THREADS
    assert SETUP.nvcc_threads("7.5;8.0;8.6;9.0;10.0;12.0+PTX", many - 1) == 1  # few cores: none idle
    monkeypatch.setenv("NVCC_THREADS", "2")
    assert SETUP.nvcc_threads("7.5;8.0;8.6;9.0;10.0;12.0+PTX", 2) == 2


def test_portable_cpu_kernels_at_o2_only_beside_wider_ones():
    """The portable kernels compile at -O2 where AVX2 / AVX512 kernels are built beside them (x86),
    after the build's -O3, so that theirs wins; alone (ARM) they keep -O3."""
    assert SETUP.capability_flags("DEFAULT", ["DEFAULT"]) == []
    assert SETUP.capability_flags("DEFAULT", ["DEFAULT", "AVX2", "AVX512"]) == ["-O2"]
    assert SETUP.capability_flags("DEFAULT", ["DEFAULT", "AVX2"]) == ["-O2"]
    for name in ("AVX2", "AVX512"):
        assert SETUP.capability_flags(name, list(SETUP.CPU_CAPABILITY_FLAGS)) == SETUP.CPU_CAPABILITY_FLAGS[name]
        assert "-O2" not in SETUP.capability_flags(name, list(SETUP.CPU_CAPABILITY_FLAGS))


@pytest.mark.skipif(shutil.which("nvcc") is None or torch.version.cuda is None,
                    reason="needs nvcc and a CUDA torch")
def test_default_arch_list_of_this_machine_compiles(tmp_path, monkeypatch):
    """The list this machine's toolkit and torch give, through torch's own parser, accepted by
    nvcc for a small kernel (the full library is compile-tested for one architecture in CI)."""
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    nvcc = shutil.which("nvcc")
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    if SETUP.toolkit_cuda_version(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout) \
            .split(".")[0] != torch.version.cuda.split(".")[0]:
        pytest.skip("the toolkit's CUDA major is not torch's")
    arch_list = SETUP.default_arch_list(SETUP.toolkit_archs(listed), SETUP.torch_archs(torch))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    flags = _get_cuda_arch_flags()
    assert any("compute_" in f and "code=compute_" in f for f in flags)  # the PTX of the newest
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n")
    res = subprocess.run([nvcc, *flags, "-c", str(src), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


# -- sdist and wheel -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """An sdist made as ``python -m build --sdist`` makes it (torch not importable)."""
    tmp = tmp_path_factory.mktemp("sdist")
    src = copy_source(tmp / "src")
    res = run_setup_py(src, ["-q", "sdist", "--dist-dir", str(tmp / "dist")], hide_torch=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((tmp / "dist").glob("fusednorm-*.tar.gz"))


def test_sdist_holds_every_source_and_header(sdist):
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in SOURCE_SUFFIXES}
    assert sources and sources <= names, sorted(sources - names)
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "LICENSE", "README.md", "CHANGELOG.md",
                 "ops/py.typed", "ops/__main__.py", "ops/_version.py", "docs/install.md"):
        assert name in names
    assert not any(name.endswith((".so", "_build_info.py")) for name in names)


@pytest.fixture(scope="module")
def wheel(sdist, tmp_path_factory):
    """The sdist unpacked and built CPU-only by tools/build_wheel.sh (a few minutes)."""
    if not RUN_SLOW:
        pytest.skip("FUSEDNORM_SLOW_TESTS=0")
    tmp = tmp_path_factory.mktemp("wheel")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp)
    unpacked = next(p for p in tmp.iterdir() if p.is_dir())
    # The portable and AVX2 kernels only: the AVX2 objects still go through the symbol renaming,
    # the strip and auditwheel that every capability beside the portable one does, and the
    # wheel's test runs them; AVX512's units would add a third of the build (~30 s on 2 cores).
    env = dict(os.environ, FUSEDNORM_CUDA="0", FUSEDNORM_CPU_CAPABILITY="avx2", PYTHON=sys.executable,
               MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    res = subprocess.run(["bash", str(ROOT / "tools" / "build_wheel.sh"), "--source", str(unpacked),
                          "--out", str(tmp / "out")], env=env, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    return next((tmp / "out").glob("fusednorm-*.whl")), res.stdout


@pytest.mark.slow
def test_wheel_from_sdist_is_pinned_stripped_and_tagged(wheel):
    path, log = wheel
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        lib = next(n for n in names if re.fullmatch(r"fusednorm/_C[^/]*\.so", n))
        lib_bytes = zf.read(lib)
    assert "fusednorm/py.typed" in names and "fusednorm/_build_info.py" in names
    assert f"Requires-Dist: torch=={torch.__version__.split('+')[0]}" in metadata
    assert "torch_dynamo_backends" in entry_points
    assert b".debug_info" not in lib_bytes  # stripped
    if shutil.which("auditwheel") or "auditwheel or patchelf not found" not in log:
        assert "manylinux" in path.name, log
        assert not any("libtorch" in n or "libc10" in n or "libgomp" in n for n in names)  # torch's own
    else:
        assert path.name.endswith("linux_x86_64.whl")


@pytest.mark.slow
def test_wheel_installs_and_runs(wheel, tmp_path):
    path, _ = wheel
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target),
                          str(path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    check = (
        "import fusednorm, torch; "
        f"assert fusednorm.__file__.startswith({str(target)!r}), fusednorm.__file__; "
        "x = torch.randn(3, 6, 5, 4, dtype=torch.float64); w = torch.randn(6, dtype=torch.float64); "
        "torch.testing.assert_close(fusednorm.group_norm(x, 3, w), torch.nn.functional.group_norm(x, 3, w)); "
        "print('ok')"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    res = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "fusednorm"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "GPU architectures: none (CPU-only build)" in res.stdout, res.stdout + res.stderr


# -- python -m fusednorm -------------------------------------------------------------------------


def run_diagnostics(**env):
    res = subprocess.run([sys.executable, "-m", "fusednorm"], capture_output=True, text=True,
                         env=dict(os.environ, **env), cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_python_m_fusednorm_reports_the_build():
    from fusednorm import _build_info

    out = run_diagnostics()
    assert out.startswith(f"fusednorm: {fusednorm.__version__} (")
    assert f"torch: built for {_build_info.TORCH_VERSION}, running {torch.__version__}" in out
    assert re.search(r"^CUDA: built for .*, running ", out, re.M)
    assert re.search(r"^GPU architectures: \S", out, re.M)
    registered = torch._C._dispatch_has_kernel_for_dispatch_key("fusednorm::group_norm_forward", "CUDA")
    assert f"CUDA kernels registered: {'yes' if registered else 'no'}" in out
    assert re.search(r"^visible GPUs:\n  " + ("0: " if torch.cuda.is_available() else "none"), out, re.M)
    from fusednorm import kernel_paths as planner

    kernel_paths = out.split("kernel paths:\n", 1)[1].splitlines()
    if hasattr(planner, "plan"):
        assert len(kernel_paths) == len(diagnostics.SAMPLE_SHAPES)
        assert not any(": error: " in line for line in kernel_paths), kernel_paths
    else:
        assert kernel_paths == ["  planner not available in this build"]


def test_python_m_fusednorm_honours_aten_cpu_capability():
    line = next(ln for ln in run_diagnostics(ATEN_CPU_CAPABILITY="default").splitlines()
                if ln.startswith("CPU capability: "))
    assert line.split(": ", 1)[1].split()[0].lower() == "default", line


def test_arch_coverage():
    archs = "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    assert diagnostics.parse_arch_list(archs)[-1] == ((12, 0), True)
    assert diagnostics.parse_arch_list("8.0 9.0+PTX,Hopper") == [((8, 0), False), ((9, 0), True)]
    assert diagnostics.coverage((9, 0), archs) == "machine code for sm_90"
    assert diagnostics.coverage((8, 9), archs) == "machine code for sm_86"  # same major, older minor
    assert diagnostics.coverage((12, 1), archs) == "machine code for sm_120"
    assert diagnostics.coverage((13, 0), archs).startswith("PTX of compute_120")
    assert diagnostics.coverage((7, 0), archs).startswith("NOT COVERED")
    assert diagnostics.coverage((9, 0), None).startswith("NOT COVERED")



@pytest.mark.parametrize("jobs", [1, 2, SETUP.PER_PATH_UNITS_FROM_JOBS - 1, SETUP.PER_PATH_UNITS_FROM_JOBS, 16])
def test_both_cuda_source_layouts_compile_every_kernel_file_once(jobs, monkeypatch):
    # Per dtype (few jobs) or per path and dtype (many): either way every file of csrc/cuda/kernels/
    # is compiled exactly once, on its own or included by its dtype's file, and nothing else is.
    monkeypatch.chdir(ROOT)
    kernels = ROOT / "csrc" / "cuda" / "kernels"
    included = {}
    units = [u for u in SETUP._cuda_sources(jobs) if "/kernels/" in u]
    for unit in units:
        text = (ROOT / unit).read_text()
        parts = re.findall(r'#include "cuda/kernels/([^"]+)"', text)
        for name in parts or [pathlib.Path(unit).name]:
            assert name not in included, f"{name} compiled twice ({included.get(name)}, {unit})"
            included[name] = unit
    part_files = {p.name for p in kernels.glob("*.cu") if "_" in p.name or p.name == "double.cu"}
    assert set(included) == part_files
    per_dtype_units = [u for u in units if "_" not in pathlib.Path(u).name]
    if jobs >= SETUP.PER_PATH_UNITS_FROM_JOBS:
        assert [pathlib.Path(u).name for u in per_dtype_units] == ["double.cu"]
    else:
        assert units == per_dtype_units


def test_compile_check_unit_includes_every_cuda_source_once(tmp_path, monkeypatch):
    # A compile check (FUSEDNORM_CUDA_COMPILE_CHECK=1) compiles one generated unit that includes
    # the few-jobs layout's units: every kernel file once, the registration and shared files.
    monkeypatch.chdir(ROOT)
    unit = SETUP.compile_check_unit(SETUP._cuda_sources(1), str(tmp_path))
    included = re.findall(r'#include "([^"]+)"', pathlib.Path(unit).read_text())
    assert included == [os.path.relpath(u, "csrc") for u in SETUP._cuda_sources(1)]
    assert "cuda/group_norm_kernel.cu" in included and "cuda/param_grads.cu" in included
    for name in included:
        assert (ROOT / "csrc" / name).is_file()
    mtime = os.stat(unit).st_mtime_ns
    assert SETUP.compile_check_unit(SETUP._cuda_sources(1), str(tmp_path)) == unit
    assert os.stat(unit).st_mtime_ns == mtime  # rewritten only when it changes


def test_ninja_compile_edges_follow_the_source_order():
    # distutils sorts the sources by name; the build file's compile edges are put back in the
    # order setup.py gives (the longest units first), each with its own variables, and the other
    # lines kept in their order.
    manifest = "\n".join([
        "ninja_required_version = 1.3",
        "rule compile",
        "  command = $cxx -c $in -o $out",
        "",
        "build /t/a.o: compile /s/a.cpp",
        "build /t/b.DEFAULT.o: compile /s/b.DEFAULT.cpp",
        "  post_cflags = $post_cflags -O2",
        "build /t/k$ x.o: cuda_compile /s/k$ x.cu",
        "",
        "",
    ])
    out = SETUP.order_compile_edges(manifest, ["/s/k x.cu", "/s/b.DEFAULT.cpp"]).split("\n")
    assert out[:4] == manifest.split("\n")[:4]
    assert out[4:] == ["build /t/k$ x.o: cuda_compile /s/k$ x.cu",
                       "build /t/b.DEFAULT.o: compile /s/b.DEFAULT.cpp",
                       "  post_cflags = $post_cflags -O2",
                       "build /t/a.o: compile /s/a.cpp",  # not listed: after the listed ones
                       "", ""]
    assert sorted(out) == sorted(manifest.split("\n"))


def test_host_sources_are_one_unit_on_few_cores(tmp_path, monkeypatch):
    # Below PER_PATH_UNITS_FROM_JOBS jobs the host sources compile as one generated unit that
    # includes each once; from there on, one unit each. Neither has the CPU kernels, which
    # compile once per capability through their own wrappers.
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(SETUP, "HERE", str(tmp_path))
    separate = SETUP._host_sources(SETUP.PER_PATH_UNITS_FROM_JOBS)
    assert "csrc/ops.cpp" in separate and "csrc/autograd.cpp" in separate and "csrc/cpu/registration.cpp" in separate
    assert not any("kernels" in src for src in separate)
    [unit] = SETUP._host_sources(SETUP.PER_PATH_UNITS_FROM_JOBS - 1)
    assert pathlib.Path(unit).parent.parent == tmp_path / "build"
    included = re.findall(r'#include "([^"]+)"', pathlib.Path(unit).read_text())
    assert included == [os.path.relpath(src, "csrc") for src in separate]
    mtime = os.stat(unit).st_mtime_ns
    assert SETUP._host_sources(1) == [unit]
    assert os.stat(unit).st_mtime_ns == mtime  # rewritten only when it changes


# -- torch.compile(backend="fusednorm") ----------------------------------------------------------


def test_dynamo_finds_the_fusednorm_backend():
    from torch._dynamo.backends.registry import lookup_backend

    installed_or_skip()
    assert "fusednorm" in torch._dynamo.list_backends()
    assert lookup_backend("fusednorm") is fusednorm.fusion.dynamo_backend


def test_compile_with_backend_name_fuses(monkeypatch):
    """backend="fusednorm" is fusion.backend(): the graph is fused, then compiled (here with
    aot_eager instead of Inductor, for time)."""
    installed_or_skip()
    counts = []
    fuse_graph = fusednorm.fusion.fuse_graph

    def counting(gm, **kwargs):
        counts.append(fuse_graph(gm, **kwargs))
        return counts[-1]

    monkeypatch.setattr(fusednorm.fusion, "fuse_graph", counting)
    monkeypatch.setattr(fusednorm.fusion.FusionBackend.__init__, "__defaults__", ("aot_eager",))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 1), torch.nn.GroupNorm(2, 8), torch.nn.SiLU()).double()
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    try:
        out = torch.compile(model, backend="fusednorm")(x)
    finally:
        torch._dynamo.reset()
    assert counts == [1]
    torch.testing.assert_close(out, model(x))


# -- docstrings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [fusednorm.nn.GroupNorm, fusednorm.nn.InstanceNorm1d,
                                 fusednorm.nn.InstanceNorm2d, fusednorm.nn.InstanceNorm3d])
def test_modules_document_activation_and_operands(cls):
    torch_cls = getattr(torch.nn, cls.__name__)
    assert cls.__doc__ != torch_cls.__doc__
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    for word in ("activation", "negative_slope", "scale", "shift", "residual", "multiplier", "leaky_relu"):
        assert word in text, word
    assert "fusednorm" in cls.__doc__ and f"torch.nn.{cls.__name__}" in cls.__doc__
    assert "multiplier" in cls.forward.__doc__
