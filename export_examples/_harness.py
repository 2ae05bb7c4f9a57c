"""Takes a model from eager through torch.compile, TorchScript, torch.export and AOTInductor,
saving and reloading each artifact, and checks every result against eager."""

import functools
import os
import tempfile
import time
import warnings
from typing import Dict, Optional, Sequence

import torch

import fusednorm  # noqa: F401  (the ops must be loaded before anything that runs them)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@functools.lru_cache(maxsize=None)
def torchscript_deprecated() -> bool:
    """Whether this torch deprecates TorchScript (from 2.14 on, torch.jit.script / save / load
    raise FutureWarning and point to torch.compile and torch.export, which these examples take
    anyway): asked once, of a trivial function, with the warning caught."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.script(_identity)
    return any(issubclass(w.category, FutureWarning) for w in caught)


def _close(name: str, got, want, atol: float, rtol: float) -> None:
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    print(f"  {name:<28} ok (max abs diff {float((got - want).abs().max()):.2e})")


def check_everywhere(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    dynamic_shapes: Optional[Dict] = None,
    other_inputs: Optional[Sequence[torch.Tensor]] = None,
    script: bool = True,
    aoti: bool = True,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> None:
    """`other_inputs`, of other batch/spatial sizes, exercise the dynamic dimensions. Exported
    programs specialize sizes 0 and 1, and an AOTInductor package does not check its inputs: keep
    dynamic sizes >= 2."""
    model = model.eval()
    with torch.no_grad():
        want = model(*inputs)
        want_other = model(*other_inputs) if other_inputs is not None else None
    t0 = time.time()

    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic_shapes is not None)
    with torch.no_grad():
        _close("torch.compile", compiled(*inputs), want, atol, rtol)
        if other_inputs is not None:
            _close("torch.compile (other sizes)", compiled(*other_inputs), want_other, atol, rtol)

    with tempfile.TemporaryDirectory() as tmp:
        if script and torchscript_deprecated():
            print(f"  {'torch.jit.script':<28} not shown: torch {torch.__version__} deprecates TorchScript "
                  "(the test suite still covers it)")
        elif script:
            scripted = torch.jit.script(model)
            path = os.path.join(tmp, "model.pt")
            torch.jit.save(scripted, path)
            with torch.no_grad():
                _close("torch.jit.script save/load", torch.jit.load(path)(*inputs), want, atol, rtol)

        ep = torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic_shapes)
        ops = {str(n.target) for n in ep.run_decompositions().graph.nodes if "fusednorm" in str(n.target)}
        assert ops, "run_decompositions() must keep the fusednorm ops"
        path = os.path.join(tmp, "model.pt2")
        torch.export.save(ep, path)
        loaded = torch.export.load(path).module()
        with torch.no_grad():
            _close("torch.export save/load", loaded(*inputs), want, atol, rtol)
            if other_inputs is not None:
                _close("torch.export (other sizes)", loaded(*other_inputs), want_other, atol, rtol)

        if aoti and hasattr(torch._inductor, "aoti_compile_and_package"):
            package = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "model.pt2"))
            runner = torch._inductor.aoti_load_package(package)
            with torch.no_grad():
                _close("AOTInductor package", runner(*inputs), want, atol, rtol)
                if other_inputs is not None:
                    _close("AOTInductor (other sizes)", runner(*other_inputs), want_other, atol, rtol)
        elif aoti:
            print("  AOTInductor packaging needs torch >= 2.6: skipped")
    print(f"  all paths agree with eager ({time.time() - t0:.0f} s)")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
