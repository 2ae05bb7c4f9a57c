"""F-style functions with the signatures, defaults and argument checks of torch.nn.functional,
plus keyword-only epilogue operands fused into the same pass over memory.

They call the composite ops torch.ops.fusednorm.group_norm / instance_norm, whose schemas have the
same arguments. TorchScript cannot compile keyword-only parameters, so each function is registered
as a TorchScript builtin of its op: scripted code that calls ``fusednorm.group_norm(...)`` (with
the same keywords) compiles to the op itself, which performs the same checks.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import _dtensor

# The ops' overloads, looked up once: calling an overload skips the packet's per-call resolution
# (~0.5 us of host time; docs/design.md, "Host time").
_GROUP_NORM = torch.ops.fusednorm.group_norm.default
_ADD_GROUP_NORM = torch.ops.fusednorm.add_group_norm.default
_INSTANCE_NORM = torch.ops.fusednorm.instance_norm.default

# The activations (None: no activation). Mirrors csrc/epilogue.h.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "leaky_relu", "mish")
# Every accepted value of `activation`, by the functions and the modules alike: the activations,
# "none" (no activation, as None) and "swish" (apex's name for SiLU; csrc/ops.cpp maps it).
ACTIVATION_NAMES = ("none",) + ACTIVATIONS + ("swish",)


def check_activation(activation: Optional[str]) -> Optional[str]:
    """The activation a module keeps: what the functions accept (else their TypeError or ValueError),
    "none" kept as None."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be None or a str, not {type(activation).__name__}")
    if activation is not None and activation not in ACTIVATION_NAMES:
        raise ValueError(
            f"Unknown activation '{activation}': expected None or one of "
            + ", ".join(f"'{a}'" for a in ACTIVATION_NAMES)
        )
    return None if activation == "none" else activation


def torch_activation(input: Tensor, activation: Optional[str], negative_slope: float = 0.01) -> Tensor:
    """The epilogue's ``activation`` (None or one of ACTIVATION_NAMES) applied to ``input`` by
    torch.nn.functional, for the compositions that compute outside fusednorm's kernels what they
    compute. TorchScript compiles it (fusednorm.nn.AdaGroupNorm calls it)."""
    if activation is None or activation == "none":
        return input
    if activation == "silu" or activation == "swish":
        return torch.nn.functional.silu(input)
    if activation == "gelu":
        return torch.nn.functional.gelu(input)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(input, approximate="tanh")
    if activation == "relu":
        return torch.nn.functional.relu(input)
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(input, negative_slope)
    if activation == "mish":
        return torch.nn.functional.mish(input)
    raise ValueError(f"Unknown activation '{activation}'")  # (callers check names: check_activation)


# Argument types, checked as torch.nn.functional's argument parser checks them, with its
# TypeError and message (the op's own schema parser would raise RuntimeError). Symbolic ints and
# floats (torch.compile) are ints and floats.


def _type_error(fn: str, name: str, position: Optional[int], expected: str, value: object) -> TypeError:
    where = f" (position {position})" if position is not None else ""
    return TypeError(f"{fn}(): argument '{name}'{where} must be {expected}, not {type(value).__name__}")


def _check_int(fn: str, name: str, position: int, value: object) -> None:
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, (int, torch.SymInt))):
        raise _type_error(fn, name, position, "int", value)


def _check_float(fn: str, name: str, position: Optional[int], value: object) -> None:
    if type(value) is not float and not isinstance(value, (int, float, torch.SymInt, torch.SymFloat)):
        raise _type_error(fn, name, position, "float", value)


def _check_tensor(fn: str, name: str, position: Optional[int], value: object) -> None:
    if value is not None and not isinstance(value, Tensor):
        raise _type_error(fn, name, position, "Tensor", value)


def _check_activation_types(fn: str, activation: object, negative_slope: object) -> None:
    if activation is not None and not isinstance(activation, str):
        raise _type_error(fn, "activation", None, "str", activation)
    _check_float(fn, "negative_slope", None, negative_slope)


def _check_epilogue_types(fn: str, activation: object, negative_slope: object, scale: object, shift: object,
                          residual: object, multiplier: object) -> None:
    _check_activation_types(fn, activation, negative_slope)
    for name, t in (("scale", scale), ("shift", shift), ("residual", residual), ("multiplier", multiplier)):
        _check_tensor(fn, name, None, t)


def _verify_batch_size(size: List[int]) -> None:
    # As torch.nn.functional._verify_batch_size.
    size_prods = size[0]
    for i in range(len(size) - 2):
        size_prods *= size[i + 2]
    if size_prods == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")


def _verify_spatial_size(size: List[int]) -> None:
    # As torch.nn.functional._verify_spatial_size.
    size_prods = 1
    for i in range(2, len(size)):
        size_prods *= size[i]
    if size_prods == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {size}")


_EPILOGUE_DOC = """
    The optional keyword-only epilogue is applied in the same pass, in this order::

        z = normalize(input) * weight + bias
        z = z * (1 + scale) + shift      # scale, shift: (N, C) or (N, C, 1, ..., 1)
        z = z + residual                 # input's shape
        z = act(z)                       # activation: None (or "none"), "silu" (or "swish"),
                                         #   "gelu", "gelu_tanh", "relu",
                                         #   "leaky_relu" (negative_slope), "mish"
        z = z * multiplier               # input's shape

    Gradients flow to every tensor operand. ``residual`` and ``multiplier`` are cast to the
    input's dtype (the output keeps the input's dtype and memory format); ``scale`` and ``shift``
    are used in float32 (float64 for float64 input).
"""


def _no_operands(scale: Optional[Tensor], shift: Optional[Tensor], residual: Optional[Tensor],
                 multiplier: Optional[Tensor]) -> bool:
    # The op gets only the keywords a call uses: each keyword argument is parsed against the schema
    # on every call. A plain call passes none (six cost ~1.5 us, a quarter of the op's host time on
    # small inputs), a norm + activation two (the other four cost another ~1.3 us).
    return scale is None and shift is None and residual is None and multiplier is None


def _plain_call(input: Tensor, scale: Optional[Tensor], shift: Optional[Tensor], residual: Optional[Tensor],
                multiplier: Optional[Tensor]) -> bool:
    # A plain tensor and no operand: the call the modules hand to the op directly (docs/design.md,
    # "Host time"); a DTensor or other subclass takes the functions' path. (__class__, not type():
    # Dynamo in torch 2.1 cannot call type() on a tensor.)
    return input.__class__ is Tensor and _no_operands(scale, shift, residual, multiplier)


def _group_norm_without_operands(input: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
                                 eps: float, activation: Optional[str], negative_slope: float) -> Tensor:
    # The op with only the keywords the call uses (see _no_operands); arguments already checked.
    # Also fusednorm.nn.GroupNorm's direct call (docs/design.md, "Host time").
    if activation is None:
        return _GROUP_NORM(input, num_groups, weight, bias, eps)
    return _GROUP_NORM(input, num_groups, weight, bias, eps, activation=activation, negative_slope=negative_slope)


def _instance_norm_without_operands(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                                    weight: Optional[Tensor], bias: Optional[Tensor], use_input_stats: bool,
                                    momentum: float, eps: float, activation: Optional[str],
                                    negative_slope: float) -> Tensor:
    # _group_norm_without_operands' twin; also the InstanceNorm modules' direct call.
    if activation is None:
        return _INSTANCE_NORM(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
    return _INSTANCE_NORM(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps,
                          activation=activation, negative_slope=negative_slope)


def _same_dtype(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    if t is None or t.dtype == dtype:
        return t
    return t.to(dtype)


def _epilogue_keywords(input: Tensor, activation: Optional[str], negative_slope: float, scale: Optional[Tensor],
                       shift: Optional[Tensor], residual: Optional[Tensor], multiplier: Optional[Tensor],
                       input_bias: Optional[Tensor] = None) -> Dict[str, Any]:
    # The ops' epilogue keywords (arguments already checked), residual, multiplier and input_bias in
    # the input's dtype; input_bias only where given (each keyword is parsed on every call; see
    # _no_operands).
    keywords = dict(activation=activation, negative_slope=negative_slope, scale=scale, shift=shift,
                    residual=_same_dtype(residual, input.dtype), multiplier=_same_dtype(multiplier, input.dtype))
    if input_bias is not None:
        keywords["input_bias"] = _same_dtype(input_bias, input.dtype)
    return keywords


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    activation: Optional[str] = None,
    negative_slope: float = 0.01,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    multiplier: Optional[Tensor] = None,
    input_bias: Optional[Tensor] = None,
) -> Tensor:
    _check_tensor("group_norm", "input", 1, input)
    _check_int("group_norm", "num_groups", 2, num_groups)
    _check_tensor("group_norm", "weight", 3, weight)
    _check_tensor("group_norm", "bias", 4, bias)
    _check_float("group_norm", "eps", 5, eps)
    if _dtensor.DTensor is not None and isinstance(input, _dtensor.DTensor):  # docs/distributed.md, 'DTensor'
        _dtensor.check_supported()
    if input.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input.dim()}")
    if num_groups <= 0:
        raise RuntimeError(f"Expected num_groups to be positive, but got num_groups={num_groups}")
    # F.group_norm's _verify_batch_size([N * C // G, G, *spatial]) rejects only N * C // G == 1 with
    # one spatial element; building its list costs a microsecond per call, so test first.
    nc = input.size(0) * input.size(1)
    if nc // num_groups == 1 and input.numel() == nc:
        _verify_batch_size([nc // num_groups, num_groups] + list(input.size()[2:]))
    if input_bias is None and _no_operands(scale, shift, residual, multiplier):
        if activation is not None:
            _check_activation_types("group_norm", activation, negative_slope)
        return _group_norm_without_operands(input, num_groups, weight, bias, eps, activation, negative_slope)
    _check_epilogue_types("group_norm", activation, negative_slope, scale, shift, residual, multiplier)
    _check_tensor("group_norm", "input_bias", None, input_bias)
    return _GROUP_NORM(input, num_groups, weight, bias, eps,
                       **_epilogue_keywords(input, activation, negative_slope, scale, shift, residual, multiplier,
                                            input_bias))


group_norm.__doc__ = """Group normalization, as :func:`torch.nn.functional.group_norm`.

    Statistics over (C / num_groups) channels x all spatial positions per sample and group, biased
    variance, optional per-channel ``weight`` and ``bias``. Any rank >= 2; contiguous,
    channels_last and channels_last_3d inputs keep their memory format.

    ``input_bias`` (keyword-only; shape (C,), (N, C) or (N, C, 1, ..., 1)) is added to the input
    before the normalization: ``group_norm(input, ..., input_bias=b)`` is
    ``group_norm(input + b[..., None, None], ...)`` in one pass, for a convolution's bias (plus a
    per-sample embedding) that a graph would otherwise add in a pass of its own. It is cast to the
    input's dtype; channels-last CUDA inputs add it in float32, other inputs are given
    ``input + input_bias`` in the input's dtype (docs/design.md, "Input bias").
""" + _EPILOGUE_DOC


def add_group_norm(
    input: Tensor,
    other: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    activation: Optional[str] = None,
    negative_slope: float = 0.01,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    multiplier: Optional[Tensor] = None,
    input_bias: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    _check_tensor("add_group_norm", "input", 1, input)
    _check_tensor("add_group_norm", "other", 2, other)
    _check_int("add_group_norm", "num_groups", 3, num_groups)
    _check_tensor("add_group_norm", "weight", 4, weight)
    _check_tensor("add_group_norm", "bias", 5, bias)
    _check_float("add_group_norm", "eps", 6, eps)
    _check_epilogue_types("add_group_norm", activation, negative_slope, scale, shift, residual, multiplier)
    _check_tensor("add_group_norm", "input_bias", None, input_bias)
    if _dtensor.DTensor is not None and isinstance(input, _dtensor.DTensor):  # docs/distributed.md, 'DTensor'
        _dtensor.check_supported()
    return _ADD_GROUP_NORM(input, other, num_groups, weight, bias, eps,
                           **_epilogue_keywords(input, activation, negative_slope, scale, shift, residual,
                                                multiplier, input_bias))


add_group_norm.__doc__ = """Group normalization of ``input + other``, returning ``(output, input + other)``.

    ``add_group_norm(x, r, G, ...)`` is ``s = x + r; (group_norm(s, G, ...), s)`` in fewer passes
    over memory: a resnet block's residual add before the next block's norm, whose sum the next
    block reads again (as ``fused_add_rmsnorm`` does for transformers). ``other`` has the input's
    shape and dtype (no broadcasting); ``input_bias`` (keyword-only, see :func:`group_norm`) is
    part of the sum: ``s = x + r + input_bias[..., None, None]``, in the input's dtype and memory
    format. Channels-last CUDA inputs that take the channels-last sweep compute ``s`` in float32
    and round it once; other inputs are given ``s`` by ATen's adds (docs/design.md, "Residual-add
    prologue"). Gradients flow through both outputs. The fusion backend
    (:mod:`fusednorm.fusion`) writes it for ``(shortcut + conv(h)) / 1`` before a group norm.
""" + _EPILOGUE_DOC


def instance_norm(
    input: Tensor,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    activation: Optional[str] = None,
    negative_slope: float = 0.01,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    multiplier: Optional[Tensor] = None,
) -> Tensor:
    _check_tensor("instance_norm", "input", 1, input)
    _check_tensor("instance_norm", "running_mean", 2, running_mean)
    _check_tensor("instance_norm", "running_var", 3, running_var)
    _check_tensor("instance_norm", "weight", 4, weight)
    _check_tensor("instance_norm", "bias", 5, bias)
    if type(use_input_stats) is not bool:
        raise _type_error("instance_norm", "use_input_stats", 6, "bool", use_input_stats)
    _check_float("instance_norm", "momentum", 7, momentum)
    _check_float("instance_norm", "eps", 8, eps)
    if _dtensor.DTensor is not None and isinstance(input, _dtensor.DTensor):  # docs/distributed.md, 'DTensor'
        return _dtensor.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps,
                                      activation=activation, negative_slope=negative_slope, scale=scale, shift=shift,
                                      residual=residual, multiplier=multiplier)
    if use_input_stats:
        _verify_spatial_size(input.size())
    if _no_operands(scale, shift, residual, multiplier):
        if activation is not None:
            _check_activation_types("instance_norm", activation, negative_slope)
        return _instance_norm_without_operands(input, running_mean, running_var, weight, bias, use_input_stats,
                                               momentum, eps, activation, negative_slope)
    _check_epilogue_types("instance_norm", activation, negative_slope, scale, shift, residual, multiplier)
    return _INSTANCE_NORM(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps,
                          **_epilogue_keywords(input, activation, negative_slope, scale, shift, residual, multiplier))


instance_norm.__doc__ = """Instance normalization, as :func:`torch.nn.functional.instance_norm`.

    With ``use_input_stats`` each (sample, channel) is normalized by its own statistics and the
    running statistics, when given, are updated in place:
    ``running = (1 - momentum) * running + momentum * batch_mean(statistic)``, the variance unbiased.
    Without it, the running statistics normalize the input.
""" + _EPILOGUE_DOC


def _register_torchscript_builtins() -> None:
    # Private but long-stable TorchScript hook (torch.nn.functional's own functions use it).
    from torch.jit._builtins import _register_builtin

    _register_builtin(group_norm, "fusednorm::group_norm")
    _register_builtin(add_group_norm, "fusednorm::add_group_norm")
    _register_builtin(instance_norm, "fusednorm::instance_norm")


_register_torchscript_builtins()
