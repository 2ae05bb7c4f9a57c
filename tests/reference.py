"""Float64 references of the formulas, written from the definitions (not from torch.nn.functional),
and helpers shared by the tests."""

import math
from typing import Optional

import torch
from torch import Tensor

TOLERANCES = {
    # (atol, rtol) for outputs of unit scale, against the float64 reference.
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def group_norm_reference(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias, statistics over (C / G) x spatial, biased
    variance, in float64. Differentiable in its (float64) arguments."""
    N, C = x.shape[:2]
    g = x.reshape(N, num_groups, -1)
    mean = g.mean(dim=2, keepdim=True)
    var = ((g - mean) ** 2).mean(dim=2, keepdim=True)
    y = ((g - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    shape = (1, C) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def _f64(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().cpu().double().requires_grad_()


def group_norm_reference_with_grads(x, num_groups, weight, bias, eps, grad_out):
    """The float64 reference output and its gradients (dx, dweight, dbias; None where absent)."""
    x64, w64, b64 = _f64(x), _f64(weight), _f64(bias)
    y = group_norm_reference(x64, num_groups, w64, b64, eps)
    inputs = [t for t in (x64, w64, b64) if t is not None]
    grads = iter(torch.autograd.grad(y, inputs, grad_out.detach().cpu().double()))
    dx = next(grads)
    dw = next(grads) if w64 is not None else None
    db = next(grads) if b64 is not None else None
    return y.detach(), dx, dw, db


def input_grad_scale(x: Tensor, num_groups: int, eps: float) -> float:
    """How much the input's gradient amplifies rounding: the largest rstd, at least 1. (A group of
    one element has rstd = 1 / sqrt(eps) and dx = 0, which float32 gives as rounding error times
    rstd: the H100 machine's CPU gave 8.5e-5 against 8e-5 allowed before rstd was in the tolerance.)"""
    xg = x.detach().double().reshape(x.shape[0], num_groups, -1)
    return max(1.0, (xg.var(-1, unbiased=False) + eps).rsqrt().max().item()) if xg.numel() else 1.0


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype, scale: float = 1.0, msg: str = "") -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.detach().cpu().double(), expected.detach().cpu().double(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{msg}\n{m}"
    )


def to_layout(t: Tensor, layout: str) -> Tensor:
    """'contiguous', 'channels_last' (channels innermost, any rank >= 3) or 'strided' (a
    non-dense view with the same values)."""
    if layout == "contiguous":
        return t.contiguous()
    if layout == "channels_last":
        if t.dim() < 3:
            return t.contiguous()
        return t.movedim(1, -1).contiguous().movedim(-1, 1)
    if layout == "strided":
        # Every other element of a tensor twice as wide in the last dim.
        wide = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
        view = wide[..., ::2]
        view.copy_(t)
        return view
    raise ValueError(layout)


def activation_reference(z: Tensor, activation: Optional[str], negative_slope: float) -> Tensor:
    """act(z) written from the definitions (float64)."""
    if activation is None:
        return z
    if activation == "silu":
        return z * torch.sigmoid(z)
    if activation == "gelu":
        return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    if activation == "gelu_tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    if activation == "relu":
        return torch.where(z > 0, z, torch.zeros_like(z))
    if activation == "leaky_relu":
        return torch.where(z > 0, z, z * negative_slope)
    if activation == "mish":
        return z * torch.tanh(torch.log1p(torch.exp(z)))
    raise ValueError(activation)


def epilogue_reference(y: Tensor, scale=None, shift=None, residual=None, activation=None, negative_slope=0.01,
                       multiplier=None) -> Tensor:
    """The fused epilogue on a normalized y: ((y * (1 + scale) + shift) + residual) -> act -> * multiplier."""
    shape = y.shape[:2] + (1,) * (y.dim() - 2)
    if scale is not None:
        y = y * (1 + scale.reshape(shape))
    if shift is not None:
        y = y + shift.reshape(shape)
    if residual is not None:
        y = y + residual
    y = activation_reference(y, activation, negative_slope)
    if multiplier is not None:
        y = y * multiplier
    return y


def assert_compiles_like_eager(f, inputs_for_shape, shapes=((2, 8, 5, 6), (3, 8, 7, 4))):
    """f compiled in one graph (fullgraph, dynamic shapes, aot_eager) gives f's output and the
    gradients of its sum with respect to every input, for inputs_for_shape(shape) at each shape
    (the second shape reuses the first's graph)."""
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for shape in shapes:
        inputs = inputs_for_shape(shape)
        got, want = compiled(*inputs), f(*inputs)
        torch.testing.assert_close(got, want)
        g = torch.autograd.grad(got.sum(), inputs)
        g_ref = torch.autograd.grad(want.sum(), inputs)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b)
