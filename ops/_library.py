"""Finds and loads fusednorm's native library, with a readable error when it cannot."""

import glob
import os
import warnings

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_BUILD_HINT = "build it with `pip install --no-build-isolation .` (or `-e .`) from the fusednorm source tree"


def library_path() -> str:
    candidates = sorted(glob.glob(os.path.join(_HERE, "_C*.so")) + glob.glob(os.path.join(_HERE, "_C*.pyd")))
    if not candidates:
        raise ImportError(f"fusednorm's native library (_C*.so) was not found in {_HERE}: {_BUILD_HINT}")
    return candidates[0]


def _base_version(v: str) -> str:
    return v.split("+")[0]


def _warn_if_compile_check() -> None:
    try:
        from ._build_info import CUDA_COMPILE_CHECK as check
    except ImportError:
        return
    if check and torch.cuda.is_available():
        warnings.warn(
            "fusednorm was built as a CUDA compile check (FUSEDNORM_CUDA_COMPILE_CHECK=1): its CUDA "
            "kernels are unoptimised PTX, slow on a GPU; rebuild without it (docs/install.md, "
            "'Compile check')", RuntimeWarning, stacklevel=3)


def load() -> None:
    path = library_path()
    try:
        from ._build_info import TORCH_VERSION as built_for
    except ImportError:
        built_for = None
    if built_for is not None and _base_version(built_for) != _base_version(torch.__version__):
        raise ImportError(
            f"fusednorm was built against torch {built_for}, but torch {torch.__version__} is "
            f"installed; the native library only works with the torch it was built for: rebuild "
            f"it ({_BUILD_HINT})"
        )
    _warn_if_compile_check()
    try:
        torch.ops.load_library(path)
    except OSError as e:
        raise ImportError(
            f"could not load fusednorm's native library {path} (built against torch "
            f"{built_for or 'unknown'}, running torch {torch.__version__}): {e}. {_BUILD_HINT}"
        ) from e
