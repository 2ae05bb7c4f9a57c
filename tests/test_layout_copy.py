"""Operands dense in the layout other than the input's: a channels-last input with a contiguous
add operand, residual, multiplier or grad_out, and the reverse. The ops copy such an operand into
the input's layout first, on CUDA with their own transposing kernel (csrc/cuda/layout_copy_kernel.cu;
docs/design.md, "Layout copies"), elsewhere with ATen's copy. A copy is exact, so every result
must equal, bit for bit, the same call's with the operands already in the input's layout: on every
dtype, on shapes of whole and partial 64 x 64 tiles, at ranks 3 to 5, in both directions."""

import pytest
import torch

import fusednorm
from fusednorm import kernel_paths
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


def with_strided_rows(t):
    """t's values in a view whose rows are contiguous but whose first two dimensions are swapped in
    memory (a video's frames as Mochi's per-frame norms take them): dense in no layout, which the
    CUDA ops copy channels-first with the replication pad's row kernels (no padding)."""
    u = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(u, t) and u.stride(-1) == 1 and not u.is_contiguous()
    return u


@pytest.fixture
def no_sweep(monkeypatch):
    """The sweep off: an input with strided rows is then copied dense (the sweep would read a
    16-bit one with long rows where it lies, tests/test_strided_rows.py)."""
    monkeypatch.setenv("FUSEDNORM_SWEEP_FORWARD", "0")
    kernel_paths.reload_overrides()


@pytest.mark.parametrize("shape, G", [case for case in CASES if case[0][0] > 1 and case[0][-1] > 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_operands_with_strided_rows(shape, G, dtype, device, no_sweep):
    x = make(shape, dtype, device, "contiguous", 1)
    other = make(shape, dtype, device, "contiguous", 2)
    w = torch.randn(shape[1], dtype=dtype, device=device)
    b = torch.randn(shape[1], dtype=dtype, device=device)
    # The input, an add operand, a residual: every result equal to the dense call's, strides too.
    want = fusednorm.group_norm(x, G, w, b, activation="silu", residual=other)
    got = fusednorm.group_norm(with_strided_rows(x), G, w, b, activation="silu", residual=with_strided_rows(other))
    assert torch.equal(got, want) and got.stride() == want.stride()
    y, s = ADD(x, other, G, w, b, 1e-5)
    y2, s2 = ADD(with_strided_rows(x), with_strided_rows(other), G, w, b, 1e-5)
    assert torch.equal(y2, y) and torch.equal(s2, s) and y2.stride() == y.stride()
    # The backward's input and grad_out.
    grads = []
    for strided in (False, True):
        xs = (with_strided_rows(x) if strided else x.clone()).requires_grad_()
        out = fusednorm.group_norm(xs, G, w, b)
        dy = make(shape, dtype, device, "contiguous", 3)
        grads.append(torch.autograd.grad(out, xs, with_strided_rows(dy) if strided else dy)[0])
    assert torch.equal(grads[1], grads[0])


def test_strided_rows_take_the_pad_kernels(device, no_sweep):
    if device != "cuda":
        pytest.skip("ATen's copy on the CPU")
    from torch.profiler import ProfilerActivity, profile

    frames = with_strided_rows(torch.randn(4, 64, 48, 300, device=device, dtype=torch.float16))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fusednorm.group_norm(frames, 32)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("replication_pad_lines_kernel" in n for n in names), names
    assert not any("copy" in n.lower() for n in names), names
