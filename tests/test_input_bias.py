"""The prologue input_bias of group_norm and fused_group_norm_forward: the op normalizes
input + input_bias (a convolution's bias (C,), plus a per-sample embedding (N, C)) in one pass.
Against the float64 reference on every dtype, layout and kernel path (the channels-last sweep and
one-pass kernels and the team forward add it on the fly, the others are given the sum), forward
and backward, twice differentiable; opcheck; argument errors; and the fusion backend's rewrite of
conv(h, w, b) [+ e] before a group norm (docs/design.md, "Input bias")."""

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

BIAS_SHAPES = ["C", "NC", "NC11"]


def make_input_bias(x, kind, dtype=None):
    N, C = x.shape[:2]
    shape = {"C": (C,), "NC": (N, C), "NC11": (N, C) + (1,) * (x.dim() - 2)}[kind]
    return torch.randn(shape, dtype=torch.float64).to(device=x.device, dtype=dtype or x.dtype)


def reference(x, G, w, b, eps, input_bias, activation=None, residual=None):
    """normalize(x + input_bias) then the epilogue, in float64 (the sum exact)."""
    f64 = lambda t: None if t is None else t.cpu().double()  # noqa: E731
    x64, p64 = f64(x), f64(input_bias)
    p64 = p64.reshape((1 if p64.dim() == 1 else x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2))
    y = group_norm_reference(x64 + p64, G, f64(w), f64(b), eps)
    return epilogue_reference(y, residual=f64(residual), activation=activation)


def check(shape, G, dtype, layout, kind, device, activation=None, with_residual=False, grads=True):
    torch.manual_seed(sum(shape) + G)
    x = to_layout(torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype), layout)
    C = shape[1]
    w = torch.randn(C, dtype=dtype, device=device)
    b = torch.randn(C, dtype=dtype, device=device)
    p = make_input_bias(x, kind)
    r = to_layout(torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype), layout) if with_residual else None
    leaves = [t.requires_grad_(grads) for t in (x, w, b, p)]
    z = fusednorm.group_norm(x, G, w, b, 1e-5, activation=activation, residual=r, input_bias=p)
    assert z.dtype == dtype and z.shape == x.shape
    if layout == "channels_last":
        assert z.movedim(1, -1).is_contiguous(), "the output keeps the channels-last layout"
    z_ref = reference(x, G, w, b, 1e-5, p, activation, r).detach()
    magnitude = max(1.0, z_ref.abs().max().item())
    # 16-bit inputs off the channels-last kernels are given input + input_bias rounded to their
    # dtype: an error of the sum's rounding, relative to the group's spread.
    assert_close(z, z_ref, dtype, scale=2 * magnitude, msg=f"output {shape} {dtype} {layout} {kind}")
    if not grads:
        return
    grad_out = torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype)
    got = torch.autograd.grad(z, leaves, grad_out)
    f64 = [t.detach().cpu().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(reference(*[f64[0], G, f64[1], f64[2], 1e-5, f64[3], activation, r]), f64,
                               grad_out.cpu().double())
    for name, g, g_ref in zip(("input", "weight", "bias", "input_bias"), got, want):
        assert g.shape == g_ref.shape and g.dtype == dtype, name
        assert_close(g, g_ref, dtype, scale=4 * max(1.0, g_ref.abs().max().item()), msg=name)


@given(
    shape=st.sampled_from([(2, 8, 5, 6), (3, 12, 7), (1, 16, 4, 4, 3), (2, 64, 9, 9), (4, 32, 1, 3)]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
    kind=st.sampled_from(BIAS_SHAPES),
    activation=st.sampled_from([None, "silu"]),
    with_residual=st.booleans(),
)
def test_against_reference(shape, dtype, layout, kind, activation, with_residual, device):
    G = 4 if shape[1] % 4 == 0 else 1
    check(shape, G, dtype, layout, kind, device, activation, with_residual)


# The kernels that add input_bias on the fly, each forced, and the one kernel the call then
# launches besides them: no elementwise pass writes input + input_bias.
TEAM = kernel_paths.PATHS["team"]
NATIVE = [
    # (knobs, shape, G, dtype, layout, kernel)
    ({"FUSEDNORM_COLS_SWEEP": "1"}, (2, 64, 16, 16), 8, torch.float16, "channels_last", "cols_sweep_moments"),
    ({"FUSEDNORM_COLS_SWEEP": "1"}, (1, 128, 24, 20), 32, torch.bfloat16, "channels_last", "cols_sweep_moments"),
    ({"FUSEDNORM_COLS_SWEEP": "1"}, (3, 32, 9, 7), 4, torch.float32, "channels_last", "cols_sweep_moments"),
    ({}, (1, 512, 64, 64), 32, torch.float16, "channels_last", "cols_one_pass"),            # clusters
    ({}, (2, 320, 16, 16), 32, torch.bfloat16, "channels_last", "cols_one_pass"),           # two groups a CTA
    ({"FUSEDNORM_COLS_PIPELINE": "1"}, (4, 40, 6, 6), 4, torch.float16, "channels_last", "cols_one_pass"),  # double-buffered
    # The channels-first shared-memory one-pass kernel: a CTA a group, a cluster a group (the
    # default plan of (1, 512, 64, 64)), and a UNet's 8 x 8 groups in shared memory.
    (kernel_paths.PATHS["one_pass_shared"], (2, 64, 16, 16), 8, torch.float16, "contiguous",
     "group_norm_one_pass_kernel"),
    (kernel_paths.PATHS["one_pass_shared"], (3, 24, 9, 4), 4, torch.float32, "contiguous",
     "group_norm_one_pass_kernel"),
    ({}, (1, 512, 64, 64), 32, torch.float16, "contiguous", "group_norm_one_pass_kernel"),
    (kernel_paths.PATHS["one_pass_shared"], (4, 320, 8, 8), 32, torch.bfloat16, "contiguous",
     "group_norm_one_pass_kernel"),
    # The team forward: chunks of several channels, a thread's packs crossing them; channels of
    # 16 packs (fewer than a CTA's threads: every pack of a thread in another channel); 5-D.
    (TEAM, (2, 32, 48, 256), 4, torch.float16, "contiguous", "group_norm_team_kernel"),
    (TEAM, (2, 32, 48, 256), 4, torch.float32, "contiguous", "group_norm_team_kernel"),
    (TEAM, (1, 2048, 8, 16), 2, torch.float16, "contiguous", "group_norm_team_kernel"),
    (TEAM, (1, 128, 20, 64, 64), 32, torch.bfloat16, "contiguous", "group_norm_team_kernel"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("knobs, shape, G, dtype, layout, kernel", NATIVE)
@pytest.mark.parametrize("kind", BIAS_SHAPES)
def test_kernels_that_add_it(knobs, shape, G, dtype, layout, kernel, kind, monkeypatch):
    kernel_paths.use_defaults(monkeypatch)
    for name, value in knobs.items():
        kernel_paths.set_knob(monkeypatch, name, value)
    check(shape, G, dtype, layout, kind, "cuda", activation="silu", grads=False)  # the kernel's own output
    check(shape, G, dtype, layout, kind, "cuda", activation="silu")
    torch.manual_seed(0)
    x = to_layout(torch.randn(shape, device="cuda", dtype=dtype), layout)
    p = make_input_bias(x, kind)
    names = kernel_paths.cuda_kernel_names(lambda: fusednorm.group_norm(x, G, activation="silu", input_bias=p))
    assert kernel in names, names
    assert "elementwise" not in names, names
    # The statistics are those of x + input_bias, as the kernels given the sum compute them.
    _, mean, rstd = torch.ops.fusednorm.fused_group_norm_forward(x, G, None, None, 1e-5, None, None, None, "silu",
                                                                 0.01, None, p)
    xs = x.float() + p.float().reshape((-1, shape[1]) + (1,) * (len(shape) - 2))
    if kernel == "group_norm_one_pass_kernel":  # x + input_bias rounded to the dtype, as the sum it replaced
        xs = xs.to(dtype).float()
    xs = xs.reshape(shape[0], G, -1)
    torch.testing.assert_close(mean, xs.mean(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rstd, torch.rsqrt(xs.var(-1, unbiased=False) + 1e-5), atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(kernel_paths.PATHS))
def test_every_path(path, monkeypatch):
    kernel_paths.set_path(monkeypatch, path)
    for layout in ("contiguous", "channels_last"):
        check((2, 32, 12, 10), 8, torch.float16, layout, "NC", "cuda", activation="silu", with_residual=True)
        check((2, 32, 12, 10), 8, torch.float32, layout, "C", "cuda")
        # Rows of 35: packs straddle channels (the one-pass kernels are given the sum).
        check((2, 32, 5, 7), 8, torch.float16, layout, "NC", "cuda", activation="silu")


def test_twice_differentiable():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    for p in (torch.randn(8, dtype=torch.float64, requires_grad=True),
              torch.randn(2, 8, 1, 1, dtype=torch.float64, requires_grad=True)):
        def f(x, w, p):
            return fusednorm.group_norm(x, 4, w, None, activation="silu", input_bias=p)
        assert torch.autograd.gradcheck(f, (x, w, p))
        assert torch.autograd.gradgradcheck(f, (x, w, p))


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("kind", BIAS_SHAPES)
def test_opcheck(kind, device):
    torch.manual_seed(0)
    for layout in ("contiguous", "channels_last"):
        x = to_layout(torch.randn(2, 8, 4, 4, device=device), layout).requires_grad_()
        p = make_input_bias(x, kind).requires_grad_()
        torch.library.opcheck(torch.ops.fusednorm.fused_group_norm_forward.default,
                              (x, 4, None, None, 1e-5, None, None, None, "silu", 0.01, None, p))


def test_compile_without_graph_breaks():
    torch.manual_seed(0)

    def f(x, p):
        return fusednorm.group_norm(x, 4, activation="silu", input_bias=p)

    assert_compiles_like_eager(
        f, lambda shape: (torch.randn(shape, requires_grad=True), torch.randn(shape[:2], requires_grad=True)))


def test_bad_input_bias_raises(device):
    x = torch.randn(2, 8, 4, 4, device=device)
    op = torch.ops.fusednorm.fused_group_norm_forward.default

    def call(p):
        return op(x, 4, None, None, 1e-5, None, None, None, "none", 0.01, None, p)

    shape_error = r"Expected input_bias of shape \(C,\), \(N, C\) or \(N, C, 1, ..., 1\) with \(N, C\) = \(2, 8\)"
    for bad in (torch.randn(7), torch.randn(1, 8), torch.randn(2, 8, 2), torch.randn(2, 8, 1, 1, 1), torch.randn(8, 1)):
        with pytest.raises(RuntimeError, match=shape_error):
            call(bad.to(device))
    with pytest.raises(TypeError, match=r"Expected input_bias to have the input's dtype \(Float\), but got Double"):
        call(torch.randn(8, dtype=torch.float64, device=device))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            call(torch.randn(8))
    # Through the function: cast to the input's dtype, as residual and multiplier are.
    p = torch.randn(8, dtype=torch.float64, device=device)
    torch.testing.assert_close(fusednorm.group_norm(x, 4, input_bias=p),
                               F.group_norm(x + p.float()[:, None, None], 4), atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="argument 'input_bias' must be Tensor, not int"):
        fusednorm.group_norm(x, 4, input_bias=1)


# -- the fusion backend ----------------------------------------------------------------------------


class ConvNorm(nn.Module):
    """silu(group_norm(conv(h) [+ e])), e = emb[:, :, None, None] (the UNet's timestep add)."""

    def __init__(self, bias=True, embedding=False, second_user=False):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=bias)
        self.norm = nn.GroupNorm(4, 8)
        self.embedding, self.second_user = embedding, second_user

    def forward(self, h, emb):
        x = self.conv(h)
        if self.embedding:
            x = x + emb[:, :, None, None]
        y = F.silu(self.norm(x))
        return y + x if self.second_user else y


@pytest.mark.parametrize("bias, embedding, second_user, taken", [
    (True, False, False, True),     # conv(h, w, b) -> norm: the bias
    (True, True, False, True),      # conv(h, w, b) + e -> norm: b + e
    (False, True, False, True),     # conv(h, w) + e -> norm: e
    (False, False, False, False),   # nothing to take
    (True, False, True, False),     # the convolution's output is used again: left as it is
])
def test_backend_takes_the_convolution_bias(bias, embedding, second_user, taken, device):
    torch.manual_seed(0)
    module = ConvNorm(bias, embedding, second_user).to(device)
    backend = Recording()
    h, emb = torch.randn(2, 4, 6, 5, device=device), torch.randn(2, 8, device=device)
    compile_and_compare(module, [h, emb], backend, atol=1e-4, rtol=1e-4)
    assert backend.fusions == [1]
    assert ("input_bias" in backend.code[0]) == taken, backend.code[0]
    # The convolution runs without its bias; the embedding's add is gone.
    conv = backend.code[0].split("torch.conv2d(")[1].split(")")[0]
    assert (conv.split(", ")[2] == "None") == (taken or not bias), conv
    if taken and embedding:
        assert "x = x +" not in backend.code[0] and "add = x +" not in backend.code[0], backend.code[0]


def test_backend_prologue_without_epilogue():
    # A norm with no step after it is fused for its prologue alone.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(2, 8))
    backend = Recording()
    compile_and_compare(module, [torch.randn(2, 3, 4, 4)], backend)
    assert backend.fusions == [1] and "input_bias" in backend.code[0]


@pytest.mark.parametrize("embedding, height, taken", [
    (False, 6, 1),      # conv(h, w, b) -> norm: the input is no elementwise op; the bias is taken
    (True, 6, 0),       # conv(h, w, b) + e, under 8 MiB: Inductor's own norm kernels compute the add
    (True, 512, 1),     # 8 MiB: the fused op, with b + e as its input_bias
])
def test_before_inductor(embedding, height, taken):
    counts, codes = [], []

    def inner(gm, example_inputs):
        counts.append(fusion.fuse_graph(gm, leave_to_inductor=True))
        codes.append(gm.code)
        return gm.forward

    torch.manual_seed(0)
    module = ConvNorm(bias=True, embedding=embedding)
    h, emb = torch.randn(2, 4, height, 256 if height > 6 else 5), torch.randn(2, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(module, backend=inner, dynamic=False)(h, emb), module(h, emb),
                                   atol=1e-4, rtol=1e-4)
    assert counts == [taken]
    assert ("input_bias" in codes[0]) == bool(taken), codes[0]


@pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")
def test_torchscript_and_export():
    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fusednorm.group_norm(x, 4, activation="silu", input_bias=b)

    class Module(nn.Module):
        def forward(self, x, b):
            return f(x, b)

    torch.manual_seed(0)
    x, b = torch.randn(2, 8, 4, 4), torch.randn(2, 8)
    want = F.silu(F.group_norm(x + b[:, :, None, None], 4))
    torch.testing.assert_close(torch.jit.script(f)(x, b), want, atol=1e-5, rtol=1e-5)
    if not hasattr(torch, "export"):
        return
    program = torch.export.export(Module(), (x, b))
    assert any("input_bias" in str(n.kwargs) or len(n.args) > 11 for n in program.graph.nodes
               if n.op == "call_function" and "fusednorm" in str(n.target)), program.graph
    torch.testing.assert_close(program.module()(x, b), want, atol=1e-5, rtol=1e-5)
