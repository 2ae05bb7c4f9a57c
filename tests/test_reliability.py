"""Where fusednorm once gave a silent wrong result, failed where eager works, or raised another
exception type than eager: one regression test per case, and property tests that state the rules
(running statistics read anywhere in a compiled graph; the running variance; non-finite epilogue
operands; memory formats; torch.func transforms). Deliberate differences from eager are listed in
docs/deviations.md; the tests here pin them too."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fusednorm
import fusednorm.nn as fnn
import kernel_paths
from fusednorm import fusion

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")

# Where a rule concerns the kernels: the CPU, and every CUDA kernel path (tests/kernel_paths.py).
PLACES = ["cpu"] + [pytest.param(f"cuda:{path}", marks=pytest.mark.cuda) for path in kernel_paths.TEST_PATHS]


def device_of(place, monkeypatch):
    """The device of `place` ("cpu" or "cuda:<path>"), with that CUDA kernel path selected."""
    if place == "cpu":
        return "cpu"
    kernel_paths.set_path(monkeypatch, place.split(":", 1)[1])
    return "cuda"


# -- running statistics in a compiled graph (the fusion backend) --------------------------------------


class NormThenAct(torch.nn.Module):
    """An instance norm that updates its running statistics, then an epilogue chain (residual,
    activation, multiplier: each optional), with the running statistics read at `read_at` (0:
    before the norm, k: after step k of the chain)."""

    def __init__(self, steps, read_at, momentum, C=4):
        super().__init__()
        self.norm = torch.nn.InstanceNorm2d(C, affine=True, track_running_stats=True, momentum=momentum)
        self.steps, self.read_at = steps, read_at

    def forward(self, x, r, m):
        reads = []

        def read():
            reads.append(self.norm.running_mean.clone())
            reads.append(self.norm.running_var * 1)

        if self.read_at == 0:
            read()
        h = self.norm(x)
        if self.read_at == 1:
            read()
        for k, step in enumerate(self.steps):
            if step == "residual":
                h = h + r
            elif step == "silu":
                h = F.silu(h)
            elif step == "relu":
                h = torch.relu(h)
            elif step == "multiplier":
                h = h * m
            if self.read_at == k + 2:
                read()
        return (h, *reads)


def run_eager_and_fused(module, inputs):
    """(eager results, compiled-with-the-fusion-backend results, number of fusions), each run from
    the same running statistics."""
    torch._dynamo.reset()
    backend = fusion.backend("aot_eager")
    compiled = torch.compile(module, backend=backend)
    start = {name: b.clone() for name, b in module.named_buffers()}
    results = []
    for fn in (module, compiled):
        for name, b in module.named_buffers():
            b.copy_(start[name])
        out = fn(*inputs)
        results.append([t.detach().clone() for t in out] + [b.clone() for b in module.buffers()])
    torch._dynamo.reset()
    return results[0], results[1], sum(backend.fusions)


def test_fusion_running_stats_read_between_norm_and_activation():
    """Issue's case: the read between the norm and its activation sees the updated statistics."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.InstanceNorm2d(4, track_running_stats=True, momentum=1.0)
            self.act = torch.nn.SiLU()

        def forward(self, x):
            h = self.norm(x)
            seen = self.norm.running_mean.clone()
            return self.act(h), seen

    x = torch.randn(2, 4, 5, 5) + 3
    eager, fused, _ = run_eager_and_fused(M(), (x,))
    assert not torch.equal(eager[1], torch.zeros(4))  # the read sees the batch mean in eager
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fusion_still_fuses_when_the_stats_are_read_after_the_chain():
    x, r, m = torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5)
    eager, fused, count = run_eager_and_fused(NormThenAct(["residual", "silu"], 3, 0.5), (x, r, m))
    assert count == 1
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


STEP_LISTS = st.lists(st.sampled_from(["residual", "silu", "relu", "multiplier"]), min_size=1, max_size=4)


@settings(max_examples=12)
@given(steps=STEP_LISTS, data=st.data(), momentum=st.sampled_from([1.0, 0.5, 0.1]), seed=st.integers(0, 2**16))
def test_property_running_stats_read_anywhere_in_a_compiled_graph_see_eager_values(steps, data, momentum, seed):
    """Reading running statistics anywhere in a graph compiled with the fusion backend sees eager's
    values, and the outputs and the final statistics are eager's."""
    read_at = data.draw(st.integers(0, len(steps) + 1), label="read_at")
    g = torch.Generator().manual_seed(seed)
    x, r, m = (torch.randn(2, 4, 5, 5, generator=g) * 2 + 1 for _ in range(3))
    eager, fused, _ = run_eager_and_fused(NormThenAct(steps, read_at, momentum), (x, r, m))
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- running_var: the variance itself, not rstd^-2 - eps ------------------------------------------------


def unbiased_variance_reference(x):
    x64 = x.double()
    return x64.flatten(2).var(dim=2, unbiased=True).mean(0)


def test_running_var_when_the_variance_is_small_against_eps():
    """Issue's case: running_var is eager's (it was -7.7e-6 from rstd^-2 - eps)."""
    x = 0.5 + 1e-3 * torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(0))
    rm, rv = torch.zeros(8), torch.ones(8)
    fusednorm.instance_norm(x, rm, rv, momentum=1.0, eps=100.0)
    rm_t, rv_t = torch.zeros(8), torch.ones(8)
    F.instance_norm(x, rm_t, rv_t, momentum=1.0, eps=100.0)
    assert (rv > 0).all()
    torch.testing.assert_close(rv, rv_t, atol=0, rtol=1e-5)
    torch.testing.assert_close(rv.double(), unbiased_variance_reference(x), atol=0, rtol=1e-5)


@given(log_std=st.floats(-5, 2), log_eps=st.floats(-8, 2), mean=st.floats(-10, 10),
       shape=st.sampled_from([(2, 3, 7), (3, 2, 4, 5), (1, 4, 3, 2, 2), (2, 1, 33)]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_property_running_var_is_the_unbiased_variance(log_std, log_eps, mean, shape, dtype, seed):
    """running_var moves to the batch mean of the unbiased per-instance variance, to the input
    precision's rounding whatever eps, as eager's."""
    g = torch.Generator().manual_seed(seed)
    x = (mean + 10**log_std * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    C = shape[1]
    rm, rv = torch.zeros(C, dtype=dtype), torch.ones(C, dtype=dtype)
    fusednorm.instance_norm(x, rm, rv, momentum=1.0, eps=10**log_eps)
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(rv.double(), unbiased_variance_reference(x), atol=0, rtol=rtol)
    scale = abs(mean) + 10**log_std  # the mean's rounding is relative to the values' magnitude
    torch.testing.assert_close(rm.double(), x.double().flatten(2).mean(2).mean(0), atol=1e-6 * scale, rtol=0)


# -- an empty spatial size or batch leaves the running statistics ---------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 0), (2, 3, 0, 4), (0, 3, 5), (0, 3, 4, 4)], ids=str)
def test_no_values_leave_the_running_stats(shape):
    """No spatial elements: the statistics stay, as eager's. An empty batch: they stay too, where
    eager makes them NaN (docs/deviations.md, 'Running statistics')."""
    x = torch.randn(shape)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    y = fusednorm.instance_norm(x, rm, rv, momentum=0.1)
    rm_t, rv_t = rm0.clone(), rv0.clone()
    y_t = F.instance_norm(x, rm_t, rv_t, momentum=0.1)
    assert y.shape == y_t.shape == x.shape
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0)
    if shape[0] != 0:
        assert torch.equal(rm_t, rm0) and torch.equal(rv_t, rv0)
    else:
        assert rm_t.isnan().all() and rv_t.isnan().all()


# -- non-finite epilogue operands propagate as in the eager composition ----------------------------------


def eager_composition(x, G, scale=None, shift=None, residual=None, activation=None, multiplier=None):
    z = F.group_norm(x, G)
    shape = z.shape[:2] + (1,) * (z.dim() - 2)
    if scale is not None:
        z = z * (1 + scale.reshape(shape))
    if shift is not None:
        z = z + shift.reshape(shape)
    if residual is not None:
        z = z + residual
    if activation == "relu":
        z = torch.relu(z)
    elif activation == "silu":
        z = F.silu(z)
    if multiplier is not None:
        z = z * multiplier
    return z


def assert_same_non_finite(actual, expected):
    """NaN where the reference is NaN, the same infinities, and close elsewhere."""
    assert torch.equal(actual.isnan(), expected.isnan()), (actual, expected)
    assert torch.equal(actual.isinf(), expected.isinf()), (actual, expected)
    assert torch.equal(actual[actual.isinf()], expected[expected.isinf()])
    finite = expected.isfinite()
    torch.testing.assert_close(actual[finite], expected[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["inf", "-inf"])
def test_infinite_scale_gives_infinities_as_eager(place, channels_last, sign, monkeypatch):
    """The kernels fold 1 + scale into their per-channel coefficients; a zero bias (or none) and
    the mean's low part must not meet an infinite scale there (0 * inf would make the channel NaN)."""
    device = device_of(place, monkeypatch)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)).to(device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    scale = torch.zeros(2, 4, device=device)
    scale[0, 1] = scale[1, 3] = sign * float("inf")
    for activation in (None, "relu", "silu"):
        actual = fusednorm.group_norm(x, 2, scale=scale, activation=activation)
        expected = eager_composition(x, 2, scale=scale, activation=activation)
        assert expected.isinf().any()
        assert_same_non_finite(actual.cpu(), expected.cpu())


@pytest.mark.parametrize("place", PLACES)
def test_infinite_scale_with_a_bias_is_never_finite(place, monkeypatch):
    """With a bias b != 0, u = xhat * w + b meets an infinite gain as two infinite terms, which
    disagree in sign where xhat * w and b do: NaN there, where eager gives u's infinity
    (docs/deviations.md, "Non-finite epilogue operands"). Never a finite value, and the channels
    whose scale is finite are untouched."""
    device = device_of(place, monkeypatch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 64, generator=g).to(device)
    bias = torch.randn(4, generator=g).to(device)
    scale = torch.zeros(2, 4, device=device)
    scale[0, 1] = float("inf")
    actual = fusednorm.group_norm(x, 2, bias=bias, scale=scale).cpu()
    expected = F.group_norm(x, 2, bias=bias).cpu() * (1 + scale.cpu()[..., None])
    assert not actual[0, 1].isfinite().any()
    agree = actual[0, 1].isinf()
    assert torch.equal(actual[0, 1][agree], expected[0, 1][agree])
    finite = torch.ones(2, 4, dtype=torch.bool)
    finite[0, 1] = False
    torch.testing.assert_close(actual[finite], expected[finite], atol=1e-5, rtol=1e-5)


def test_nan_multiplier_where_relu_is_inactive_keeps_the_input_gradient_finite():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 8, generator=g, requires_grad=True)
    multiplier = torch.ones(1, 2, 8)
    z = F.group_norm(x.detach(), 1)
    multiplier[z <= 0] = float("nan")  # only where ReLU passes nothing
    (gx,) = torch.autograd.grad(fusednorm.group_norm(x, 1, activation="relu", multiplier=multiplier).sum(), x)
    (gx_t,) = torch.autograd.grad(eager_composition(x, 1, activation="relu", multiplier=multiplier).sum(), x)
    assert gx_t.isfinite().all()
    assert_same_non_finite(gx, gx_t)


NON_FINITE = st.sampled_from([float("inf"), float("-inf"), float("nan")])


@settings(max_examples=40)
@example(operand="scale", value=float("inf"), where=0, activation=None, seed=0)
@given(operand=st.sampled_from(["scale", "shift", "residual", "multiplier"]), value=NON_FINITE,
       where=st.integers(0, 7), activation=st.sampled_from([None, "relu", "silu"]), seed=st.integers(0, 2**16))
def test_property_non_finite_epilogue_operands_propagate_as_in_eager(operand, value, where, activation, seed):
    """A non-finite value in an epilogue operand gives the NaN and infinities the eager
    composition gives, no more (never a whole group of NaN) and no fewer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    ops = {}
    if operand in ("scale", "shift"):
        ops[operand] = torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.3
        ops[operand].view(-1)[where] = value
    else:
        ops[operand] = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
        ops[operand].view(-1)[where * 8 + 3] = value
    actual = fusednorm.group_norm(x, 2, activation=activation, **ops)
    assert_same_non_finite(actual, eager_composition(x, 2, activation=activation, **ops))


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(kernel_paths.TEST_PATHS))
@pytest.mark.parametrize("operand", ["scale", "shift", "residual", "multiplier"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=str)
def test_non_finite_epilogue_operands_propagate_as_in_eager_cuda(path, operand, value, monkeypatch):
    """The property above on every CUDA kernel path (float32, 8 x 8 spatial so that each path
    takes the groups), each activation the kernels specialise."""
    kernel_paths.set_path(monkeypatch, path)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, 8, generator=g).cuda()
    if operand in ("scale", "shift"):
        t = torch.randn(2, 4, generator=g) * 0.3
        t[0, 1] = value
    else:
        t = torch.randn(2, 4, 8, 8, generator=g)
        t[1, 2, 3, 5] = value
    t = t.cuda()
    for activation in (None, "relu", "silu"):
        actual = fusednorm.group_norm(x, 2, activation=activation, **{operand: t})
        assert_same_non_finite(actual.cpu(), eager_composition(x, 2, activation=activation, **{operand: t}).cpu())


@given(operand=st.sampled_from(["residual", "multiplier"]), value=NON_FINITE, where=st.integers(0, 63),
       activation=st.sampled_from([None, "silu", "gelu"]), seed=st.integers(0, 2**16))
def test_property_non_finite_elementwise_operands_stay_where_they_are(operand, value, where, activation, seed):
    """A non-finite residual or multiplier element changes that output element only, as eager's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    t = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    t.view(-1)[where] = value
    actual = fusednorm.group_norm(x, 2, activation=activation, **{operand: t})
    expected = eager_composition(x, 2, **{operand: t})
    if activation is not None:
        expected = eager_composition(x, 2, activation=None, **({"residual": t} if operand == "residual" else {}))
        expected = {"silu": F.silu, "gelu": F.gelu}[activation](expected)
        if operand == "multiplier":
            expected = expected * t
    assert_same_non_finite(actual, expected)


# -- extreme magnitudes: never a silent zero -------------------------------------------------------------


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_huge_magnitudes_never_give_zeros(dtype, place, monkeypatch):
    device = device_of(place, monkeypatch)
    x = (torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3e19).to(dtype)
    y = fusednorm.group_norm(x.to(device), 2).double().cpu()
    # Either the true values (of unit scale) or NaN as eager: never a finite wrong value.
    expected = F.group_norm(x.double(), 2)
    ok = y.isnan() | ((y - expected).abs() < 0.05)
    assert ok.all(), y


@pytest.mark.parametrize("place", PLACES)
def test_zero_eps_and_zero_variance_is_not_finite(place, monkeypatch):
    """eps = 0 with a variance that rounds to zero (denormal input): the output is NaN where eager
    gives +-inf or NaN (docs/deviations.md, 'Non-finite results'): never a finite value."""
    device = device_of(place, monkeypatch)
    x = torch.full((1, 2, 64), 1e-45) * torch.tensor([1.0, -1.0]).repeat(32)
    y = fusednorm.group_norm(x.to(device), 1, eps=0.0).cpu()
    y_t = F.group_norm(x, 1, eps=0.0)
    assert not y_t.isfinite().all()
    assert not y.isfinite().any()


# -- channels-last precision at large offsets --------------------------------------------------------------


def test_channels_last_precision_at_a_large_offset():
    g = torch.Generator().manual_seed(0)
    x32 = (1e4 + torch.randn(2, 4, 64, 64, generator=g, dtype=torch.float64)).float()
    expected = F.group_norm(x32.double(), 1)  # of the float32 values: their rounding is not the kernel's
    err_contiguous = (fusednorm.group_norm(x32, 1).double() - expected).abs().max().item()
    err_cl = (fusednorm.group_norm(x32.to(memory_format=torch.channels_last), 1).double() - expected).abs().max().item()
    # (measured: 7.9e-7 contiguous, 8.9e-6 channels-last)
    assert err_cl < max(2 * err_contiguous, 1e-6), (err_cl, err_contiguous)


# -- torch.func ----------------------------------------------------------------------------------------------


def test_vmap_instance_norm_function():
    xs = torch.randn(3, 2, 4, 5, generator=torch.Generator().manual_seed(0))
    w, b = torch.randn(4), torch.randn(4)
    ys = torch.func.vmap(lambda x: fusednorm.instance_norm(x, weight=w, bias=b))(xs)
    expected = torch.stack([F.instance_norm(x, weight=w, bias=b) for x in xs])
    torch.testing.assert_close(ys, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_vmap_instance_norm_modules(dim):
    ours = getattr(fnn, f"InstanceNorm{dim}d")(4, affine=True)
    theirs = getattr(torch.nn, f"InstanceNorm{dim}d")(4, affine=True)
    theirs.load_state_dict(ours.state_dict())
    xs = torch.randn((3, 2, 4) + (3,) * dim)
    torch.testing.assert_close(torch.func.vmap(ours)(xs), torch.func.vmap(theirs)(xs), atol=1e-5, rtol=1e-5)


def test_vmap_instance_norm_with_running_stats_in_eval():
    xs = torch.randn(3, 2, 4, 5)
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    ys = torch.func.vmap(lambda x: fusednorm.instance_norm(x, rm, rv, use_input_stats=False))(xs)
    expected = torch.stack([F.instance_norm(x, rm, rv, use_input_stats=False) for x in xs])
    torch.testing.assert_close(ys, expected, atol=1e-5, rtol=1e-5)


def channels_last(shape, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)


FUNC_CASES = {
    "group_norm": (lambda x: fusednorm.group_norm(x, 2), lambda x: F.group_norm(x, 2)),
    "group_norm_silu": (lambda x: fusednorm.group_norm(x, 2, activation="silu"), lambda x: F.silu(F.group_norm(x, 2))),
    "instance_norm": (lambda x: fusednorm.instance_norm(x), lambda x: F.instance_norm(x)),
}


@pytest.mark.parametrize("case", list(FUNC_CASES))
@pytest.mark.parametrize("shape", [(2, 4, 3, 3), (1, 2, 2, 3, 2)], ids=str)
def test_jacfwd_and_hessian_on_channels_last(case, shape):
    ours, theirs = FUNC_CASES[case]
    x = channels_last(shape)
    # The reference takes the contiguous copy: eager's own group_norm fails under these transforms
    # on channels-last input before torch 2.14 (a .view in F.group_norm); the values are the same.
    torch.testing.assert_close(torch.func.jacfwd(ours)(x), torch.func.jacfwd(theirs)(x.contiguous()),
                               atol=1e-8, rtol=1e-7)
    x_small = channels_last((1, 2, 2, 2))
    def loss(f):
        return lambda t: (f(t) ** 3).sum()
    torch.testing.assert_close(torch.func.hessian(loss(ours))(x_small), torch.func.hessian(loss(theirs))(x_small.contiguous()),
                               atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("case", list(FUNC_CASES))
def test_vmap_of_jvp_on_channels_last(case):
    ours, theirs = FUNC_CASES[case]
    x = channels_last((2, 4, 3, 3))
    tangents = torch.randn(3, *x.shape, dtype=torch.float64)

    def jvp_of(f, x):
        return torch.func.vmap(lambda t: torch.func.jvp(f, (x,), (t,))[1])

    # The reference at the contiguous copy (see test_jacfwd_and_hessian_on_channels_last).
    torch.testing.assert_close(jvp_of(ours, x)(tangents), jvp_of(theirs, x.contiguous())(tangents),
                               atol=1e-8, rtol=1e-7)


# -- memory formats ----------------------------------------------------------------------------------------------


def test_empty_channels_last_batch_keeps_channels_last(device):
    """An empty batch comes back in the layout of a full one (eager's CPU group_norm returns it
    contiguous: docs/deviations.md, 'Memory format')."""
    for shape, fmt in (((0, 4, 3, 3), torch.channels_last), ((0, 4, 2, 3, 3), torch.channels_last_3d)):
        x = torch.randn(shape, device=device).to(memory_format=fmt)
        full = torch.randn((2,) + shape[1:], device=device).to(memory_format=fmt)
        for fn in (lambda t: fusednorm.group_norm(t, 2), lambda t: fusednorm.instance_norm(t),
                   lambda t: fusednorm.group_norm(t, 2, activation="silu")):
            y = fn(x)
            assert y.shape == x.shape and y.is_contiguous(memory_format=fmt) and y.stride() == x.stride()
            assert fn(full).is_contiguous(memory_format=fmt)
    x = torch.randn(0, 4, 3, 3, device=device)
    assert fusednorm.group_norm(x, 2).stride() == x.stride()


def test_empty_channels_last_batch_under_fake_tensors():
    """The fake kernel gives the strides the real one gives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(0, 4, 3, 3).to(memory_format=torch.channels_last)
    real = torch.ops.fusednorm.group_norm_forward(x, 2, None, None, 1e-5)[0]
    with FakeTensorMode() as mode:
        fake = torch.ops.fusednorm.group_norm_forward(mode.from_tensor(x), 2, None, None, 1e-5)[0]
    assert fake.stride() == real.stride()


@pytest.mark.parametrize("fmt", ["channels_last", "channels_last_3d"])
@pytest.mark.parametrize("slicing", ["spatial_step", "channel_slice", "batch_step"])
def test_sliced_channels_last_input_keeps_its_suggested_format(device, fmt, slicing):
    memory_format = getattr(torch, fmt)
    shape = (4, 6, 6, 6) if fmt == "channels_last" else (4, 6, 4, 4, 4)
    base = torch.randn(shape, device=device).to(memory_format=memory_format)
    x = {"spatial_step": base[:, :, ::2], "channel_slice": base[:, :4], "batch_step": base[::2]}[slicing]
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=memory_format)
    C = x.shape[1]
    y, y_t = fusednorm.group_norm(x, 2), F.group_norm(x, 2)
    if device == "cpu":  # eager keeps the suggested format on the CPU
        assert y_t.is_contiguous(memory_format=memory_format)
    assert y.is_contiguous(memory_format=memory_format)
    torch.testing.assert_close(y, y_t, atol=1e-5, rtol=1e-5)
    # instance_norm keeps it too, where eager returns it contiguous (docs/deviations.md)
    y = fusednorm.instance_norm(x, weight=torch.ones(C, device=device))
    assert y.is_contiguous(memory_format=memory_format)
    torch.testing.assert_close(y, F.instance_norm(x, weight=torch.ones(C, device=device)), atol=1e-5, rtol=1e-5)
    # the fake kernel agrees
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ops.fusednorm.group_norm_forward(x, 2, None, None, 1e-5)[0]
    with FakeTensorMode() as mode:
        fake = torch.ops.fusednorm.group_norm_forward(mode.from_tensor(x), 2, None, None, 1e-5)[0]
    assert fake.stride() == real.stride()


@given(shape=st.sampled_from([(2, 4, 3, 5), (3, 6, 4, 2), (1, 2, 5, 5), (2, 4, 2, 3, 4)]),
       dims=st.lists(st.sampled_from(["n", "c", "s"]), min_size=0, max_size=3),
       fmt=st.sampled_from(["contiguous", "channels_last"]), seed=st.integers(0, 2**16))
def test_property_output_memory_format_is_the_inputs(shape, dims, fmt, seed):
    """The output of group_norm has the strides eager's CPU group_norm gives for any slice of a
    contiguous or channels-last tensor, and its values."""
    g = torch.Generator().manual_seed(seed)
    big = tuple(2 * s for s in shape)
    base = torch.randn(big, generator=g)
    if fmt == "channels_last":
        base = base.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    index = [slice(0, s) for s in shape]
    for d in dims:
        axis = {"n": 0, "c": 1, "s": 2}[d]
        index[axis] = slice(0, 2 * shape[axis], 2)
    x = base[tuple(index)]
    y, y_t = fusednorm.group_norm(x, 2), F.group_norm(x, 2)
    torch.testing.assert_close(y, y_t, atol=1e-5, rtol=1e-5)
    assert y.stride() == y_t.stride(), (x.stride(), y.stride(), y_t.stride())


# -- argument types: eager's TypeError ------------------------------------------------------------------------

X = torch.randn(2, 6, 5)

TYPE_ERRORS = {
    # case: (fusednorm call, torch.nn.functional call)
    "float_num_groups": (lambda: fusednorm.group_norm(X, 3.0), lambda: F.group_norm(X, 3.0)),
    "bool_num_groups": (lambda: fusednorm.group_norm(X, True), lambda: F.group_norm(X, True)),
    "eps_none": (lambda: fusednorm.group_norm(X, 3, eps=None), lambda: F.group_norm(X, 3, eps=None)),
    "eps_str": (lambda: fusednorm.group_norm(X, 3, eps="1e-5"), lambda: F.group_norm(X, 3, eps="1e-5")),
    "weight_list": (lambda: fusednorm.group_norm(X, 3, [1.0] * 6), lambda: F.group_norm(X, 3, [1.0] * 6)),
    "weight_ndarray": (lambda: fusednorm.group_norm(X, 3, np.ones(6, np.float32)),
                       lambda: F.group_norm(X, 3, np.ones(6, np.float32))),
    "bias_list": (lambda: fusednorm.group_norm(X, 3, None, [0.0] * 6), lambda: F.group_norm(X, 3, None, [0.0] * 6)),
    "in_momentum_none": (lambda: fusednorm.instance_norm(X, torch.zeros(6), torch.ones(6), momentum=None),
                         lambda: F.instance_norm(X, torch.zeros(6), torch.ones(6), momentum=None)),
    "in_eps_none": (lambda: fusednorm.instance_norm(X, eps=None), lambda: F.instance_norm(X, eps=None)),
    "in_weight_list": (lambda: fusednorm.instance_norm(X, weight=[1.0] * 6), lambda: F.instance_norm(X, weight=[1.0] * 6)),
    "in_running_mean_list": (lambda: fusednorm.instance_norm(X, [0.0] * 6, [1.0] * 6),
                             lambda: F.instance_norm(X, [0.0] * 6, [1.0] * 6)),
    "in_use_input_stats_none": (lambda: fusednorm.instance_norm(X, use_input_stats=None),
                                lambda: F.instance_norm(X, use_input_stats=None)),
    "residual_ndarray": (lambda: fusednorm.group_norm(X, 3, residual=np.ones((2, 6, 5), np.float32)), None),
    "scale_list": (lambda: fusednorm.group_norm(X, 3, scale=[[1.0] * 6] * 2), None),
    "activation_int": (lambda: fusednorm.group_norm(X, 3, activation=1), None),
}


@pytest.mark.parametrize("case", list(TYPE_ERRORS))
def test_argument_of_the_wrong_type_is_a_type_error(case):
    ours, theirs = TYPE_ERRORS[case]
    if theirs is not None:
        with pytest.raises(TypeError):
            theirs()
    with pytest.raises(TypeError, match="must be"):
        ours()


def test_eager_accepted_scalar_types_are_accepted():
    y = fusednorm.group_norm(X, 3, eps=1)
    torch.testing.assert_close(y, F.group_norm(X, 3, eps=1))
    y = fusednorm.instance_norm(X, momentum=1, eps=1)
    torch.testing.assert_close(y, F.instance_norm(X, momentum=1, eps=1))
    fusednorm.group_norm(X, 3, weight=torch.nn.Parameter(torch.ones(6)))


@pytest.mark.parametrize("x_dtype,p_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32),
                                             (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)], ids=str)
def test_parameter_dtype_mismatch_is_a_runtime_error_as_eager(x_dtype, p_dtype):
    x = X.to(x_dtype)
    w = torch.ones(6, dtype=p_dtype)
    with pytest.raises(RuntimeError):
        F.group_norm(x, 3, w)
    with pytest.raises(RuntimeError, match="Expected weight to have the input's dtype"):
        fusednorm.group_norm(x, 3, w)
    with pytest.raises(RuntimeError, match="Expected weight to have the input's dtype"):
        fusednorm.instance_norm(x, weight=w)


# -- accepted where eager raises ------------------------------------------------------------------------------------


def test_zero_channels():
    x = torch.randn(2, 0, 5)
    # (eager raises too from torch 2.14 on; older versions return an empty tensor)
    for fn in (lambda: fusednorm.group_norm(x, 1), lambda: torch.ops.fusednorm.group_norm(x, 1)):
        with pytest.raises(RuntimeError, match="number of channels to be greater than 0"):
            fn()
    # instance_norm takes it, as eager does
    assert fusednorm.instance_norm(x).shape == F.instance_norm(x).shape == x.shape
    rm, rv = torch.zeros(0), torch.ones(0)
    assert fusednorm.instance_norm(x, rm, rv).shape == x.shape


@pytest.mark.parametrize("shape", [(2, 6, 0), (3, 6, 0, 4), (0, 6, 0)], ids=str)
def test_zero_spatial_size(shape):
    x = torch.randn(shape, requires_grad=True)
    # (eager raises too from torch 2.14 on, in ATen's check_group_norm_inputs; older versions
    # return an empty tensor)
    calls = (lambda: fusednorm.group_norm(x, 3), lambda: torch.ops.fusednorm.group_norm(x, 3),
             lambda: fusednorm.group_norm(x, 3, activation="silu", residual=torch.zeros(shape)),
             lambda: fusednorm.add_group_norm(x, torch.zeros(shape), 3)[0], lambda: fusednorm.nn.GroupNorm(3, 6)(x))
    for fn in calls:
        with pytest.raises(RuntimeError, match="Expected HxW to be greater than 0, got 0"):
            fn()
    # the kernel ops take it (a spatially sharded norm's empty slice): an empty output, (N, G) statistics
    y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, 3, None, None, 1e-5)
    assert y.shape == x.shape and mean.shape == rstd.shape == (shape[0], 3)
    # instance_norm takes it, as eager does
    assert fusednorm.instance_norm(x).shape == F.instance_norm(x).shape == x.shape


@pytest.mark.parametrize("use_input_stats", [True, False])
@pytest.mark.parametrize("which", ["running_mean", "running_var"])
def test_running_stats_that_require_grad(use_input_stats, which):
    x = torch.randn(2, 3, 5)

    def stats():
        s = {"running_mean": torch.zeros(3), "running_var": torch.ones(3)}
        s[which].requires_grad_()
        return s

    with pytest.raises(RuntimeError):
        F.instance_norm(x, **stats(), use_input_stats=use_input_stats)
    for fn in (fusednorm.instance_norm, torch.ops.fusednorm.instance_norm):
        with pytest.raises(RuntimeError, match=f"not differentiable with respect to argument '{which}'"):
            fn(x, **stats(), use_input_stats=use_input_stats)
    with torch.no_grad():  # as eager: taken, and updated
        s, s_t = stats(), stats()
        y = fusednorm.instance_norm(x, **s, use_input_stats=use_input_stats)
        torch.testing.assert_close(y, F.instance_norm(x, **s_t, use_input_stats=use_input_stats))
        torch.testing.assert_close(s[which], s_t[which])


@pytest.mark.parametrize("operand", ["scale", "shift"])
def test_per_sample_operand_of_a_higher_rank_than_the_input(operand):
    x = torch.randn(2, 6, 5)
    t = torch.randn(2, 6, 1, 1)
    for fn in (lambda: fusednorm.group_norm(x, 3, **{operand: t}),
               lambda: fusednorm.instance_norm(x, **{operand: t}),
               lambda: fusednorm.instance_norm(x, torch.zeros(6), torch.ones(6), use_input_stats=False, **{operand: t})):
        with pytest.raises(RuntimeError, match=f"Expected {operand} of shape"):
            fn()
    y = fusednorm.group_norm(x, 3, **{operand: t[..., 0]})  # (N, C, 1): the input's rank
    assert y.shape == x.shape


def test_float32_weight_with_bfloat16_bias_is_taken():
    """Accepted where eager's CPU kernel raises "mixed dtype" (docs/deviations.md): the result is
    the float64 reference's, to bfloat16 rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=g).bfloat16()
    w, b = torch.randn(6, generator=g), torch.randn(6, generator=g).bfloat16()
    with pytest.raises(RuntimeError):
        F.group_norm(x, 3, w, b)
    y = fusednorm.group_norm(x, 3, w, b)
    expected = F.group_norm(x.double(), 3, w.double(), b.double())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), expected, atol=3e-2, rtol=2e-2)


# -- activation names: one rule for the functions and the modules -------------------------------------------------


@pytest.mark.parametrize("name", ["none", None])
def test_activation_none_accepted_everywhere(name):
    x = torch.randn(2, 6, 5)
    torch.testing.assert_close(fusednorm.group_norm(x, 3, activation=name), F.group_norm(x, 3))
    torch.testing.assert_close(fusednorm.instance_norm(x, activation=name), F.instance_norm(x))
    m = fnn.GroupNorm(3, 6, activation=name)
    assert m.activation is None and "activation" not in repr(m)
    torch.testing.assert_close(m(x), F.group_norm(x, 3, m.weight, m.bias))
    m = fnn.InstanceNorm1d(6, activation=name)
    torch.testing.assert_close(m(x), F.instance_norm(x))


def test_swish_is_silu():
    x = torch.randn(2, 6, 5, requires_grad=True)
    torch.testing.assert_close(fusednorm.group_norm(x, 3, activation="swish"), fusednorm.group_norm(x, 3, activation="silu"))
    torch.testing.assert_close(fusednorm.instance_norm(x, activation="swish"), F.silu(F.instance_norm(x)))
    torch.testing.assert_close(torch.ops.fusednorm.group_norm(x, 3, activation="swish"), F.silu(F.group_norm(x, 3)))
    m = fnn.GroupNorm(3, 6, activation="swish")
    assert "swish" in repr(m)
    y = m(x)
    torch.testing.assert_close(y, F.silu(F.group_norm(x, 3, m.weight, m.bias)))
    y.sum().backward()
    assert x.grad is not None and x.grad.isfinite().all()
    m = fnn.InstanceNorm2d(6, activation="swish", track_running_stats=True).eval()
    x4 = torch.randn(2, 6, 3, 3)
    torch.testing.assert_close(m(x4), F.silu(F.instance_norm(x4, m.running_mean, m.running_var, use_input_stats=False)))


@pytest.mark.parametrize("name", ["Swish", "sigmoid", "", "gelu_erf"])
def test_unknown_activation_is_a_value_error_everywhere(name):
    x = torch.randn(2, 6, 5)
    for fn in (lambda: fusednorm.group_norm(x, 3, activation=name),
               lambda: fusednorm.instance_norm(x, activation=name),
               lambda: fnn.GroupNorm(3, 6, activation=name),
               lambda: fnn.InstanceNorm2d(6, activation=name)):
        with pytest.raises(ValueError, match="Unknown activation"):
            fn()


def test_activation_names_are_the_ops():
    """The Python list of names is what the op accepts."""
    x = torch.randn(2, 6, 5)
    for name in fusednorm.functional.ACTIVATION_NAMES:
        fusednorm.group_norm(x, 3, activation=name)
