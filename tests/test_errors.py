"""Bad arguments: the exception type (PyTorch's where PyTorch raises something sensible for the same
mistake), the message, and that the process stays usable afterwards."""

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fusednorm
import fusednorm.nn as fnn

OPS = torch.ops.fusednorm
DIVISIBLE = "divisible by num_groups"
POSITIVE = "num_groups to be positive"
PARAM_SIZE = "to be a vector of size equal to the number of channels"
AT_LEAST_2D = "Expected at least 2 dimensions for input tensor"
NOT_IMPL = "not implemented for"
DTYPE = "dtype"


def assert_still_usable(device="cpu"):
    """A valid call of every entry point after an error: right results, nothing left broken."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=g).to(device).requires_grad_()
    w, b = torch.randn(6, generator=g).to(device), torch.randn(6, generator=g).to(device)
    y = fusednorm.group_norm(x, 3, w, b)
    torch.testing.assert_close(y, F.group_norm(x, 3, w, b), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    rm, rv = torch.zeros(6, device=device), torch.ones(6, device=device)
    rm_t, rv_t = rm.clone(), rv.clone()
    y = fusednorm.instance_norm(x, rm, rv, w, b)
    torch.testing.assert_close(y, F.instance_norm(x, rm_t, rv_t, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rm, rm_t, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rv, rv_t, atol=1e-6, rtol=1e-6)


def raises_like_torch(ours, theirs, exc_type, match):
    """`ours()` raises exc_type with a message matching `match`; `theirs()` (PyTorch's, None where
    PyTorch has nothing sensible) raises the same type. Then the process must still be usable."""
    if theirs is not None:
        with pytest.raises(exc_type):
            theirs()
    with pytest.raises(exc_type, match=match):
        ours()
    assert_still_usable()


def x_(shape=(2, 6, 5), dtype=torch.float32, device="cpu"):
    return torch.randn(shape, dtype=torch.float64).to(dtype).to(device)


# -- group_norm: num_groups ------------------------------------------------------------------------

GROUP_NORM_FNS = {
    "functional": lambda x, G, w=None, b=None: fusednorm.group_norm(x, G, w, b),
    "op": lambda x, G, w=None, b=None: OPS.group_norm(x, G, w, b),
    "forward_op": lambda x, G, w=None, b=None: OPS.group_norm_forward(x, G, w, b, 1e-5),
}


@pytest.mark.parametrize("fn", list(GROUP_NORM_FNS))
@given(G=st.integers(1, 12), C=st.integers(1, 12), N=st.integers(1, 3))
def test_num_groups_not_dividing_channels(fn, G, C, N):
    x = x_((N, C, 4))
    if C % G == 0:  # valid: no error
        GROUP_NORM_FNS[fn](x, G)
        return
    raises_like_torch(lambda: GROUP_NORM_FNS[fn](x, G), lambda: F.group_norm(x, G), RuntimeError, DIVISIBLE)


@pytest.mark.parametrize("fn", list(GROUP_NORM_FNS))
@given(G=st.integers(-8, 0))
def test_num_groups_zero_or_negative(fn, G):
    x = x_((2, 6, 5))
    # PyTorch: ZeroDivisionError from Python for 0 (not sensible), RuntimeError for negative.
    theirs = (lambda: F.group_norm(x, G)) if G < 0 else None
    raises_like_torch(lambda: GROUP_NORM_FNS[fn](x, G), theirs, RuntimeError, POSITIVE)


@pytest.mark.parametrize("G", [0, -1, -3])
def test_num_groups_zero_or_negative_backward_op(G):
    x, g = x_(), x_()
    mean = rstd = torch.zeros(2, 1)
    with pytest.raises(RuntimeError, match=POSITIVE):
        OPS.group_norm_backward(g, x, mean, rstd, None, G, [True, True, True])
    assert_still_usable()


# -- group_norm: weight and bias -------------------------------------------------------------------

BAD_PARAM_SHAPES = [(5,), (7,), (1,), (0,), (6, 1), (1, 6), (2, 3), ()]


@pytest.mark.parametrize("fn", list(GROUP_NORM_FNS))
@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("shape", BAD_PARAM_SHAPES, ids=str)
def test_param_of_wrong_size_or_rank(fn, which, shape):
    x = x_()
    p = torch.ones(shape)
    kw = {"w": p} if which == "weight" else {"b": p}
    tkw = {"weight": p} if which == "weight" else {"bias": p}
    raises_like_torch(lambda: GROUP_NORM_FNS[fn](x, 3, **kw), lambda: F.group_norm(x, 3, **tkw), RuntimeError,
                      f"Expected {which} {PARAM_SIZE}")


# -- group_norm: input rank and dtype --------------------------------------------------------------


@pytest.mark.parametrize("fn", list(GROUP_NORM_FNS))
@pytest.mark.parametrize("shape", [(), (6,), (1,)], ids=str)
def test_input_with_fewer_than_2_dims(fn, shape):
    x = torch.randn(shape)
    raises_like_torch(lambda: GROUP_NORM_FNS[fn](x, 1), lambda: F.group_norm(x, 1), RuntimeError, AT_LEAST_2D)


BAD_INPUT_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@pytest.mark.parametrize("fn", list(GROUP_NORM_FNS))
@pytest.mark.parametrize("dtype", BAD_INPUT_DTYPES, ids=str)
def test_unsupported_input_dtype(fn, dtype):
    x = torch.ones(2, 6, 5, dtype=dtype)
    raises_like_torch(lambda: GROUP_NORM_FNS[fn](x, 3), lambda: F.group_norm(x, 3), NotImplementedError, NOT_IMPL)


MISMATCHED_PARAM_DTYPES = [
    (torch.float32, torch.float64), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
    (torch.float64, torch.float32), (torch.bfloat16, torch.float64), (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16), (torch.float32, torch.int64),
]


@pytest.mark.parametrize("fn", list(GROUP_NORM_FNS))
@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("x_dtype,p_dtype", MISMATCHED_PARAM_DTYPES, ids=str)
def test_param_dtype_mismatch_is_runtime_error(fn, which, x_dtype, p_dtype):
    # As PyTorch's CPU kernel, which raises RuntimeError("mixed dtype ...").
    x = x_(dtype=x_dtype)
    p = torch.ones(6, dtype=p_dtype)
    kw = {"w": p} if which == "weight" else {"b": p}
    tkw = {"weight": p} if which == "weight" else {"bias": p}
    raises_like_torch(lambda: GROUP_NORM_FNS[fn](x, 3, **kw), lambda: F.group_norm(x, 3, **tkw), RuntimeError,
                      re.escape(f"Expected {which} to have the input's dtype"))


@pytest.mark.parametrize("fn", list(GROUP_NORM_FNS))
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
@given(seed=st.integers(0, 2**31 - 1), G=st.sampled_from([1, 2, 3, 6]))
def test_reduced_input_with_fp32_params_is_allowed(fn, x_dtype, seed, G):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 5, generator=g).to(x_dtype)
    w, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    out = GROUP_NORM_FNS[fn](x, G, w, b)
    y = out[0] if isinstance(out, (tuple, list)) else out
    assert y.dtype == x_dtype
    torch.testing.assert_close(y.float(), F.group_norm(x, G, w, b).float(), atol=3e-2, rtol=2e-2)


# -- group_norm_backward op --------------------------------------------------------------------------


def backward_args(x_dtype=torch.float32, weight=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, generator=g).to(x_dtype)
    w = torch.randn(6, generator=g) if weight else None
    if w is not None and x_dtype == torch.float64:
        w = w.double()
    _, mean, rstd = OPS.group_norm_forward(x, 3, w, None, 1e-5)
    grad = torch.randn(2, 6, 5, generator=g).to(x_dtype)
    return grad, x, mean, rstd, w


def aten_backward(grad, x, mean, rstd, w):
    return torch.ops.aten.native_group_norm_backward(grad, x, mean, rstd, w, 2, 6, 5, 3, [True, True, True])


def mutate_stat(t, how):
    return {
        "short_batch": lambda: t[:1],
        "transposed": lambda: t.t().contiguous(),
        "flat": lambda: t.flatten(),
        "3d": lambda: t.unsqueeze(-1),
        "extra_group": lambda: torch.cat([t, t[:, :1]], 1),
        "float64": lambda: t.double(),
        "bfloat16": lambda: t.bfloat16(),
        "float16": lambda: t.half(),
    }[how]()


STAT_MUTATIONS = ["short_batch", "transposed", "flat", "3d", "extra_group", "float64", "bfloat16", "float16"]


@pytest.mark.parametrize("which", ["mean", "rstd"])
@pytest.mark.parametrize("how", STAT_MUTATIONS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_stats_of_wrong_shape_or_dtype(which, how, x_dtype):
    grad, x, mean, rstd, w = backward_args(x_dtype)
    assert mean.dtype == torch.float32  # stats are float32 for float32 and bf16 input
    if which == "mean":
        mean = mutate_stat(mean, how)
    else:
        rstd = mutate_stat(rstd, how)
    # aten's native_group_norm_backward raises RuntimeError for the analogous mistakes on float32.
    # (aten checks only numel and dtype, so it has no counterpart for "transposed", "flat", "3d")
    aten_checks = how in ("short_batch", "extra_group", "float64", "bfloat16", "float16")
    theirs = (lambda: aten_backward(grad, x, mean, rstd, w)) if x_dtype == torch.float32 and aten_checks else None
    raises_like_torch(lambda: OPS.group_norm_backward(grad, x, mean, rstd, w, 3, [True, True, True]), theirs,
                      RuntimeError, f"Expected {which} to be a")


def test_backward_stats_of_a_different_num_groups():
    grad, x, mean, rstd, w = backward_args()
    raises_like_torch(lambda: OPS.group_norm_backward(grad, x, mean, rstd, w, 2, [True, True, True]), None,
                      RuntimeError, "Expected mean to be a")


def test_backward_float64_input_needs_float64_stats():
    grad, x, mean, rstd, w = backward_args(torch.float64)
    assert mean.dtype == torch.float64
    raises_like_torch(lambda: OPS.group_norm_backward(grad, x, mean.float(), rstd, w, 3, [True] * 3), None,
                      RuntimeError, "Expected mean to be a")


@pytest.mark.parametrize("shape", [(2, 6, 4), (2, 5, 6), (1, 6, 5), (2, 6, 5, 1), (60,), (2, 30)], ids=str)
def test_backward_grad_out_of_wrong_shape(shape):
    grad, x, mean, rstd, w = backward_args()
    bad = torch.randn(shape)
    theirs = (lambda: aten_backward(bad, x, mean, rstd, w)) if bad.numel() != x.numel() else None
    raises_like_torch(lambda: OPS.group_norm_backward(bad, x, mean, rstd, w, 3, [True] * 3), theirs,
                      RuntimeError, "grad_out")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_backward_grad_out_of_wrong_dtype(dtype):
    grad, x, mean, rstd, w = backward_args()
    raises_like_torch(lambda: OPS.group_norm_backward(grad.to(dtype), x, mean, rstd, w, 3, [True] * 3), None,
                      RuntimeError, "grad_out")


def test_backward_weight_checks():
    grad, x, mean, rstd, w = backward_args()
    raises_like_torch(lambda: OPS.group_norm_backward(grad, x, mean, rstd, w.double(), 3, [True] * 3),
                      lambda: aten_backward(grad, x, mean, rstd, w.double()), RuntimeError,
                      "Expected weight to have the input's dtype")
    raises_like_torch(lambda: OPS.group_norm_backward(grad, x, mean, rstd, w[:5], 3, [True] * 3), None,
                      RuntimeError, f"Expected weight {PARAM_SIZE}")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64], ids=str)
def test_backward_unsupported_input_dtype(dtype):
    grad, x, mean, rstd, w = backward_args()
    raises_like_torch(lambda: OPS.group_norm_backward(grad.to(dtype), x.to(dtype), mean, rstd, w, 3, [True] * 3),
                      None, NotImplementedError, NOT_IMPL)


# -- instance_norm ---------------------------------------------------------------------------------

INSTANCE_NORM_FNS = {"functional": fusednorm.instance_norm, "op": OPS.instance_norm}


def instance_args(C=6):
    """Fresh (running_mean, running_var)."""
    return torch.zeros(C), torch.ones(C)


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("shape", BAD_PARAM_SHAPES, ids=str)
def test_instance_norm_param_of_wrong_size_or_rank_training(fn, which, shape):
    x = x_()
    rm, rv = instance_args()
    p = torch.ones(shape)
    kw = {which: p}
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x, rm, rv, **kw),
                      lambda: F.instance_norm(x, rm.clone(), rv.clone(), **kw), RuntimeError, which)
    assert torch.equal(rm, torch.zeros(6)) and torch.equal(rv, torch.ones(6)), "running stats changed by a failed call"


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("dtype", BAD_INPUT_DTYPES, ids=str)
def test_instance_norm_unsupported_input_dtype_training(fn, dtype):
    x = torch.ones(2, 6, 5, dtype=dtype)
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x), lambda: F.instance_norm(x), NotImplementedError, NOT_IMPL)


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("p_dtype", [torch.float64, torch.float16], ids=str)
def test_instance_norm_param_dtype_mismatch_training(fn, which, p_dtype):
    x = x_()
    rm, rv = instance_args()
    p = torch.ones(6, dtype=p_dtype)
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x, rm, rv, **{which: p}),
                      lambda: F.instance_norm(x, rm.clone(), rv.clone(), **{which: p}), RuntimeError,
                      f"Expected {which} to have the input's dtype")
    assert torch.equal(rm, torch.zeros(6)) and torch.equal(rv, torch.ones(6))


@pytest.mark.parametrize("shape", [(), (6,)], ids=str)
def test_instance_norm_fewer_than_2_dims(shape):
    x = torch.randn(shape)
    # The functional (training) mirrors F.instance_norm: ValueError from the spatial-size check.
    raises_like_torch(lambda: fusednorm.instance_norm(x), lambda: F.instance_norm(x), ValueError, "spatial element")
    # The op itself checks the rank.
    raises_like_torch(lambda: OPS.instance_norm(x), None, RuntimeError, AT_LEAST_2D)
    raises_like_torch(lambda: OPS.instance_norm(x, torch.zeros(6), torch.ones(6), use_input_stats=False), None,
                      RuntimeError, AT_LEAST_2D)


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("shape", [(2, 6), (2, 6, 1), (3, 6, 1, 1), (1, 6, 1, 1, 1)], ids=str)
def test_instance_norm_single_spatial_element_training(fn, shape):
    x = torch.randn(shape)
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x), lambda: F.instance_norm(x), ValueError,
                      "Expected more than 1 spatial element when training")


# Eval mode (use_input_stats=False): the running statistics normalize; the same mistakes must be
# rejected as in training and as by PyTorch.


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64], ids=str)
def test_instance_norm_unsupported_input_dtype_eval(fn, dtype):
    x = torch.ones(2, 6, 5, dtype=dtype)
    rm, rv = instance_args()
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x, rm, rv, use_input_stats=False),
                      lambda: F.instance_norm(x, rm, rv, use_input_stats=False), NotImplementedError, NOT_IMPL)


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("shape", [(1,), (1, 6), (5,)], ids=str)
def test_instance_norm_param_of_wrong_size_eval(fn, which, shape):
    x = x_()
    rm, rv = instance_args()
    kw = {which: torch.ones(shape)}
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x, rm, rv, use_input_stats=False, **kw),
                      lambda: F.instance_norm(x, rm, rv, use_input_stats=False, **kw), RuntimeError, which)


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("which", ["weight", "bias"])
def test_instance_norm_param_dtype_mismatch_eval(fn, which):
    x = x_()
    rm, rv = instance_args()
    p = torch.ones(6, dtype=torch.float64)
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x, rm, rv, use_input_stats=False, **{which: p}),
                      lambda: F.instance_norm(x, rm, rv, use_input_stats=False, **{which: p}), RuntimeError,
                      f"Expected {which} to have the input's dtype")


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("use_input_stats", [True, False])
def test_instance_norm_bf16_input_fp32_weight_allowed(fn, use_input_stats):
    x = x_(dtype=torch.bfloat16)
    w, b = torch.randn(6), torch.randn(6)
    rm, rv = torch.randn(6), torch.rand(6) + 0.5
    rm_t, rv_t = rm.clone(), rv.clone()
    y = INSTANCE_NORM_FNS[fn](x, rm, rv, w, b, use_input_stats)
    y_t = F.instance_norm(x, rm_t, rv_t, w, b, use_input_stats)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_t.float(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(rm, rm_t, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", list(INSTANCE_NORM_FNS))
@pytest.mark.parametrize("given_stat", ["running_mean", "running_var"])
def test_instance_norm_only_one_running_stat(fn, given_stat):
    x = x_()
    stats = {"running_mean": None, "running_var": None, given_stat: torch.ones(6)}
    raises_like_torch(lambda: INSTANCE_NORM_FNS[fn](x, **stats), lambda: F.instance_norm(x, **stats), ValueError,
                      "running_mean and running_var")


# -- modules ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_groups,num_channels", [(4, 6), (7, 3), (-4, 6)])
def test_group_norm_module_indivisible_at_construction(num_groups, num_channels):
    raises_like_torch(lambda: fnn.GroupNorm(num_groups, num_channels),
                      lambda: torch.nn.GroupNorm(num_groups, num_channels), ValueError,
                      r"num_channels.*must be divisible by num_groups")


def test_group_norm_module_zero_groups_like_torch():
    # torch.nn.GroupNorm(0, C) fails with ZeroDivisionError in its own __init__; so does the subclass.
    raises_like_torch(lambda: fnn.GroupNorm(0, 6), lambda: torch.nn.GroupNorm(0, 6), ZeroDivisionError, "by zero")


@pytest.mark.parametrize("num_groups", [-1, -2, -3, -6])
def test_group_norm_module_negative_groups_fail_in_forward(num_groups):
    m, m_t = fnn.GroupNorm(num_groups, 6), torch.nn.GroupNorm(num_groups, 6)
    x = x_()
    raises_like_torch(lambda: m(x), lambda: m_t(x), RuntimeError, POSITIVE)


GN_MODULE_CASES = {
    # case: (input, affine, exception, message); torch.nn.GroupNorm raises the same type.
    "channels_indivisible": (lambda: x_((2, 8, 4)), False, RuntimeError, DIVISIBLE),
    "channels_vs_weight": (lambda: x_((2, 9, 4)), True, RuntimeError, f"Expected weight {PARAM_SIZE}"),
    "rank1": (lambda: torch.randn(6), True, RuntimeError, AT_LEAST_2D),
    "rank0": (lambda: torch.tensor(1.0), False, RuntimeError, AT_LEAST_2D),
    # (with affine=True torch raises "mixed dtype" RuntimeError first; without parameters both
    # raise NotImplementedError)
    "int": (lambda: torch.ones(2, 6, 4, dtype=torch.int64), False, NotImplementedError, NOT_IMPL),
    "bool": (lambda: torch.ones(2, 6, 4, dtype=torch.bool), False, NotImplementedError, NOT_IMPL),
    "complex": (lambda: torch.ones(2, 6, 4, dtype=torch.complex64), False, NotImplementedError, NOT_IMPL),
}


@pytest.mark.parametrize("case", list(GN_MODULE_CASES))
def test_group_norm_module_bad_input(case):
    make, affine, exc, match = GN_MODULE_CASES[case]
    m, m_t = fnn.GroupNorm(3, 6, affine=affine), torch.nn.GroupNorm(3, 6, affine=affine)
    x = make()
    raises_like_torch(lambda: m(x), lambda: m_t(x), exc, match)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64], ids=str)
def test_group_norm_module_affine_bad_input_dtype(dtype):
    m = fnn.GroupNorm(3, 6)
    raises_like_torch(lambda: m(torch.ones(2, 6, 4, dtype=dtype)), None, NotImplementedError, NOT_IMPL)


def test_group_norm_module_fp64_params_fp32_input():
    m = fnn.GroupNorm(3, 6).double()
    raises_like_torch(lambda: m(x_()), lambda: torch.nn.GroupNorm(3, 6).double()(x_()), RuntimeError,
                      "Expected weight to have the input's dtype")


INSTANCE_MODULES = {1: (fnn.InstanceNorm1d, torch.nn.InstanceNorm1d), 2: (fnn.InstanceNorm2d, torch.nn.InstanceNorm2d),
                    3: (fnn.InstanceNorm3d, torch.nn.InstanceNorm3d)}


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64], ids=str)
def test_instance_norm_module_bad_dtype_training(dim, dtype):
    ours_cls, torch_cls = INSTANCE_MODULES[dim]
    x = torch.ones((2, 4) + (3,) * dim, dtype=dtype)
    raises_like_torch(lambda: ours_cls(4, track_running_stats=True)(x), lambda: torch_cls(4, track_running_stats=True)(x),
                      NotImplementedError, NOT_IMPL)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64], ids=str)
def test_instance_norm_module_bad_dtype_eval(dim, dtype):
    ours_cls, torch_cls = INSTANCE_MODULES[dim]
    x = torch.ones((2, 4) + (3,) * dim, dtype=dtype)
    raises_like_torch(lambda: ours_cls(4, track_running_stats=True).eval()(x),
                      lambda: torch_cls(4, track_running_stats=True).eval()(x), NotImplementedError, NOT_IMPL)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_instance_norm_module_param_dtype_mismatch_training(dim):
    ours_cls, torch_cls = INSTANCE_MODULES[dim]
    m = ours_cls(4, affine=True).double()
    x = x_((2, 4) + (3,) * dim)
    raises_like_torch(lambda: m(x), lambda: torch_cls(4, affine=True).double()(x), RuntimeError,
                      "Expected weight to have the input's dtype")


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_instance_norm_module_wrong_rank_and_features(dim):
    ours_cls, torch_cls = INSTANCE_MODULES[dim]
    x = torch.randn((2,) * (dim + 3))
    with pytest.raises(ValueError) as theirs:
        torch_cls(2)(x)
    raises_like_torch(lambda: ours_cls(2)(x), None, ValueError, re.escape(str(theirs.value)))
    x = x_((2, 5) + (3,) * dim)
    raises_like_torch(lambda: ours_cls(4, affine=True)(x), lambda: torch_cls(4, affine=True)(x), ValueError,
                      "to match num_features")


# -- under torch.compile / fake tensors ----------------------------------------------------------------


def compiled_raises(fn, args, *fragments):
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as info:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    finally:
        torch._dynamo.reset()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)[:2000]
    assert_still_usable()


def test_compile_num_groups_not_dividing_channels():
    compiled_raises(lambda x: fusednorm.group_norm(x, 4), (x_(),), DIVISIBLE)


def test_compile_weight_dtype_mismatch():
    compiled_raises(lambda x, w: OPS.group_norm(x, 3, w, None), (x_(), torch.ones(6, dtype=torch.float64)),
                    "Expected weight to have the input's dtype")


def test_compile_instance_norm_running_mean_of_wrong_size():
    compiled_raises(lambda x, rm, rv: fusednorm.instance_norm(x, rm, rv), (x_(), torch.zeros(5), torch.ones(6)),
                    "Expected running_mean to be a vector")


FAKE_FORWARD_CASES = {
    "indivisible": (lambda: (x_(), 4, None, None), RuntimeError, DIVISIBLE),
    "groups_zero": (lambda: (x_(), 0, None, None), RuntimeError, POSITIVE),
    "weight_size": (lambda: (x_(), 3, torch.ones(5), None), RuntimeError, PARAM_SIZE),
    "bias_rank2": (lambda: (x_(), 3, None, torch.ones(1, 6)), RuntimeError, PARAM_SIZE),
    "weight_dtype": (lambda: (x_(), 3, torch.ones(6, dtype=torch.float64), None), RuntimeError, "dtype"),
    "rank1": (lambda: (torch.randn(6), 1, None, None), RuntimeError, AT_LEAST_2D),
    "int_input": (lambda: (torch.ones(2, 6, 5, dtype=torch.int64), 3, None, None), NotImplementedError, NOT_IMPL),
}


@pytest.mark.parametrize("case", list(FAKE_FORWARD_CASES))
def test_fake_forward_kernel_runs_the_same_checks(case):
    """The fake kernel raises what the real one raises, so tracing rejects what eager rejects."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    make, exc, match = FAKE_FORWARD_CASES[case]
    args = make()
    with pytest.raises(exc, match=match):
        OPS.group_norm_forward(*args, 1e-5)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(exc, match=match):
            OPS.group_norm_forward(*fake_args, 1e-5)
    assert_still_usable()


def _fake_backward(mutate):
    from torch._subclasses.fake_tensor import FakeTensorMode

    grad, x, mean, rstd, w = backward_args()
    grad, x, mean, rstd = mutate(grad, x, mean, rstd)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(t) for t in (grad, x, mean, rstd, w)]
        OPS.group_norm_backward(*f, 3, [True, True, True])


def test_fake_backward_kernel_checks_grad_out_shape():
    with pytest.raises(RuntimeError, match="grad_out"):
        _fake_backward(lambda g, x, m, r: (g[:, :, :4], x, m, r))
    assert_still_usable()


@pytest.mark.parametrize("case", ["mean_shape", "rstd_dtype", "grad_dtype"])
def test_fake_backward_kernel_checks_stats_and_grad_dtype(case):
    mutate = {
        "mean_shape": lambda g, x, m, r: (g, x, m[:1], r),
        "rstd_dtype": lambda g, x, m, r: (g, x, m, r.double()),
        "grad_dtype": lambda g, x, m, r: (g.double(), x, m, r),
    }[case]
    with pytest.raises(RuntimeError, match="Expected"):
        _fake_backward(mutate)
