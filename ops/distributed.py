"""GroupNorm and InstanceNorm of a tensor split across processes (``fusednorm.distributed``).

Patch-parallel code holds plain local shards: rank r has the rows [a_r, b_r) of an activation whose
normalization statistics are those of the whole tensor. :func:`group_norm` and
:func:`instance_norm` take such a shard and a process group (NCCL on GPUs, gloo on CPU) and return
this rank's shard of the result of the whole-tensor op, with the same epilogue keywords as
:func:`fusednorm.group_norm`.

Communication (docs/distributed.md, 'Communication'): the forward makes ONE collective, an
all-gather of every rank's per-(sample, group) partial moments (count, mean, M2), which each rank
merges in rank order with Chan's formula; the backward makes ONE, an all-gather of the two
per-(sample, group) sums of the normalization's backward, added in rank order. Both carry
3 x N x G (2 x N x G) float64 numbers per rank, and every rank computes bitwise the same
statistics, whatever the backend's reduction order.

Gradients: the input's gradient is this rank's shard of the whole gradient; the gradients of
``weight``, ``bias``, ``scale`` and ``shift`` are this rank's share: their sum over the ranks is the
whole gradient (what DDP's all-reduce or a DTensor ``Partial`` placement adds up).

The same functions (:func:`sharded_forward`, :func:`backward_local`) serve the DTensor support
in ``fusednorm._dtensor``.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .functional import check_activation, torch_activation

__all__ = ["group_norm", "instance_norm", "is_available"]


def is_available() -> bool:
    """Whether torch.distributed is built into this torch (it is not on some platforms)."""
    return torch.distributed.is_available()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # The kernels' precision: float32, float64 for float64 input (docs/design.md, 'Numerics').
    return torch.float64 if dtype == torch.float64 else torch.float32


def _world(group) -> int:
    return torch.distributed.get_world_size(group)


def _all_gather(t: Tensor, group) -> List[Tensor]:
    # The list form of all_gather: gloo and NCCL both have it on every supported torch.
    parts = [torch.empty_like(t) for _ in range(_world(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


# -- statistics --------------------------------------------------------------------------------------


def _grouped(t: Tensor, num_groups: int) -> Tensor:
    # (N, C, *) -> (N, G, C/G, *), a view whatever the memory format (channels stay one dimension).
    return t.unflatten(1, (num_groups, t.shape[1] // num_groups))


def _stat_shape(grouped: Tensor) -> Tuple[int, ...]:
    # (N, G) statistics broadcast against a _grouped tensor (N, G, C/G, *).
    return tuple(grouped.shape[:2]) + (1,) * (grouped.dim() - 2)


def local_moments(x: Tensor, num_groups: int) -> Tensor:
    """(3, N, G) float64: this shard's element count, mean and sum of squared deviations (M2) per
    (sample, group), computed in the kernels' precision."""
    N = x.shape[0]
    count = x.numel() // max(N * num_groups, 1) if N * num_groups else 0
    moments = torch.zeros((3, N, num_groups), dtype=torch.float64, device=x.device)
    moments[0] = count
    if count > 0:
        # The kernels' own statistics: one read of x, where var_mean of an upcast copy made two
        # passes more over a tensor twice the size (bf16). Its output is dropped. eps = 0, so that
        # the variance is rstd^-2 with no eps to cancel (docs/distributed.md, 'Statistics').
        with torch.no_grad():
            dropped, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, num_groups, None, None, 0.0)
        moments[1] = mean.reshape(N, num_groups)
        if x.dtype == torch.float32:
            # The kernel's mean, rounded to float32, is off the centre it normalized on by up to
            # half an ulp of |mean| (5e-4 at 1e4), which the local normalize would add to every
            # output at float32's precision: moved by the mean of x - mean, whose values lie
            # near the spread. (16-bit outputs round coarser than that unless |mean| exceeds
            # ~6e4 spreads: a pass saved.) The kernel's dropped output holds x - mean.
            xg = _grouped(x, num_groups)
            centred = torch.sub(xg, mean.reshape(_stat_shape(xg)), out=_grouped(dropped, num_groups))
            moments[1] += centred.sum(dim=list(range(2, xg.dim()))).double() / count
        moments[2] = rstd.double().reshape(N, num_groups).pow(-2) * count
    return moments


def merge_moments(parts: Sequence[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """Chan et al.'s pairwise update over the ranks' (count, mean, M2), in rank order: no
    E[x^2] - E[x]^2 cancellation, and the same bits on every rank (docs/distributed.md,
    'Statistics'). Returns count, mean, M2 (float64)."""
    n, mean, m2 = parts[0][0], parts[0][1], parts[0][2]
    for p in parts[1:]:
        nb, mb, m2b = p[0], p[1], p[2]
        total = n + nb
        # An empty shard (uneven splits) adds nothing: its weight nb / total is 0.
        frac = torch.where(total > 0, nb / total.clamp(min=1), torch.zeros_like(total))
        delta = mb - mean
        mean = mean + delta * frac
        m2 = m2 + m2b + delta * delta * n * frac
        n = total
    return n, mean, m2


def _statistics(x: Tensor, num_groups: int, eps: float, group) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # The whole tensor's count, mean, rstd (float64) and this shard's moments: one all-gather.
    local = local_moments(x, num_groups)
    count, mean, m2 = merge_moments(_all_gather(local, group))
    return count, mean, torch.rsqrt(m2 / count + eps), local


def global_statistics(x: Tensor, num_groups: int, eps: float, group) -> Tuple[Tensor, Tensor, Tensor]:
    """mean and rstd of the whole tensor per (sample, group), in the kernels' stats dtype, and the
    whole tensor's element count per group (float64): one all-gather."""
    count, mean, rstd, _ = _statistics(x, num_groups, eps, group)
    stats_dtype = _compute_dtype(x.dtype)
    return mean.to(stats_dtype), rstd.to(stats_dtype), count


def _folded_affine(x: Tensor, weight, bias, scale, shift) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """weight, bias, 1 + scale, and w_eff, b_eff: the affine map and the epilogue's scale and shift
    as one per-(sample, channel) map, normalize(x) * w_eff + b_eff (epilogue.h), each (N, C)
    float64 (absent ones as the identity). The local normalize and backward give the kernels
    w_eff and b_eff in place of weight, bias, scale and shift."""
    N, C = x.shape[:2]

    def per_sample_channel(t: Optional[Tensor], default: float) -> Tensor:
        if t is None:
            return torch.full((N, C), default, dtype=torch.float64, device=x.device)
        return t.to(torch.float64).reshape(-1, C).expand(N, C)

    w, b = per_sample_channel(weight, 1.0), per_sample_channel(bias, 0.0)
    s1 = 1 + per_sample_channel(scale, 0.0)
    return w, b, s1, w * s1, b * s1 + per_sample_channel(shift, 0.0)


def sharded_forward(x: Tensor, num_groups: int, eps: float, group, weight=None, bias=None, scale=None, shift=None,
                    residual=None, activation=None, negative_slope=0.01, multiplier=None):
    """This shard's output of the whole-tensor group norm, and the whole tensor's mean, rstd (stats
    dtype) and count per group (float64): one all-gather.

    The normalize runs in the fused kernel (docs/distributed.md, 'Local normalize'): the kernel
    normalizes with the shard's own statistics, and a per-(sample, channel) scale and shift,
    folded with weight, bias and the epilogue's scale and shift, turn that into the normalize with
    the global ones: (x - m) * r = xhat_local * (r / r_local) + (m_local - m) * r."""
    count, mean, rstd, local = _statistics(x, num_groups, eps, group)
    stats_dtype = _compute_dtype(x.dtype)
    mean_s, rstd_s = mean.to(stats_dtype), rstd.to(stats_dtype)
    if x.numel() == 0 or eps <= 0:
        # An empty shard has nothing to normalize; without eps a constant shard's own rstd is inf.
        out = forward_local(x, mean_s, rstd_s, num_groups, weight, bias, scale, shift, residual, activation,
                            negative_slope, multiplier)
        return out, mean_s, rstd_s, count
    per_group = x.shape[1] // num_groups
    local_rstd = torch.rsqrt(local[2] / local[0] + eps)
    a = (rstd / local_rstd).repeat_interleave(per_group, dim=1)  # (N, C), float64
    b = ((local[1] - mean) * rstd).repeat_interleave(per_group, dim=1)
    w_eff, b_eff = _folded_affine(x, weight, bias, scale, shift)[3:]
    folded_scale = a * w_eff - 1
    folded_shift = b * w_eff + b_eff
    out, _, _ = torch.ops.fusednorm.fused_group_norm_forward(
        x, num_groups, None, None, eps, folded_scale.to(stats_dtype), folded_shift.to(stats_dtype),
        _in_dtype(residual, x.dtype), activation if activation is not None else "none", negative_slope,
        _in_dtype(multiplier, x.dtype))
    return out, mean_s, rstd_s, count


def _in_dtype(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


# -- the local computation with given statistics -----------------------------------------------------


def _per_channel(t: Tensor, rank: int) -> Tensor:
    return t.reshape((1, -1) + (1,) * (rank - 2))


def _per_sample_channel(t: Tensor, x: Tensor) -> Tensor:
    return t.reshape(x.shape[:2] + (1,) * (x.dim() - 2))


def _normalized(x: Tensor, mean: Tensor, rstd: Tensor, num_groups: int) -> Tensor:
    cdt = _compute_dtype(x.dtype)
    xg = _grouped(x.to(cdt), num_groups)
    return ((xg - mean.to(cdt).reshape(_stat_shape(xg))) * rstd.to(cdt).reshape(_stat_shape(xg))).flatten(1, 2)


def _epilogue_chain(xhat: Tensor, x: Tensor, weight, bias, scale, shift, residual, activation, negative_slope):
    """The affine map and the epilogue up to the activation's input, in the compute dtype:
    returns (affine output, activation input)."""
    cdt = xhat.dtype
    z = xhat
    if weight is not None:
        z = z * _per_channel(weight.to(cdt), x.dim())
    if bias is not None:
        z = z + _per_channel(bias.to(cdt), x.dim())
    affine = z
    if scale is not None:
        z = z * (1 + _per_sample_channel(scale.to(cdt), x))
    if shift is not None:
        z = z + _per_sample_channel(shift.to(cdt), x)
    if residual is not None:
        z = z + residual.to(cdt)
    return affine, z


def forward_local(x: Tensor, mean: Tensor, rstd: Tensor, num_groups: int, weight=None, bias=None, scale=None,
                  shift=None, residual=None, activation=None, negative_slope=0.01, multiplier=None) -> Tensor:
    """This shard's output given the (global) statistics: normalize, weight and bias, epilogue, as
    ATen ops in float32 (float64 for float64 input); the result in the input's dtype and memory
    format. sharded_forward's fallback (docs/distributed.md, 'Local normalize')."""
    xhat = _normalized(x, mean, rstd, num_groups)
    _, z = _epilogue_chain(xhat, x, weight, bias, scale, shift, residual, activation, negative_slope)
    z = torch_activation(z, activation, negative_slope)
    if multiplier is not None:
        z = z * multiplier.to(z.dtype)
    return z.to(x.dtype).contiguous(memory_format=_memory_format(x))


def _memory_format(x: Tensor) -> torch.memory_format:
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def backward_local(grad_out: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, count: Optional[Tensor], num_groups: int,
                   weight=None, bias=None, scale=None, shift=None, residual=None, activation=None,
                   negative_slope=0.01, multiplier=None, output_mask: Sequence[bool] = (True,) * 7,
                   group=None) -> List[Optional[Tensor]]:
    """The gradients of input, weight, bias, scale, shift, residual and multiplier (None where
    output_mask says no), this rank's share of the parameter gradients. With a process group the
    input's, weight's and scale's gradients take ONE all-gather of four per-(sample, group) sums,
    added in rank order; without one (group=None and count=None) the shard holds whole groups and
    nothing is communicated. ``count`` is the whole tensor's element count per group (float64),
    as global_statistics returns it.

    One fused backward kernel call on the shard (docs/distributed.md, 'Local backward'): weight,
    bias and the epilogue's scale and shift folded into one (N, C) scale and shift, so that the
    kernel's per-(sample, channel) sums of dp and of dp times x's distance from its mean give every
    parameter's gradient and this shard's group sums; the kernel's input gradient, taken with the
    shard's sums, is then moved to the whole tensor's in one elementwise pass."""
    cdt = _compute_dtype(x.dtype)
    N, C = x.shape[:2]
    G = num_groups
    f64 = torch.float64

    def per_group(t: Tensor) -> Tensor:  # (N, C) -> (N, G): summed over each group's channels
        return t.reshape(N, G, C // G).sum(-1)

    def to_channels(t: Tensor) -> Tensor:  # (N, G) -> (N, C)
        return t.repeat_interleave(C // G, dim=1)

    w, b, s1, w_eff, b_eff = _folded_affine(x, weight, bias, scale, shift)
    kernel_mask = [bool(output_mask[0]), False, False, True, True, bool(output_mask[5]), bool(output_mask[6])]
    dx, _, _, sum_dp_xc, sum_dp, grad_residual, grad_multiplier = torch.ops.fusednorm.fused_group_norm_backward(
        grad_out, x, mean, rstd, None, None, G, (w_eff - 1).to(cdt), b_eff.to(cdt), _in_dtype(residual, x.dtype),
        activation if activation is not None else "none", negative_slope, _in_dtype(multiplier, x.dtype),
        kernel_mask, False)
    # Per (n, c) over this shard: sum_dp = sum dp, sum_dp_xc = rstd * sum dp * (x - m_l). The
    # kernel centres its sums on the shard's own mean m_l (docs/design.md, 'Backward sums'), as
    # the single-device backward centres on the whole tensor's mean c: both are taken from the
    # sums of x (the saved mean is c rounded to the statistics' dtype).
    M = float(x.numel() // max(N * G, 1))
    r, mean_s = rstd.to(f64), mean.to(f64)
    xg = _grouped(x, G)
    shape = _stat_shape(xg)
    # x - mean in the compute dtype (a new tensor whatever x's dtype, its values near the spread,
    # so that its sum in the compute dtype keeps the local mean's digits); the correction below
    # reuses it.
    if x.is_cuda or x.dtype == cdt:
        centred = torch.sub(xg, mean.to(cdt).reshape(shape))
    else:  # the CPU's mixed-dtype subtraction runs element by element (~40x a conversion's time)
        centred = xg.to(cdt).sub_(mean.to(cdt).reshape(shape))
    X = centred.sum(dim=list(range(2, xg.dim()))).to(f64) + M * mean_s if M > 0 else torch.zeros_like(r)
    m_l = X / max(M, 1.0)
    sum_dp, sum_dp_xc = sum_dp.to(f64), sum_dp_xc.to(f64)
    # g = dp * w_eff; per group of this shard: A = sum g, T = rstd * sum g * (x - m_l). The ranks'
    # A, T, m_l * A and X, added in rank order, give the whole tensor's (ONE all-gather).
    A, T = per_group(w_eff * sum_dp), per_group(w_eff * sum_dp_xc)
    local = torch.stack([A, T, m_l * A, X])
    sums = local
    if group is not None and (output_mask[0] or output_mask[1] or output_mask[3]):
        parts = _all_gather(local, group)
        sums = parts[0]
        for p in parts[1:]:
            sums = sums + p
    whole = count if count is not None else torch.full_like(r, M)
    c = sums[3] / whole.clamp(min=1)  # the whole tensor's mean
    # sum dp * xhat per (n, c), xhat = (x - c) * rstd; the parameter gradients from it.
    sum_dp_xhat = sum_dp_xc + to_channels(r * (m_l - c)) * sum_dp
    grads: List[Optional[Tensor]] = [None] * 7
    if weight is not None and output_mask[1]:
        grads[1] = (s1 * sum_dp_xhat).sum(0).to(weight.dtype)
    if bias is not None and output_mask[2]:
        grads[2] = (s1 * sum_dp).sum(0).to(bias.dtype)
    if scale is not None and output_mask[3]:  # d/dscale of u * (1 + scale), u = xhat * weight + bias
        grads[3] = (w * sum_dp_xhat + b * sum_dp).reshape(scale.shape).to(scale.dtype)
    if shift is not None and output_mask[4]:
        grads[4] = sum_dp.reshape(shift.shape).to(shift.dtype)
    if residual is not None and output_mask[5]:
        grads[5] = grad_residual
    if multiplier is not None and output_mask[6]:
        grads[6] = grad_multiplier
    if output_mask[0]:
        if M > 0 and count is not None:  # (else the shard holds whole groups: the kernel's dx is it)
            # The kernel's dx is rstd * (g - A / M) - rstd^2 * T / M * (x - m_l); the whole
            # tensor's rstd * (g - A' / M') - rstd^2 * T' / M' * (x - c), with A' = sum A,
            # T' = sum T + rstd * (sum m_l * A - c * A') and M' its count. The difference is
            # k1 * (x - c) + rstd * (A / M - A' / M') + rstd^2 * T / M * (c - m_l),
            # k1 = rstd^2 * (T / M - T' / M'); x - c is taken as `centred` - (c - mean), so that
            # it keeps its digits when |c| >> the spread.
            T_whole = sums[1] + r * (sums[2] - c * sums[0])
            k1 = r * r * (T / M - T_whole / whole)
            k0 = r * (A / M - sums[0] / whole) + r * r * T / M * (c - m_l) - k1 * (c - mean_s)
            moved = torch.addcmul(_grouped(dx, G), centred, k1.to(cdt).reshape(shape))
            dx = moved.add_(k0.to(cdt).reshape(shape)).flatten(1, 2).to(x.dtype)
        grads[0] = dx.contiguous(memory_format=_memory_format(x))
    return grads


# -- autograd on plain shards --------------------------------------------------------------------------


class _ShardedGroupNorm(torch.autograd.Function):
    # One node for the whole call: its forward makes one all-gather (statistics), its backward one
    # (the two sums); docs/distributed.md, 'Communication'.

    @staticmethod
    def forward(ctx, x, weight, bias, scale, shift, residual, multiplier, num_groups, eps, activation,
                negative_slope, group):
        out, mean, rstd, count = sharded_forward(x, num_groups, eps, group, weight, bias, scale, shift, residual,
                                                 activation, negative_slope, multiplier)
        ctx.save_for_backward(x, mean, rstd, count, weight, bias, scale, shift, residual, multiplier)
        ctx.args = (num_groups, activation, negative_slope, group)
        ctx.mark_non_differentiable(mean, rstd, count)
        return out, mean, rstd, count

    @staticmethod
    @once_differentiable  # the collectives are not: a second derivative raises rather than be wrong
    def backward(ctx, grad_out, _grad_mean, _grad_rstd, _grad_count):
        x, mean, rstd, count, weight, bias, scale, shift, residual, multiplier = ctx.saved_tensors
        num_groups, activation, negative_slope, group = ctx.args
        mask = list(ctx.needs_input_grad[:7])
        grads = backward_local(grad_out, x, mean, rstd, count, num_groups, weight, bias, scale, shift, residual,
                               activation, negative_slope, multiplier, output_mask=mask, group=group)
        return tuple(grads) + (None,) * 5


def _check_shard_dim(input: Tensor, dim: int) -> int:
    d = dim + input.dim() if dim < 0 else dim
    if not 0 <= d < input.dim():
        raise IndexError(f"Dimension out of range (expected to be in range of [{-input.dim()}, {input.dim() - 1}], but got {dim})")
    if d == 1:
        raise ValueError("fusednorm.distributed: dim=1 (channels) is not a spatial split; shard the channels on "
                         "group boundaries and call fusednorm.group_norm on each shard with its weight and bias slice")
    return d


def _check_args(input, num_groups, weight, bias, dim, activation, negative_slope, scale, shift, residual,
                multiplier) -> int:
    # fusednorm.group_norm's checks, messages and exception types; returns the split dimension.
    if input.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input.dim()}")
    if num_groups <= 0:
        raise RuntimeError(f"Expected num_groups to be positive, but got num_groups={num_groups}")
    if input.shape[1] == 0:
        raise RuntimeError("Expected number of channels to be greater than 0, got 0")
    if input.shape[1] % num_groups != 0:
        raise RuntimeError("Expected number of channels in input to be divisible by num_groups, but got input of "
                           f"shape {tuple(input.shape)} and num_groups={num_groups}")
    check_activation(activation)
    d = _check_shard_dim(input, dim)
    if input.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise NotImplementedError(f"\"fusednorm::group_norm\" not implemented for '{input.dtype}'")
    C = input.shape[1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.numel() != C):
            raise RuntimeError(f"Expected {name} to be a vector of size equal to the number of channels in input, "
                               f"but got {name} of shape {tuple(p.shape)} and input of shape {tuple(input.shape)}")
    for name, t in (("scale", scale), ("shift", shift)):
        if t is not None and (t.dim() < 2 or t.shape[0] != input.shape[0] or t.shape[1] != C
                              or any(s != 1 for s in t.shape[2:])):
            raise RuntimeError(f"Expected {name} of shape (N, C) or (N, C, 1, ..., 1) with (N, C) = "
                               f"({input.shape[0]}, {C}), but got {name} of shape {tuple(t.shape)}")
    for name, t in (("residual", residual), ("multiplier", multiplier)):
        if t is not None and t.shape != input.shape:
            raise RuntimeError(f"Expected {name} of the input's shape {tuple(input.shape)}, but got {tuple(t.shape)}")
    return d


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    group=None,
    dim: int = 2,
    activation: Optional[str] = None,
    negative_slope: float = 0.01,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    multiplier: Optional[Tensor] = None,
) -> Tensor:
    """Group normalization of a tensor split along ``dim`` across the ranks of ``group``.

    ``input`` is this rank's slice (N, C, *) along ``dim`` (a spatial dimension, default 2: rows of
    an image); slices may differ in size, one may be empty. The statistics are those of the whole
    tensor; the result is this rank's slice of ``fusednorm.group_norm`` of the whole tensor, with the
    same epilogue keywords (``scale`` and ``shift`` are whole (N, C); ``residual`` and
    ``multiplier`` are slices like ``input``). ``dim=0`` (a batch split) needs no communication
    and runs :func:`fusednorm.group_norm` locally.

    Every rank must call it with the same ``num_groups``, ``eps`` and operands present. One
    all-gather in the forward, one in the backward (docs/distributed.md). The gradients of
    ``weight``, ``bias``, ``scale`` and ``shift`` are this rank's share: summed over the ranks (as
    DDP does) they are the whole gradient.
    """
    from . import functional

    d = _check_args(input, num_groups, weight, bias, dim, activation, negative_slope, scale, shift, residual,
                    multiplier)
    if d == 0:
        return functional.group_norm(input, num_groups, weight, bias, eps, activation=activation,
                                     negative_slope=negative_slope, scale=scale, shift=shift, residual=residual,
                                     multiplier=multiplier)
    return _group_norm_with_stats(input, num_groups, weight, bias, eps, group, activation, negative_slope, scale,
                                  shift, residual, multiplier)[0]


def _group_norm_with_stats(input, num_groups, weight, bias, eps, group, activation, negative_slope, scale, shift,
                           residual, multiplier):
    # (output, mean, rstd, count per group) after group_norm's checks.
    if group is None:
        group = torch.distributed.group.WORLD
    if activation == "swish":  # the composite op's alias; the forward and backward ops take "silu"
        activation = "silu"
    return _ShardedGroupNorm.apply(input, weight, bias, scale, shift, residual, multiplier, num_groups, eps,
                                   activation, negative_slope, group)


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
    group=None,
    dim: int = 2,
    activation: Optional[str] = None,
    negative_slope: float = 0.01,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    multiplier: Optional[Tensor] = None,
) -> Tensor:
    """Instance normalization of a tensor split along a spatial ``dim`` across the ranks of
    ``group``: group_norm with one channel per group, and the running statistics (when given)
    updated in place from the whole tensor's statistics, as :func:`fusednorm.instance_norm` does
    (the same values on every rank). Without ``use_input_stats`` the running statistics normalize
    the shard locally, with no communication."""
    from . import functional

    d = _check_shard_dim(input, dim) if input.dim() >= 2 else dim
    # No channels: nothing to normalize or gather (every rank has the same C), and eager's
    # instance_norm takes it (fusednorm.instance_norm returns the empty output).
    if not use_input_stats or d == 0 or (input.dim() >= 2 and input.shape[1] == 0):
        return functional.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum,
                                        eps, activation=activation, negative_slope=negative_slope, scale=scale,
                                        shift=shift, residual=residual, multiplier=multiplier)
    if input.dim() < 3:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {list(input.size())}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must either both be None or neither be None")
    C = input.shape[1]
    # The node also returns the whole tensor's statistics: the running statistics cost no second
    # collective.
    _check_args(input, C, weight, bias, dim, activation, negative_slope, scale, shift, residual, multiplier)
    out, mean, rstd, count = _group_norm_with_stats(input, C, weight, bias, eps, group, activation, negative_slope,
                                                    scale, shift, residual, multiplier)
    if running_mean is not None and input.shape[0] > 0:
        # count: the whole tensor's spatial size (one channel per group).
        _update_running_stats(running_mean, running_var, mean, rstd, eps, momentum, spatial=count)
    return out


def _update_running_stats(running_mean: Tensor, running_var: Tensor, mean: Tensor, rstd: Tensor, eps: float,
                          momentum: float, spatial: Tensor) -> None:
    # As the composite op in csrc/ops.cpp: running = (1 - momentum) * running + momentum * batch
    # mean of the per-instance statistic, the variance unbiased. spatial: the whole tensor's
    # elements per (sample, channel), as global_statistics counts them.
    with torch.no_grad():
        running_mean.mul_(1 - momentum).add_(mean.mean(0).to(running_mean.dtype), alpha=momentum)
        n = float(spatial.reshape(-1)[0])
        unbiased = rstd.pow(-2).sub_(eps).mul_(n).div_(n - 1)
        running_var.mul_(1 - momentum).add_(unbiased.mean(0).to(running_var.dtype), alpha=momentum)


from . import _dtensor  # noqa: E402  (needs this module's functions)

_dtensor.install()
