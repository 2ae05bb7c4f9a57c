"""Eager replication pads through fusednorm's kernels (docs/design.md, "Replication pads in eager
mode").

The video VAEs' causal convolutions pad their input with ``F.pad(x, padding, mode="replicate")``
inside the convolution modules' own ``forward``; ATen's CUDA pad runs at a fraction of the copy
rate. Within
``with fusednorm.replication_pads():`` such calls on CUDA tensors run
``torch.ops.fusednorm.replication_pad``, which returns the same tensor (a copy: bit for bit, in
the input's suggested memory format) through fusednorm's pad kernels, and ATen's pad, with its
errors and gradients, for every call those kernels do not take.

It is a ``torch.overrides.TorchFunctionMode``: every torch function called inside the block passes
through one Python call, a few microseconds, so it is for models whose time is on the GPU (a
video decode), not for host-bound ones. It is for eager mode: code Inductor compiled calls ATen's
kernels, not torch functions, so the block changes nothing there (the fusion backend takes the
pads that follow its fused norms itself).

``fusednorm.convert`` gives the causal convolutions of diffusers' video VAEs a class of
``padded_forward_class``: their own ``forward`` inside the block, the rest of the model outside it.
"""

import functools
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["replication_pads"]

_PADS = (F.pad, torch._C._nn.pad)
# Where fusednorm's pad has kernels of its own (on the CPU the op is ATen's pad); tests widen it.
_DEVICE_TYPES = ("cuda",)
_ARGUMENTS = ("input", "pad", "mode", "value")


def _routed_pad(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """fusednorm's replication pad of an ``F.pad(input, pad, mode, value)`` call it takes (a
    replicate pad without a value, of a plain tensor on a device of _DEVICE_TYPES, int padding),
    or None: the call then runs as it was made."""
    bound = dict(zip(_ARGUMENTS, args))
    bound.update(kwargs)
    x, padding = bound.get("input"), bound.get("pad")
    if bound.get("mode", "constant") != "replicate" or bound.get("value") is not None \
            or type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type not in _DEVICE_TYPES \
            or not isinstance(padding, (list, tuple)) or not all(type(p) is int for p in padding):
        return None
    # F.pad's deterministic replicate pad is a decomposition whose backward is deterministic.
    if torch.are_deterministic_algorithms_enabled():
        return None
    return torch.ops.fusednorm.replication_pad(x, list(padding))


class replication_pads(TorchFunctionMode):  # noqa: N801 (used as a function: `with replication_pads():`)
    """Context manager: ``F.pad(x, padding, mode="replicate")`` of CUDA tensors inside the block
    runs fusednorm's replication pad (the same result, faster; see the module's docstring).

    Example::

        vae = fusednorm.convert(vae)
        with torch.no_grad(), fusednorm.replication_pads():
            video = vae.decode(latents).sample
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PADS:
            out = _routed_pad(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _compiling() -> bool:
    """Whether Dynamo is tracing the caller (torch.compile, torch.export)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()  # torch < 2.3


class ReplicationPadsInForward:
    """Base of the classes :func:`padded_forward_class` makes (their ``forward`` runs the original
    class's inside :class:`replication_pads`): a module of such a class pickles and deep-copies as
    one, its class made again from the original class."""

    _padded_base: type  # the original class, set by padded_forward_class

    def __reduce_ex__(self, protocol: int) -> Any:
        return _remade, (self._padded_base,), dict(self.__dict__)


_PADDED_CLASSES: Dict[type, type] = {}


def padded_forward_class(cls: type) -> type:
    """The subclass of the nn.Module class ``cls`` whose ``forward`` runs ``cls.forward`` inside
    :class:`replication_pads` (ReplicationPadsInForward), one a class: ``isinstance`` checks
    against ``cls`` still hold, and its attributes are the module's own (``fusednorm.convert``
    makes diffusers' causal convolutions so, docs/design.md, "Replication pads in eager mode")."""
    if cls not in _PADDED_CLASSES:
        original = cls.forward

        # The original's name, docstring and signature (inspect.signature follows __wrapped__).
        @functools.wraps(original)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if _compiling():  # Dynamo traces the original as written: Inductor sees F.pad
                return original(self, *args, **kwargs)
            with replication_pads():
                return original(self, *args, **kwargs)

        name = f"{cls.__name__}WithReplicationPads"
        _PADDED_CLASSES[cls] = type(name, (ReplicationPadsInForward, cls), {
            "__module__": __name__, "__qualname__": name, "_padded_base": cls, "forward": forward})
    return _PADDED_CLASSES[cls]


def _remade(cls: type) -> Any:
    """An empty instance of padded_forward_class(cls), for pickle (which then sets its state)."""
    padded = padded_forward_class(cls)
    return padded.__new__(padded)
