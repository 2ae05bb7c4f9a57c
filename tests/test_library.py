"""Loading the native library: readable failures when it is missing or built for another torch."""

import pytest
import torch

import fusednorm
from fusednorm import _build_info, _library


def test_library_built_for_another_torch_names_both_versions(monkeypatch):
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "1.0.0+elsewhere")
    with pytest.raises(ImportError) as info:
        _library.load()
    message = str(info.value)
    assert "1.0.0+elsewhere" in message and torch.__version__ in message and "rebuild" in message


def test_missing_library_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setattr(_library, "_HERE", str(tmp_path))
    with pytest.raises(ImportError, match="was not found.*pip install --no-build-isolation"):
        _library.load()


def test_loaded_library_registers_every_op():
    for name in ("group_norm_forward", "group_norm_backward", "group_norm", "instance_norm"):
        assert hasattr(torch.ops.fusednorm, name)
    assert fusednorm.__version__
