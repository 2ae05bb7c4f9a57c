"""The CUDA kernels of fusednorm::group_norm_forward / group_norm_backward against float64
references computed with plain torch ops (on the CPU, or on the GPU in float64 for the large
tests), over the shapes, layouts, dtypes and argument combinations the kernels special-case."""

import math

import pytest
import torch
import torch.nn.functional as F

import fusednorm  # noqa: F401  (loads the native library)
import kernel_paths


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Module globals (not fixtures) so that the helpers can also drive another backend of the ops.
OPS = torch.ops.fusednorm
DEV = "cuda"
EPS = 1e-5
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (atol, rtol) for outputs of unit scale; atol is multiplied by the largest reference magnitude.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-9, 1e-9),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2),
}
# mean and rstd are float32 (float64 for float64 input), accumulated in float32 or better.
STATS_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float64: (1e-10, 1e-10),
    torch.bfloat16: (2e-5, 2e-5),
    torch.float16: (2e-5, 2e-5),
}


# ---------------------------------------------------------------------------------------------
# References (float64)


def _f64(t, device="cpu"):
    return None if t is None else t.detach().to(device=device, dtype=torch.float64)


def ref_stats(x, G, eps=EPS, device="cpu"):
    xd = _f64(x, device)
    N, C = xd.shape[:2]
    M = (C // G) * math.prod(xd.shape[2:])
    if M == 0:
        return torch.zeros(N, G, dtype=torch.float64, device=device), torch.full(
            (N, G), 1 / math.sqrt(eps), dtype=torch.float64, device=device)
    xg = xd.reshape(N, G, M)
    mean = xg.mean(-1)
    var = ((xg - mean[..., None]) ** 2).mean(-1)
    return mean, (var + eps).rsqrt()


def ref_forward(x, G, w, b, eps=EPS, device="cpu"):
    xd = _f64(x, device)
    N, C = xd.shape[:2]
    S = math.prod(xd.shape[2:])
    mean, rstd = ref_stats(xd, G, eps, device)
    D = C // G
    y = ((xd.reshape(N, G, D * S) - mean[..., None]) * rstd[..., None]).reshape(xd.shape)
    shape = (1, C) + (1,) * (xd.dim() - 2)
    if w is not None:
        y = y * _f64(w, device).reshape(shape)
    if b is not None:
        y = y + _f64(b, device).reshape(shape)
    return y, mean, rstd


def ref_backward(dy, x, w, G, eps=EPS, device="cpu"):
    """The exact gradients of the forward (statistics recomputed from x in float64):
    dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)), dW = sum dy*xhat, dB = sum dy."""
    xd, dyd = _f64(x, device), _f64(dy, device)
    N, C = xd.shape[:2]
    S = math.prod(xd.shape[2:])
    D = C // G
    mean, rstd = ref_stats(xd, G, eps, device)
    xg = xd.reshape(N, G, D, S)
    dyg = dyd.reshape(N, G, D, S)
    xhat = (xg - mean[:, :, None, None]) * rstd[:, :, None, None]
    wg = _f64(w, device).reshape(1, G, D, 1) if w is not None else torch.ones((), dtype=torch.float64, device=device)
    dxhat = dyg * wg
    dx = rstd[:, :, None, None] * (
        dxhat - dxhat.mean((2, 3), keepdim=True) - xhat * (dxhat * xhat).mean((2, 3), keepdim=True))
    dw = (dyg * xhat).sum((0, 3)).reshape(C)
    db = dyg.sum((0, 3)).reshape(C)
    return dx.reshape(xd.shape), dw, db


def assert_close(actual, expected, dtype, what, tol=None):
    atol, rtol = (tol or TOL)[dtype]
    expected = expected.detach().to(actual.device, torch.float64) if actual.is_cuda else _f64(expected)
    actual = actual.detach().to(expected.device, torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------
# Inputs


def channels_last(t):
    """`t` with the channel dimension innermost (channels_last / channels_last_3d for rank 4 / 5,
    the same strides for any rank >= 3)."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def make(shape, dtype, layout="contiguous", seed=0, scale=1.0, offset=0.0):
    """A tensor of `shape` on DEV in `layout`:
    contiguous | channels_last | transposed (dense, neither layout) | sliced (every other element
    of the last dim) | offset (contiguous, data pointer one element past a 16-byte boundary) |
    offset_cl (channels_last with the same misalignment)."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
    if layout == "contiguous":
        return v.to(DEV)
    if layout == "channels_last":
        return channels_last(v.to(DEV))
    if layout == "transposed":
        assert v.dim() >= 3 and v.shape[-1] > 1 and v.shape[-2] > 1
        return v.transpose(-1, -2).contiguous().to(DEV).transpose(-1, -2)
    if layout == "sliced":
        wide = torch.zeros(shape[:-1] + (2 * shape[-1],), dtype=dtype, device=DEV)
        view = wide[..., ::2]
        view.copy_(v)
        return view
    if layout in ("offset", "offset_cl"):
        flat = torch.zeros(v.numel() + 1, dtype=dtype, device=DEV)[1:]
        if layout == "offset":
            out = flat.view(shape)
        else:
            cl = v.movedim(1, -1)
            out = flat.view(cl.shape).movedim(-1, 1)
        out.copy_(v)
        return out
    raise ValueError(layout)


def make_params(C, dtype, affine="both", param_dtype=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    pd = param_dtype or dtype
    w = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(pd).to(DEV)
    b = torch.randn(C, generator=g, dtype=torch.float64).to(pd).to(DEV)
    return (w if affine in ("both", "weight") else None, b if affine in ("both", "bias") else None)


def expected_strides(x):
    """The strides of an output in the layout the ops pick for x (layout_for in group_norm.cpp)."""
    if x.is_contiguous():
        return torch.empty(x.shape).stride()
    if x.dim() >= 3 and x.movedim(1, -1).is_contiguous():
        return channels_last(torch.empty(x.shape)).stride()
    return torch.empty(x.shape).stride()


# ---------------------------------------------------------------------------------------------
# Checks


def check_forward(x, G, w, b, eps=EPS):
    dtype = x.dtype
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, eps)
    stats_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    N, C = x.shape[:2]
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    assert y.stride() == expected_strides(x), f"output strides {y.stride()} for input strides {x.stride()}"
    assert mean.dtype == stats_dtype and rstd.dtype == stats_dtype
    assert mean.shape == (N, G) and rstd.shape == (N, G)
    y_ref, mean_ref, rstd_ref = ref_forward(x, G, w, b, eps)
    assert_close(mean, mean_ref, dtype, "mean", STATS_TOL)
    assert_close(rstd, rstd_ref, dtype, "rstd", STATS_TOL)
    assert_close(y, y_ref, dtype, "y")
    return y, mean, rstd


def check_backward(dy, x, G, w, b=None, mask=(True, True, True), eps=EPS):
    dtype = x.dtype
    _, mean, rstd = OPS.group_norm_forward(x, G, w, b, eps)
    dx, dw, db = OPS.group_norm_backward(dy, x, mean, rstd, w, G, list(mask))
    # The parameter gradients come in the weight's dtype (param_grad_dtype in group_norm.h; this
    # op is not given the bias), the statistics' without weight.
    pdtype = w.dtype if w is not None else torch.float64 if dtype == torch.float64 else torch.float32
    C = x.shape[1]
    dx_ref, dw_ref, db_ref = ref_backward(dy, x, w, G, eps)
    if mask[0]:
        assert dx.dtype == dtype and dx.shape == x.shape
        assert dx.stride() == expected_strides(x), f"grad_input strides {dx.stride()} for input strides {x.stride()}"
        assert_close(dx, dx_ref, dtype, "grad_input")
    else:
        assert dx.shape == (0,) and dx.dtype == dtype
    for name, got, ref, on in (("grad_weight", dw, dw_ref, mask[1]), ("grad_bias", db, db_ref, mask[2])):
        assert got.dtype == pdtype, f"{name} dtype {got.dtype}, expected {pdtype}"
        if on:
            assert got.shape == (C,)
            assert_close(got, ref, pdtype, name)
        else:
            assert got.shape == (0,)
    return dx, dw, db


def run_case(shape, G, dtype, layout="contiguous", affine="both", param_dtype=None, dy_layout=None, seed=0):
    x = make(shape, dtype, layout, seed=seed)
    w, b = make_params(shape[1], dtype, affine, param_dtype)
    check_forward(x, G, w, b)
    dy = make(shape, dtype, dy_layout or layout, seed=seed + 7)
    check_backward(dy, x, G, w, b)


# ---------------------------------------------------------------------------------------------
# Shapes: rank 2..6; D = 1, 2, 3, 4, 8, 10, 20, 32, C; S = 1, 7, 35, 4096, 4097 (odd: scalar
# path); few huge groups; many channels.

CASES = [
    ((2, 6), 2),             # rank 2, S = 1, D = 3
    ((3, 20), 2),            # rank 2, D = 10
    ((2, 8192), 32),         # rank 2, many channels, D = 256
    ((4, 40, 7), 2),         # D = 20, S = 7
    ((2, 3, 4097), 1),       # D = 3, S = 4097
    ((2, 12, 4097), 4),      # D = 3, S = 4097
    ((8, 512, 33), 16),      # D = 32, odd S
    ((2, 10, 5, 7), 1),      # D = 10, S = 35
    ((3, 16, 8, 8), 16),     # D = 1 (instance norm)
    ((2, 64, 16, 16), 32),   # D = 2
    ((6, 24, 13, 13), 6),    # D = 4, S = 169
    ((5, 7, 1, 1), 7),       # S = 1, one element per group
    ((2, 4, 64, 64), 2),     # S = 4096, vector path
    ((1, 128, 64, 64), 32),  # N * G = 32: groups split over many CTAs
    ((1, 4096, 4, 4), 1),    # D = C = 4096
    ((2, 30, 3, 5, 7), 3),   # rank 5, D = 10
    ((1, 32, 4, 8, 8), 8),   # rank 5, D = 4
    ((2, 6, 2, 3, 2, 2), 3),  # rank 6
]

CL_CASES = [
    ((2, 6, 5), 3),           # rank 3, C = 6 (scalar path), D = 2
    ((2, 3, 17, 19), 1),      # RGB, D = 3
    ((2, 64, 9, 9), 32),      # D = 2
    ((1, 128, 32, 32), 32),   # D = 4, N = 1: rows split over many CTAs
    ((2, 40, 7, 7), 4),       # D = 10: pieces of 2 channels
    ((2, 320, 8, 8), 32),     # D = 10, C = 320 (Stable Diffusion)
    ((3, 24, 1, 7), 3),       # D = 8
    ((2, 64, 5, 5), 4),       # D = 16: pieces spanning 2 (16-bit) or 4 (float32) threads
    ((2, 16, 4, 5, 6), 16),   # rank 5 (channels_last_3d), D = 1
    ((1, 2048, 4, 4), 1),     # D = C: pieces spanning several threads
    ((2, 8192, 2, 2), 4),     # many channels: several channel blocks
]


def _id(case):
    shape, G = case
    return "x".join(map(str, shape)) + f"-G{G}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_forward_backward_shapes(case, dtype):
    shape, G = case
    run_case(shape, G, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CL_CASES, ids=_id)
def test_channels_last(case, dtype):
    """channels_last / channels_last_3d (and channels-innermost rank 3) inputs are read in place;
    y and grad_input keep the layout (checked in check_forward / check_backward)."""
    shape, G = case
    run_case(shape, G, dtype, layout="channels_last")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "offset", "offset_cl"])
@pytest.mark.parametrize("case", [((2, 8, 6, 10), 4), ((3, 16, 16, 16), 2), ((2, 64, 9, 9), 32)], ids=_id)
def test_noncontiguous_and_misaligned_inputs(case, layout, dtype):
    """Views that need a copy, and inputs whose data pointer is not 16-byte aligned (the kernels
    must fall back from 16-byte vector accesses)."""
    shape, G = case
    run_case(shape, G, dtype, layout=layout)


@pytest.mark.parametrize(
    "x_layout,dy_layout",
    [("contiguous", "channels_last"), ("channels_last", "contiguous"), ("channels_last", "sliced"),
     ("contiguous", "offset"), ("channels_last", "offset_cl"), ("offset", "contiguous")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_grad_out_in_another_layout(x_layout, dy_layout, dtype):
    run_case((2, 32, 8, 8), 8, dtype, layout=x_layout, dy_layout=dy_layout)


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_affine_variants(affine, layout, dtype):
    run_case((2, 24, 6, 6), 6, dtype, layout=layout, affine=affine)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mixed_precision_params(dtype, layout):
    """bf16/fp16 input with float32 weight and bias."""
    run_case((2, 32, 8, 8), 8, dtype, layout=layout, param_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mixed_weight_and_bias_dtypes(dtype):
    """Weight float32 and bias in the input's dtype (each is checked on its own)."""
    x = make((2, 16, 5, 5), dtype)
    w, _ = make_params(16, dtype, param_dtype=torch.float32)
    _, b = make_params(16, dtype)
    check_forward(x, 4, w, b)
    check_backward(make((2, 16, 5, 5), dtype, seed=3), x, 4, w, b)


@pytest.mark.parametrize("mask", [(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_output_mask(mask, layout):
    x = make((2, 16, 6, 6), torch.float32, layout)
    w, b = make_params(16, torch.float32)
    check_backward(make((2, 16, 6, 6), torch.float32, layout, seed=5), x, 4, w, b, mask=mask)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_eps(layout):
    x = make((2, 16, 5, 5), torch.float32, layout)
    w, b = make_params(16, torch.float32)
    check_forward(x, 4, w, b, eps=0.1)
    check_backward(make((2, 16, 5, 5), torch.float32, layout, seed=3), x, 4, w, b, eps=0.1)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    """Kernels run on the input's device and stream, whichever device is current."""
    x = make((2, 32, 9, 9), torch.float32).to("cuda:1")
    w, b = (t.to("cuda:1") for t in make_params(32, torch.float32))
    dy = make((2, 32, 9, 9), torch.float32, seed=2).to("cuda:1")
    with torch.cuda.device(0):
        y, mean, rstd = check_forward(x, 8, w, b)
        dx, dw, db = check_backward(dy, x, 8, w, b)
    assert all(t.device == x.device for t in (y, mean, rstd, dx, dw, db))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_grad_weight_without_weight(layout):
    """grad_weight = sum dy * xhat is computed when asked for even without a weight."""
    x = make((2, 12, 7, 7), torch.bfloat16, layout)
    dy = make((2, 12, 7, 7), torch.bfloat16, layout, seed=2)
    check_backward(dy, x, 3, None)


@pytest.mark.parametrize("shape,G", [((0, 4, 3, 3), 2), ((2, 4, 0), 2), ((2, 4, 3, 0, 5), 4), ((3, 0, 5), 1), ((0, 6), 3)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_zero_size(shape, G, layout):
    if layout == "channels_last" and len(shape) < 3:
        pytest.skip("rank 2 has no channels_last")
    x = make(shape, torch.float32, layout)
    C = shape[1]
    w, b = make_params(C, torch.float32)
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    assert y.shape == x.shape and mean.shape == (shape[0], G) and rstd.shape == (shape[0], G)
    if shape[0] > 0:
        assert torch.equal(mean.cpu(), torch.zeros(shape[0], G))
        assert torch.allclose(rstd.cpu(), torch.full((shape[0], G), 1 / math.sqrt(EPS)))
    dx, dw, db = OPS.group_norm_backward(torch.zeros_like(x), x, mean, rstd, w, G, [True, True, True])
    assert dx.shape == x.shape
    assert dw.shape == (C,) and db.shape == (C,)
    assert not dw.any() and not db.any()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_groups(layout, dtype):
    """var = 0: rstd = 1/sqrt(eps) exactly enough, y = bias, finite gradients."""
    N, C, H, W, G = 2, 12, 5, 7, 4
    levels = torch.tensor([0.0, 1.0, -3.5, 1e4 if dtype in (torch.float32, torch.float64) else 64.0,
                           0.1, 7.25, -0.3, 2.0])
    v = levels[: N * G].reshape(N, G, 1, 1, 1).expand(N, G, C // G, H, W).reshape(N, C, H, W).to(dtype)
    x = v.to(DEV)
    if layout == "channels_last":
        x = channels_last(x)
    w, b = make_params(C, dtype)
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()
    torch.testing.assert_close(rstd.cpu().double(), torch.full((N, G), 1 / math.sqrt(EPS), dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(mean.cpu().double(), levels[: N * G].reshape(N, G).to(dtype).double(), rtol=1e-7, atol=0)
    torch.testing.assert_close(y.cpu().double(), b.cpu().double().reshape(1, C, 1, 1).expand(N, C, H, W), rtol=0, atol=1e-6)
    dy = make((N, C, H, W), dtype, layout, seed=4)
    check_backward(dy, x, G, w, b)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", [((2, 32, 16, 16), 4), ((1, 64, 64, 64), 8), ((3, 20), 2)], ids=_id)
def test_large_offset(case, dtype, layout):
    """x = 1e4 + randn: E[x^2] - E[x]^2 would lose every digit; mean, rstd, y and all gradients
    must keep the float32 accuracy of unit-scale data."""
    shape, G = case
    if layout == "channels_last" and len(shape) < 3:
        pytest.skip("rank 2 has no channels_last")
    x = make(shape, dtype, layout, offset=1e4)
    w, b = make_params(shape[1], dtype)
    _, mean, _ = check_forward(x, G, w, b)
    mean_ref, _ = ref_stats(x, G)
    torch.testing.assert_close(mean.cpu().double(), mean_ref, rtol=1e-7 if dtype == torch.float32 else 1e-12, atol=0)
    # dy with a non-zero mean makes sum(dy) large, and with it the error of centring the
    # backward sums on the saved mean (rounded to float32) instead of the true one.
    check_backward(make(shape, dtype, layout, seed=9, offset=1.0), x, G, w, b)


def _run_all(x, G, w, b, dy):
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    dx, dw, db = OPS.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True])
    return y, mean, rstd, dx, dw, db


@pytest.mark.parametrize(
    "shape,G,dtype,layout",
    [((1, 128, 64, 64), 32, torch.bfloat16, "contiguous"), ((1, 128, 64, 64), 32, torch.bfloat16, "channels_last"),
     ((2, 8192), 32, torch.float32, "contiguous"), ((4, 320, 16, 16), 32, torch.float16, "channels_last"),
     ((2, 16, 4097), 4, torch.float32, "contiguous")],
)
def test_deterministic(shape, G, dtype, layout):
    """Split reductions combine their partials in a fixed order: bitwise equal reruns."""
    x = make(shape, dtype, layout)
    dy = make(shape, dtype, layout, seed=3)
    w, b = make_params(shape[1], dtype)
    first = _run_all(x, G, w, b, dy)
    for _ in range(2):
        again = _run_all(x, G, w, b, dy)
        for name, p, q in zip(("y", "mean", "rstd", "dx", "dw", "db"), first, again):
            assert torch.equal(p, q), f"{name} differs between runs"


@pytest.mark.parametrize("parts", ["1", "3", "8"])
def test_parameter_gradients_over_a_cluster(parts, monkeypatch):
    """grad_weight / grad_bias of 32 channels are summed by a cluster of CTAs on sm_90
    (FUSEDNORM_PARAM_GRAD_PARTS forces its size; elsewhere every CTA sums alone): against the
    float64 reference in float64 (a lost rank's share would show), bitwise equal on a rerun, and
    within rounding of one CTA's sums in float32. The shapes leave hundreds of partials a channel
    (channels_last) and a few (contiguous), with channel blocks of 32, 5 x 32 and one partial."""
    for shape, G, layout in (((2, 320, 32, 32), 32, "channels_last"), ((3, 1000, 6, 6), 8, "channels_last"),
                             ((4, 48, 64, 64), 4, "contiguous")):
        kernel_paths.set_knob(monkeypatch, "FUSEDNORM_PARAM_GRAD_PARTS", parts)
        x = make(shape, torch.float64, layout, seed=4, offset=1.0)
        dy = make(shape, torch.float64, layout, seed=5)
        w, b = make_params(shape[1], torch.float64)
        check_backward(dy, x, G, w, b)
        x32, dy32, w32, b32 = (t.float() for t in (x, dy, w, b))
        got = _run_all(x32, G, w32, b32, dy32)
        assert all(torch.equal(p, q) for p, q in zip(got, _run_all(x32, G, w32, b32, dy32))), "rerun differs"
        kernel_paths.set_knob(monkeypatch, "FUSEDNORM_PARAM_GRAD_PARTS", "1")
        one = _run_all(x32, G, w32, b32, dy32)
        for name, p, q in zip(("dw", "db"), got[4:], one[4:]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_capture(layout, dtype):
    """Forward and backward are capturable (no host sync, no cudaMalloc outside the caching
    allocator) and replay on new data."""
    shape, G = (2, 64, 24, 24), 16
    x = make(shape, dtype, layout)
    dy = make(shape, dtype, layout, seed=1)
    w, b = make_params(shape[1], dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _run_all(x, G, w, b, dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run_all(x, G, w, b, dy)
    x.copy_(make(shape, dtype, layout, seed=11))
    dy.copy_(make(shape, dtype, layout, seed=12))
    graph.replay()
    torch.cuda.synchronize()
    eager = _run_all(x, G, w, b, dy)
    for name, p, q in zip(("y", "mean", "rstd", "dx", "dw", "db"), captured, eager):
        assert torch.equal(p, q), f"{name}: replay differs from eager"
    check_forward(x, G, w, b)


def test_parameter_on_another_device_raises():
    x = make((2, 4, 8), torch.float32)
    w_cpu = torch.ones(4)
    with pytest.raises(RuntimeError, match="same device"):
        OPS.group_norm_forward(x, 2, w_cpu, None, EPS)
    with pytest.raises(RuntimeError, match="same device"):
        OPS.group_norm_forward(x, 2, None, w_cpu, EPS)
    _, mean, rstd = OPS.group_norm_forward(x, 2, None, None, EPS)
    with pytest.raises(RuntimeError, match="same device"):
        OPS.group_norm_backward(torch.ones_like(x), x, mean, rstd, w_cpu, 2, [True, True, True])
    with pytest.raises(RuntimeError, match="same device"):
        OPS.group_norm_backward(torch.ones_like(x), x, mean.cpu(), rstd, None, 2, [True, True, True])


def test_reference_matches_autograd():
    """The references used here agree with autograd through F.group_norm in float64, and the
    kernels with both."""
    torch.manual_seed(0)
    x = torch.randn(3, 12, 5, 4, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(12, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 12, 5, 4, dtype=torch.float64)
    y = F.group_norm(x, 4, w, b, EPS)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
    y_ref, _, _ = ref_forward(x, 4, w, b)
    dx_ref, dw_ref, db_ref = ref_backward(dy, x, w, 4)
    for got, ref in ((y_ref, y), (dx_ref, gx), (dw_ref, gw), (db_ref, gb)):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-10)
    xc = x.detach().float().to(DEV)
    wc, bc = w.detach().float().to(DEV), b.detach().float().to(DEV)
    check_forward(xc, 4, wc, bc)
    check_backward(dy.float().to(DEV), xc, 4, wc, bc)


def test_huge_groups_small_batch():
    """The VAE decoder shape: N * G = 32 groups of 2M elements each, in both layouts."""
    shape, G = (1, 128, 512, 512), 32
    for layout in ("contiguous", "channels_last"):
        x = make(shape, torch.bfloat16, layout)
        w, b = make_params(128, torch.bfloat16)
        check_forward(x, G, w, b)
        dy = make(shape, torch.bfloat16, layout, seed=2)
        check_backward(dy, x, G, w, b)


# ---------------------------------------------------------------------------------------------
# Large tensors: 64-bit offsets. Each needs tens of GB of GPU memory.


def _require_free_gpu_memory(nbytes):
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def _check_group(x, y, mean, rstd, w, b, n, g, G, dtype):
    """Forward stats and output of group (n, g) against a float64 recomputation of that group."""
    C = x.shape[1]
    D = C // G
    xg = x[n, g * D:(g + 1) * D].double()
    m = xg.mean()
    r = ((xg - m).pow(2).mean() + EPS).rsqrt()
    torch.testing.assert_close(mean[n, g].double(), m, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(rstd[n, g].double(), r, rtol=2e-5, atol=2e-5)
    shape = (D,) + (1,) * (x.dim() - 2)
    y_ref = (xg - m) * r * w[g * D:(g + 1) * D].double().reshape(shape) + b[g * D:(g + 1) * D].double().reshape(shape)
    assert_close(y[n, g * D:(g + 1) * D], y_ref, dtype, f"y of group ({n}, {g})")


@pytest.mark.large
def test_large_fp32_forward_112x64x512x512():
    """7.5 GB of float32: element offsets fit in int32, byte offsets do not."""
    _require_free_gpu_memory(20 * 2**30)
    shape, G = (112, 64, 512, 512), 8
    torch.manual_seed(0)
    x = torch.rand(shape, device=DEV)
    w = torch.rand(64, device=DEV) + 0.5
    b = torch.randn(64, device=DEV)
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    assert torch.isfinite(mean).all() and torch.isfinite(rstd).all()
    for n, g in ((0, 0), (57, 3), (111, 7)):
        _check_group(x, y, mean, rstd, w, b, n, g, G, torch.float32)


@pytest.mark.large
def test_large_bf16_more_than_2_31_elements():
    """A bfloat16 tensor of 2^31 + 2M elements: element indices overflow int32. Forward and
    backward, checked on the groups at both ends (the last one lies beyond element 2^31)."""
    _require_free_gpu_memory(30 * 2**30)
    shape, G = (1, 64, 32768, 1025), 32
    assert math.prod(shape) > 2**31
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    w = (torch.rand(64, device=DEV) + 0.5).bfloat16()
    b = torch.randn(64, device=DEV).bfloat16()
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    for g in (0, 16, G - 1):
        _check_group(x, y, mean, rstd, w, b, 0, g, G, torch.bfloat16)
    del y
    dy = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    dx, dw, db = OPS.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True])
    D = 64 // G
    for g in (0, G - 1):
        sl = slice(g * D, (g + 1) * D)
        dx_ref, _, _ = ref_backward(dy[:, sl], x[:, sl], w[sl], 1, device=DEV)
        assert_close(dx[:, sl], dx_ref, torch.bfloat16, f"grad_input of group {g}")
    # Parameter gradients from float64 statistics recomputed one group at a time.
    dw_ref = torch.empty(64, dtype=torch.float64, device=DEV)
    db_ref = torch.empty(64, dtype=torch.float64, device=DEV)
    for g in range(G):
        m, r = (t[0, 0] for t in ref_stats(x[:, g * D:(g + 1) * D], 1, device=DEV))
        for c in range(g * D, (g + 1) * D):
            dyc = dy[0, c].double()
            dw_ref[c] = (dyc * ((x[0, c].double() - m) * r)).sum()
            db_ref[c] = dyc.sum()
    assert_close(dw, dw_ref, torch.bfloat16, "grad_weight")
    assert_close(db, db_ref, torch.bfloat16, "grad_bias")


# ---------------------------------------------------------------------------------------------
# Forward and backward have two paths each: one pass (ChannelsFirst, groups up to
# FUSEDNORM_ONE_PASS_MAX_BYTES, 16-byte aligned) and the split reduce / finalize / apply passes;
# by default ChannelsFirst groups over the one-pass limit take the team forward (group_norm_team.cuh),
# and so do 512 KB - 1 MB groups in fewer groups than half the SMs (csrc/plan.cpp, team_forward);
# the "team" path forces it on every group.
# The one-pass forward holds a group in registers where it fits (one CTA a group, at most 4 packs
# a thread; FUSEDNORM_ONE_PASS_REGISTERS=0 turns that off), else in shared memory, spread over a
# cluster of CTAs when large; the one-pass backward takes one CTA a group and needs S == 1 or S a
# multiple of the pack width. Most shapes above take the one-pass paths; here each case runs every
# path, and each must agree with the reference and with the split path.

ONE_PASS_CASES = [
    ((2, 64, 8, 8), 32),      # D = 2, S = 64
    ((3, 40, 9, 7), 4),       # S = 63: packs straddle channels (the backward takes the split path)
    ((3, 40, 9, 7), 10),      # the same with D * S a multiple of the pack width (the team path too)
    ((8, 8192), 1),           # problem 3's rows: S = 1, one group of 8192 channels (a cluster of 2)
    ((160, 8192), 1),         # the same rows, enough of them for one CTA a group: in registers
    ((16, 6000), 1),          # in registers, 4 packs a thread (float32), a partial last round
    ((8, 4000), 1),           # in registers with a partial last round of packs
    ((4, 24), 3),             # S = 1, D = 8
    ((2, 12, 5, 4), 3),       # one pack per thread or fewer
    ((2, 4, 64, 64), 4),      # D = 1, S = 4096: the whole CTA sums one channel
    ((2, 32, 40, 40), 2),     # group of 25600 elements: 100 KB in float32 (a cluster of 2 CTAs)
    ((2, 2, 256, 256), 2),    # D = 1, 256 KB in float32: clusters of 4 CTAs
    ((1, 8, 128, 128), 1),    # 512 KB in float32: clusters of 8 CTAs (the backward is split)
    ((1, 16, 128, 128), 1),   # 1 MB in float32: clusters of 16 CTAs where the device has them
    ((3, 64, 128, 128), 2),   # 2 MB in float32: the team forward by default (6 teams of 44 CTAs on an H100)
    ((100, 4, 160, 128), 2),  # 160 KB float32 groups: 100 teams of 2 CTAs, 2 rounds
]


@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ONE_PASS_CASES, ids=_id)
def test_one_pass_and_split_paths(case, dtype, path, monkeypatch):
    shape, G = case
    other = "split" if path != "split" else "one_pass"
    kernel_paths.set_path(monkeypatch, path)
    x = make(shape, dtype, seed=3, offset=3.0)
    w, b = make_params(shape[1], dtype)
    dy = make(shape, dtype, seed=5)
    y, mean, rstd = check_forward(x, G, w, b)
    grads = check_backward(dy, x, G, w, b)
    kernel_paths.set_path(monkeypatch, other)
    y2, mean2, rstd2 = OPS.group_norm_forward(x, G, w, b, EPS)
    grads2 = OPS.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True])
    low = dtype != torch.float32
    tol = dict(rtol=2e-2, atol=2e-2) if low else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(mean, mean2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd, rstd2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads2[0], **tol)
    # Sums over N * S elements, in float32 and rounded once to the weight's dtype: the two paths'
    # orders of summation may round to neighbouring values there.
    param_tol = dict(rtol=1e-2, atol=1e-2) if low else dict(rtol=1e-4, atol=1e-3)
    for got, want in zip(grads[1:], grads2[1:]):
        torch.testing.assert_close(got, want, **param_tol)


# The split apply pass over rows takes short tiles of a row, a CTA each (plan.cpp,
# tile_apply_rows: the plain kernels' 128 threads times 4 packs in float32, 16 forward and 8
# backward in 16-bit types; 256 times 16 with an epilogue): rows over several tiles with a
# partial last one, in single elements (S = 4087 is no multiple of a pack) and in packs
# (S = 20480: float32 rows of 5120 packs, 16-bit 2560 over 2048-pack tiles forward, 1024-pack
# backward), forward and backward; then the EPI kernels' tiles (GN+SiLU, S = 17030 single
# elements) against float64.
SPLIT_APPLY_CASES = [((2, 6, 61, 67), 3), ((2, 4, 128, 160), 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", SPLIT_APPLY_CASES, ids=_id)
def test_split_apply_over_tiles_of_a_row(case, dtype, monkeypatch):
    shape, G = case
    kernel_paths.set_path(monkeypatch, "split")
    names = kernel_paths.cuda_kernel_names(lambda: OPS.group_norm_forward(make(shape, dtype), G, None, None, EPS))
    assert "apply_rows_kernel" in names, names
    x = make(shape, dtype, seed=8, offset=2.0)
    w, b = make_params(shape[1], dtype)
    check_forward(x, G, w, b)
    check_backward(make(shape, dtype, seed=9), x, G, w, b)


def test_split_apply_epilogue_over_tiles_of_a_row(monkeypatch):
    kernel_paths.set_path(monkeypatch, "split")
    shape, G = (2, 4, 130, 131), 2
    x = make(shape, torch.float32, seed=10, offset=2.0).requires_grad_()
    w, b = (p.requires_grad_() for p in make_params(shape[1], torch.float32))
    dz = make(shape, torch.float32, seed=11)
    y = fusednorm.group_norm(x, G, w, b, EPS, activation="silu")
    names = kernel_paths.cuda_kernel_names(lambda: fusednorm.group_norm(x, G, w, b, EPS, activation="silu"))
    assert "apply_rows_kernel" in names, names
    grads = torch.autograd.grad(y, (x, w, b), dz)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = F.silu(F.group_norm(x64, G, w64, b64, EPS))
    grads64 = torch.autograd.grad(y64, (x64, w64, b64), dz.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads64):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


# The channels-last forward holds a group in registers where a CTA of 512 threads covers its S
# rows in 2 packs a thread (4 but in bfloat16): each row's D channels in 16-byte packs, D a
# multiple of the pack width. Other groups whose rows are whole 4-byte packs and fit a CTA's
# shared memory take the channels-last shared-memory kernel (activation none / SiLU / ReLU); the
# rest the split passes.
CL_ONE_PASS_CASES = [
    ((8, 1280, 8, 8), 32),      # UNet's channels_last groups: D = 40, S = 64
    ((2, 1280, 16, 16), 32),    # S = 256: 4 rows a thread in float16, shared memory in bfloat16 and float32
    ((3, 48, 5, 7), 2),         # D = 24: threads past whole rows idle, a partial last round
    ((2, 4096, 2, 2), 1),       # 512 packs a row in float16 (a thread a pack), split in float32
    ((2, 64, 3, 3, 3), 8),      # channels_last_3d, D = 8
    ((4, 32, 1, 3), 4),         # S = 3
    ((2, 36, 4, 4), 3),         # D = 12: 8-byte packs in half precision, 16-byte in float32
    ((2, 320, 16, 16), 32),     # UNet's D = 10: 4-byte packs in half precision, 8-byte in float32
    ((2, 64, 48, 48), 8),       # D = 8, 2304 rows: too many for registers (float16: 36 KB, float32: 72 KB)
    ((2, 6, 9, 7), 6),          # D = 1 (InstanceNorm): a 4-byte element a pack in float32, split in half precision
    ((2, 12, 5, 5), 4),         # D = 3
    ((96, 320, 4, 5), 32),      # 3072 groups, more than the CTAs resident at once: each CTA takes ~3
                                # in the shared-memory kernel, the next one's copy in flight
    ((2, 64, 6, 7), 16),        # D = 4: rows of 8 bytes (half precision: 4 groups a CTA of the
                                # shared-memory kernel) or 16 (float32: registers; shared: 2 a CTA)
]


def _channels_last_path(shape, G, dtype, registers=True):
    """The kernel forward_one_pass picks for a channels_last input with the one-pass path forced,
    one stream, no activation: "registers", "shared" (group_norm_cols_one_pass_kernel) or "split"."""
    D, S = shape[1] // G, math.prod(shape[2:])
    size = dtype.itemsize
    V = 16 // size
    if registers and D % V == 0:
        rows = 512 // (D // V)
        if D // V <= 512 and (S <= 2 * rows or (S <= 4 * rows and dtype != torch.bfloat16)):
            return "registers"
    row = D * size
    if row % 4:
        return "split"
    pack = 16 if row % 16 == 0 else 8 if row % 8 == 0 else 4
    optin = getattr(torch.cuda.get_device_properties(DEV), "shared_memory_per_block_optin", 48 * 1024)
    return "shared" if row // pack <= 256 and S * row + 1024 <= optin else "split"


@pytest.mark.parametrize("path", ["one_pass", "one_pass_shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CL_ONE_PASS_CASES, ids=_id)
def test_channels_last_forward_in_one_pass(case, dtype, path, monkeypatch):
    shape, G = case
    x = make(shape, dtype, layout="channels_last", seed=4, offset=2.0)
    w, b = make_params(shape[1], dtype)
    kernel_paths.set_path(monkeypatch, path)
    expected = _channels_last_path(shape, G, dtype, registers=path == "one_pass")
    names = kernel_paths.cuda_kernel_names(lambda: OPS.group_norm_forward(x, G, w, b, EPS))
    assert ("registers_kernel" in names) == (expected == "registers"), names
    assert ("cols_one_pass_kernel" in names) == (expected == "shared"), names
    y, mean, rstd = check_forward(x, G, w, b)
    assert y.movedim(1, -1).is_contiguous()
    kernel_paths.set_path(monkeypatch, "split")
    names = kernel_paths.cuda_kernel_names(lambda: OPS.group_norm_forward(x, G, w, b, EPS))
    assert "registers_kernel" not in names and "cols_one_pass_kernel" not in names, names
    y2, mean2, rstd2 = OPS.group_norm_forward(x, G, w, b, EPS)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(mean, mean2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd, rstd2, rtol=1e-5, atol=1e-6)
    # A constant group: variance exactly 0, y exactly the bias.
    kernel_paths.set_path(monkeypatch, path)
    x[0, : shape[1] // G] = 1.5
    y, mean, _ = OPS.group_norm_forward(x, G, w, b, EPS)
    assert mean[0, 0] == 1.5
    assert torch.all(y[0, : shape[1] // G] == b[: shape[1] // G].view(-1, *([1] * (x.dim() - 2))))


# Channels-last slabs that no CTA takes alone, or too few to fill the GPU one a CTA, take the
# shared-memory forward in clusters (sm_90, 16-bit types without a residual or multiplier;
# docs/design.md, "Channels-last one-pass"): the SD VAE's 512-channel groups at 64x64 (two groups
# a slab over clusters of 16 CTAs of 16 KB where the device schedules clusters of 16, else one
# over 8) and 128x128 (two over 16 of 64 KB), the UNet's D = 10 at 64x64 (two groups a slab of
# 4-byte packs over 8), and an odd S split unevenly over a cluster of 4 (1763 rows of D = 32);
# against the split passes.
CL_CLUSTER_CASES = [
    ((1, 512, 64, 64), 32, torch.float16),
    ((1, 512, 64, 64), 32, torch.bfloat16),
    ((2, 320, 64, 64), 32, torch.float16),
    ((2, 320, 64, 64), 32, torch.bfloat16),
    ((1, 512, 128, 128), 32, torch.float16),
    ((1, 128, 41, 43), 4, torch.float16),
]


@pytest.mark.parametrize("case", CL_CLUSTER_CASES, ids=lambda case: f"{_id(case[:2])}-{case[2]}")
def test_channels_last_forward_in_clusters(case, monkeypatch):
    shape, G, dtype = case
    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("thread block clusters need sm_90")
    kernel_paths.use_defaults(monkeypatch)
    assert "cluster=" in fusednorm.kernel_paths.plan(shape, G, dtype, channels_last=True, device=DEV)
    x = make(shape, dtype, layout="channels_last", seed=12, offset=2.0)
    w, b = make_params(shape[1], dtype)
    names = kernel_paths.cuda_kernel_names(lambda: OPS.group_norm_forward(x, G, w, b, EPS))
    assert "cols_one_pass_kernel" in names and "reduce_cols" not in names, names
    y, mean, rstd = check_forward(x, G, w, b)
    y2, mean2, rstd2 = OPS.group_norm_forward(x, G, w, b, EPS)
    assert torch.equal(y, y2) and torch.equal(mean, mean2) and torch.equal(rstd, rstd2)
    kernel_paths.set_path(monkeypatch, "split")
    names = kernel_paths.cuda_kernel_names(lambda: OPS.group_norm_forward(x, G, w, b, EPS))
    assert "cols_one_pass_kernel" not in names, names
    y3, mean3, rstd3 = OPS.group_norm_forward(x, G, w, b, EPS)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y3, **tol)
    torch.testing.assert_close(mean, mean3, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd, rstd3, rtol=1e-5, atol=1e-6)
    # A constant group (its rows over every CTA of the cluster): variance exactly 0, y exactly the bias.
    kernel_paths.use_defaults(monkeypatch)
    D = shape[1] // G
    x[0, :D] = 1.5
    y, mean, _ = OPS.group_norm_forward(x, G, w, b, EPS)
    assert mean[0, 0] == 1.5
    assert torch.all(y[0, :D] == b[:D].view(-1, *([1] * (x.dim() - 2))))


# The channels-last sweep (docs/design.md, "Channels-last sweep") takes channels-last groups in
# tiles of whole rows, every thread on one pack of channels: packs holding two groups (D = 4) or
# eight (D = 1), groups across packs (D = 10, D = C), an odd S whose last tile and last unrolled
# step are short, and rows of 256 packs (one output row a CTA). Rows of more than 256 packs, and
# double, take the split passes.
CL_SWEEP_CASES = [
    ((2, 128, 64, 64), 32),    # D = 4, 32 tiles a sample
    ((2, 320, 17, 19), 32),    # D = 10, S = 323: moments CTAs of 480 threads
    ((3, 64, 33, 35), 64),     # D = 1 (InstanceNorm)
    ((1, 16, 300, 301), 4),    # 88 (float16) / 176 (float32) tiles, the last one short
    ((1, 2048, 9, 9), 1),      # D = C; 256 packs a row in float16, 512 (the split passes) in float32
    ((2, 32, 5, 3, 7), 4),     # channels_last_3d, D = 8
    ((2, 4096, 3, 3), 32),     # 512 packs a row in float16: the split passes
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CL_SWEEP_CASES, ids=_id)
def test_channels_last_sweep(case, dtype, monkeypatch):
    shape, G = case
    kernel_paths.set_path(monkeypatch, "cols_sweep")
    x = make(shape, dtype, layout="channels_last", seed=9, offset=2.0)
    w, b = make_params(shape[1], dtype)
    names = kernel_paths.cuda_kernel_names(lambda: OPS.group_norm_forward(x, G, w, b, EPS))
    cpr = shape[1] * dtype.itemsize // 16
    assert ("cols_sweep_moments_kernel" in names) == (cpr <= 256), names
    check_forward(x, G, w, b)
    # Deterministic: the same bits again.
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    y2, mean2, rstd2 = OPS.group_norm_forward(x, G, w, b, EPS)
    assert torch.equal(y, y2) and torch.equal(mean, mean2) and torch.equal(rstd, rstd2)
    # Far from zero (mean 300, sd 1): the tile sums are of x - K, K the group's first element, so
    # neither the mean nor the variance loses digits to the offset.
    far = make(shape, dtype, layout="channels_last", seed=10, offset=300.0)
    _, mean, rstd = OPS.group_norm_forward(far, G, w, b, EPS)
    _, mean_ref, rstd_ref = ref_forward(far, G, w, b)
    assert_close(mean, mean_ref, dtype, "mean", STATS_TOL)
    assert_close(rstd, rstd_ref, dtype, "rstd", STATS_TOL)
    # Outliers where the shifts come from: the group's first element (K, every tile of the
    # group) and the first rows of the first tile (each thread's own shift T is its first row):
    # M2 = q2 - q1^2 / n must keep the variance's digits.
    D = shape[1] // G
    x[(0, 0) + (0,) * (x.dim() - 2)] = 1e3
    x[0, :D].view(D, -1)[:, 1:9] = -5e2
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    y_ref, mean_ref, rstd_ref = ref_forward(x, G, w, b)
    torch.testing.assert_close(rstd.double().cpu(), rstd_ref.cpu(), rtol=2e-5, atol=0)
    # (The mean's error is relative to K's distance from it, 1e3: test_group_whose_first_element_is_an_outlier.)
    torch.testing.assert_close(mean.double().cpu(), mean_ref.cpu(), atol=2e-5 * 1e3, rtol=0)
    # A constant group: variance exactly 0, y exactly the bias.
    x[0, :D] = 1.5
    y, mean, _ = OPS.group_norm_forward(x, G, w, b, EPS)
    assert mean[0, 0] == 1.5
    assert torch.all(y[0, :D] == b[:D].view(-1, *([1] * (x.dim() - 2))))


def test_team_edges(monkeypatch):
    # The team kernels on rounds fewer and more than one a team, teams of one CTA and of many
    # (channels split over several CTAs, and CTAs holding several channels), and a constant group
    # (forward: variance exactly 0, y exactly the bias; backward: against the float64 reference),
    # and teams of several rounds, whose odd teams start late (TeamGrid::start: (24, 64, 128, 128)
    # takes 12 teams of 4 rounds on an H100).
    kernel_paths.set_path(monkeypatch, "team")
    for shape, G in (((3, 64, 128, 128), 2), ((100, 4, 160, 128), 2), ((40, 12, 33, 20), 3), ((2, 8, 4, 4), 8),
                     ((2, 4, 64, 64), 4), ((24, 64, 128, 128), 2)):
        x = make(shape, torch.float32, seed=7, offset=3.0)
        D = shape[1] // G
        x[0, :D] = 2.5
        w, b = make_params(shape[1], torch.float32)
        y, mean, rstd = check_forward(x, G, w, b)
        assert mean[0, 0] == 2.5
        assert torch.all(y[0, :D] == b[:D].view(-1, *([1] * (x.dim() - 2))))
        dy = make(shape, torch.float32, seed=8)
        for mask in ((True, True, True), (True, False, True), (True, False, False)):
            check_backward(dy, x, G, w, b, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [((2, 256, 255, 255), 32), ((2, 256, 256, 256), 32)], ids=["straddling", "uniform"])
def test_team_forward_launches(case, dtype, monkeypatch):
    # The team forward is two kernels, for packs that straddle channels (S = 65025, no multiple of
    # a pack) and for packs that do not (group_norm_team_kernel's kStraddling); a refused launch
    # falls back to another path without a word, so the kernel is looked for by name. Chunks over
    # the default 48 KB of shared memory a CTA (87-104 KB), which a kernel gets only once allowed
    # (team_residency allows the one the call launches); y against the float64 reference.
    shape, G = case
    kernel_paths.set_path(monkeypatch, "team")
    x = make(shape, dtype, seed=41, offset=1.0)
    w, b = make_params(shape[1], dtype)
    names = kernel_paths.cuda_kernel_names(lambda: OPS.group_norm_forward(x, G, w, b, EPS))
    assert "group_norm_team_kernel" in names, names
    check_forward(x, G, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_team_tuning_changes_no_bit(dtype, monkeypatch):
    # Neither the team kernels' L2 prefetch of a CTA's next chunk (TeamGrid::prefetch_chunk) nor
    # the copies of the partials a CTA publishes (TeamGrid::replicas) changes a bit: y, mean, rstd
    # and every gradient are the same with the prefetch off and one copy, with the prefetch at 3/8
    # and whole, with 2 and 16 copies, and by the default rules (teams of 16 CTAs and more
    # prefetch, backward CTAs publish a copy a rank up to 16, forward CTAs 4: (3, 64, 128, 128)
    # takes 6 teams of 44 forward on an H100), on teams of one round and of
    # several (odd ones started late), with and without an activation, and against the float64
    # reference.
    cases = (((24, 64, 128, 128), 2, None), ((100, 4, 160, 128), 2, "silu"), ((40, 12, 33, 20), 3, None),
             ((3, 64, 128, 128), 2, "silu"))
    settings = {
        "plain": {"FUSEDNORM_TEAM_PREFETCH": "0", "FUSEDNORM_TEAM_REPLICAS": "1"},
        "prefetch 3/8": {"FUSEDNORM_TEAM_PREFETCH": "3"},
        "prefetch 8/8": {"FUSEDNORM_TEAM_PREFETCH": "8"},
        "2 copies": {"FUSEDNORM_TEAM_REPLICAS": "2"},
        "16 copies": {"FUSEDNORM_TEAM_REPLICAS": "16"},
        "default": {},
    }
    for shape, G, activation in cases:
        x = make(shape, dtype, seed=31, offset=1.0)
        w, b = make_params(shape[1], dtype)
        outputs = {}
        for name, env in settings.items():
            kernel_paths.set_path(monkeypatch, "team")  # unsets every other knob
            for key, value in env.items():
                kernel_paths.set_knob(monkeypatch, key, value)
            leaves = [t.detach().requires_grad_() for t in (x, w, b)]
            y = fusednorm.group_norm(*leaves[:1], G, *leaves[1:], EPS, activation=activation)
            grads = torch.autograd.grad(y, leaves, torch.ones_like(y))
            mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)[1:]
            outputs[name] = (y.detach(), mean, rstd, *grads)
        for name, got in outputs.items():
            for have, want in zip(got, outputs["plain"]):
                assert torch.equal(have, want), (shape, dtype, name)
        if activation is None:
            check_forward(x, G, w, b)
            check_backward(make(shape, dtype, seed=32), x, G, w, b)


@pytest.mark.parametrize("path", ["team", "one_pass"])
def test_cuda_graph_capture_kernel_paths(path, monkeypatch):
    # The ops inside a captured CUDA graph (torch.compile's "reduce-overhead" mode captures them):
    # the team kernels' cooperative launches, their memset and their temporaries from the graph's
    # pool; replays on new data must match eager calls.
    kernel_paths.set_path(monkeypatch, path)
    shape, G = (3, 64, 64, 64), 2
    x = make(shape, torch.float32, seed=9, offset=1.0)
    dy = make(shape, torch.float32, seed=10)
    w, b = make_params(shape[1], torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run_all(x, G, w, b, dy)  # warm-up outside the capture (attributes, allocator)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _run_all(x, G, w, b, dy)
    for seed in (11, 12):
        x.copy_(make(shape, torch.float32, seed=seed, offset=-2.0))
        dy.copy_(make(shape, torch.float32, seed=seed + 10))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, _run_all(x, G, w, b, dy)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# Every path shifts the data by the group's first element K before summing; a first element far
# from the rest must not cost the variance its digits. The team forward once took each chunk's M2
# as sum (x - K)^2 - (sum (x - K))^2 / n, which cancelled here (1.5-3% variance error in a float32
# simulation); the team, sweep and channels-last sweep moments now sum x - T, T each thread's own
# first element (docs/design.md, "Numerics"), and the other paths take two passes. bfloat16: the
# sweep path's (2 MB groups of 16-bit types).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
def test_group_whose_first_element_is_an_outlier(path, dtype, monkeypatch):
    kernel_paths.set_path(monkeypatch, path)
    shape, G = (2, 4, 256, 256), 1  # 1 MB groups: the team forward by default
    x = make(shape, dtype, seed=21)
    x[:, 0, 0, 0] = 1e4
    w, b = make_params(shape[1], dtype)
    y, mean, rstd = OPS.group_norm_forward(x, G, w, b, EPS)
    y_ref, mean_ref, rstd_ref = ref_forward(x, G, w, b)
    assert_close(rstd, rstd_ref, dtype, "rstd", STATS_TOL)
    # mean = K + (mean of x - K) in float32: its error is relative to the data's range (1e4), not
    # to the mean (~0.04); every path rounds there.
    torch.testing.assert_close(mean.double().cpu(), mean_ref.cpu(), atol=2e-5 * 1e4, rtol=0)
    # y away from the outlier, at its own scale.
    rest = (slice(None), slice(None), slice(1, None))
    assert_close(y[rest], y_ref[rest], dtype, "y")


# Channels of one group far apart: the team forward's chunks of the first channel lie near K, the
# others' far from it; the team merges both kinds.
@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
def test_group_of_channels_far_apart(path, monkeypatch):
    kernel_paths.set_path(monkeypatch, path)
    shape, G = (2, 4, 256, 256), 1
    x = make(shape, torch.float32, seed=22)
    x += torch.tensor([0.0, 40.0, -25.0, 70.0], device=x.device).view(1, 4, 1, 1)
    w, b = make_params(shape[1], torch.float32)
    check_forward(x, G, w, b)
