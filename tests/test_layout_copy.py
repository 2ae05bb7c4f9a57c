"""Operands dense in the layout other than the input's: a channels-last input with a contiguous
add operand, residual, multiplier or grad_out, and the reverse. The ops copy such an operand into
the input's layout first, on CUDA with their own transposing kernel (csrc/cuda/layout_copy_kernel.cu;
docs/design.md, "Layout copies"), elsewhere with ATen's copy. A copy is exact, so every result
must equal, bit for bit, the same call's with the operands already in the input's layout: on every
dtype, on shapes of whole and partial 64 x 64 tiles, at ranks 3 to 5, in both directions."""

import pytest
import torch

import fusednorm
from reference import to_layout

ADD = torch.ops.fusednorm.add_group_norm

# (shape, num_groups): whole tiles; partial tiles both ways at rank 5; fewer channels than a tile
# with many spatial elements and the reverse; rank 3; one spatial element (both layouts at once).
CASES = [
    ((2, 64, 64, 64), 8),
    ((3, 96, 5, 33, 35), 32),
    ((2, 6, 7, 129), 3),
    ((1, 200, 3, 2), 8),
    ((2, 130, 67), 2),
    ((2, 64, 1, 1), 4),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DIRECTIONS = [("channels_last", "contiguous"), ("contiguous", "channels_last")]


def make(shape, dtype, device, layout, seed):
    g = torch.Generator().manual_seed(seed)
    return to_layout(torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype), layout)


def in_other_layout(t, layout):
    """t's values, dense in `layout`, and checked to be so (the case tests the copy)."""
    u = to_layout(t, layout)
    assert torch.equal(u, t)
    assert (u if layout == "contiguous" else u.movedim(1, -1)).is_contiguous()
    return u


@pytest.mark.parametrize("shape, G", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layouts", DIRECTIONS, ids=["cl_input", "cf_input"])
def test_add_operand_in_the_other_layout(shape, G, dtype, layouts, device):
    input_layout, operand_layout = layouts
    x = make(shape, dtype, device, input_layout, 1)
    other = make(shape, dtype, device, input_layout, 2)
    w = torch.randn(shape[1], dtype=dtype, device=device)
    b = torch.randn(shape[1], dtype=dtype, device=device)
    y, s = ADD(x, other, G, w, b, 1e-5, activation="silu")
    y2, s2 = ADD(x, in_other_layout(other, operand_layout), G, w, b, 1e-5, activation="silu")
    assert torch.equal(s2, s) and torch.equal(y2, y)
    assert s2.stride() == s.stride() and y2.stride() == y.stride()


@pytest.mark.parametrize("shape, G", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layouts", DIRECTIONS, ids=["cl_input", "cf_input"])
def test_residual_multiplier_and_grad_out_in_the_other_layout(shape, G, dtype, layouts, device):
    input_layout, operand_layout = layouts
    x = make(shape, dtype, device, input_layout, 3).requires_grad_()
    residual = make(shape, dtype, device, input_layout, 4).requires_grad_()
    multiplier = make(shape, dtype, device, input_layout, 5).requires_grad_()
    grad_out = make(shape, dtype, device, input_layout, 6)
    leaves = (x, residual, multiplier)

    def run(operand):
        y = fusednorm.group_norm(x, G, activation="gelu", residual=operand(residual),
                                 multiplier=operand(multiplier))
        return (y,) + torch.autograd.grad(y, leaves, operand(grad_out))

    same = run(lambda t: t)
    other = run(lambda t: in_other_layout(t, operand_layout))
    for a, b in zip(same, other):
        assert torch.equal(b, a)
