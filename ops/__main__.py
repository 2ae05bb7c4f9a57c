"""``python -m fusednorm``: what this fusednorm is and what it will run.

Prints the fusednorm version, the torch and CUDA it was built for and the ones it runs with, the
GPU architectures compiled in, the CPU capability in use (``ATEN_CPU_CAPABILITY`` honoured), whether
CUDA kernels are registered, the visible GPUs, and the kernel path the planner picks for a few
sample shapes: what to paste into a bug report.
"""

import os
import sys
from typing import Dict, List, Optional, Tuple

import torch

import fusednorm
from fusednorm import _build_info, _version

# (label, shape, num_groups, dtype, planner keywords): a Stable Diffusion UNet block's GroupNorm,
# the same channels_last with SiLU, its backward, a large bfloat16 VAE decoder norm, and an
# InstanceNorm-shaped problem (one channel per group).
SAMPLE_SHAPES = (
    ("unet block", (2, 320, 64, 64), 32, torch.float16, {}),
    ("unet block, channels_last + silu", (2, 320, 64, 64), 32, torch.float16,
     {"channels_last": True, "activation": "silu"}),
    ("unet block backward", (2, 320, 64, 64), 32, torch.float16, {"backward": True}),
    ("vae decoder", (1, 128, 512, 512), 32, torch.bfloat16, {}),
    ("instance norm", (4, 64, 128, 128), 64, torch.float32, {}),
)


def parse_arch_list(arch_list: Optional[str]) -> List[Tuple[Tuple[int, int], bool]]:
    """((major, minor), with PTX) of each entry of a TORCH_CUDA_ARCH_LIST such as '8.0;9.0+PTX'
    (named ones such as 'Hopper' are left out)."""
    entries = []
    for item in (arch_list or "").replace(",", ";").replace(" ", ";").split(";"):
        name, ptx = (item[:-4], True) if item.upper().endswith("+PTX") else (item, False)
        parts = name.split(".")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            entries.append(((int(parts[0]), int(parts[1])), ptx))
    return entries


def coverage(capability: Tuple[int, int], arch_list: Optional[str]) -> str:
    """How a GPU of ``capability`` runs the compiled kernels: its own machine code (built for an
    architecture of the same major version, no newer than it), PTX JIT-compiled by the driver
    (PTX of an older architecture), or not at all."""
    entries = parse_arch_list(arch_list)
    sass = [a for a, _ in entries if a[0] == capability[0] and a <= tuple(capability)]
    if sass:
        return f"machine code for sm_{max(sass)[0]}{max(sass)[1]}"
    ptx = [a for a, has_ptx in entries if has_ptx and a <= tuple(capability)]
    if ptx:
        return f"PTX of compute_{max(ptx)[0]}{max(ptx)[1]}, JIT-compiled by the driver"
    return "NOT COVERED: rebuild with its architecture in TORCH_CUDA_ARCH_LIST"


def cpu_capability() -> str:
    """The CPU code fusednorm's kernels use, as the library reports it where it can; else
    torch's (ATen's dispatch honours ATEN_CPU_CAPABILITY)."""
    try:
        return str(torch.ops.fusednorm._cpu_capability())
    except (AttributeError, RuntimeError):
        pass
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    if get is not None:
        # ATen says "DEFAULT" / "AVX2" / "AVX512"; ATEN_CPU_CAPABILITY's spelling is lowercase.
        return f"{get().lower()} (torch's; fusednorm's own is not reported by this build)"
    return "unknown (this torch does not report it)"


def cuda_kernels_registered() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("fusednorm::group_norm_forward", "CUDA")


def planner_lines() -> List[str]:
    plan = getattr(getattr(fusednorm, "kernel_paths", None), "plan", None)
    if plan is None:
        try:
            from fusednorm import kernel_paths
            plan = getattr(kernel_paths, "plan", None)
        except ImportError:
            plan = None
    if plan is None:
        return ["planner not available in this build"]
    lines = []
    for label, shape, groups, dtype, options in SAMPLE_SHAPES:
        try:
            path = plan(shape, groups, dtype, **options)
        except Exception as e:  # a diagnostic prints what went wrong and carries on
            path = f"error: {type(e).__name__}: {e}"
        dims = "x".join(str(s) for s in shape)
        lines.append(f"{label} ({dims}, {groups} groups, {str(dtype).replace('torch.', '')}): {path}")
    return lines


def report() -> Dict[str, object]:
    """Everything ``python -m fusednorm`` prints, by name."""
    built_cuda = getattr(_build_info, "CUDA_VERSION", None)
    arch_list = getattr(_build_info, "CUDA_ARCH_LIST", None)
    with_cuda = getattr(_build_info, "WITH_CUDA", None)
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            cap = (props.major, props.minor)
            gpus.append(f"{i}: {props.name}, sm_{cap[0]}{cap[1]}, {props.total_memory / 2**30:.0f} GiB; "
                        + coverage(cap, arch_list if cuda_kernels_registered() else None))
    return {
        "fusednorm": f"{_version.__version__} ({os.path.dirname(os.path.abspath(fusednorm.__file__))})",
        "torch": f"built for {getattr(_build_info, 'TORCH_VERSION', 'unknown')}, running {torch.__version__}",
        "CUDA": (f"built for {built_cuda or 'none (CPU-only torch)'}"
                 + (f" with toolkit {_build_info.CUDA_TOOLKIT_VERSION}"
                    if getattr(_build_info, "CUDA_TOOLKIT_VERSION", None) else "")
                 + (" (no CUDA kernels compiled)" if built_cuda and with_cuda is False else "")
                 + f", running {torch.version.cuda or 'none (CPU-only torch)'}"),
        "GPU architectures": (arch_list if with_cuda and arch_list else
                              "none (CPU-only build)" if with_cuda is False else "not recorded by this build"),
        "CPU capability": cpu_capability(),
        "CUDA kernels registered": "yes" if cuda_kernels_registered() else "no",
        "visible GPUs": gpus or ["none"],
        "kernel paths": planner_lines(),
    }


def main() -> int:
    for name, value in report().items():
        if isinstance(value, list):
            print(f"{name}:")
            for line in value:
                print(f"  {line}")
        else:
            print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
