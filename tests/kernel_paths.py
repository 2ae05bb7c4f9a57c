"""The CUDA kernel paths every test that must cover them runs (fusednorm.kernel_paths.TEST_PATHS):
one pass (the forward holds a small group in registers, a larger one in shared memory), one pass
with the register kernel off, the split passes, and the team kernels (a group spread over the
shared memory of a team of CTAs, forward and backward), and which kernels a call launched."""

import torch

from fusednorm.kernel_paths import KNOBS, TEST_PATHS

PATHS = TEST_PATHS


def set_path(monkeypatch, path):
    """Selects `path` (a key of PATHS) for the rest of the test."""
    use_defaults(monkeypatch)
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)


def use_defaults(monkeypatch):
    """Unsets every knob for the rest of the test: each path's measured default."""
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)


def cuda_kernel_names(fn):
    """The names of the CUDA kernels fn() launches, one string (the profiler's demangled names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.key for e in prof.key_averages())
