"""The residual-add prologue, add_group_norm / add_group_norm_forward: the op normalizes
sum = input + other (+ input_bias) and returns that sum too (a resnet's output, which the next
block reads again). Against the float64 reference on every dtype and layout, forward and backward
(gradients through both outputs), twice differentiable, on every kernel path (the channels-last
sweep computes the sum on the fly, the others are given it); opcheck; argument errors; and the
fusion backend's rewrite of ``(shortcut + conv(h)) / 1`` before a group norm (docs/design.md,
"Residual-add prologue")."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fusednorm
import kernel_paths
from fusednorm import fusion
from reference import assert_close, assert_compiles_like_eager, epilogue_reference, group_norm_reference, to_layout
from test_fusion import Recording, compile_and_compare
from test_input_bias import BIAS_SHAPES, make_input_bias

OP = torch.ops.fusednorm.add_group_norm


def sum_reference(x, other, input_bias):
    """x + other (+ input_bias) in float64."""
    s = x.detach().cpu().double() + other.detach().cpu().double()
    if input_bias is not None:
        p = input_bias.detach().cpu().double()
        s = s + p.reshape((1 if p.dim() == 1 else x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2))
    return s


def check(shape, G, dtype, layout, kind, device, activation=None, grads=True):
    torch.manual_seed(sum(shape) + G)
    make = lambda: to_layout(torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype), layout)  # noqa: E731
    x, other = make(), make()
    C = shape[1]
    w = torch.randn(C, dtype=dtype, device=device)
    b = torch.randn(C, dtype=dtype, device=device)
    p = make_input_bias(x, kind) if kind is not None else None
    leaves = [t.requires_grad_(grads) for t in (x, other, w, b) + ((p,) if p is not None else ())]
    y, s = OP(x, other, G, w, b, 1e-5, activation=activation, input_bias=p)
    for t in (y, s):
        assert t.dtype == dtype and t.shape == x.shape
        if layout == "channels_last":
            assert t.movedim(1, -1).is_contiguous(), "the outputs keep the channels-last layout"
    # The sum: x + other + input_bias rounded to the dtype (once, or once an addition).
    s_ref = sum_reference(x, other, p)
    assert_close(s, s_ref, dtype, scale=max(1.0, s_ref.abs().max().item()), msg=f"sum {shape} {dtype} {layout} {kind}")
    # The output: the normalization of the sum the op returned (its statistics are that sum's).
    f64 = lambda t: None if t is None else t.detach().cpu().double()  # noqa: E731
    y_ref = epilogue_reference(group_norm_reference(f64(s), G, f64(w), f64(b), 1e-5), activation=activation)
    assert_close(y, y_ref, dtype, scale=2 * max(1.0, y_ref.abs().max().item()),
                 msg=f"output {shape} {dtype} {layout} {kind}")
    if not grads:
        return
    # Gradients through both outputs, against the float64 composition.
    gy, gs = (torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype) for _ in range(2))
    got = torch.autograd.grad((y, s), leaves, (gy, gs))
    l64 = [f64(t).requires_grad_() for t in leaves]
    x64, o64, w64, b64 = l64[:4]
    s64 = x64 + o64
    if p is not None:
        p64 = l64[4]
        s64 = s64 + p64.reshape((1 if p64.dim() == 1 else shape[0], C) + (1,) * (len(shape) - 2))
    y64 = epilogue_reference(group_norm_reference(s64, G, w64, b64, 1e-5), activation=activation)
    want = torch.autograd.grad((y64, s64), l64, (gy.cpu().double(), gs.cpu().double()))
    for name, g, g_ref in zip(("input", "other", "weight", "bias", "input_bias"), got, want):
        assert g.shape == g_ref.shape and g.dtype == dtype, name
        assert_close(g, g_ref, dtype, scale=4 * max(1.0, g_ref.abs().max().item()), msg=name)


@given(
    shape=st.sampled_from([(2, 8, 5, 6), (3, 12, 7), (1, 16, 4, 4, 3), (2, 64, 9, 9), (4, 32, 1, 3)]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
    kind=st.sampled_from([None] + BIAS_SHAPES),
    activation=st.sampled_from([None, "silu"]),
)
def test_against_reference(shape, dtype, layout, kind, activation, device):
    G = 4 if shape[1] % 4 == 0 else 1
    check(shape, G, dtype, layout, kind, device, activation)


# The channels-last sweep computes the sum on the fly: its moments kernel reads both operands and
# writes the sum, and no other kernel (an elementwise add) runs besides the finalize and output.
NATIVE = [
    # (shape, G, dtype)
    ((2, 64, 16, 16), 8, torch.float16),
    ((1, 128, 24, 20), 32, torch.bfloat16),
    ((3, 32, 9, 7), 4, torch.float32),
    ((1, 128, 64, 64), 32, torch.float16),
]


@pytest.mark.cuda
@pytest.mark.parametrize("shape, G, dtype", NATIVE)
@pytest.mark.parametrize("kind", [None] + BIAS_SHAPES)
def test_channels_last_sweep_adds_on_the_fly(shape, G, dtype, kind, monkeypatch):
    kernel_paths.use_defaults(monkeypatch)
    kernel_paths.set_knob(monkeypatch, "FUSEDNORM_COLS_SWEEP", "1")
    check(shape, G, dtype, "channels_last", kind, "cuda", activation="silu")
    torch.manual_seed(0)
    x, other = (torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=torch.channels_last) for _ in range(2))
    p = make_input_bias(x, kind) if kind is not None else None
    names = kernel_paths.cuda_kernel_names(lambda: OP(x, other, G, activation="silu", input_bias=p))
    assert "cols_sweep_add_moments" in names, names
    assert "elementwise" not in names, names
    # The sum is x + other + input_bias added in float32 and rounded once; the statistics are its.
    y, s, mean, rstd = torch.ops.fusednorm.add_group_norm_forward(x, other, G, None, None, 1e-5, None, None, None,
                                                                  "silu", 0.01, None, p)
    want = x.float() + other.float()
    if p is not None:
        want = want + p.float().reshape((-1, shape[1]) + (1,) * (len(shape) - 2))
    assert torch.equal(s, want.to(dtype))
    xs = s.float().reshape(shape[0], G, -1)
    torch.testing.assert_close(mean, xs.mean(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rstd, torch.rsqrt(xs.var(-1, unbiased=False) + 1e-5), atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
def test_every_path(path, monkeypatch):
    kernel_paths.set_path(monkeypatch, path)
    for layout in ("contiguous", "channels_last"):
        check((2, 32, 12, 10), 8, torch.float16, layout, "NC", "cuda", activation="silu")
        check((2, 32, 12, 10), 8, torch.float32, layout, None, "cuda")


def test_twice_differentiable():
    torch.manual_seed(0)
    x, other = (torch.randn(2, 8, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    p = torch.randn(8, dtype=torch.float64, requires_grad=True)

    def f(x, other, w, p):
        return OP(x, other, 4, w, None, activation="silu", input_bias=p)

    assert torch.autograd.gradcheck(f, (x, other, w, p))
    assert torch.autograd.gradgradcheck(f, (x, other, w, p))


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("kind", [None] + BIAS_SHAPES)
def test_opcheck(kind, device):
    torch.manual_seed(0)
    for layout in ("contiguous", "channels_last"):
        x, other = (to_layout(torch.randn(2, 8, 4, 4, device=device), layout).requires_grad_() for _ in range(2))
        p = make_input_bias(x, kind).requires_grad_() if kind is not None else None
        torch.library.opcheck(torch.ops.fusednorm.add_group_norm_forward.default,
                              (x, other, 4, None, None, 1e-5, None, None, None, "silu", 0.01, None, p))


def test_compile_without_graph_breaks():
    torch.manual_seed(0)

    def f(x, other):
        y, s = OP(x, other, 4, activation="silu")
        return y * s

    assert_compiles_like_eager(f, lambda shape: tuple(torch.randn(shape, requires_grad=True) for _ in range(2)))


def test_bad_other_raises(device):
    x = torch.randn(2, 8, 4, 4, device=device)
    with pytest.raises(RuntimeError, match=r"Expected other of the input's shape \[2, 8, 4, 4\], but got other of "
                                           r"shape \[2, 8, 4, 1\]"):
        OP(x, torch.randn(2, 8, 4, 1, device=device), 4)
    with pytest.raises(TypeError, match=r"Expected other to have the input's dtype \(Float\), but got Double"):
        OP(x, torch.randn(2, 8, 4, 4, dtype=torch.float64, device=device), 4)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            OP(x, torch.randn(2, 8, 4, 4), 4)
    # group_norm's own checks come first, as the sum's.
    with pytest.raises(RuntimeError, match="Expected number of channels in input to be divisible by num_groups"):
        OP(x, torch.randn(2, 8, 4, 1, device=device), 3)


@pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")
def test_torchscript_and_export():
    def f(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        y, s = fusednorm.add_group_norm(x, other, 4, activation="silu")
        return y + s

    class Module(nn.Module):
        def forward(self, x, other):
            return f(x, other)

    torch.manual_seed(0)
    x, other = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4)
    want = F.silu(F.group_norm(x + other, 4)) + (x + other)
    torch.testing.assert_close(torch.jit.script(f)(x, other), want, atol=1e-5, rtol=1e-5)
    if not hasattr(torch, "export"):
        return
    program = torch.export.export(Module(), (x, other))
    assert any("add_group_norm" in str(n.target) for n in program.graph.nodes), program.graph
    torch.testing.assert_close(program.module()(x, other), want, atol=1e-5, rtol=1e-5)


# -- the fusion backend ----------------------------------------------------------------------------


class Block(nn.Module):
    """diffusers' ResnetBlock2D in small: (shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))) / 1."""

    def __init__(self, cin, cout, scale=1.0):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None
        self.scale = scale

    def forward(self, x):
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        if self.shortcut is not None:
            x = self.shortcut(x)
        return (x + h) / self.scale


class Blocks(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.blocks = nn.Sequential(Block(8, 8, scale), Block(8, 16, scale), Block(16, 16, scale))
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, x):
        return F.silu(self.norm(self.blocks(x)))


@pytest.mark.parametrize("scale, taken", [(1.0, 3), (2.0, 0)])
def test_backend_takes_the_residual_add(scale, taken, device, monkeypatch):
    # Each block's sum feeds the next block's first norm (and its shortcut), the last one the final
    # norm: three adds, the second block's two convolutions' biases summed into input_bias. Divided
    # by anything but 1, the add stays.
    monkeypatch.setattr(fusion, "_residual_add_pays", lambda *args: True)
    torch.manual_seed(0)
    module = Blocks(scale).to(device)
    backend = Recording()
    compile_and_compare(module, [torch.randn(2, 8, 6, 5, device=device)], backend, atol=1e-4, rtol=1e-4)
    assert backend.fusions == [7]
    code = backend.code[0]
    assert code.count("fusednorm.add_group_norm") == taken, code
    # The norms' input_bias takes every conv1's bias; the residual adds take conv2's and the
    # shortcut's.
    conv_biases = [line.split("torch.conv2d(")[1].split(", ")[2] for line in code.splitlines() if "torch.conv2d(" in line]
    assert len(conv_biases) == 7 and conv_biases.count("None") == (7 if taken else 3), code
    if taken:
        assert " / 1.0" not in code and "truediv" not in code, code


def test_backend_leaves_the_add_where_it_does_not_pay():
    # On the CPU (and on CUDA wherever the planner does not give the channels-last sweep) the op
    # would only write the sum with an add of its own: the add is left to the inner backend.
    torch.manual_seed(0)
    backend = Recording()
    compile_and_compare(Blocks(), [torch.randn(2, 8, 6, 5)], backend, atol=1e-4, rtol=1e-4)
    assert "add_group_norm" not in backend.code[0]


@pytest.mark.cuda
@pytest.mark.parametrize("shape, inductor, pays", [
    ((1, 128, 512, 512), True, True),     # Inductor's channels-last convolution output: the sweep
    ((1, 256, 256, 256), True, True),
    ((1, 512, 64, 64), True, False),      # the one-pass kernels
    ((1, 128, 512, 512), False, False),   # a contiguous input: the (channels-first) sweep or team
])
def test_residual_add_pays_where_the_sweep_runs(shape, inductor, pays):
    ref = torch.empty(shape, device="cuda", dtype=torch.float16)
    assert fusion._residual_add_pays(ref, 32, {"activation": "silu"}, inductor) == pays


def test_backend_keeps_the_sums_other_users_in_order(monkeypatch):
    # The sum is read before the norm's chain ends: the op would run too late for that reader.
    monkeypatch.setattr(fusion, "_residual_add_pays", lambda *args: True)

    class EarlyReader(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)
            self.norm = nn.GroupNorm(4, 8)

        def forward(self, x):
            s = x + self.conv(x)
            t = s * 2
            return F.silu(self.norm(s)) + t

    torch.manual_seed(0)
    backend = Recording()
    compile_and_compare(EarlyReader(), [torch.randn(2, 8, 4, 4)], backend, atol=1e-4, rtol=1e-4)
    assert "add_group_norm" not in backend.code[0], backend.code[0]


def test_functional(device):
    torch.manual_seed(0)
    x, other = (torch.randn(2, 8, 4, 4, device=device) for _ in range(2))
    p = torch.randn(8, dtype=torch.float64, device=device)  # cast to the input's dtype, as group_norm's
    y, s = fusednorm.add_group_norm(x, other, 4, activation="silu", input_bias=p)
    y_op, s_op = OP(x, other, 4, activation="silu", input_bias=p.float())
    assert torch.equal(y, y_op) and torch.equal(s, s_op)
    torch.testing.assert_close(y, fusednorm.group_norm(x + other, 4, activation="silu", input_bias=p.float()))
    with pytest.raises(TypeError, match=r"add_group_norm\(\): argument 'other' \(position 2\) must be Tensor, not int"):
        fusednorm.add_group_norm(x, 1, 4)
    with pytest.raises(TypeError, match=r"add_group_norm\(\): argument 'num_groups' \(position 3\) must be int"):
        fusednorm.add_group_norm(x, other, 4.0)
