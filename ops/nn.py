"""Drop-in replacements for torch.nn.GroupNorm and torch.nn.InstanceNorm1d/2d/3d.

Each subclasses its torch.nn counterpart, so constructor arguments, input checks, exceptions,
warnings, train/eval behaviour, state_dict keys and checkpoint loading are PyTorch's own; only the
computation goes through fusednorm's ops. Two additions: a keyword-only ``activation`` (and
``negative_slope``) at construction, fused after the normalization, and the optional epilogue
operands ``scale``, ``shift``, ``residual`` and ``multiplier`` of :func:`fusednorm.group_norm`
as (keyword) arguments of ``forward``. Neither adds parameters or buffers: a module with an
activation loads a plain torch.nn checkpoint.

``FrameGroupNorm`` and ``AdaGroupNorm`` have no torch.nn counterpart: the group norm of each
frame of a video, as diffusers' Mochi VAE computes it, and a group norm modulated by an embedding,
as diffusers' ``AdaGroupNorm`` computes it (``fusednorm.convert`` puts each in place of that
module).
"""

import inspect
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import functional as F

__all__ = ["AdaGroupNorm", "FrameGroupNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"]


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
        self.activation = F.check_activation(activation)
        self.negative_slope = negative_slope

    sig = inspect.signature(torch_cls.__init__)
    extra = [
        inspect.Parameter("activation", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[str]),
        inspect.Parameter("negative_slope", inspect.Parameter.KEYWORD_ONLY, default=0.01, annotation=float),
    ]
    __init__.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + extra)
    return __init__


class GroupNorm(torch.nn.GroupNorm):
    """Group Normalization over a mini-batch (as :class:`torch.nn.GroupNorm`), computed by
    fusednorm's fused kernels, with an optional activation and epilogue in the same pass.

    The input's channels are split into ``num_groups`` groups; each group of each sample is
    normalized by its own mean and (biased) variance, then scaled and shifted per channel::

        y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias

    Args:
        num_groups: number of groups to separate the channels into (divides ``num_channels``).
        num_channels: number of channels C expected in the input.
        eps: added to the variance for numerical stability (default 1e-5).
        affine: learnable per-channel ``weight`` (ones) and ``bias`` (zeros) (default True).
        device, dtype: of the parameters (factory keywords, as torch.nn's).
        activation: ``None`` (default), ``"silu"`` (alias ``"swish"``), ``"gelu"``,
            ``"gelu_tanh"``, ``"relu"``, ``"leaky_relu"`` or ``"mish"``: applied to the normalized
            output in the same pass
            (keyword-only; adds no parameter or buffer, so torch.nn checkpoints still load).
        negative_slope: the slope of ``"leaky_relu"`` for negative inputs (default 0.01;
            keyword-only, ignored by the other activations).

    Epilogue operands of ``forward(input, scale=None, shift=None, residual=None, multiplier=None)``
    (each optional, fused into the same pass over memory, applied in this order)::

        z = normalize(input) * weight + bias
        z = z * (1 + scale) + shift    # scale, shift: (N, C) or (N, C, 1, ..., 1) (AdaGN / FiLM)
        z = z + residual               # residual: input's shape (a skip connection)
        z = act(z)                     # the module's activation, if any
        z = z * multiplier             # multiplier: input's shape (a gate)

    Gradients flow to every tensor operand. ``residual`` and ``multiplier`` are cast to the
    input's dtype; ``scale`` and ``shift`` are used in float32 (float64 for float64 input).

    Shape:
        - Input: (N, C, *); channels_last and channels_last_3d inputs keep their memory format.
        - Output: (N, C, *), the input's shape, dtype and memory format.

    Everything else (argument checks and their exceptions, ``state_dict`` keys, ``extra_repr``)
    is :class:`torch.nn.GroupNorm`'s, of which this is a subclass.

    Example::

        >>> norm = fusednorm.nn.GroupNorm(32, 320, activation="silu")
        >>> x = torch.randn(2, 320, 64, 64)
        >>> y = norm(x)                                   # silu(group_norm(x))
        >>> y = norm(x, scale=emb_scale, shift=emb_shift) # emb_*: (2, 320) time embedding
    """

    __init__ = _init_with_activation(torch.nn.GroupNorm)

    def forward(self, input: Tensor, scale: Optional[Tensor] = None, shift: Optional[Tensor] = None,
                residual: Optional[Tensor] = None, multiplier: Optional[Tensor] = None) -> Tensor:
        """The normalization of ``input``, then the epilogue with the given operands (see the
        class docstring): ``scale``/``shift`` of shape (N, C) or (N, C, 1, ..., 1), ``residual``
        and ``multiplier`` of the input's shape."""
        # The common call (a plain tensor, no operand) goes to the op directly: the op performs
        # F.group_norm's value checks itself, and the Python layers in between cost more host time
        # than nn.GroupNorm's whole call (docs/design.md, "Host time"). Anything else (operands,
        # a DTensor or other subclass, an input F.group_norm would reject by its own message)
        # takes F.group_norm.
        if not torch.jit.is_scripting():
            if F._plain_call(input, scale, shift, residual, multiplier) and input.numel() >= 2 * self.num_groups:
                return F._group_norm_without_operands(input, self.num_groups, self.weight, self.bias, self.eps,
                                                      self.activation, self.negative_slope)
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps,
                            activation=self.activation, negative_slope=self.negative_slope,
                            scale=scale, shift=shift, residual=residual, multiplier=multiplier)

    def extra_repr(self) -> str:
        return super().extra_repr() + _activation_repr(self.activation, self.negative_slope)


class FrameGroupNorm(torch.nn.Module):
    """Group Normalization of each frame of a video on its own, computed by fusednorm's fused
    kernels: the input (N, C, T, *) is normalized as the batch of its N * T frames (N * T, C, *),
    each frame's groups by their own mean and (biased) variance, then scaled and shifted per
    channel, then the activation, if any.

    It computes what diffusers' ``MochiChunkedGroupNorm3D`` computes (which normalizes the frames
    8 at a time and concatenates the chunks), in one call; :func:`fusednorm.convert` puts it in
    that module's place, where a following activation can then be folded into it.

    Args:
        num_groups, num_channels, eps, affine, device, dtype: as :class:`torch.nn.GroupNorm`'s,
            whose module this one holds as ``norm_layer`` (so its parameters are
            ``norm_layer.weight`` and ``norm_layer.bias``, the ``state_dict`` keys of Mochi's
            module).
        activation, negative_slope: as :class:`fusednorm.nn.GroupNorm`'s (keyword-only).

    Shape:
        - Input: (N, C, T, *).
        - Output: the input's shape and dtype; the frames' result (N * T, C, *) viewed back, as
          Mochi's module returns it.

    Example::

        >>> norm = fusednorm.nn.FrameGroupNorm(32, 128, activation="silu")
        >>> video = torch.randn(1, 128, 7, 60, 106)
        >>> y = norm(video)   # silu of each frame's group norm
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None, *, activation: Optional[str] = None, negative_slope: float = 0.01) -> None:
        super().__init__()
        self.norm_layer = torch.nn.GroupNorm(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        self.activation = F.check_activation(activation)
        self.negative_slope = negative_slope

    def forward(self, input: Tensor) -> Tensor:
        # The frames (N * T, C, *) as Mochi's module takes them (a copy where no view can be one).
        frames = input.transpose(1, 2).flatten(0, 1)
        norm = self.norm_layer
        out = F.group_norm(frames, norm.num_groups, norm.weight, norm.bias, norm.eps,
                           activation=self.activation, negative_slope=self.negative_slope)
        return out.unflatten(0, (input.shape[0], input.shape[2])).transpose(1, 2)

    def extra_repr(self) -> str:
        return _activation_repr(self.activation, self.negative_slope).lstrip(", ")


# diffusers' get_activation: the activations an AdaGroupNorm's act_fn names, by their modules.
_EMBEDDING_ACTIVATIONS = {"swish": torch.nn.SiLU, "silu": torch.nn.SiLU, "mish": torch.nn.Mish,
                          "gelu": torch.nn.GELU, "relu": torch.nn.ReLU}


class AdaGroupNorm(torch.nn.Module):
    """Group Normalization modulated by an embedding (AdaGN), computed by fusednorm's fused
    kernels: what diffusers' ``AdaGroupNorm`` computes, the modulation (and an activation) in the
    normalization's pass over memory::

        emb = linear(act(emb))                  # (N, 2 * out_dim)
        scale, shift = emb.chunk(2, dim=1)      # (N, out_dim) each
        y = group_norm(input, num_groups, eps=eps) * (1 + scale) + shift
        y = activation(y)                       # the module's fused activation, if any

    :func:`fusednorm.convert` puts it in place of diffusers' module (the same ``linear`` and
    ``act``, so the same ``state_dict`` keys), where a following activation can then be folded
    into it (diffusers' ``ResnetBlockCondNorm2D``).

    Args:
        embedding_dim: size of the embedding.
        out_dim: number of channels C of the input.
        num_groups: number of groups to separate the channels into (divides C).
        act_fn: ``None`` (default) or the embedding's activation, as diffusers names it:
            ``"silu"`` / ``"swish"``, ``"mish"``, ``"gelu"`` or ``"relu"``.
        eps: added to the variance for numerical stability (default 1e-5).
        activation, negative_slope: the output's fused activation, as
            :class:`fusednorm.nn.GroupNorm`'s (keyword-only).
        device, dtype: of ``linear``'s parameters (keyword-only).

    Shape:
        - Input: (N, C, H, W) and the embedding (N, embedding_dim) or (1, embedding_dim), of the
          input's dtype; channels_last inputs keep their memory format. Other shapes and dtypes
          take diffusers' composition (``emb[:, :, None, None]`` broadcast against the input, in
          torch's type promotion), then the activation.
        - Output: the input's shape.

    Example::

        >>> norm = fusednorm.nn.AdaGroupNorm(1280, 320, 32, activation="silu")
        >>> y = norm(torch.randn(2, 320, 64, 64), torch.randn(2, 1280))
    """

    def __init__(self, embedding_dim: int, out_dim: int, num_groups: int, act_fn: Optional[str] = None,
                 eps: float = 1e-5, *, activation: Optional[str] = None, negative_slope: float = 0.01,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.num_groups = num_groups
        self.eps = eps
        if act_fn is None:
            self.act = None
        elif act_fn.lower() in _EMBEDDING_ACTIVATIONS:
            self.act = _EMBEDDING_ACTIVATIONS[act_fn.lower()]()
        else:
            raise ValueError(f"activation function {act_fn} not found in ACT2FN mapping "
                             f"{list(_EMBEDDING_ACTIVATIONS)}")
        self.linear = torch.nn.Linear(embedding_dim, out_dim * 2, device=device, dtype=dtype)
        self.activation = F.check_activation(activation)
        self.negative_slope = negative_slope

    def forward(self, input: Tensor, emb: Tensor) -> Tensor:
        if self.act is not None:
            emb = self.act(emb)
        emb = self.linear(emb)
        if (input.dim() == 4 and emb.dim() == 2 and (emb.shape[0] == 1 or emb.shape[0] == input.shape[0])
                and emb.dtype == input.dtype):
            scale, shift = emb.expand(input.shape[0], -1).chunk(2, dim=1)
            return F.group_norm(input, self.num_groups, eps=self.eps, activation=self.activation,
                                negative_slope=self.negative_slope, scale=scale, shift=shift)
        scale, shift = emb[:, :, None, None].chunk(2, dim=1)
        out = torch.nn.functional.group_norm(input, self.num_groups, eps=self.eps) * (1 + scale) + shift
        return F.torch_activation(out, self.activation, self.negative_slope)

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, eps={self.eps}" + _activation_repr(self.activation, self.negative_slope)


class _InstanceNormMixin:
    """forward of torch.nn's _InstanceNorm (checks, the num_features warning, inputs without a
    batch dimension), extended with the epilogue; written out because TorchScript cannot call
    super().forward."""

    def forward(self, input: Tensor, scale: Optional[Tensor] = None, shift: Optional[Tensor] = None,
                residual: Optional[Tensor] = None, multiplier: Optional[Tensor] = None) -> Tensor:
        """The normalization of ``input``, then the epilogue with the given operands (see the
        class docstring): ``scale``/``shift`` of shape (N, C) or (N, C, 1, ..., 1), ``residual``
        and ``multiplier`` of the input's shape."""
        # The common call (a plain batched tensor of num_features channels, no operand) goes to the
        # op directly, as GroupNorm's does: the op performs F.instance_norm's value checks itself.
        # The rest takes torch.nn's checks below, and an input of one spatial element, which the op
        # rejects in its own wording of the size, F.instance_norm.
        if not torch.jit.is_scripting():
            if (F._plain_call(input, scale, shift, residual, multiplier)
                    and input.dim() == self._NO_BATCH_DIM + 1 and input.size(1) == self.num_features
                    and input.numel() != input.size(0) * self.num_features):
                return F._instance_norm_without_operands(
                    input, self.running_mean, self.running_var, self.weight, self.bias,
                    self.training or not self.track_running_stats,
                    self.momentum if self.momentum is not None else 0.0, self.eps, self.activation,
                    self.negative_slope)
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


_INSTANCE_NORM_DOC = """Instance Normalization over {d}d inputs (as :class:`torch.nn.InstanceNorm{d}d`), computed
    by fusednorm's fused kernels, with an optional activation and epilogue in the same pass.

    Each channel of each sample is normalized by its own mean and (biased) variance::

        y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias

    Args:
        num_features: number of channels C expected in the input.
        eps: added to the variance for numerical stability (default 1e-5).
        momentum: of the running statistics' update (default 0.1; None leaves them as they
            are, as torch.nn's InstanceNorm does).
        affine: learnable per-channel ``weight`` and ``bias`` (default False).
        track_running_stats: keep running mean and variance and use them in eval mode (default
            False).
        device, dtype: of the parameters and buffers (factory keywords, as torch.nn's).
        activation: ``None`` (default), ``"silu"`` (alias ``"swish"``), ``"gelu"``,
            ``"gelu_tanh"``, ``"relu"``, ``"leaky_relu"`` or ``"mish"``: applied to the normalized
            output in the same pass
            (keyword-only; adds no parameter or buffer, so torch.nn checkpoints still load).
        negative_slope: the slope of ``"leaky_relu"`` for negative inputs (default 0.01;
            keyword-only, ignored by the other activations).

    Epilogue operands of ``forward(input, scale=None, shift=None, residual=None, multiplier=None)``
    (each optional, fused into the same pass over memory, applied in this order)::

        z = normalize(input) * weight + bias
        z = z * (1 + scale) + shift    # scale, shift: (N, C) or (N, C, 1, ...) (AdaGN / FiLM)
        z = z + residual               # residual: input's shape (a skip connection)
        z = act(z)                     # the module's activation, if any
        z = z * multiplier             # multiplier: input's shape (a gate)

    Gradients flow to every tensor operand. ``residual`` and ``multiplier`` are cast to the
    input's dtype; ``scale`` and ``shift`` are used in float32 (float64 for float64 input).

    Shape:
        - Input: {shape} (no batch dimension: operands then have none either).
        - Output: the input's shape, dtype and memory format.

    Everything else (argument checks and their exceptions and warnings, running statistics,
    ``state_dict`` keys) is :class:`torch.nn.InstanceNorm{d}d`'s, of which this is a subclass.
    """


class InstanceNorm1d(_InstanceNormMixin, torch.nn.InstanceNorm1d):
    __doc__ = _INSTANCE_NORM_DOC.format(d=1, shape="(N, C, L) or (C, L)")

    __init__ = _init_with_activation(torch.nn.InstanceNorm1d)
    _NO_BATCH_DIM = 2


class InstanceNorm2d(_InstanceNormMixin, torch.nn.InstanceNorm2d):
    __doc__ = _INSTANCE_NORM_DOC.format(d=2, shape="(N, C, H, W) or (C, H, W)")

    __init__ = _init_with_activation(torch.nn.InstanceNorm2d)
    _NO_BATCH_DIM = 3


class InstanceNorm3d(_InstanceNormMixin, torch.nn.InstanceNorm3d):
    __doc__ = _INSTANCE_NORM_DOC.format(d=3, shape="(N, C, D, H, W) or (C, D, H, W)")

    __init__ = _init_with_activation(torch.nn.InstanceNorm3d)
    _NO_BATCH_DIM = 4
