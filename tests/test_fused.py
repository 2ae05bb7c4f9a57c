"""The fused epilogue (scale / shift / residual / activation / multiplier) of group_norm and
instance_norm: every combination against the composed float64 reference, forward and backward,
on every dtype and layout; the ops under opcheck; the modules; argument errors."""

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import fusednorm
import fusednorm.nn as fnn
import kernel_paths
from reference import assert_close, epilogue_reference, group_norm_reference, input_grad_scale, to_layout
from test_group_norm import group_norm_cases

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")

ACTIVATIONS = [None, "silu", "gelu", "gelu_tanh", "relu", "leaky_relu", "mish"]
OPERANDS = ["scale", "shift", "residual", "multiplier"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "channels_last", "strided"]


def make_operands(x, names, device, dtype, per_sample_shape="flat"):
    """Random epilogue operands: scale / shift per (N, C) ((N, C) or (N, C, 1, ...)), residual and
    multiplier of x's shape and dtype, in x's layout family."""
    N, C = x.shape[:2]
    ops = {}
    for name in names:
        if name in ("scale", "shift"):
            shape = (N, C) if per_sample_shape == "flat" else (N, C) + (1,) * (x.dim() - 2)
            ops[name] = (0.5 * torch.randn(shape, dtype=torch.float64)).to(device=device, dtype=dtype)
        else:
            ops[name] = torch.randn(x.shape, dtype=torch.float64).to(device=device, dtype=dtype)
    return ops


def reference_with_grads(x, G, w, b, eps, operands, activation, slope, grad_out):
    """Composed float64 reference output and gradients of every tensor argument (a dict)."""
    leaves = {"input": x, "weight": w, "bias": b, **operands}
    f64 = {k: v.detach().cpu().double().requires_grad_() for k, v in leaves.items() if v is not None}
    y = group_norm_reference(f64["input"], G, f64.get("weight"), f64.get("bias"), eps)
    z = epilogue_reference(y, f64.get("scale"), f64.get("shift"), f64.get("residual"), activation, slope,
                           f64.get("multiplier"))
    names = list(f64)
    grads = torch.autograd.grad(z, [f64[k] for k in names], grad_out.detach().cpu().double())
    return z.detach(), dict(zip(names, grads))


def check_fused(shape, G, dtype, layout, names, activation, device, affine=True, slope=0.2, eps=1e-5,
                per_sample_shape="flat", param_dtype=None, operand_grads=True):
    """fusednorm.group_norm with the epilogue operands `names` against the composed float64
    reference: its output and the gradients of x, weight, bias and (with operand_grads) of the
    operands."""
    x = to_layout(torch.randn(shape, dtype=torch.float64).to(dtype).to(device), layout).requires_grad_()
    C = shape[1]
    param_dtype = param_dtype or dtype
    w = torch.randn(C, dtype=param_dtype, device=device).requires_grad_() if affine else None
    b = torch.randn(C, dtype=param_dtype, device=device).requires_grad_() if affine else None
    ops = make_operands(x, names, device, dtype, per_sample_shape)
    ops = {k: (to_layout(v, layout) if v.shape == x.shape else v).requires_grad_(operand_grads)
           for k, v in ops.items()}

    z = fusednorm.group_norm(x, G, w, b, eps, activation=activation, negative_slope=slope, **ops)
    assert z.dtype == dtype and z.shape == x.shape
    if layout == "channels_last" and x.dim() >= 3:
        assert z.movedim(1, -1).is_contiguous(), "output must keep the channels-last layout"

    grad_out = torch.randn(shape, dtype=torch.float64).to(dtype).to(device)
    z_ref, grads_ref = reference_with_grads(x, G, w, b, eps, ops, activation, slope, grad_out)
    magnitude = max(1.0, z_ref.abs().max().item())
    assert_close(z, z_ref, dtype, scale=magnitude, msg=f"output ({activation}, {names})")

    leaves = {"input": x, "weight": w, "bias": b, **ops}
    leaves = {k: v for k, v in leaves.items() if v is not None and v.requires_grad}
    grads = dict(zip(leaves, torch.autograd.grad(z, list(leaves.values()), grad_out)))
    M = x.numel() // (shape[0] * G)
    amplified = input_grad_scale(x, G, eps)  # the input's gradient scales with rstd
    for name, g in grads.items():
        assert g.dtype == leaves[name].dtype and g.shape == leaves[name].shape, name
        ref = grads_ref[name]
        gmag = max(1.0, ref.abs().max().item())
        # Per-channel and per-(n, c) gradients are sums over many elements.
        summed = {"weight": M * shape[0], "bias": M * shape[0], "scale": M, "shift": M}.get(name, 1)
        assert_close(g, ref, dtype, scale=4 * gmag * math.sqrt(summed) * (2 if activation else 1)
                     * (amplified if name == "input" else 1.0),
                     msg=f"grad of {name} ({activation}, {names})")


# Every combination of operands and activation, small shapes, both kernel layouts, float64
# (tight) and float32.
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_combination(activation, layout, dtype, device):
    torch.manual_seed(0)
    for k in range(len(OPERANDS) + 1):
        for names in itertools.combinations(OPERANDS, k):
            check_fused((2, 6, 5, 3), 3, dtype, layout, list(names), activation, device)


# Channels-last rows of a few vectors, fewer channels than a vector holds or not a whole number
# of vectors are mapped several rows at a time on the CPU (csrc/cpu/kernels/channels_last.h,
# rows_per_run): whole runs of rows and a last, shorter one (117 rows a sample), with and without
# every operand.
@pytest.mark.parametrize("channels,groups", [(3, 1), (5, 5), (24, 8), (40, 5), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_short_channels_last_rows(channels, groups, dtype, activation, device):
    torch.manual_seed(channels)
    for names in ([], OPERANDS):
        check_fused((2, channels, 9, 13), groups, dtype, "channels_last", names, activation, device)


# Channels-first rows of a few vectors: the CPU backward takes several groups a step, their dp
# cached between the sums and dx (csrc/cpu/kernels/backward.cpp, short_rows_group_batch): whole
# batches of groups and a last, smaller one.
@pytest.mark.parametrize("shape,groups", [((5, 6, 7, 7), 3), ((3, 40, 4, 4), 40), ((2, 12, 3, 5), 4)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_short_channels_first_rows(shape, groups, dtype, activation, device):
    torch.manual_seed(shape[1])
    for names in ([], OPERANDS):
        check_fused(shape, groups, dtype, "contiguous", names, activation, device)


@given(case=group_norm_cases(max_numel=20_000), dtype=st.sampled_from(DTYPES), layout=st.sampled_from(LAYOUTS),
       names=st.lists(st.sampled_from(OPERANDS), unique=True), activation=st.sampled_from(ACTIVATIONS),
       affine=st.booleans(), per_sample_shape=st.sampled_from(["flat", "broadcast"]),
       mixed=st.booleans(), seed=st.integers(0, 2**31 - 1))
# Groups of one element (the input's gradient is rounding error times rstd = 1 / sqrt(eps)).
@example(case=((3, 4), 4), dtype=torch.float32, layout="contiguous", names=["scale"], activation=None, affine=True,
         per_sample_shape="flat", mixed=False, seed=0)
def test_fused_hypothesis(case, dtype, layout, names, activation, affine, per_sample_shape, mixed, seed, device):
    torch.manual_seed(seed)
    shape, G = case
    param_dtype = torch.float32 if mixed and dtype in (torch.bfloat16, torch.float16) else dtype
    check_fused(shape, G, dtype, layout, names, activation, device, affine=affine,
                per_sample_shape=per_sample_shape, param_dtype=param_dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_instance_norm_fused_train_and_eval(activation, device):
    torch.manual_seed(1)
    x = torch.randn(3, 4, 6, 5, dtype=torch.float64, device=device)
    w, b = torch.randn(4, dtype=torch.float64, device=device), torch.randn(4, dtype=torch.float64, device=device)
    ops = make_operands(x, OPERANDS, device, torch.float64)
    # Training: instance norm is group norm with one channel per group.
    z = fusednorm.instance_norm(x, None, None, w, b, activation=activation, **ops)
    want = epilogue_reference(group_norm_reference(x, 4, w, b, 1e-5), activation=activation, **ops)
    torch.testing.assert_close(z, want, atol=1e-10, rtol=1e-8)
    # Eval with running statistics: the epilogue after the per-channel affine map.
    rm, rv = torch.randn(4, dtype=torch.float64, device=device), torch.rand(4, dtype=torch.float64, device=device) + 0.5
    z = fusednorm.instance_norm(x, rm, rv, w, b, False, activation=activation, **ops)
    shape = (1, 4, 1, 1)
    y = (x - rm.reshape(shape)) / torch.sqrt(rv.reshape(shape) + 1e-5) * w.reshape(shape) + b.reshape(shape)
    torch.testing.assert_close(z, epilogue_reference(y, activation=activation, **ops), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("train", [True, False])
def test_activation_alone_keeps_its_slope(train, device):
    # An activation without tensor operands takes the functions' shortest call into the op (two
    # keywords); negative_slope must still reach it, in both norms.
    torch.manual_seed(4)
    x = torch.randn(3, 6, 5, 4, dtype=torch.float64, device=device)
    w, b = torch.randn(6, dtype=torch.float64, device=device), torch.randn(6, dtype=torch.float64, device=device)
    rm, rv = torch.randn(6, dtype=torch.float64, device=device), torch.rand(6, dtype=torch.float64, device=device) + 0.5
    want = F.leaky_relu(F.instance_norm(x, rm.clone(), rv.clone(), w, b, train), 0.3)
    z = fusednorm.instance_norm(x, rm, rv, w, b, train, activation="leaky_relu", negative_slope=0.3)
    torch.testing.assert_close(z, want, atol=1e-10, rtol=1e-8)
    z = fusednorm.group_norm(x, 3, w, b, activation="leaky_relu", negative_slope=0.3)
    torch.testing.assert_close(z, F.leaky_relu(F.group_norm(x, 3, w, b), 0.3), atol=1e-10, rtol=1e-8)


EAGER_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda p: F.gelu(p, approximate="tanh"),
    "relu": F.relu,
    "leaky_relu": lambda p: F.leaky_relu(p, 0.2),
    "mish": F.mish,
}
# Where the kernels' approximations (the device SiLU's ex2 and approximate division, GELU's
# polynomial) meet their ends: infinities, NaN, the ranges past which exponentials flush or 1 + erf
# rounds to 0, signed zeros.
SPECIAL_VALUES = [-math.inf, math.inf, math.nan, -100.0, -88.8, -13.5, -10.0, -5.6, -5.5, -4.0, -1.0, -1e-3,
                  0.0, -0.0, 1e-3, 1.0, 4.0, 5.5, 10.0, 88.8, 100.0]


def activation_at(values, activation):
    """fusednorm.group_norm's output and the bias's gradient (act'(p) summed over a channel) where
    p takes each of `values`: one channel a group, zero weight, so the normalized value is the
    bias exactly. Output (1, C, 2), gradient (C,), on values' device and dtype."""
    C = values.numel()
    x = torch.randn(1, C, 2, dtype=values.dtype, device=values.device)
    b = values.clone().requires_grad_()
    z = fusednorm.group_norm(x, C, torch.zeros_like(values), b, activation=activation, negative_slope=0.2)
    (grad_b,) = torch.autograd.grad(z, b, torch.ones_like(z))
    return z, grad_b


@pytest.mark.parametrize("activation", list(EAGER_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_activation_special_values_match_eager(activation, dtype, device):
    # The output and the bias's gradient against eager's activation, NaN and infinities in the
    # same places.
    values = torch.tensor(SPECIAL_VALUES, dtype=dtype, device=device)
    z, grad_b = activation_at(values, activation)
    eager_b = values.clone().requires_grad_()
    want = EAGER_ACTIVATIONS[activation](eager_b.view(1, -1, 1).expand_as(z))
    (want_grad_b,) = torch.autograd.grad(want, eager_b, torch.ones_like(want))
    torch.testing.assert_close(z, want, equal_nan=True, msg=lambda m: f"{activation} output: {m}")
    torch.testing.assert_close(grad_b, want_grad_b, equal_nan=True, msg=lambda m: f"{activation} grad: {m}")


# Not gelu_tanh: its formula (PyTorch's) cancels in 1 + tanh for p < 0, eager's own float32
# derivative is 1e-6 off there.
@pytest.mark.parametrize("activation", [a for a in EAGER_ACTIVATIONS if a != "gelu_tanh"])
def test_activation_dense_range_float32(activation, device):
    # The activations and their derivatives in float32 at 20001 points of [-10, 10], against
    # float64: a few float32 ulp wherever the value is not tiny. The CUDA kernels' own SiLU and
    # GELU (an ex2 and a fitted polynomial, tools/fit_gelu_cdf.py) are held to this, not only to
    # the dtype tolerances of the shape tests.
    from reference import activation_reference

    values = torch.linspace(-10, 10, 20001, dtype=torch.float64)
    C = values.numel()
    z, grad_b = activation_at(values.float().to(device), activation)  # act'(p) at two elements a channel
    p = values.float().double().requires_grad_()
    want = activation_reference(p, activation, 0.2)
    (want_grad,) = torch.autograd.grad(want, p, torch.ones_like(want))
    torch.testing.assert_close(z[0].double().cpu(), want.detach()[:, None].expand(C, 2), atol=3e-7, rtol=1e-6)
    torch.testing.assert_close(grad_b.double().cpu() / 2, want_grad, atol=3e-7, rtol=1e-6)


def test_operands_of_another_dtype_are_cast_to_the_input_dtype(device):
    x = torch.randn(2, 4, 8, device=device)
    r = torch.randn(2, 4, 8, dtype=torch.float64, device=device, requires_grad=True)
    m = torch.randn(2, 4, 8, dtype=torch.bfloat16, device=device, requires_grad=True)
    s = torch.randn(2, 4, dtype=torch.float16, device=device, requires_grad=True)
    z = fusednorm.group_norm(x, 2, residual=r, multiplier=m, scale=s)
    assert z.dtype == torch.float32
    want = epilogue_reference(F.group_norm(x, 2), residual=r.float(), multiplier=m.float(), scale=s.float())
    torch.testing.assert_close(z, want, atol=1e-5, rtol=1e-5)
    z.sum().backward()
    assert r.grad.dtype == torch.float64 and m.grad.dtype == torch.bfloat16 and s.grad.dtype == torch.float16


def test_plain_call_stays_on_the_plain_op():
    # No epilogue: the composite dispatches the plain kernel op (graphs of plain calls are unchanged).
    x = torch.randn(2, 4, 3)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda t: fusednorm.group_norm(t, 2))(x)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "fusednorm.group_norm_forward.default" in targets
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda t: fusednorm.group_norm(t, 2, activation="silu"))(x)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "fusednorm.fused_group_norm_forward.default" in targets


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_fused_ops(requires_grad, device):
    torch.manual_seed(2)
    x = torch.randn(2, 6, 4, 3, device=device, requires_grad=requires_grad)
    w, b = torch.randn(6, device=device, requires_grad=requires_grad), torch.randn(6, device=device)
    ops = {k: v.requires_grad_(requires_grad) for k, v in make_operands(x, OPERANDS, device, torch.float32).items()}
    args = (x, 3, w, b, 1e-5, ops["scale"], ops["shift"], ops["residual"], "gelu", 0.01, ops["multiplier"])
    torch.library.opcheck(torch.ops.fusednorm.fused_group_norm_forward.default, args)
    cl = x.detach().to(memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.fusednorm.fused_group_norm_forward.default,
                          (cl, 3, None, None, 1e-5, None, ops["shift"], None, "leaky_relu", 0.3, None))
    _, mean, rstd = torch.ops.fusednorm.fused_group_norm_forward(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    dz = torch.randn_like(x)
    bw_args = (dz, x.detach(), mean, rstd, w.detach(), b, 3, ops["scale"].detach(), ops["shift"].detach(),
               ops["residual"].detach(), "mish", 0.01, ops["multiplier"].detach(), [True] * 7)
    torch.library.opcheck(torch.ops.fusednorm.fused_group_norm_backward.default, bw_args)
    bw_args = bw_args[:-1] + ([True, False, True, False, True, False, True],)
    torch.library.opcheck(torch.ops.fusednorm.fused_group_norm_backward.default, bw_args)
    torch.library.opcheck(torch.ops.fusednorm.fused_group_norm_backward.default, bw_args + (True,))


@pytest.mark.parametrize("activation", [None, "silu"])
def test_one_tensor_as_residual_and_multiplier(activation, device):
    # Autograd gives y of (norm(h) + y) * y the sum of its two gradients (the backward op sums them
    # when residual is multiplier): the same as with two copies of y.
    torch.manual_seed(14)
    h = torch.randn(4, 40, device=device, requires_grad=True)
    y = torch.randn(4, 40, device=device, requires_grad=True)
    z = fusednorm.group_norm(h, 1, activation=activation, residual=y, multiplier=y)
    dz = torch.randn_like(z)
    grad_h, grad_y = torch.autograd.grad(z, [h, y], dz)
    y1, y2 = (y.detach().clone().requires_grad_() for _ in range(2))
    z2 = fusednorm.group_norm(h, 1, activation=activation, residual=y1, multiplier=y2)
    grad_h2, grad_y1, grad_y2 = torch.autograd.grad(z2, [h, y1, y2], dz)
    torch.testing.assert_close(z, z2)
    torch.testing.assert_close(grad_h, grad_h2)
    torch.testing.assert_close(grad_y, grad_y1 + grad_y2)


@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", [None, "silu", "gelu"])
def test_summed_residual_multiplier_grads(activation, layout, path, device, monkeypatch):
    # sum_residual_multiplier_grads: output 5 is grad_residual + grad_multiplier and output 6 is
    # empty, whichever of the two the mask asks for; the other outputs are unchanged. (The CUDA
    # kernels write the sum where the two output buffers are one; every kernel path here.)
    kernel_paths.set_path(monkeypatch, path)
    torch.manual_seed(13)
    op = torch.ops.fusednorm.fused_group_norm_backward
    for shape, G in (((2, 8, 5, 6), 4), ((2, 16, 4, 8), 2), ((3, 64), 1)):
        x = to_layout(torch.randn(shape, device=device), layout)
        y = to_layout(torch.randn(shape, device=device), layout)
        w, b = torch.randn(shape[1], device=device), torch.randn(shape[1], device=device)
        act = activation or "none"
        _, mean, rstd = torch.ops.fusednorm.fused_group_norm_forward(x, G, w, b, 1e-5, None, None, y, act, 0.1, y)
        dz = to_layout(torch.randn(shape, device=device), layout)
        args = (dz, x, mean, rstd, w, b, G, None, None, y, act, 0.1, y)
        separate = op(*args, [True] * 7)
        for mask in ([True] * 7, [False] * 5 + [True, False], [True] + [False] * 5 + [True]):
            summed = op(*args, mask, True)
            assert summed[6].numel() == 0
            torch.testing.assert_close(summed[5], separate[5] + separate[6], rtol=1e-5, atol=1e-5)
            for i in range(5):
                if mask[i]:
                    torch.testing.assert_close(summed[i], separate[i], rtol=1e-5, atol=1e-5)
            if mask[0]:
                assert summed[5].stride() == separate[5].stride(), "the kernel layout"


def check_gradients_whichever_arguments_require_grad(x, groups, residual_is_multiplier, device):
    # Each argument's gradient is the same whichever of the others require grad: the autograd
    # kernel (csrc/autograd.cpp) turns the arguments that require grad into the backward op's
    # output mask and maps the op's outputs back to the arguments, (N, C, 1) scale and shift
    # included.
    C = x.shape[1]
    values = {"input": x, "weight": torch.randn(C, device=device), "bias": torch.randn(C, device=device),
              **make_operands(x, OPERANDS, device, torch.float32, per_sample_shape="broadcast")}
    names = [k for k in values if not (residual_is_multiplier and k == "multiplier")]
    dz = torch.randn_like(x)

    def grads(wanted):
        leaves = {k: v.detach().clone().requires_grad_(k in wanted) for k, v in values.items()}
        if residual_is_multiplier:
            leaves["multiplier"] = leaves["residual"]
        z = fusednorm.group_norm(leaves["input"], groups, leaves["weight"], leaves["bias"], activation="silu",
                                 scale=leaves["scale"], shift=leaves["shift"], residual=leaves["residual"],
                                 multiplier=leaves["multiplier"])
        return dict(zip(wanted, torch.autograd.grad(z, [leaves[k] for k in wanted], dz)))

    every = grads(names)
    for r in range(1, len(names)):
        for wanted in itertools.combinations(names, r):
            for k, g in grads(wanted).items():
                assert g.shape == values[k].shape, k
                torch.testing.assert_close(g, every[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k} of {wanted}: {m}")


@pytest.mark.parametrize("residual_is_multiplier", [False, True])
def test_gradients_whichever_arguments_require_grad(residual_is_multiplier, device):
    torch.manual_seed(21)
    check_gradients_whichever_arguments_require_grad(torch.randn(2, 4, 5, device=device), 2, residual_is_multiplier,
                                                     device)


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(kernel_paths.TEST_PATHS))
@pytest.mark.parametrize("residual_is_multiplier", [False, True])
def test_gradients_whichever_arguments_require_grad_kernel_paths_cuda(residual_is_multiplier, path, monkeypatch):
    # The same on every CUDA kernel path, with S a multiple of the pack width so that the one-CTA
    # and team backwards take the groups: with an activation they keep dp alone where no operand
    # gradient is wanted, and dp with the operands' gradients where one is (Keep in
    # csrc/cuda/common/keep.cuh: kernels of their own).
    kernel_paths.set_path(monkeypatch, path)
    torch.manual_seed(23)
    check_gradients_whichever_arguments_require_grad(torch.randn(2, 16, 8, 8, device="cuda"), 4,
                                                     residual_is_multiplier, "cuda")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_double_backward(activation, device):
    # With create_graph the gradients are taken through a differentiable composition of ATen ops
    # (csrc/autograd.cpp), so gradients of gradients exist: gradient penalties, Hessian-vector
    # products.
    torch.manual_seed(22)
    x = torch.randn(2, 4, 3, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    ops = {k: v.requires_grad_() for k, v in make_operands(x, OPERANDS, device, torch.float64, "broadcast").items()}
    fn = lambda x, w, b, s, t, r, m: fusednorm.group_norm(  # noqa: E731
        x, 2, w, b, activation=activation, scale=s, shift=t, residual=r, multiplier=m)
    assert torch.autograd.gradgradcheck(fn, (x, w, b, ops["scale"], ops["shift"], ops["residual"], ops["multiplier"]))
    assert torch.autograd.gradgradcheck(lambda x, w, b: fusednorm.group_norm(x, 2, w, b, activation=activation), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x, r: fusednorm.group_norm(x, 1, residual=r, multiplier=r), (x, ops["residual"]))
    assert torch.autograd.gradgradcheck(lambda x, w: fusednorm.instance_norm(x, weight=w, activation=activation), (x, w))


def _composed_reference(G, activation):
    def fn(x, w, b, s, t, r, m):
        return epilogue_reference(group_norm_reference(x, G, w, b, 1e-5), s, t, r, activation, 0.01, m)
    return fn


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_functorch_transforms(activation, device):
    # torch.func.grad / jacrev / hessian refuse C++ autograd Functions and jvp / jacfwd need
    # tangents the kernels do not compute: there the call goes through the composed ATen forward
    # (csrc/autograd.cpp). Each transform against the float64 reference's.
    torch.manual_seed(24)
    x = torch.randn(2, 4, 3, dtype=torch.float64, device=device)
    args = (x, torch.randn(4, dtype=torch.float64, device=device), torch.randn(4, dtype=torch.float64, device=device),
            *make_operands(x, OPERANDS, device, torch.float64, "broadcast").values())
    ours = lambda *a: fusednorm.group_norm(  # noqa: E731
        a[0], 2, a[1], a[2], activation=activation, scale=a[3], shift=a[4], residual=a[5], multiplier=a[6])
    ref = _composed_reference(2, activation)
    every = tuple(range(len(args)))
    loss = lambda f: lambda *a: (f(*a) ** 2).sum()  # noqa: E731
    tangents = tuple(torch.randn_like(a) for a in args)
    samples = torch.randn(3, 4, 3, dtype=torch.float64, device=device)
    transforms = {
        "grad": lambda f: torch.func.grad(loss(f), argnums=every)(*args),
        "jacrev": lambda f: torch.func.jacrev(f, argnums=every)(*args),
        "jacfwd": lambda f: torch.func.jacfwd(f, argnums=every)(*args),
        "jvp": lambda f: torch.func.jvp(f, args, tangents),
        "hessian of x": lambda f: torch.func.hessian(lambda x: loss(f)(x, *args[1:]))(x),
        "per-sample grads": lambda f: torch.vmap(torch.func.grad(lambda xi, wi: loss(f)(xi[None], wi, *args[2:3], *(
            a[:1] for a in args[3:]))), in_dims=(0, None))(samples, args[1]),
    }
    for name, transform in transforms.items():
        got, want = transform(ours), transform(ref)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_forward_mode_ad(layout, device):
    # torch.autograd.forward_ad (no functorch): the output's tangent, in float32 and the input's
    # layout, against the float64 reference's; before, the tangent was silently dropped.
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(25)
    x = to_layout(torch.randn(2, 8, 5, 6, device=device), layout)
    w, b = torch.randn(8, device=device), torch.randn(8, device=device)
    dx, dw = torch.randn_like(x), torch.randn_like(w)
    with fwAD.dual_level():
        z = fusednorm.group_norm(fwAD.make_dual(x, dx), 4, fwAD.make_dual(w, dw), b, activation="gelu")
        primal, tangent = fwAD.unpack_dual(z)
    assert tangent is not None
    _, want = torch.func.jvp(lambda x, w: _composed_reference(4, "gelu")(x, w, b.double(), *[None] * 4),
                             (x.double(), w.double()), (dx.double(), dw.double()))
    torch.testing.assert_close(tangent.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(primal, fusednorm.group_norm(x, 4, w, b, activation="gelu"))
    assert primal.dtype == x.dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_create_graph_gradients_match_the_kernels(layout, dtype, device):
    # The create_graph path computes the same first-order gradients as the kernels, in every dtype
    # and layout, and they depend on the inputs (a gradient penalty's gradient is not zero).
    torch.manual_seed(23)
    x = to_layout(torch.randn(2, 8, 5, 6, device=device).to(dtype), layout).requires_grad_()
    w = torch.randn(8, device=device, dtype=dtype, requires_grad=True)
    ops = {k: v.requires_grad_() for k, v in make_operands(x, ["scale", "residual"], device, dtype).items()}
    z = fusednorm.group_norm(x, 4, w, None, activation="silu", scale=ops["scale"], residual=ops["residual"])
    dz = torch.randn_like(z)
    leaves = [x, w, ops["scale"], ops["residual"]]
    plain = torch.autograd.grad(z, leaves, dz, retain_graph=True)
    graphed = torch.autograd.grad(z, leaves, dz, create_graph=True)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 5e-2)
    for g, h in zip(plain, graphed):
        assert h.dtype == g.dtype and h.shape == g.shape
        torch.testing.assert_close(h, g, rtol=tol, atol=tol)
    penalty = sum((g.float() ** 2).sum() for g in graphed)
    assert all(p.abs().sum() > 0 for p in torch.autograd.grad(penalty, [x, w]))


def test_gradcheck_every_operand(device):
    torch.manual_seed(3)
    x = torch.randn(2, 4, 5, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    ops = {k: v.requires_grad_() for k, v in make_operands(x, OPERANDS, device, torch.float64).items()}
    for activation in ACTIVATIONS:
        fn = lambda x, w, b, s, t, r, m: fusednorm.group_norm(  # noqa: E731
            x, 2, w, b, activation=activation, scale=s, shift=t, residual=r, multiplier=m)
        assert torch.autograd.gradcheck(fn, (x, w, b, ops["scale"], ops["shift"], ops["residual"], ops["multiplier"]))


def test_deterministic(device):
    torch.manual_seed(4)
    x = torch.randn(4, 8, 33, 17, device=device).to(memory_format=torch.channels_last).requires_grad_()
    ops = {k: v.requires_grad_() for k, v in make_operands(x, OPERANDS, device, torch.float32).items()}
    dz = torch.randn_like(x)

    def run():
        z = fusednorm.group_norm(x, 4, activation="silu", **ops)
        return [z] + list(torch.autograd.grad(z, [x] + list(ops.values()), dz))

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape,groups", [((3, 40, 5, 3), 4), ((2, 96, 8, 8), 2), ((2, 64, 300), 4)])
def test_parameter_grads_same_bits_with_or_without_input_grad_cpu(shape, groups):
    # On the CPU, asking for grad_input sends the ChannelsFirst fused backward group by group (the
    # rows' sums in blocks aligned to each group: D = 10 and 48 rows here, S at most 4 vectors, and
    # long rows in the last case); without it the two-pass path takes them (blocks aligned to the
    # tensor). The other gradients must not depend on that.
    torch.manual_seed(5)
    x = torch.randn(shape) * 2 + 1
    w, b, dy = torch.randn(shape[1]), torch.randn(shape[1]), torch.randn(shape)
    scale, residual = torch.randn(shape[:2]), torch.randn(shape)
    for activation in ("silu", "relu"):
        _, mean, rstd = torch.ops.fusednorm.fused_group_norm_forward(
            x, groups, w, b, 1e-5, scale, None, residual, activation, 0.01, None)
        grads = [torch.ops.fusednorm.fused_group_norm_backward(
            dy, x, mean, rstd, w, b, groups, scale, None, residual, activation, 0.01, None,
            [want_input, True, True, True, False, True, False]) for want_input in (True, False)]
        assert grads[0][0].numel() > 0 and grads[1][0].numel() == 0
        for i in (1, 2, 3, 5):  # weight, bias, scale, residual
            assert torch.equal(grads[0][i], grads[1][i]), (activation, i)


# -- errors ------------------------------------------------------------------------------------------


def test_unknown_activation_is_a_value_error(device):
    x = torch.randn(2, 4, 3, device=device)
    with pytest.raises(ValueError, match="Unknown activation 'swiglu'"):
        fusednorm.group_norm(x, 2, activation="swiglu")
    with pytest.raises(ValueError, match="Unknown activation"):
        fusednorm.instance_norm(x, activation="tanh")
    with pytest.raises(ValueError, match="Unknown activation"):
        fnn.GroupNorm(2, 4, activation="Silu")


@pytest.mark.parametrize("name,shape", [("scale", (2, 3)), ("scale", (1, 4)), ("shift", (2, 4, 3)),
                                        ("residual", (2, 4, 1)), ("multiplier", (4, 3))])
def test_mis_shaped_operands_are_rejected(name, shape, device):
    x = torch.randn(2, 4, 3, device=device)
    with pytest.raises(RuntimeError, match=f"Expected {name} of"):
        fusednorm.group_norm(x, 2, **{name: torch.randn(shape, device=device)})


def test_operand_on_another_device_is_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.randn(2, 4, 3, device="cuda")
    with pytest.raises(RuntimeError, match="same device"):
        fusednorm.group_norm(x, 2, residual=torch.randn(2, 4, 3))
    with pytest.raises(RuntimeError, match="same device"):
        fusednorm.group_norm(x, 2, scale=torch.randn(2, 4))


# -- modules -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_group_norm_module_with_activation(activation, device):
    torch.manual_seed(5)
    ref = torch.nn.GroupNorm(2, 6).to(device)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = fnn.GroupNorm(2, 6, activation=activation, negative_slope=0.3).to(device)
    ours.load_state_dict(ref.state_dict())  # a plain torch.nn checkpoint
    x = torch.randn(3, 6, 4, 4, device=device)
    r = torch.randn_like(x)
    want = activation_of(ref(x) + r, activation, 0.3)
    torch.testing.assert_close(ours(x, residual=r), want, atol=1e-5, rtol=1e-5)
    assert set(ours.state_dict()) == set(ref.state_dict())
    if activation is not None:
        assert f"activation='{activation}'" in repr(ours)
    scripted = torch.jit.script(ours)
    torch.testing.assert_close(scripted(x, residual=r), want, atol=1e-5, rtol=1e-5)


def activation_of(z, activation, slope):
    return {None: lambda t: t, "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, slope), "mish": F.mish}[activation](z)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_instance_norm_module_with_operands(dims, device):
    torch.manual_seed(6)
    torch_cls = {1: torch.nn.InstanceNorm1d, 2: torch.nn.InstanceNorm2d, 3: torch.nn.InstanceNorm3d}[dims]
    ours_cls = {1: fnn.InstanceNorm1d, 2: fnn.InstanceNorm2d, 3: fnn.InstanceNorm3d}[dims]
    ref = torch_cls(4, affine=True, track_running_stats=True).to(device)
    ours = ours_cls(4, affine=True, track_running_stats=True, activation="silu").to(device)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn((2, 4) + (5,) * dims, device=device)
    s, t = torch.randn(2, 4, device=device), torch.randn(2, 4, device=device)
    shape = (2, 4) + (1,) * dims
    for train in (True, False):
        ref.train(train)
        ours.train(train)
        want = F.silu(ref(x) * (1 + s.reshape(shape)) + t.reshape(shape))
        torch.testing.assert_close(ours(x, scale=s, shift=t), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    # An unbatched input: its operands are unbatched too.
    xu, ru = x[0], torch.randn_like(x[0])
    torch.testing.assert_close(ours(xu, residual=ru), F.silu(ref(xu) + ru), atol=1e-5, rtol=1e-5)
    torch.jit.script(ours)


@pytest.mark.cuda
def test_fused_cuda_graph_capture_and_replay():
    torch.manual_seed(7)
    x = torch.randn(2, 64, 16, 16, device="cuda")
    ops = make_operands(x, OPERANDS, "cuda", torch.float32)
    w = torch.randn(64, device="cuda")

    def step():
        return fusednorm.group_norm(x, 8, w, None, activation="silu", **ops)

    want = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, step())
    assert not torch.equal(out, want)


@pytest.mark.cuda
def test_fused_cuda_matches_cpu():
    torch.manual_seed(8)
    for layout in ("contiguous", "channels_last"):
        x = to_layout(torch.randn(3, 40, 9, 7), layout)
        ops = make_operands(x, OPERANDS, "cpu", torch.float32)
        w, b = torch.randn(40), torch.randn(40)
        cpu = fusednorm.group_norm(x, 4, w, b, activation="gelu_tanh", **ops)
        gpu = fusednorm.group_norm(x.cuda(), 4, w.cuda(), b.cuda(), activation="gelu_tanh",
                                   **{k: v.cuda() for k, v in ops.items()})
        torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_gradients_of_absent_operands_are_taken_at_their_neutral_values(activation, device):
    # The backward op may be asked for the gradient of an operand that was not given: it is the
    # gradient at scale = shift = residual = 0, multiplier = 1 (never uninitialised memory).
    torch.manual_seed(9)
    x = torch.randn(2, 8, 6, 5, dtype=torch.float64, device=device)
    w, b = torch.randn(8, dtype=torch.float64, device=device), torch.randn(8, dtype=torch.float64, device=device)
    act = activation or "none"
    _, mean, rstd = torch.ops.fusednorm.fused_group_norm_forward(x, 4, w, b, 1e-5, None, None, None, act, 0.01, None)
    dz = torch.randn_like(x)
    absent = torch.ops.fusednorm.fused_group_norm_backward(
        dz, x, mean, rstd, w, b, 4, None, None, None, act, 0.01, None, [True] * 7)
    zero_nc = torch.zeros(2, 8, dtype=torch.float64, device=device)
    neutral = torch.ops.fusednorm.fused_group_norm_backward(
        dz, x, mean, rstd, w, b, 4, zero_nc, zero_nc, torch.zeros_like(x), act, 0.01, torch.ones_like(x), [True] * 7)
    for got, want in zip(absent, neutral):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_paths_cuda(activation, path, monkeypatch):
    # The CUDA forward runs small ChannelsFirst groups in one pass, with the group in registers
    # (up to 2 packs a thread with any operands, 4 with at most one tensor-sized operand) or in
    # shared memory, and the rest in split passes; the epilogue, forward and backward, must be
    # right on each (test_cuda_kernels.py covers the plain op). The team forward takes groups over
    # 1 MB with their operands ((2, 4, 128, 320) with a residual and a multiplier) by default, and
    # every group on the "team" path, whose forward has a kernel of its own for packs that
    # straddle channels (S = 63: (2, 40, 9, 7) in float32, (2, 16, 9, 7) in packs of 8).
    kernel_paths.set_path(monkeypatch, path)
    torch.manual_seed(10)
    for shape, G, dtype in (((2, 40, 9, 7), 4, torch.float32), ((4, 512), 1, torch.float32),
                            ((8, 3072), 1, torch.float32), ((2, 64, 8, 8), 32, torch.bfloat16),
                            ((2, 40, 9, 7), 10, torch.float32), ((2, 16, 9, 7), 2, torch.bfloat16),
                            ((2, 4, 128, 320), 1, torch.float16)):
        for names in (OPERANDS, ["residual", "multiplier"], ["residual"], ["multiplier"], ["scale"]):
            check_fused(shape, G, dtype, "contiguous", names, activation, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", [None, "silu", "gelu"])
def test_fused_sweep_tiles_across_channels_cuda(activation, dtype, monkeypatch):
    # The sweep forward (docs/design.md, "Sweep path") cuts a group into tiles of 256 KB that need
    # not end with a channel: groups of 2 channels of 160000 elements are 3 tiles of 13334 packs,
    # the second holding the channel boundary; each tile merges all three tiles' moments.
    kernel_paths.set_knob(monkeypatch, "FUSEDNORM_SWEEP_FORWARD", "1")
    torch.manual_seed(12)
    for names in (OPERANDS, ["residual", "multiplier"], ["scale", "shift"], []):
        check_fused((2, 4, 160000), 2, dtype, "contiguous", names, activation, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("activation", [None, "silu", "gelu", "mish"])
def test_fused_channels_last_sweep_cuda(activation, monkeypatch):
    # The channels-last sweep (docs/design.md, "Channels-last sweep"): each thread's channels'
    # coefficients (w_eff, b_eff per sample) computed once; the operands in the same tiles of rows.
    kernel_paths.set_path(monkeypatch, "cols_sweep")
    torch.manual_seed(15)
    for shape, G, dtype in (((2, 128, 40, 40), 32, torch.float16), ((2, 320, 9, 11), 32, torch.bfloat16),
                            ((2, 64, 20, 30), 64, torch.float32), ((1, 256, 3, 5, 7), 8, torch.float16)):
        for names in (OPERANDS, ["residual", "multiplier"], ["scale", "shift"], ["residual"], []):
            check_fused(shape, G, dtype, "channels_last", names, activation, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["one_pass", "one_pass_shared", "split"])
@pytest.mark.parametrize("activation", [None, "silu", "relu", "gelu"])
def test_fused_channels_last_one_pass_cuda(activation, path, monkeypatch):
    # The channels-last one-pass forwards (test_cuda_kernels.py, CL_ONE_PASS_CASES) take the
    # epilogue with per-lane coefficients: the register kernel with at most one tensor-sized
    # operand (none in bfloat16), the shared-memory kernel with any (the register kernel off on the
    # one_pass_shared path, and D = 10 / 3 in any case); other activations take the split passes.
    kernel_paths.set_path(monkeypatch, path)
    torch.manual_seed(11)
    for shape, G, dtype in (((2, 64, 4, 4), 4, torch.float32), ((2, 80, 3, 5), 2, torch.float16),
                            ((2, 64, 4, 4), 4, torch.bfloat16), ((2, 48, 2, 2, 3), 2, torch.float32),
                            ((2, 40, 3, 3), 4, torch.float16), ((2, 12, 3, 4), 4, torch.float32)):
        for names in (OPERANDS, ["scale", "shift"], ["residual"], ["multiplier"], ["scale"], []):
            check_fused(shape, G, dtype, "channels_last", names, activation, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("activation", [None, "silu", "relu"])
def test_fused_channels_last_clusters_cuda(activation, monkeypatch):
    # The channels-last shared-memory forward in clusters (test_cuda_kernels.py, CL_CLUSTER_CASES),
    # by default on these shapes (sm_90), with the per-sample scale and shift (a residual or a
    # multiplier takes the split passes: asserted).
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread block clusters need sm_90")
    kernel_paths.use_defaults(monkeypatch)
    torch.manual_seed(16)
    for shape, G, dtype in (((1, 512, 64, 64), 32, torch.float16), ((2, 320, 64, 64), 32, torch.bfloat16),
                            ((1, 128, 41, 43), 4, torch.float16)):
        assert "cluster=" in fusednorm.kernel_paths.plan(shape, G, dtype, channels_last=True, activation=activation,
                                               operands=["scale", "shift"], device="cuda")
        assert "cluster=" not in fusednorm.kernel_paths.plan(shape, G, dtype, channels_last=True, activation=activation,
                                                   operands=["residual"], device="cuda")
        for names in (["scale", "shift"], ["scale"], ["shift"], [], ["residual"]):
            check_fused(shape, G, dtype, "channels_last", names, activation, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", [None, "silu", "relu"])
def test_fused_channels_last_split_backward_activation_kernels_cuda(activation, dtype, monkeypatch):
    # The channels-last backward takes the split passes; with an activation alone (and the
    # per-sample scale and shift, no residual or multiplier) its reduce and apply passes run the
    # kernels of that activation (plan: cols_act_kernel=1) on 16-byte packs, else the shared EPI
    # kernels. Groups of 8 and 24 channels, a tile of rows crossing samples, odd spatial sizes; 12
    # channels are no whole 16-byte packs in 16-bit types, whose backward then takes the shared
    # kernels although planned with the activation's.
    kernel_paths.use_defaults(monkeypatch)
    torch.manual_seed(17)
    for shape, G in (((2, 64, 9, 7), 8), ((3, 48, 5, 5), 2), ((2, 320, 16, 16), 32), ((2, 12, 5, 7), 3)):
        for names in ([], ["scale", "shift"], ["scale"], ["residual"]):
            if activation is None and not names:
                continue  # the plain op
            planned = fusednorm.kernel_paths.plan(shape, G, dtype, channels_last=True, activation=activation,
                                                  operands=names, backward=True, device="cuda")
            assert ("cols_act_kernel=1" in planned) == ("residual" not in names), planned
            check_fused(shape, G, dtype, "channels_last", names, activation, "cuda")


def _check_channels_last_shared_forward(monkeypatch, knob, value, cases, operand_sets, activation):
    """check_fused on the channels-last shared-memory forward (the register kernel off), with the
    knob set to value (None: unset)."""
    kernel_paths.set_path(monkeypatch, "one_pass_shared")
    if value is not None:
        kernel_paths.set_knob(monkeypatch, knob, value)
    for shape, G, dtype in cases:
        for names in operand_sets:
            check_fused(shape, G, dtype, "channels_last", names, activation, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("pipeline", [None, "0", "1"])
def test_fused_channels_last_double_buffered_cuda(pipeline, monkeypatch):
    # 1280 channels_last groups of D = 10, more than the CTAs of the shared-memory forward resident
    # at once: each CTA takes several, the next group's copy in flight (FUSEDNORM_COLS_PIPELINE
    # unset: without a residual or multiplier; 1: with them too; 0: never).
    torch.manual_seed(13)
    _check_channels_last_shared_forward(
        monkeypatch, "FUSEDNORM_COLS_PIPELINE", pipeline,
        [((40, 320, 2, 2), 32, torch.float16), ((40, 320, 2, 2), 32, torch.float32)],
        (OPERANDS, ["residual"], ["multiplier"], ["scale", "shift"], []), "silu")


@pytest.mark.cuda
@pytest.mark.parametrize("span", [None, "1", "2"])
def test_fused_channels_last_groups_a_cta_cuda(span, monkeypatch):
    # Where a group's row fills less than a 32-byte sector, a CTA of the channels-last
    # shared-memory forward takes 2 or 4 adjacent groups (D = 8 in bfloat16, D = 10 in float16, D = 4
    # in float32: 2; D = 4 in float16: 4, or 2 where G = 6), each thread's pack in one group;
    # FUSEDNORM_COLS_SPAN caps the groups a CTA (1: one).
    torch.manual_seed(14)
    _check_channels_last_shared_forward(
        monkeypatch, "FUSEDNORM_COLS_SPAN", span,
        [((2, 64, 9, 7), 8, torch.bfloat16), ((3, 80, 5, 5), 8, torch.float16), ((2, 32, 3, 5), 8, torch.float32),
         ((2, 32, 3, 5), 8, torch.float16), ((2, 24, 4, 3), 6, torch.float16)],
        (OPERANDS, ["residual"], []), "relu")


def _register_kernel_variants(fn):
    """The last template argument (kLate) of each register-kernel launch of fn: "true" / "false"."""
    names = kernel_paths.cuda_kernel_names(fn)
    return re.findall(r"group_norm_registers_kernel<[^()]*(?:\([^()]*\)[^()<>]*)*, (true|false|\(bool\)[01])>", names)


@pytest.mark.cuda
@pytest.mark.parametrize("late", [None, "0"])
def test_fused_registers_late_cuda(late, monkeypatch):
    # ChannelsFirst groups in registers without per-channel parameters (problem 3's tail), but in
    # bfloat16, take the register kernel's late-operand variant (three CTAs an SM, the residual and multiplier loaded
    # after the moments); FUSEDNORM_REGISTERS_LATE=0 the general one, as groups with a weight or a
    # scale do. 2 and 4 packs a thread, partial rounds, every operand set, against float64.
    kernel_paths.use_defaults(monkeypatch)
    if late is not None:
        kernel_paths.set_knob(monkeypatch, "FUSEDNORM_REGISTERS_LATE", late)
    torch.manual_seed(15)
    cases = (((16, 6000), 1, torch.float32), ((6, 3000), 1, torch.float32), ((3, 64, 9, 7), 8, torch.float16),
             ((4, 40, 8, 8), 2, torch.bfloat16))
    for (shape, G, dtype), names, activation in itertools.product(
            cases, (["residual"], ["multiplier"], ["residual", "multiplier"], [], ["scale"]), (None, "silu")):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        ops = make_operands(x, names, "cuda", dtype)
        # (Where the register kernel runs: two distinct operands in bfloat16, or beside 4 packs a
        # thread, take the shared-memory kernel.)
        variants = _register_kernel_variants(lambda: fusednorm.group_norm(x, G, activation=activation, **ops))
        assert len(variants) <= 1, variants
        expected = late is None and "scale" not in names and dtype != torch.bfloat16
        assert all((v in ("true", "(bool)1")) == expected for v in variants), (shape, names, variants)
        check_fused(shape, G, dtype, "contiguous", names, activation, "cuda", affine=False)
    # Problem 3's tail takes it (rows enough for one CTA a row), and a weight the general kernel
    # (on channels of 1024 elements: a pack's elements share their weight).
    h, y = torch.randn(2, 256, 8192, device="cuda")
    variants = _register_kernel_variants(lambda: fusednorm.group_norm(h, 1, residual=y, multiplier=y))
    assert variants == (["true"] if late is None else ["false"]) or variants == (["(bool)1"] if late is None else ["(bool)0"])
    h, y = torch.randn(2, 256, 8, 1024, device="cuda")
    w = torch.randn(8, device="cuda")
    variants = _register_kernel_variants(lambda: fusednorm.group_norm(h, 1, w, residual=y))
    assert variants in (["false"], ["(bool)0"]), variants


@pytest.mark.cuda
@pytest.mark.parametrize("parts", ["1", "3", "8"])
def test_per_sample_parameter_gradients_over_a_cluster_cuda(parts, monkeypatch):
    # With a scale the parameter-gradient finalize weights each sample and writes grad_scale /
    # grad_shift per (n, c); a cluster's warps take whole samples, N below and above the number of
    # warps (32 a CTA). float64, against the composed reference.
    kernel_paths.set_knob(monkeypatch, "FUSEDNORM_PARAM_GRAD_PARTS", parts)
    torch.manual_seed(12)
    for shape, G in (((2, 320, 16, 16), 32), ((70, 64, 2, 2), 8)):
        for names in (["scale", "shift"], ["scale", "residual", "multiplier"]):
            check_fused(shape, G, torch.float64, "channels_last", names, "silu", "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
@pytest.mark.parametrize("shape", [(1024, 8192), (6, 3000), (12, 6000)], ids=str)
def test_residual_that_is_the_multiplier_cuda(shape, path, monkeypatch):
    # Problem 3's tail, (instance_norm(h) + y) * y with y one tensor: the one-pass kernels load it
    # once for both roles (in registers: 4 packs a thread, 2, and 4 with a partial round), and the
    # backward op returns y's whole gradient (sum_residual_multiplier_grads).
    kernel_paths.set_path(monkeypatch, path)
    torch.manual_seed(12)
    h = torch.randn(shape, device="cuda", requires_grad=True)
    y = torch.randn(shape, device="cuda", requires_grad=True)
    z = fusednorm.group_norm(h, 1, eps=1e-5, residual=y, multiplier=y)
    dz = torch.randn_like(z)
    grads = torch.autograd.grad(z, [h, y], dz)
    h64, y64 = (t.detach().double().requires_grad_() for t in (h, y))
    z64 = (group_norm_reference(h64, 1, None, None, 1e-5) + y64) * y64
    grads64 = torch.autograd.grad(z64, [h64, y64], dz.double())
    assert_close(z, z64, torch.float32, scale=z64.abs().max().item(), msg="output")
    for name, g, g64 in zip(("input", "y"), grads, grads64):
        assert_close(g, g64, torch.float32, scale=g64.abs().max().item(), msg=f"grad of {name}")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_fused_backward_large_groups_cpu(layout):
    # The CPU backward keeps a group's dp between its passes when the group is small enough
    # (kMaxGroupDpBytes); a 640 KB group takes the path that recomputes it.
    torch.manual_seed(11)
    check_fused((2, 4, 200, 200), 1, torch.float32, layout, OPERANDS, "silu", "cpu")


@pytest.mark.parametrize("shape,layout", [((2, 8, 4, 6), "contiguous"), ((2, 8, 4, 6), "channels_last"),
                                          ((4, 8), "contiguous")])
def test_param_grad_dtypes(device, shape, layout):
    # The backward ops return each parameter's gradient in that parameter's dtype (rounded once
    # from the float32 sums), so that autograd casts nothing after them: mixed dtypes here, in
    # both layouts and with one element per channel (S == 1: the CPU kernel writes grad_scale and
    # grad_shift through an opmath buffer there).
    torch.manual_seed(11)
    x = to_layout(torch.randn(*shape, dtype=torch.bfloat16, device=device), layout)
    w = torch.randn(8, dtype=torch.float32, device=device)
    b = torch.randn(8, dtype=torch.bfloat16, device=device)
    scale = 0.1 * torch.randn(shape[0], 8, dtype=torch.float64, device=device)
    shift = 0.1 * torch.randn(shape[0], 8, dtype=torch.float16, device=device)
    y, mean, rstd = torch.ops.fusednorm.fused_group_norm_forward(
        x, 4, w, b, 1e-5, scale, shift, None, "silu", 0.01, None)
    dz = torch.randn_like(y)

    def backward(*params):
        return torch.ops.fusednorm.fused_group_norm_backward(
            dz, x, mean, rstd, params[0], params[1], 4, params[2], params[3], None, "silu", 0.01, None, [True] * 5 + [False] * 2)

    grads = backward(w, b, scale, shift)
    assert [g.dtype for g in grads[1:5]] == [torch.float32, torch.bfloat16, torch.float64, torch.float16]
    # The same sums with float32 parameters (what the kernels accumulate in), rounded once.
    reference = backward(w, b.float(), scale.float(), shift.float())
    for got, want in zip(grads[1:5], reference[1:5]):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-2, atol=1e-2)

    plain = torch.ops.fusednorm.group_norm_backward(dz, x, mean, rstd, w, 4, [True, True, True])
    assert plain[1].dtype == torch.float32 and plain[2].dtype == torch.float32  # the weight's
    plain_bf16 = torch.ops.fusednorm.group_norm_backward(dz, x, mean, rstd, w.bfloat16(), 4, [False, True, True])
    assert plain_bf16[1].dtype == torch.bfloat16 and plain_bf16[2].dtype == torch.bfloat16
    plain_none = torch.ops.fusednorm.group_norm_backward(dz, x, mean, rstd, None, 4, [False, False, True])
    assert plain_none[2].dtype == torch.float32  # no parameter: the statistics' dtype
