"""The CUDA kernel paths every test that must cover them runs (fusednorm.kernel_paths.TEST_PATHS):
one pass (the forward holds a small group in registers, a larger one in shared memory), one pass
with the register kernel off, the split passes, the team kernels (a group spread over the
shared memory of a team of CTAs, forward and backward) and the sweep forward (two streaming
launches over tiles of a group), and which kernels a call launched.

The library reads the overrides once (docs/design.md, "Kernel overrides"): every helper here that
changes them makes it read them again, and conftest.py's autouse `fresh_overrides` does once
monkeypatch has restored them after a test."""

import pytest
import torch

from fusednorm.kernel_paths import KNOBS, TEST_PATHS, reload_overrides

PATHS = TEST_PATHS


def set_path(monkeypatch, path):
    """Selects `path` (a key of PATHS) for the rest of the test."""
    use_defaults(monkeypatch)
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    reload_overrides()


def set_knob(monkeypatch, name, value):
    """Sets override `name` to `value` (a string) for the rest of the test."""
    monkeypatch.setenv(name, value)
    reload_overrides()


def use_defaults(monkeypatch):
    """Unsets every knob for the rest of the test: each path's measured default."""
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)
    reload_overrides()


def cuda_kernel_names(fn):
    """The names of the CUDA kernels fn() launches, one string (the profiler's demangled names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.key for e in prof.key_averages())
