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
``padded_forward_class``: their own ``forward`` inside the block, the rest of the model outside it;
and torch's convolutions of ``padding_mode="replicate"`` a class of ``padded_conv_class``, whose
``_conv_forward`` calls the op itself, without the block.
"""

import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["replication_pads"]

_PADS = (F.pad, torch._C._nn.pad)
# Where fusednorm's pad has kernels of its own (on the CPU the op is ATen's pad); tests widen it.
_DEVICE_TYPES = ("cuda",)
_ARGUMENTS = ("input", "pad", "mode", "value")


def _replicated(x: Any, padding: Sequence[int]) -> Optional[torch.Tensor]:
    """fusednorm's replication pad of `x` by `padding` (ints), where it takes it: a plain tensor
    on a device of _DEVICE_TYPES, nondeterministic algorithms allowed (F.pad's deterministic
    replicate pad is a decomposition whose backward is deterministic); otherwise None."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type not in _DEVICE_TYPES \
            or torch.are_deterministic_algorithms_enabled():
        return None
    return torch.ops.fusednorm.replication_pad.default(x, list(padding))


def _routed_pad(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """fusednorm's replication pad of an ``F.pad(input, pad, mode, value)`` call it takes (a
    replicate pad without a value, int padding, and what _replicated takes), or None: the call
    then runs as it was made."""
    bound = dict(zip(_ARGUMENTS, args))
    bound.update(kwargs)
    padding = bound.get("pad")
    if bound.get("mode", "constant") != "replicate" or bound.get("value") is not None \
            or not isinstance(padding, (list, tuple)) or not all(type(p) is int for p in padding):
        return None
    return _replicated(bound.get("input"), padding)


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


_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _compiling() -> bool:
    """Whether Dynamo is tracing the caller (torch.compile, torch.export)."""
    if _IS_COMPILING is not None:
        return _IS_COMPILING()
    return torch._dynamo.is_compiling()  # torch < 2.3


class ReplicationPadsClass:
    """Base of the classes :func:`padded_forward_class` and :func:`padded_conv_class` make: a
    module of such a class pickles and deep-copies as one, its class made again from the original
    class; ``torch.jit.script`` scripts it as a module of the original class (the same attributes,
    ATen's pads)."""

    _padded_base: type  # the original class
    _padded_maker: Callable[[type], type]  # the function that made the class (a staticmethod)

    def __reduce_ex__(self, protocol: int) -> Any:
        return _remade, (self._padded_maker, self._padded_base), dict(self.__dict__)

    def __prepare_scriptable__(self) -> Any:
        original = self._padded_base.__new__(self._padded_base)
        original.__dict__.update(self.__dict__)
        return original


_MADE: Dict[Tuple[Callable[[type], type], type], type] = {}  # (maker, original class) -> made class
_CONVS = ((nn.Conv3d, F.conv3d), (nn.Conv2d, F.conv2d), (nn.Conv1d, F.conv1d))


def _made(maker: Callable[[type], type], cls: type, methods: Callable[[], Dict[str, Any]]) -> type:
    """The class `maker` makes of `cls`, made once: `<cls>WithReplicationPads`, a subclass of
    ReplicationPadsClass and `cls` with the methods `methods()` gives."""
    if (maker, cls) not in _MADE:
        name = f"{cls.__name__}WithReplicationPads"
        _MADE[maker, cls] = type(name, (ReplicationPadsClass, cls), {
            "__module__": __name__, "__qualname__": name, "_padded_base": cls,
            "_padded_maker": staticmethod(maker), **methods()})
    return _MADE[maker, cls]


def padded_forward_class(cls: type) -> type:
    """The subclass of the nn.Module class ``cls`` whose ``forward`` runs ``cls.forward`` inside
    :class:`replication_pads` (a ReplicationPadsClass), one a class: ``isinstance`` checks
    against ``cls`` still hold, and its attributes are the module's own (``fusednorm.convert``
    makes diffusers' causal convolutions so, docs/design.md, "Replication pads in eager mode")."""
    def methods() -> Dict[str, Any]:
        original = cls.forward

        # The original's name, docstring and signature (inspect.signature follows __wrapped__).
        @functools.wraps(original)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if _compiling():  # Dynamo traces the original as written: Inductor sees F.pad
                return original(self, *args, **kwargs)
            with replication_pads():
                return original(self, *args, **kwargs)

        return {"forward": forward}

    return _made(padded_forward_class, cls, methods)


def pads_in_conv_forward(module: nn.Module) -> bool:
    """Whether `module` is a ``torch.nn.Conv1d/2d/3d`` of padding_mode "replicate" whose class
    keeps torch's ``_conv_forward`` (which pads it): the modules padded_conv_class serves."""
    return any(isinstance(module, base) and type(module)._conv_forward is base._conv_forward
               for base, _ in _CONVS) and module.padding_mode == "replicate"


def padded_conv_class(cls: type) -> type:
    """The subclass of the ``torch.nn.Conv1d/2d/3d`` class ``cls`` whose ``_conv_forward`` pads by
    replication on fusednorm's op where :class:`replication_pads` would route the pad (padding
    mode "replicate", a plain CUDA tensor, eager mode) and then convolves the padded input
    unpadded, as torch's own does after its ``F.pad``; otherwise it is torch's. One a class, as
    :func:`padded_forward_class`'s; without the mode's Python call on every torch function
    (~3 us of host time a convolution call against ~11; docs/design.md, "Replication pads in
    eager mode")."""
    def methods() -> Dict[str, Any]:
        conv = next(function for base, function in _CONVS if issubclass(cls, base))
        original = cls._conv_forward

        def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Any:
            if self.padding_mode == "replicate" and not _compiling():
                padded = _replicated(input, self._reversed_padding_repeated_twice)
                if padded is not None:
                    return conv(padded, weight, bias, self.stride, 0, self.dilation, self.groups)
            return original(self, input, weight, bias)

        return {"_conv_forward": _conv_forward}

    return _made(padded_conv_class, cls, methods)


def _remade(maker: Callable[[type], type], cls: type) -> Any:
    """An empty instance of the class `maker` (padded_forward_class or padded_conv_class) makes of
    `cls`, for pickle (which then sets its state)."""
    padded = maker(cls)
    return padded.__new__(padded)
