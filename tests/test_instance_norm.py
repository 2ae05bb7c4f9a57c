"""instance_norm (functional and op) against a float64 reference written from the definition, and
against torch.nn.functional.instance_norm."""

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import fusednorm
from reference import TOLERANCES, to_layout

# -- the reference -----------------------------------------------------------------------------


def instance_norm_reference(
    x: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    use_input_stats: bool,
    momentum: float,
    eps: float,
):
    """Float64 instance norm from the definition. Returns (y, new_running_mean, new_running_var);
    differentiable in x, weight and bias (float64 leaves).

    With use_input_stats: per (n, c) mean and biased variance over the spatial positions; the
    running statistics become (1 - m) * running + m * mean over n of the per-instance mean /
    UNBIASED variance (factor S / (S - 1)). An empty batch (N = 0) has no instance statistics and
    leaves the running statistics as they are. Without use_input_stats: the running statistics
    normalize."""
    N, C = x.shape[:2]
    S = math.prod(x.shape[2:])
    flat = x.reshape(N, C, S)
    # On the CPU, as the float64 leaves x, weight and bias are.
    new_rm = None if running_mean is None else running_mean.detach().cpu().double().clone()
    new_rv = None if running_var is None else running_var.detach().cpu().double().clone()
    if use_input_stats:
        mean = flat.sum(dim=2, keepdim=True) / S
        var = ((flat - mean) ** 2).sum(dim=2, keepdim=True) / S
        y = ((flat - mean) / torch.sqrt(var + eps)).reshape(x.shape)
        if N > 0:
            with torch.no_grad():
                if new_rm is not None:
                    new_rm = (1 - momentum) * new_rm + momentum * mean[:, :, 0].sum(0) / N
                if new_rv is not None:
                    unbiased = var[:, :, 0] * S / (S - 1)
                    new_rv = (1 - momentum) * new_rv + momentum * unbiased.sum(0) / N
    else:
        shape = (1, C) + (1,) * (x.dim() - 2)
        rm = running_mean.detach().cpu().double().reshape(shape)
        rv = running_var.detach().cpu().double().reshape(shape)
        y = (x - rm) / torch.sqrt(rv + eps)
    shape = (1, C) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y, new_rm, new_rv


def close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str) -> None:
    """Within the dtype's tolerance of the float64 reference, atol scaled to its magnitude."""
    atol, rtol = TOLERANCES[dtype]
    scale = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().cpu().double(), expected.detach().cpu().double(), atol=atol * scale, rtol=rtol,
        msg=lambda m: f"{what}\n{m}",
    )


# -- inputs ------------------------------------------------------------------------------------


def make_input(shape, seed: int, dtype: torch.dtype, device) -> Tensor:
    """Each (n, c) instance has a random mean in [-2, 2] and standard deviation in [0.5, 2], so
    rstd stays O(1) and the tolerances can stay tight."""
    g = torch.Generator().manual_seed(seed)
    N, C = shape[:2]
    S = math.prod(shape[2:])
    z = torch.randn(N, C, S, generator=g, dtype=torch.float64)
    if z.numel():
        z = (z - z.mean(2, keepdim=True)) / z.std(2, unbiased=False, keepdim=True)
    mu = torch.rand(N, C, 1, generator=g, dtype=torch.float64) * 4 - 2
    sigma = torch.rand(N, C, 1, generator=g, dtype=torch.float64) * 1.5 + 0.5
    return (z * sigma + mu).reshape(shape).to(dtype).to(device)


def randn(shape, seed, dtype, device) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


@st.composite
def shapes(draw, min_batch=0):
    rank = draw(st.integers(3, 5))
    N = draw(st.integers(min_batch, 4))
    C = draw(st.integers(1, 9))
    spatial = draw(
        st.lists(st.integers(1, 9), min_size=rank - 2, max_size=rank - 2).filter(lambda s: math.prod(s) > 1)
    )
    return (N, C) + tuple(spatial)


@st.composite
def instance_norm_cases(draw, min_batch=0):
    shape = draw(shapes(min_batch=min_batch))
    # Both running statistics or neither: F.instance_norm rejects one without the other (see
    # test_errors.py::test_instance_norm_only_one_running_stat).
    has_rm = has_rv = draw(st.booleans())
    return dict(
        shape=shape,
        has_weight=draw(st.booleans()),
        has_bias=draw(st.booleans()),
        has_rm=has_rm,
        has_rv=has_rv,
        # Without running statistics only use_input_stats=True is valid.
        use_input_stats=draw(st.booleans()) if has_rm else True,
        momentum=draw(st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0.0, 1.0)),
        eps=draw(st.sampled_from([1e-5, 1e-3, 0.1]) | st.floats(1e-6, 0.5)),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        layout=draw(st.sampled_from(["contiguous", "channels_last"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build(case, device, stats_dtype=None, param_dtype=None):
    """(x, running_mean, running_var, weight, bias, grad_out) for a case; x, weight and bias
    require grad."""
    shape, dtype, seed = case["shape"], case["dtype"], case["seed"]
    stats_dtype = stats_dtype or dtype
    param_dtype = param_dtype or dtype
    C = shape[1]
    x = to_layout(make_input(shape, seed, dtype, device), case["layout"]).requires_grad_()
    rm = randn(C, seed + 1, stats_dtype, device) if case["has_rm"] else None
    rv = (torch.rand(C, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64) * 2 + 0.5).to(
        stats_dtype).to(device) if case["has_rv"] else None
    w = randn(C, seed + 3, param_dtype, device).requires_grad_() if case["has_weight"] else None
    b = randn(C, seed + 4, param_dtype, device).requires_grad_() if case["has_bias"] else None
    grad_out = randn(shape, seed + 5, dtype, device)
    return x, rm, rv, w, b, grad_out


def f64_leaf(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().cpu().double().requires_grad_()


# -- against the reference ---------------------------------------------------------------------


@given(case=instance_norm_cases())
def test_instance_norm_matches_reference(case, device):
    x, rm, rv, w, b, grad_out = build(case, device)
    use_input_stats, momentum, eps, dtype = case["use_input_stats"], case["momentum"], case["eps"], case["dtype"]
    rm0 = None if rm is None else rm.clone()
    rv0 = None if rv is None else rv.clone()

    x64, w64, b64 = f64_leaf(x), f64_leaf(w), f64_leaf(b)
    y_ref, rm_ref, rv_ref = instance_norm_reference(x64, rm0, rv0, w64, b64, use_input_stats, momentum, eps)

    y = fusednorm.instance_norm(x, rm, rv, w, b, use_input_stats, momentum, eps)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    if x.shape[0] == 0:
        assert y.numel() == 0
    close(y, y_ref, dtype, "output")

    # Running statistics: updated in place (same tensor objects) with input stats, untouched without.
    if rm is not None:
        assert rm.dtype == dtype
        if use_input_stats:
            close(rm, rm_ref, dtype, "running_mean")
        else:
            assert torch.equal(rm, rm0)
    if rv is not None:
        if use_input_stats:
            close(rv, rv_ref, dtype, "running_var")
        else:
            assert torch.equal(rv, rv0)
    if x.shape[0] == 0:
        for new, old in ((rm, rm0), (rv, rv0)):
            if new is not None:
                assert torch.equal(new, old), "an empty batch must leave the running statistics as they are"

    inputs = [t for t in (x, w, b) if t is not None]
    grads = torch.autograd.grad(y, inputs, grad_out)
    inputs64 = [t for t in (x64, w64, b64) if t is not None]
    grads_ref = torch.autograd.grad(y_ref, inputs64, grad_out.detach().cpu().double(), allow_unused=True)
    for name, t, g, g_ref in zip(("input", "weight", "bias"), inputs, grads, grads_ref):
        if g_ref is None:  # x with N = 0 contributes nothing to the graph
            g_ref = torch.zeros_like(t, dtype=torch.float64, device="cpu")
        assert g.shape == t.shape and g.dtype == t.dtype, name
        close(g, g_ref, dtype, f"grad_{name}")
    if x.shape[0] == 0:
        for t, g in zip(inputs[1:], grads[1:]):
            assert g.shape == t.shape and torch.count_nonzero(g) == 0, "N = 0: weight/bias grads must be zeros"


@given(case=instance_norm_cases(min_batch=1))
def test_op_matches_torch_functional(case, device):
    """torch.ops.fusednorm.instance_norm and F.instance_norm: outputs, gradients and the running
    statistics they update. F.instance_norm runs on the CPU: on CUDA (cuDNN batch norm) it fails or
    gives wrong bias gradients on some tiny shapes (seen with torch 2.11: (1, 1, 1, 1, 2))."""
    x, rm, rv, w, b, grad_out = build(case, device)
    args = (case["use_input_stats"], case["momentum"], case["eps"])
    x_t = x.detach().cpu().clone().requires_grad_()
    w_t = None if w is None else w.detach().cpu().clone().requires_grad_()
    b_t = None if b is None else b.detach().cpu().clone().requires_grad_()
    rm_t = None if rm is None else rm.cpu().clone()
    rv_t = None if rv is None else rv.cpu().clone()

    y = torch.ops.fusednorm.instance_norm(x, rm, rv, w, b, *args)
    y_t = F.instance_norm(x_t, rm_t, rv_t, w_t, b_t, *args)
    atol = 1e-5 if case["dtype"] == torch.float32 else 1e-10
    torch.testing.assert_close(y.cpu(), y_t, atol=atol, rtol=atol)
    stat_tol = 1e-6 if case["dtype"] == torch.float32 else 1e-12
    if rm is not None:
        torch.testing.assert_close(rm.cpu(), rm_t, atol=stat_tol, rtol=stat_tol)
        torch.testing.assert_close(rv.cpu(), rv_t, atol=stat_tol, rtol=stat_tol)

    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], grad_out)
    grads_t = torch.autograd.grad(y_t, [t for t in (x_t, w_t, b_t) if t is not None], grad_out.cpu())
    for g, g_t in zip(grads, grads_t):
        scale = max(1.0, float(g_t.abs().max()))
        torch.testing.assert_close(g.cpu(), g_t, atol=atol * 10 * scale, rtol=atol * 10)


@given(shape=shapes(), eps=st.sampled_from([1e-5, 1e-3]), seed=st.integers(0, 2**31 - 1))
def test_functional_defaults_match_op(shape, eps, seed, device):
    """fusednorm.instance_norm's defaults (no running stats, use_input_stats=True) equal the op's
    and give per-instance normalization."""
    x = make_input(shape, seed, torch.float32, device)
    y = fusednorm.instance_norm(x, eps=eps)
    torch.testing.assert_close(y, torch.ops.fusednorm.instance_norm(x, eps=eps), atol=0, rtol=0)
    y_ref, _, _ = instance_norm_reference(x.double().cpu(), None, None, None, None, True, 0.1, eps)
    close(y, y_ref, torch.float32, "output")


# -- bfloat16 input, float32 running statistics and parameters -------------------------------------


@settings(max_examples=10)
@given(case=instance_norm_cases(min_batch=1), use_input_stats=st.booleans())
def test_bf16_input_fp32_stats_and_weight(case, use_input_stats, device):
    case = dict(case, dtype=torch.bfloat16, has_rm=True, has_rv=True, has_weight=True,
                use_input_stats=use_input_stats)
    x, rm, rv, w, b, grad_out = build(case, device, stats_dtype=torch.float32, param_dtype=torch.float32)
    momentum, eps = case["momentum"], case["eps"]
    rm0, rv0 = rm.clone(), rv.clone()
    x64, w64, b64 = f64_leaf(x), f64_leaf(w), f64_leaf(b)
    y_ref, rm_ref, rv_ref = instance_norm_reference(x64, rm0, rv0, w64, b64, use_input_stats, momentum, eps)

    y = fusednorm.instance_norm(x, rm, rv, w, b, use_input_stats, momentum, eps)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    close(y, y_ref, torch.bfloat16, "output")
    # The statistics are computed in float32 from the bf16 values: float32 accuracy.
    assert rm.dtype == torch.float32 and rv.dtype == torch.float32
    close(rm, rm_ref, torch.float32, "running_mean")
    close(rv, rv_ref, torch.float32, "running_var")

    # F.instance_norm accepts the same mix on the CPU; the running statistics agree closely.
    rm_t, rv_t = rm0.clone().cpu(), rv0.clone().cpu()
    F.instance_norm(x.detach().cpu(), rm_t, rv_t, w.detach().cpu(), None if b is None else b.detach().cpu(),
                    use_input_stats, momentum, eps)
    torch.testing.assert_close(rm.cpu(), rm_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rv.cpu(), rv_t, atol=1e-5, rtol=1e-5)

    inputs = [t for t in (x, w, b) if t is not None]
    grads = torch.autograd.grad(y, inputs, grad_out)
    grads_ref = torch.autograd.grad(y_ref, [t for t in (x64, w64, b64) if t is not None], grad_out.double().cpu())
    assert grads[0].dtype == torch.bfloat16
    close(grads[0], grads_ref[0], torch.bfloat16, "grad_input")
    for g, g_ref, t in zip(grads[1:], grads_ref[1:], inputs[1:]):
        assert g.dtype == torch.float32 == t.dtype
        # Sums over N * S bf16 products: bf16 relative accuracy of the terms.
        close(g, g_ref, torch.bfloat16, "grad_param")


def test_bf16_input_fp32_bias_only_grad_has_fp32_accuracy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 1000, generator=g).bfloat16().requires_grad_()
    grad_out = torch.randn(2, 3, 1000, generator=g).bfloat16()
    b = torch.zeros(3, requires_grad=True)
    fusednorm.instance_norm(x, None, None, None, b).backward(grad_out)
    b_t = torch.zeros(3, requires_grad=True)
    F.instance_norm(x.detach(), None, None, None, b_t).backward(grad_out)
    expected = grad_out.double().sum((0, 2))
    assert b.grad.dtype == torch.float32
    torch.testing.assert_close(b_t.grad.double(), expected, atol=1e-4, rtol=1e-5)  # torch: fp32-accurate
    torch.testing.assert_close(b.grad.double(), expected, atol=1e-4, rtol=1e-5)


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [fusednorm.instance_norm, torch.ops.fusednorm.instance_norm, F.instance_norm],
                         ids=["functional", "op", "torch"])
@pytest.mark.parametrize("given_stat", [None, "running_mean", "running_var"])
def test_eval_without_running_stats_raises(fn, given_stat, device):
    x = torch.randn(2, 3, 5, device=device)
    stats = {"running_mean": None, "running_var": None}
    if given_stat:
        stats[given_stat] = torch.ones(3, device=device)
    with pytest.raises(RuntimeError, match="running_mean and running_var to be defined"):
        fn(x, stats["running_mean"], stats["running_var"], use_input_stats=False)
    # still usable
    torch.testing.assert_close(fn(x), F.instance_norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", [fusednorm.instance_norm, torch.ops.fusednorm.instance_norm],
                         ids=["functional", "op"])
@pytest.mark.parametrize("use_input_stats", [True, False])
@pytest.mark.parametrize("bad", ["mean_short", "mean_long", "var_short", "mean_2d"])
def test_running_stat_of_wrong_size_raises(fn, use_input_stats, bad, device):
    C = 4
    x = torch.randn(2, C, 5, device=device)
    rm, rv = torch.zeros(C, device=device), torch.ones(C, device=device)
    if bad == "mean_short":
        rm = torch.zeros(C - 1, device=device)
    elif bad == "mean_long":
        rm = torch.zeros(C + 2, device=device)
    elif bad == "var_short":
        rv = torch.ones(C - 1, device=device)
    else:
        rm = torch.zeros(C, 1, device=device)
    rm0, rv0 = rm.clone(), rv.clone()
    name = "running_var" if bad == "var_short" else "running_mean"
    # torch raises RuntimeError for the same mistake.
    with pytest.raises(RuntimeError):
        F.instance_norm(x, rm.clone(), rv.clone(), use_input_stats=use_input_stats)
    with pytest.raises(RuntimeError, match=name):
        fn(x, rm, rv, None, None, use_input_stats)
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0), "a rejected call must not touch the running stats"
    rm, rv = torch.zeros(C, device=device), torch.ones(C, device=device)
    fn(x, rm, rv, None, None, use_input_stats)  # still usable


@pytest.mark.cuda
@pytest.mark.parametrize("stats_on", ["cpu", "cuda"])
@pytest.mark.parametrize("use_input_stats", [True, False])
def test_running_stats_on_another_device_raise(stats_on, use_input_stats):
    x_dev = "cuda" if stats_on == "cpu" else "cpu"
    x = torch.randn(2, 3, 5, device=x_dev)
    rm, rv = torch.zeros(3, device=stats_on), torch.ones(3, device=stats_on)
    with pytest.raises(RuntimeError, match="device"):
        fusednorm.instance_norm(x, rm, rv, use_input_stats=use_input_stats)
    assert torch.count_nonzero(rm) == 0 and torch.equal(rv, torch.ones_like(rv))


# -- opcheck ------------------------------------------------------------------------------------

OPCHECK_CASES = {
    "no_stats": dict(stats=False, grad=False, use_input_stats=True),
    "stats_train": dict(stats=True, grad=False, use_input_stats=True),
    "stats_eval": dict(stats=True, grad=False, use_input_stats=False),
    "grad_no_stats": dict(stats=False, grad=True, use_input_stats=True),
    "grad_stats_train": dict(stats=True, grad=True, use_input_stats=True),
    "grad_stats_eval": dict(stats=True, grad=True, use_input_stats=False),
}


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_instance_norm(name, device):
    c = OPCHECK_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(3, 4, 5, 2, generator=g).to(device).requires_grad_(c["grad"])
    w = torch.randn(4, generator=g).to(device).requires_grad_(c["grad"])
    b = torch.randn(4, generator=g).to(device).requires_grad_(c["grad"])
    rm = torch.randn(4, generator=g).to(device) if c["stats"] else None
    rv = (torch.rand(4, generator=g) + 0.5).to(device) if c["stats"] else None
    result = torch.library.opcheck(
        torch.ops.fusednorm.instance_norm, (x, rm, rv, w, b, c["use_input_stats"], 0.3, 1e-4)
    )
    assert all(v == "SUCCESS" for v in result.values()), result
