"""benchmarks/diffusers_bench.py's workloads (what the GPU runs measure): each builds in its tiny
configuration, runs, and gives under fusednorm.convert what it gives unconverted (float32, CPU)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

import fusednorm
from test_convert import import_or_skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import diffusers_bench as db  # noqa: E402

WORKLOADS = {**db.WORKLOADS, **db.MORE_WORKLOADS}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_runs_and_converts(name):
    import_or_skip("diffusers")
    model, inputs = WORKLOADS[name]("cpu", torch.float32, False)
    with torch.no_grad():
        want = model(*inputs)
        got = fusednorm.convert(copy.deepcopy(model))(*inputs)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_workload_names_are_unique_and_picked():
    assert len(WORKLOADS) == len(db.WORKLOADS) + len(db.MORE_WORKLOADS)
    assert db.pick("UNet step", WORKLOADS, "workload", substrings=True) == [
        "UNet step b2", "UNet step b8", "AnimateDiff UNet step", "SVD UNet step"]  # ("UNet3D step": no)
    with pytest.raises(SystemExit, match="unknown workload"):
        db.pick("no such model", WORKLOADS, "workload", substrings=True)
