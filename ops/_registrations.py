"""Fake (meta) kernels for the kernel ops defined in csrc/ops.cpp.

The composite ops (group_norm, instance_norm) need none: they decompose into the kernel ops.
replication_pad's is ATen's pad on the fake input, in the input's suggested memory format.
Fake kernels go through torch.library.register_fake (torch >= 2.4) or its older equivalents (see
_compat). Autograd is in C++ (csrc/autograd.cpp), so that a backward runs no Python.
"""

from typing import List, Optional

import torch
from torch import Tensor

from ._compat import register_fake

# -- shared by the fake kernels ------------------------------------------------------------------


def _check_same_device(name: str, t: Tensor, input: Tensor) -> None:
    torch._check(
        t.device == input.device,
        lambda: f"Expected all tensors to be on the same device, but found input on {input.device} and {name} on {t.device}",
    )


def _check_group_norm_args(input: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor]) -> None:
    # The same checks, messages and exception types as check_group_norm_args in csrc/group_norm.cpp,
    # so that torch.compile rejects bad arguments at trace time as eager does at run time.
    torch._check(input.dim() >= 2, lambda: f"Expected at least 2 dimensions for input tensor but received {input.dim()}")
    if input.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise NotImplementedError(f"\"fusednorm::group_norm\" not implemented for '{input.dtype}'")
    torch._check(num_groups > 0, lambda: f"Expected num_groups to be positive, but got num_groups={num_groups}")
    C = input.shape[1]
    torch._check(
        C % num_groups == 0,
        lambda: "Expected number of channels in input to be divisible by num_groups, but got input "
        f"of shape {tuple(input.shape)} and num_groups={num_groups}",
    )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        _check_same_device(name, p, input)
        torch._check(
            p.dim() == 1 and p.numel() == C,
            lambda: f"Expected {name} to be a vector of size equal to the number of channels in input, "
            f"but got {name} of shape {tuple(p.shape)} and input of shape {tuple(input.shape)}",
        )
        reduced = input.dtype in (torch.bfloat16, torch.float16)
        torch._check(
            p.dtype == input.dtype or (reduced and p.dtype == torch.float32),
            lambda: f"Expected {name} to have the input's dtype ({input.dtype}), but got {p.dtype}",
        )


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    # Mean and rstd: float32, float64 for float64 input (stats_dtype in C++).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _suggested_memory_format(t: Tensor) -> torch.memory_format:
    # Tensor::suggest_memory_format() of C++, which Python does not expose as a method.
    try:
        from torch._prims_common import suggest_memory_format
    except ImportError:  # pragma: no cover (every supported torch has it)
        return torch.contiguous_format
    return suggest_memory_format(t)


def _suggests_channels_last(t: Tensor) -> bool:
    return _suggested_memory_format(t) in (torch.channels_last, torch.channels_last_3d)


def _has_strides_of(t: Tensor, channels_last: bool) -> bool:
    # has_strides_of() in csrc/group_norm.cpp.
    v = t.movedim(1, -1) if channels_last else t
    expected = 1
    for size, stride in reversed(list(zip(v.shape, v.stride()))):
        if size != 1 and stride != expected:
            return False
        expected *= max(size, 1)
    return True


def _is_channels_last(t: Tensor) -> bool:
    # Mirrors layout_for() in csrc/group_norm.cpp: the output strides must match the kernels'.
    if t.numel() == 0:
        return t.dim() >= 3 and not _has_strides_of(t, False) and _has_strides_of(t, True)
    if t.is_contiguous():
        return False
    if t.dim() >= 3 and t.movedim(1, -1).is_contiguous():
        return True
    return _suggests_channels_last(t)


def _empty_like_kernel_output(t: Tensor, dtype: torch.dtype) -> Tensor:
    if _is_channels_last(t):
        return t.new_empty(t.movedim(1, -1).shape, dtype=dtype).movedim(-1, 1)
    return t.new_empty(t.shape, dtype=dtype)


# -- group_norm_forward ----------------------------------------------------------------------------


@register_fake("group_norm_forward")
def _group_norm_forward_fake(input, num_groups, weight, bias, eps):
    _check_group_norm_args(input, num_groups, weight, bias)
    stats_shape = (input.shape[0], num_groups)
    return (
        _empty_like_kernel_output(input, input.dtype),
        input.new_empty(stats_shape, dtype=_stats_dtype(input.dtype)),
        input.new_empty(stats_shape, dtype=_stats_dtype(input.dtype)),
    )


# -- group_norm_backward -----------------------------------------------------------------------------


@register_fake("group_norm_backward")
def _group_norm_backward_fake(grad_out, input, mean, rstd, weight, num_groups, output_mask: List[bool]):
    # As check_group_norm_backward_args in csrc/group_norm.cpp.
    _check_group_norm_args(input, num_groups, weight, None)
    torch._check(grad_out.shape == input.shape, lambda: f"Expected grad_out of the input's shape {tuple(input.shape)}, but got {tuple(grad_out.shape)}")
    torch._check(grad_out.dtype == input.dtype, lambda: f"Expected grad_out of the input's dtype {input.dtype}, but got {grad_out.dtype}")
    stats_dtype = _stats_dtype(input.dtype)
    for name, stat in (("mean", mean), ("rstd", rstd)):
        torch._check(
            stat.dim() == 2 and stat.shape[0] == input.shape[0] and stat.shape[1] == num_groups and stat.dtype == stats_dtype,
            lambda: f"Expected {name} to be a {stats_dtype} tensor of shape ({input.shape[0]}, {num_groups}), but got {stat.dtype} of shape {tuple(stat.shape)}",
        )
    C = input.shape[1]
    grad_input = _empty_like_kernel_output(input, input.dtype) if output_mask[0] else input.new_empty((0,))
    # Parameter gradients in the parameter's dtype (param_grad_dtype in csrc/group_norm.cpp): the
    # weight's for both, as this op is not given the bias.
    param_dtype = weight.dtype if weight is not None else stats_dtype
    grad_weight = input.new_empty((C,) if output_mask[1] else (0,), dtype=param_dtype)
    grad_bias = input.new_empty((C,) if output_mask[2] else (0,), dtype=param_dtype)
    return grad_input, grad_weight, grad_bias


# -- fused_group_norm_forward / fused_group_norm_backward ------------------------------------------

_ACTIVATION_NAMES = ("none", "silu", "gelu", "gelu_tanh", "relu", "leaky_relu", "mish")


def _check_epilogue_args(input, scale, shift, residual, activation, multiplier) -> None:
    # As make_epilogue in csrc/group_norm.cpp.
    if activation not in _ACTIVATION_NAMES:
        raise ValueError(
            f"Unknown activation '{activation}': expected one of " + ", ".join(f"'{a}'" for a in _ACTIVATION_NAMES)
        )
    N, C = input.shape[0], input.shape[1]
    for name, t in (("scale", scale), ("shift", shift)):
        if t is None:
            continue
        _check_same_device(name, t, input)
        torch._check(
            t.dim() >= 2 and t.shape[0] == N and t.shape[1] == C and all(s == 1 for s in t.shape[2:]),
            lambda: f"Expected {name} of shape (N, C) or (N, C, 1, ..., 1) with (N, C) = ({N}, {C}), but got {name} of shape {tuple(t.shape)}",
        )
        torch._check_type(t.dtype.is_floating_point, lambda: f"Expected {name} to be a floating-point tensor, but got {t.dtype}")
    for name, t in (("residual", residual), ("multiplier", multiplier)):
        if t is None:
            continue
        _check_same_device(name, t, input)
        torch._check(t.shape == input.shape, lambda: f"Expected {name} of the input's shape {tuple(input.shape)}, but got {tuple(t.shape)}")
        torch._check_type(t.dtype == input.dtype, lambda: f"Expected {name} to have the input's dtype ({input.dtype}), but got {t.dtype}")


def _check_input_bias(input: Tensor, input_bias: Tensor) -> None:
    # As check_input_bias in csrc/group_norm.cpp.
    _check_same_device("input_bias", input_bias, input)
    N, C = input.shape[0], input.shape[1]
    t = input_bias
    if t.dim() == 1:
        ok = t.shape[0] == C
    else:
        ok = 2 <= t.dim() <= input.dim() and t.shape[0] == N and t.shape[1] == C and all(s == 1 for s in t.shape[2:])
    torch._check(
        ok,
        lambda: f"Expected input_bias of shape (C,), (N, C) or (N, C, 1, ..., 1) with (N, C) = ({N}, {C}), but got input_bias of shape {tuple(t.shape)}",
    )
    torch._check_type(
        t.dtype == input.dtype, lambda: f"Expected input_bias to have the input's dtype ({input.dtype}), but got {t.dtype}"
    )


@register_fake("fused_group_norm_forward")
def _fused_group_norm_forward_fake(input, num_groups, weight, bias, eps, scale, shift, residual, activation,
                                   negative_slope, multiplier, input_bias=None):
    _check_group_norm_args(input, num_groups, weight, bias)
    _check_epilogue_args(input, scale, shift, residual, activation, multiplier)
    if input_bias is not None:
        _check_input_bias(input, input_bias)
    return _group_norm_forward_fake(input, num_groups, weight, bias, eps)


# -- add_group_norm_forward -------------------------------------------------------------------------


def _check_addend(input: Tensor, other: Tensor) -> None:
    # As check_addend in csrc/group_norm.cpp.
    _check_same_device("other", other, input)
    torch._check(
        other.shape == input.shape,
        lambda: f"Expected other of the input's shape {tuple(input.shape)}, but got other of shape {tuple(other.shape)}",
    )
    torch._check_type(
        other.dtype == input.dtype, lambda: f"Expected other to have the input's dtype ({input.dtype}), but got {other.dtype}"
    )


@register_fake("add_group_norm_forward")
def _add_group_norm_forward_fake(input, other, num_groups, weight, bias, eps, scale, shift, residual, activation,
                                 negative_slope, multiplier, input_bias=None):
    _check_group_norm_args(input, num_groups, weight, bias)  # group_norm's checks, then other's, as the kernels
    _check_addend(input, other)
    output, mean, rstd = _fused_group_norm_forward_fake(input, num_groups, weight, bias, eps, scale, shift, residual,
                                                        activation, negative_slope, multiplier, input_bias)
    return output, _empty_like_kernel_output(input, input.dtype), mean, rstd


@register_fake("fused_group_norm_backward")
def _fused_group_norm_backward_fake(grad_out, input, mean, rstd, weight, bias, num_groups, scale, shift, residual,
                                    activation, negative_slope, multiplier, output_mask: List[bool],
                                    sum_residual_multiplier_grads: bool = False):
    _check_group_norm_args(input, num_groups, weight, bias)
    _check_epilogue_args(input, scale, shift, residual, activation, multiplier)
    grad_input, grad_weight, _ = _group_norm_backward_fake(
        grad_out, input, mean, rstd, weight, num_groups, output_mask[:3]
    )
    stats_dtype = _stats_dtype(input.dtype)
    N, C = input.shape[0], input.shape[1]
    # Each parameter gradient in its parameter's dtype (param_grad_dtype in csrc/group_norm.cpp).
    bias_dtype = bias.dtype if bias is not None else weight.dtype if weight is not None else stats_dtype
    grad_bias = input.new_empty((C,) if output_mask[2] else (0,), dtype=bias_dtype)
    scale_dtype = scale.dtype if scale is not None else stats_dtype
    shift_dtype = shift.dtype if shift is not None else stats_dtype
    grad_scale = input.new_empty((N, C) if output_mask[3] else (0,), dtype=scale_dtype)
    grad_shift = input.new_empty((N, C) if output_mask[4] else (0,), dtype=shift_dtype)
    # With sum_residual_multiplier_grads, grad_residual holds both (csrc/group_norm.h).
    summed = sum_residual_multiplier_grads
    wants_residual = output_mask[5] or (summed and output_mask[6])
    wants_multiplier = output_mask[6] and not summed
    grad_residual = _empty_like_kernel_output(input, input.dtype) if wants_residual else input.new_empty((0,))
    grad_multiplier = _empty_like_kernel_output(input, input.dtype) if wants_multiplier else input.new_empty((0,))
    return grad_input, grad_weight, grad_bias, grad_scale, grad_shift, grad_residual, grad_multiplier


@register_fake("replication_pad")
def _replication_pad_fake(input, padding):
    # ATen's pad on the fake input (its shape and errors are the kernels', which are ATen's pad
    # wherever they do not apply), in the input's suggested memory format, as the op's output on
    # every device (ATen's CUDA pad returns a contiguous tensor, its CPU pad that format).
    return torch.nn.functional.pad(input, list(padding), mode="replicate").contiguous(
        memory_format=_suggested_memory_format(input))
