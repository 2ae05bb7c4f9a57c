import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import fusednorm  # noqa: F401  (loads the ops)
from fusednorm.kernel_paths import reload_overrides

# "ci": derandomized and bounded, so the suite fits CI's time budget and a failure reproduces.
# "dev": fresh random examples each run. Pick with HYPOTHESIS_PROFILE; CI=true selects "ci".
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# FUSEDNORM_TEST_DEVICES ("cuda", "cpu,cuda") narrows them: tools/gpu_prebuilt.sh runs the GPU
# machine's suite with "cuda": CI runs the CPU variants, which cost the GPU machine's time there
# (test_double_backward's six took ~85 s each of a 470 s run, 12 workers).
_ONLY_DEVICES = os.environ.get("FUSEDNORM_TEST_DEVICES")
if _ONLY_DEVICES:
    DEVICES = [d for d in DEVICES if d in _ONLY_DEVICES.split(",")]


def pytest_generate_tests(metafunc):
    # Every test that takes `device` runs on the CPU and, where there is one, on the GPU.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if (item.get_closest_marker("cuda") or item.get_closest_marker("large")) and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def fresh_overrides():
    """After each test (and after monkeypatch, set up later, has restored the environment), the
    library reads the kernel-path overrides again (docs/design.md, "Kernel overrides")."""
    yield
    reload_overrides()


@pytest.fixture
def routed_pads(monkeypatch):
    """The replication pads handed to fusednorm's op by fusednorm.replication_pads() (also those
    of the causal convolutions fusednorm.convert makes run inside it) and by the convolutions
    convert gives padded_conv_class, recorded as their output shapes, with the CPU among the
    devices routed (where the op is ATen's pad), so that CI sees the routing."""
    from fusednorm import _replication_pads

    monkeypatch.setattr(_replication_pads, "_DEVICE_TYPES", ("cpu", "cuda"))
    calls = []
    replicate = _replication_pads._replicated

    def spy(x, padding):
        out = replicate(x, padding)
        if out is not None:
            calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(_replication_pads, "_replicated", spy)
    return calls
