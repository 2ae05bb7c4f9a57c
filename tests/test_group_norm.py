"""group_norm (functional, op and kernels) against the float64 reference of its formula."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fusednorm
from reference import assert_close, group_norm_reference_with_grads, input_grad_scale, to_layout

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "channels_last", "strided"]
AFFINE = ["both", "weight", "bias", "none"]


@st.composite
def group_norm_cases(draw, max_numel=60_000):
    """Shapes of rank 2..5 with group sizes that are odd, non-powers of two, one channel, or the
    whole of C, and spatial sizes from 1 up."""
    rank = draw(st.integers(2, 5))
    G = draw(st.integers(1, 6))
    D = draw(st.sampled_from([1, 2, 3, 5, 10, 20]))
    C = G * D
    N = draw(st.integers(1, 3))
    spatial = draw(st.lists(st.integers(1, 13), min_size=rank - 2, max_size=rank - 2))
    numel = N * C * math.prod(spatial)
    if numel > max_numel or (N * D * math.prod(spatial) == 1):
        # Too big for CI, or a single value per group (F.group_norm's training check rejects it).
        spatial = [2] * (rank - 2)
        N = 2
    return (N, C) + tuple(spatial), G


def make_params(C, affine, param_dtype, device):
    w = torch.randn(C, dtype=param_dtype, device=device) if affine in ("both", "weight") else None
    b = torch.randn(C, dtype=param_dtype, device=device) if affine in ("both", "bias") else None
    return w, b


def run_and_check(shape, G, dtype, layout, affine, eps, device, mixed=False, offset=0.0):
    param_dtype = torch.float32 if mixed else dtype
    x = to_layout((torch.randn(shape, dtype=torch.float64) + offset).to(dtype).to(device), layout)
    w, b = make_params(shape[1], affine, param_dtype, device)
    x.requires_grad_()
    for p in (w, b):
        if p is not None:
            p.requires_grad_()

    y = fusednorm.group_norm(x, G, w, b, eps)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    if layout == "channels_last" and x.dim() >= 3:
        assert y.movedim(1, -1).is_contiguous(), "output must keep the channels-last layout"
    elif layout == "contiguous":
        assert y.is_contiguous()

    grad_out = to_layout(torch.randn(shape, dtype=torch.float64).to(dtype).to(device), "contiguous")
    y_ref, dx_ref, dw_ref, db_ref = group_norm_reference_with_grads(x, G, w, b, eps, grad_out)
    assert_close(y, y_ref, dtype, msg="output")
    inputs = [t for t in (x, w, b) if t is not None]
    grads = iter(torch.autograd.grad(y, inputs, grad_out))
    dx = next(grads)
    assert dx.dtype == dtype
    # Gradients scale with rstd (input_grad_scale) and with the number of elements summed.
    M = x.numel() // (shape[0] * G)
    assert_close(dx, dx_ref, dtype, scale=4 * input_grad_scale(x, G, eps), msg="grad_input")
    if w is not None:
        dw = next(grads)
        assert dw.dtype == w.dtype
        assert_close(dw, dw_ref, dtype, scale=4 * math.sqrt(M * shape[0]), msg="grad_weight")
    if b is not None:
        db = next(grads)
        assert db.dtype == b.dtype
        assert_close(db, db_ref, dtype, scale=4 * math.sqrt(M * shape[0]), msg="grad_bias")


@given(case=group_norm_cases(), dtype=st.sampled_from(DTYPES), layout=st.sampled_from(LAYOUTS),
       affine=st.sampled_from(AFFINE), eps=st.sampled_from([1e-5, 1e-3, 0.1]))
def test_matches_reference(device, case, dtype, layout, affine, eps):
    shape, G = case
    run_and_check(shape, G, dtype, layout, affine, eps, device)


@given(case=group_norm_cases(), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       layout=st.sampled_from(LAYOUTS), affine=st.sampled_from(["both", "weight"]))
def test_reduced_precision_input_with_float32_params(device, case, dtype, layout, affine):
    shape, G = case
    run_and_check(shape, G, dtype, layout, affine, 1e-5, device, mixed=True)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape,G", [((2, 64, 32, 32), 32), ((1, 4, 131072), 1), ((1, 3, 5, 7, 9), 3)])
def test_large_groups_and_odd_shapes(device, shape, G, layout):
    run_and_check(shape, G, torch.float32, layout, "both", 1e-5, device)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_offset(device, layout, dtype):
    # Variance as E[x^2] - E[x]^2 would lose every digit here.
    run_and_check((2, 12, 17, 9), 3, dtype, layout, "both", 1e-5, device, offset=1e4)


# The CPU's channels-last moments sum x - K and (x - K)^2 in one pass, K the mean of a chunk's
# first 8 rows, and take a second pass over a block of channels where M2 = sum (x - K)^2 -
# (sum (x - K))^2 / n cancelled (docs/design.md, "Shifted moments and Chan merges"). Here the
# first 8 rows lie 64 standard deviations of the whole below the other 4088: without the second
# pass rstd came out 1.8e-5 off (measured), with it within float32's rounding.
def test_channels_last_moments_whose_shift_is_far_from_the_mean():
    shape, G = (2, 4, 64, 64), 1  # one chunk of 4096 rows
    x = 64.0 + 0.01 * torch.randn(shape, dtype=torch.float64)
    x[:, :, 0, :8] = 0.0
    x = to_layout(x.to(torch.float32), "channels_last")
    y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, G, None, None, 1e-5)
    xg = x.double().reshape(shape[0], G, -1)
    torch.testing.assert_close(rstd.double(), (xg.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-6, atol=0)
    torch.testing.assert_close(mean.double(), xg.mean(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_groups(device, layout, dtype):
    x = to_layout(torch.full((2, 6, 4, 5), 3.0, dtype=dtype, device=device), layout).requires_grad_()
    eps = 1e-5
    y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, 3, None, None, eps)
    assert not torch.isnan(rstd).any()
    torch.testing.assert_close(rstd.cpu().double(), torch.full((2, 3), 1 / math.sqrt(eps), dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(mean.cpu().double(), torch.full((2, 3), 3.0, dtype=torch.float64))
    assert torch.equal(y.float().cpu(), torch.zeros(2, 6, 4, 5))
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.isfinite(dx).all()


@pytest.mark.parametrize("shape", [(0, 6, 4, 4), (0, 6)])
def test_empty(device, shape):
    # (C = 0 and an empty spatial size are refused, as eager refuses them:
    # tests/test_reliability.py::test_zero_channels, ::test_zero_spatial_size; the kernel ops take
    # them, tests/test_cuda_kernels.py::test_zero_size.)
    G = 3
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.randn(shape[1], device=device, requires_grad=True)
    b = torch.randn(shape[1], device=device, requires_grad=True)
    y = torch.ops.fusednorm.group_norm(x, G, w, b, 1e-5)
    assert y.shape == x.shape
    dx, dw, db = torch.autograd.grad(y.sum(), (x, w, b))
    assert dx.shape == x.shape
    assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


def test_matches_torch_group_norm(device):
    # Beside the float64 reference, agreement with PyTorch's own kernel in float64.
    x = torch.randn(3, 20, 7, 6, dtype=torch.float64, device=device)
    w = torch.randn(20, dtype=torch.float64, device=device)
    b = torch.randn(20, dtype=torch.float64, device=device)
    torch.testing.assert_close(fusednorm.group_norm(x, 4, w, b), F.group_norm(x, 4, w, b))


def test_saved_statistics(device):
    x = torch.randn(3, 12, 5, 5, device=device)
    _, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, 4, None, None, 1e-5)
    g = x.double().reshape(3, 4, -1)
    assert mean.dtype == torch.float32 and rstd.dtype == torch.float32
    torch.testing.assert_close(mean.double(), g.mean(-1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rstd.double(), (g.var(-1, unbiased=False) + 1e-5).rsqrt(), atol=1e-6, rtol=1e-6)


def test_grad_out_in_another_layout(device):
    x = torch.randn(2, 8, 6, 5, device=device).to(memory_format=torch.channels_last).requires_grad_()
    y = fusednorm.group_norm(x, 2)
    grad_out = torch.randn(2, 8, 6, 5, device=device)  # contiguous, unlike x
    (dx,) = torch.autograd.grad(y, x, grad_out)
    _, dx_ref, _, _ = group_norm_reference_with_grads(x, 2, None, None, 1e-5, grad_out)
    assert_close(dx, dx_ref, torch.float32, scale=4)


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, True], [False, False, True], [True, True, True]])
def test_backward_output_mask(device, mask):
    x = torch.randn(2, 6, 5, device=device)
    w = torch.randn(6, device=device)
    y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, 3, w, None, 1e-5)
    dy = torch.randn_like(y)
    outs = torch.ops.fusednorm.group_norm_backward(dy, x, mean, rstd, w, 3, mask)
    full = torch.ops.fusednorm.group_norm_backward(dy, x, mean, rstd, w, 3, [True, True, True])
    for wanted, out, ref in zip(mask, outs, full):
        if wanted:
            assert torch.equal(out, ref)
        else:
            assert out.numel() == 0


def test_deterministic(device):
    x = torch.randn(3, 32, 33, 17, device=device).to(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(32, device=device, requires_grad=True)
    b = torch.randn(32, device=device, requires_grad=True)
    dy = torch.randn(3, 32, 33, 17, device=device)
    runs = []
    for _ in range(3):
        y = fusednorm.group_norm(x, 8, w, b)
        runs.append((y,) + torch.autograd.grad(y, (x, w, b), dy))
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            assert torch.equal(a, b_)


# (64, 4096): one element per channel. (63, 52, 3, 5): short rows, whose backward sums go a block
# of rows at a time (3276 rows: the last block partial, the blocks split over threads).
@pytest.mark.parametrize("shape,layout", [((2, 16, 64, 64), "channels_last"), ((2, 16, 64, 64), "contiguous"),
                                          ((64, 4096), "contiguous"), ((63, 52, 3, 5), "contiguous")])
@pytest.mark.parametrize("fused", [False, True])
def test_result_independent_of_thread_count(shape, layout, fused):
    torch.manual_seed(0)
    x = to_layout(torch.randn(shape), layout).requires_grad_()
    w, b = torch.randn(shape[1], requires_grad=True), torch.randn(shape[1], requires_grad=True)
    extra = {}
    if fused:
        extra = dict(activation="silu", scale=torch.randn(shape[:2], requires_grad=True),
                     residual=torch.randn(shape).requires_grad_())
    dy = torch.randn(shape)
    leaves = [x, w, b] + list(extra.values())[1:]
    old = torch.get_num_threads()
    try:
        outs = []
        # 3 threads for N = 2: the fused channels-last backward then takes its two-pass path
        # instead of the per-sample one, which must give the same bits.
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            y = fusednorm.group_norm(x, 4, w, b, **extra)
            outs.append((y,) + torch.autograd.grad(y, leaves, dy))
    finally:
        torch.set_num_threads(old)
    for other in outs[1:]:
        for a, b_ in zip(outs[0], other):
            assert torch.equal(a, b_)


@pytest.mark.parametrize("fused", [False, True])
def test_one_element_per_channel_grads_independent_of_parameter_grads(fused):
    # S = 1 on the CPU: without parameter gradients each group's dx follows its sums at once (one
    # pass over memory); with them the batch's per-channel sums come first. Same bits either way.
    torch.manual_seed(0)
    x = torch.randn(33, 4100) * 2 + 1
    w, b = torch.randn(4100), torch.randn(4100)
    y_op = torch.randn(33, 4100)
    dy = torch.randn(33, 4100)
    extra = dict(activation="gelu", residual=y_op, multiplier=y_op) if fused else {}
    grads = []
    for want_params in (True, False):
        xg = x.clone().requires_grad_()
        wg, bg = w.clone().requires_grad_(want_params), b.clone().requires_grad_(want_params)
        out = fusednorm.group_norm(xg, 2, wg, bg, **extra)
        grads.append(torch.autograd.grad(out, xg, dy)[0])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("affine", AFFINE)
def test_gradcheck(device, layout, affine):
    x = to_layout(torch.randn(2, 6, 3, 4, dtype=torch.float64, device=device), layout).requires_grad_()
    w, b = make_params(6, affine, torch.float64, device)
    inputs = [x] + [p.requires_grad_() for p in (w, b) if p is not None]

    def fn(*args):
        it = iter(args[1:])
        w_ = next(it) if w is not None else None
        b_ = next(it) if b is not None else None
        return fusednorm.group_norm(args[0], 3, w_, b_, 1e-5)

    assert torch.autograd.gradcheck(fn, inputs)


opcheck = getattr(torch.library, "opcheck", None)


@pytest.mark.skipif(opcheck is None, reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(device, requires_grad, layout, dtype):
    x = to_layout(torch.randn(2, 6, 5, 4, device=device, dtype=dtype), layout).requires_grad_(requires_grad)
    w = torch.randn(6, device=device, requires_grad=requires_grad)
    b = torch.randn(6, device=device, requires_grad=requires_grad)
    opcheck(torch.ops.fusednorm.group_norm_forward, (x, 3, w, b, 1e-5))
    opcheck(torch.ops.fusednorm.group_norm_forward, (x, 3, None, None, 1e-5))
    opcheck(torch.ops.fusednorm.group_norm, (x, 3, w, b, 1e-5))
    opcheck(torch.ops.fusednorm.group_norm, (x, 3), {"weight": w})
    y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x.detach(), 3, w.detach(), b.detach(), 1e-5)
    dy = torch.randn_like(y)
    opcheck(torch.ops.fusednorm.group_norm_backward, (dy, x.detach(), mean, rstd, w.detach(), 3, [True, True, True]))
    opcheck(torch.ops.fusednorm.group_norm_backward, (dy, x.detach(), mean, rstd, None, 3, [True, False, True]))


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_autocast_runs_in_the_input_dtype(device, input_dtype):
    # Documented in the README: no cast to float32 as PyTorch's group_norm gets under autocast;
    # a model's float32 parameters go in beside a bf16 activation.
    x = torch.randn(2, 8, 5, 5, device=device).to(input_dtype)
    w = torch.randn(8, device=device)
    b = torch.randn(8, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = fusednorm.group_norm(x, 4, w, b)
        z = fusednorm.instance_norm(x, weight=w, bias=b)
    assert y.dtype == input_dtype and z.dtype == input_dtype
    ref, _, _, _ = group_norm_reference_with_grads(x, 4, w, b, 1e-5, torch.zeros_like(x))
    assert_close(y, ref, input_dtype)
    ref, _, _, _ = group_norm_reference_with_grads(x, 8, w, b, 1e-5, torch.zeros_like(x))
    assert_close(z, ref, input_dtype)


def test_graph_recorded_only_when_needed(device):
    # The autograd kernel records a node only in grad mode with an input that requires grad
    # (_compat.register_autograd); otherwise it calls the kernel directly. Either way the values
    # are the same, and a graph is built for whichever input requires grad.
    torch.manual_seed(3)
    x = torch.randn(2, 6, 5, device=device)
    w = torch.randn(6, device=device)
    b = torch.randn(6, device=device)
    plain = fusednorm.group_norm(x, 3, w, b)
    assert not plain.requires_grad and plain.grad_fn is None
    with torch.no_grad():
        no_grad = fusednorm.group_norm(x.requires_grad_(), 3, w, b, activation="silu")
    assert not no_grad.requires_grad and no_grad.grad_fn is None
    with torch.inference_mode():
        inference = fusednorm.group_norm(x.detach(), 3, w, b, activation="silu")
    torch.testing.assert_close(no_grad, inference)
    w.requires_grad_()
    b.requires_grad_()
    for i in range(3):  # one input requiring grad at a time
        args = [t if j == i else t.detach() for j, t in enumerate((x, w, b))]
        y = fusednorm.group_norm(args[0], 3, args[1], args[2], activation="silu")
        assert y.requires_grad and y.grad_fn is not None
        torch.testing.assert_close(y.detach(), no_grad)
        (grad,) = torch.autograd.grad(y.sum(), [args[i]])
        assert grad.shape == args[i].shape and torch.isfinite(grad).all()
    torch.testing.assert_close(plain, F.group_norm(x.detach(), 3, w.detach(), b.detach()))
