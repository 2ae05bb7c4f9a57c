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


@pytest.mark.parametrize("name", list(db.ALL_WORKLOADS))
def test_workload_runs_and_converts(name):
    import_or_skip("diffusers")
    model, inputs = db.ALL_WORKLOADS[name]("cpu", torch.float32, False)
    with torch.no_grad():
        want = model(*inputs)
        got = fusednorm.convert(copy.deepcopy(model))(*inputs)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_workload_names_are_unique_and_picked():
    assert len(db.ALL_WORKLOADS) == len(db.WORKLOADS) + len(db.MORE_WORKLOADS)
    assert db.pick("UNet step", db.ALL_WORKLOADS, "workload", substrings=True) == [
        "UNet step b2", "UNet step b8", "AnimateDiff UNet step", "SVD UNet step"]  # ("UNet3D step": no)
    with pytest.raises(SystemExit, match="unknown workload"):
        db.pick("no such model", db.ALL_WORKLOADS, "workload", substrings=True)


def test_rounds_time_every_variant_in_turns_and_keep_the_median():
    import_or_skip("diffusers")
    name = "VAE decode 512"
    model, inputs = db.ALL_WORKLOADS[name]("cpu", torch.float32, False)
    calls = []

    def measure(timed):  # a fake timer: records which variant it timed, returns a time per call
        before = len(calls)
        timed()
        calls.append(before)
        return float(len(calls))

    labels, errors = ["eager", "eager + convert"], []
    with torch.no_grad():
        row = db.run_workload(name, model, inputs, labels, measure, "cpu", errors, rounds=4)
        once = db.run_workload(name, model, inputs, labels, measure, "cpu", [])
    assert errors == []
    # the first round in the variants' order, then backward, forward, backward: 1, 2 | 4, 3 | 5, 6 | 8, 7
    assert row["ms_rounds"] == {"eager": [1.0, 4.0, 5.0, 8.0], "eager + convert": [2.0, 3.0, 6.0, 7.0]}
    assert row["ms"] == {"eager": 4.0, "eager + convert": 3.0}  # the lower median of an even count
    assert "ms_rounds" not in once and set(once["ms"]) == set(labels)
