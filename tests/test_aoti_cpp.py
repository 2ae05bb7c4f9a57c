"""Python-free deployment: C++ programs (export_examples/cpp, CMake with torch's CMake config) load
the fusednorm library and run an AOTInductor package, or train through a TorchScript module, and
match eager PyTorch."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fusednorm
from fusednorm import _library

CPP_DIR = os.path.join(os.path.dirname(__file__), "..", "export_examples", "cpp")

pytestmark = [
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"),
    pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning"),
]


def cuda_cmake_hints():
    """torch's CMake config insists on finding CUDA when torch is a CUDA build, even for a CPU
    program: point it at the toolkit (and at pip's NVRTC where the toolkit lacks it)."""
    if torch.version.cuda is None:
        return []
    hints = []
    toolkit = os.environ.get("CUDA_HOME")
    nvcc = shutil.which("nvcc")
    if toolkit is None and nvcc:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True, text=True)
        m = re.search(r"^#\$ TOP=(.*)$", out.stdout + out.stderr, re.M)
        toolkit = os.path.realpath(m.group(1).strip()) if m else None
    if toolkit:
        hints += [f"-DCUDA_TOOLKIT_ROOT_DIR={toolkit}", f"-DCUDAToolkit_ROOT={toolkit}"]
        if not glob.glob(os.path.join(toolkit, "lib*", "libnvrtc.so*")):
            nvrtc = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "*", "lib", "libnvrtc.so.*")))
            nvrtc = [p for p in nvrtc if re.search(r"libnvrtc\.so\.\d+$", p)]
            if nvrtc:
                hints.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc[0]}")
    return hints + ["-DTORCH_CUDA_ARCH_LIST=9.0"]


def write_tensor(path, t):
    t = t.detach().cpu().float().contiguous()
    with open(path, "wb") as f:
        f.write(torch.tensor([t.dim()] + list(t.shape), dtype=torch.int64).numpy().tobytes())
        f.write(t.numpy().tobytes())


def read_tensor(path):
    with open(path, "rb") as f:
        data = f.read()
    rank = int.from_bytes(data[:8], "little")
    shape = torch.frombuffer(bytearray(data[8:8 + 8 * rank]), dtype=torch.int64).tolist()
    return torch.frombuffer(bytearray(data[8 + 8 * rank:]), dtype=torch.float32).reshape(shape)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.emb = torch.nn.Linear(4, 16)
        self.gn = fusednorm.nn.GroupNorm(2, 8, activation="silu")
        self.inorm = fusednorm.nn.InstanceNorm2d(8, affine=True, activation="leaky_relu", negative_slope=0.2)

    def forward(self, x):
        # Every epilogue argument kind: optional tensors given and omitted, a string, a float.
        scale, shift = self.emb(x.mean(dim=(2, 3))).chunk(2, dim=1)
        h = self.conv(x)
        return self.inorm(self.gn(h, scale=scale, shift=shift), residual=h, multiplier=h)


@pytest.fixture(scope="module")
def cpp_build(tmp_path_factory):
    """Configures export_examples/cpp once; build_program(name) builds one of its programs."""
    build = tmp_path_factory.mktemp("cpp") / "build"
    configure = subprocess.run(
        ["cmake", "-S", CPP_DIR, "-B", str(build), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"] + cuda_cmake_hints(),
        capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]

    # Both programs on the first call, side by side (each is one ~20 s compile of torch's headers);
    # the AOTInductor runner only where torch has it.
    programs = ["train_torchscript"]
    if hasattr(torch._inductor, "aoti_compile_and_package"):
        programs.append("run_aoti_package")
    built = []

    def build_program(name):
        if not built:
            compiled = subprocess.run(["cmake", "--build", str(build), "--target", *programs, "-j2"],
                                      capture_output=True, text=True)
            assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
            built.extend(programs)
        assert name in built, name
        return str(build / name)

    return build_program


@pytest.mark.skipif(not hasattr(torch._inductor, "aoti_compile_and_package"), reason="AOTInductor packaging needs torch >= 2.6")
def test_cpp_program_runs_aoti_package(cpp_build, tmp_path):
    program = cpp_build("run_aoti_package")
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 4, 10, 10)
    ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "net.pt2"))
    other = torch.randn(3, 4, 10, 10)
    write_tensor(tmp_path / "in.bin", other)

    run = subprocess.run([program, _library.library_path(), package,
                          str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    with torch.no_grad():
        torch.testing.assert_close(read_tensor(tmp_path / "out.bin"), model(other), atol=1e-5, rtol=1e-5)


def test_cpp_program_trains_torchscript_module(cpp_build, tmp_path):
    # The fusednorm ops' autograd is C++ (csrc/autograd.cpp), so a scripted module trains where
    # there is no Python: gradients of the input and of a parameter match eager PyTorch's.
    program = cpp_build("train_torchscript")
    torch.manual_seed(1)
    model = Net()
    torch.jit.script(model).save(str(tmp_path / "net.pt"))
    x = torch.randn(3, 4, 10, 10)
    dy = torch.randn(3, 8, 10, 10)
    write_tensor(tmp_path / "x.bin", x)
    write_tensor(tmp_path / "dy.bin", dy)
    run = subprocess.run([program, _library.library_path(), str(tmp_path / "net.pt"), str(tmp_path / "x.bin"),
                          str(tmp_path / "dy.bin"), str(tmp_path / "dx.bin"), "gn.weight", str(tmp_path / "dw.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    xg = x.clone().requires_grad_()
    model(xg).backward(dy)
    torch.testing.assert_close(read_tensor(tmp_path / "dx.bin"), xg.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(read_tensor(tmp_path / "dw.bin"), model.gn.weight.grad, atol=1e-5, rtol=1e-5)
