"""Drop-in replacements for torch.nn.GroupNorm and torch.nn.InstanceNorm1d/2d/3d.

Each subclasses its torch.nn counterpart, so constructor arguments, input checks, exceptions,
warnings, train/eval behaviour, state_dict keys and checkpoint loading are PyTorch's own; only the
computation goes through fusednorm's ops. Two additions: a keyword-only ``activation`` (and
``negative_slope``) at construction, fused after the normalization, and the optional epilogue
operands ``scale``, ``shift``, ``residual`` and ``multiplier`` of :func:`fusednorm.group_norm`
as (keyword) arguments of ``forward``. Neither adds parameters or buffers: a module with an
activation loads a plain torch.nn checkpoint.
"""

import inspect
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import functional as F

__all__ = ["GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"]


def _check_activation(activation: Optional[str]) -> Optional[str]:
    """The activation the module keeps: what the functions accept, "none" kept as None."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be None or a str, not {type(activation).__name__}")
    if activation is not None and activation not in F.ACTIVATION_NAMES:
        raise ValueError(
            f"Unknown activation '{activation}': expected None or one of "
            + ", ".join(f"'{a}'" for a in F.ACTIVATION_NAMES)
        )
    return None if activation == "none" else activation


def _activation_repr(activation: Optional[str], negative_slope: float) -> str:
    if activation is None:
        return ""
    if activation == "leaky_relu":
        return f", activation='{activation}', negative_slope={negative_slope}"
    return f", activation='{activation}'"


def _init_with_activation(torch_cls):
    """An __init__ taking torch_cls's arguments (whatever this torch version's are) plus the
    keyword-only activation and negative_slope; its signature says so."""

    def __init__(self, *args, activation: Optional[str] = None, negative_slope: float = 0.01, **kwargs) -> None:
        torch_cls.__init__(self, *args, **kwargs)
        self.activation = _check_activation(activation)
        self.negative_slope = negative_slope

    sig = inspect.signature(torch_cls.__init__)
    extra = [
        inspect.Parameter("activation", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[str]),
        inspect.Parameter("negative_slope", inspect.Parameter.KEYWORD_ONLY, default=0.01, annotation=float),
    ]
    __init__.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + extra)
    return __init__


class GroupNorm(torch.nn.GroupNorm):
    __doc__ = torch.nn.GroupNorm.__doc__
    __init__ = _init_with_activation(torch.nn.GroupNorm)

    def forward(self, input: Tensor, scale: Optional[Tensor] = None, shift: Optional[Tensor] = None,
                residual: Optional[Tensor] = None, multiplier: Optional[Tensor] = None) -> Tensor:
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps,
                            activation=self.activation, negative_slope=self.negative_slope,
                            scale=scale, shift=shift, residual=residual, multiplier=multiplier)

    def extra_repr(self) -> str:
        return super().extra_repr() + _activation_repr(self.activation, self.negative_slope)


class _InstanceNormMixin:
    """forward of torch.nn's _InstanceNorm (checks, the num_features warning, inputs without a
    batch dimension), extended with the epilogue; written out because TorchScript cannot call
    super().forward."""

    def forward(self, input: Tensor, scale: Optional[Tensor] = None, shift: Optional[Tensor] = None,
                residual: Optional[Tensor] = None, multiplier: Optional[Tensor] = None) -> Tensor:
        self._check_input_dim(input)
        # Dynamo in torch 2.1 cannot call _get_no_batch_dim on a subclass; TorchScript cannot
        # read a class attribute: each gets its own spelling.
        if torch.jit.is_scripting():
            no_batch_dim = self._get_no_batch_dim()
        else:
            no_batch_dim = self._NO_BATCH_DIM
        feature_dim = input.dim() - no_batch_dim
        if input.size(feature_dim) != self.num_features:
            if self.affine:
                raise ValueError(
                    f"expected input's size at dim={feature_dim} to match num_features"
                    f" ({self.num_features}), but got: {input.size(feature_dim)}."
                )
            else:
                warnings.warn(
                    f"input's size at dim={feature_dim} does not match num_features. "
                    "You can silence this warning by not passing in num_features, "
                    "which is not used because affine=False",
                    stacklevel=2,
                )
        if input.dim() == no_batch_dim:
            # One sample: operands gain the batch dimension with it.
            if scale is not None:
                scale = scale.unsqueeze(0)
            if shift is not None:
                shift = shift.unsqueeze(0)
            if residual is not None:
                residual = residual.unsqueeze(0)
            if multiplier is not None:
                multiplier = multiplier.unsqueeze(0)
            return self._apply_fused(input.unsqueeze(0), scale, shift, residual, multiplier).squeeze(0)
        return self._apply_fused(input, scale, shift, residual, multiplier)

    def _apply_fused(self, input: Tensor, scale: Optional[Tensor], shift: Optional[Tensor],
                     residual: Optional[Tensor], multiplier: Optional[Tensor]) -> Tensor:
        return F.instance_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            self.momentum if self.momentum is not None else 0.0,
            self.eps,
            activation=self.activation,
            negative_slope=self.negative_slope,
            scale=scale,
            shift=shift,
            residual=residual,
            multiplier=multiplier,
        )

    def _apply_instance_norm(self, input: Tensor) -> Tensor:
        return self._apply_fused(input, None, None, None, None)

    def extra_repr(self) -> str:
        return super().extra_repr() + _activation_repr(self.activation, self.negative_slope)


class InstanceNorm1d(_InstanceNormMixin, torch.nn.InstanceNorm1d):
    __doc__ = torch.nn.InstanceNorm1d.__doc__
    __init__ = _init_with_activation(torch.nn.InstanceNorm1d)
    _NO_BATCH_DIM = 2


class InstanceNorm2d(_InstanceNormMixin, torch.nn.InstanceNorm2d):
    __doc__ = torch.nn.InstanceNorm2d.__doc__
    __init__ = _init_with_activation(torch.nn.InstanceNorm2d)
    _NO_BATCH_DIM = 3


class InstanceNorm3d(_InstanceNormMixin, torch.nn.InstanceNorm3d):
    __doc__ = torch.nn.InstanceNorm3d.__doc__
    __init__ = _init_with_activation(torch.nn.InstanceNorm3d)
    _NO_BATCH_DIM = 4
