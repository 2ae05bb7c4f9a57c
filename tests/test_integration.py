"""The ops inside real pipelines: torch.compile, TorchScript tracing, torch.export and AOTInductor,
each artifact saved and reloaded (in a fresh process where that is what deployment does)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import fusednorm
from reference import to_layout

HAS_EXPORT_SAVE = hasattr(torch, "export") and hasattr(torch.export, "save") and hasattr(torch.export, "Dim")
HAS_AOTI_PACKAGE = hasattr(torch._inductor, "aoti_compile_and_package")


class Block(torch.nn.Module):
    """A diffusion-style block: GroupNorm + scale/shift + SiLU fused, a conv, InstanceNorm with
    running stats and a fused residual add, plain GroupNorm + SiLU."""

    def __init__(self, channels=8):
        super().__init__()
        self.norm1 = fusednorm.nn.GroupNorm(4, channels, activation="silu")
        self.emb = torch.nn.Linear(channels, 2 * channels)
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = fusednorm.nn.InstanceNorm2d(channels, affine=True, track_running_stats=True)
        self.norm3 = fusednorm.nn.GroupNorm(2, channels)

    def forward(self, x):
        scale, shift = self.emb(x.mean(dim=(2, 3))).chunk(2, dim=1)
        h = self.conv(self.norm1(x, scale=scale, shift=shift))
        return F.silu(self.norm3(self.norm2(h, residual=x)))


def functional_pipeline(x, w, b):
    y = fusednorm.group_norm(x, 4, w, b)
    z = fusednorm.group_norm(x, 2, w, None, activation="gelu", residual=y, scale=w[None].expand(x.shape[0], -1))
    return fusednorm.instance_norm(y * 2, weight=w, bias=b, activation="leaky_relu", negative_slope=0.2,
                                   multiplier=z) + y


@pytest.fixture
def no_tf32():
    # cuDNN convolutions default to TF32 (~1e-3 relative): compiled and eager convolutions may then
    # pick different algorithms and differ by more than the comparison allows.
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def run_fresh_process(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_compile_fullgraph_forward_backward(device, dynamic, layout):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(functional_pipeline, fullgraph=True, dynamic=dynamic, backend=counter)
    w = torch.randn(8, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    shapes = [(2, 8, 6, 5), (3, 8, 7, 9), (5, 8, 4, 11)]
    compiles_after_first_call = None
    for shape in shapes:
        x = to_layout(torch.randn(shape, device=device), layout).requires_grad_()
        out = compiled(x, w, b)
        ref = functional_pipeline(x, w, b)
        torch.testing.assert_close(out, ref)
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, (x, w, b), g)
        want = torch.autograd.grad(ref, (x, w, b), g)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e)
        if compiles_after_first_call is None:
            compiles_after_first_call = counter.frame_count
    if dynamic:
        # Batch and spatial sizes changed twice: no recompilation.
        assert counter.frame_count == compiles_after_first_call, "recompiled when sizes changed"


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_graphs_call_the_kernel_ops(device, dynamic):
    # AOTAutograd traces the C++ autograd (csrc/autograd.cpp): the forward graph calls the forward
    # kernel ops and the backward graph the backward ones, not the composed ATen path that serves
    # create_graph, forward-mode AD and the functorch transforms.
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    targets = []

    def backend(gm, example_inputs):
        def compiler(graph, _):
            targets.append({str(n.target) for n in graph.graph.nodes if n.op == "call_function"})
            return make_boxed_func(graph.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler)

    torch._dynamo.reset()
    compiled = torch.compile(functional_pipeline, fullgraph=True, dynamic=dynamic, backend=backend)
    w = torch.randn(8, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    x = torch.randn(2, 8, 6, 5, device=device, requires_grad=True)
    compiled(x, w, b).sum().backward()
    forward, backward = targets
    assert {"fusednorm.group_norm_forward.default", "fusednorm.fused_group_norm_forward.default"} <= forward
    assert {"fusednorm.group_norm_backward.default", "fusednorm.fused_group_norm_backward.default"} <= backward
    assert not any("native_group_norm" in t for t in forward | backward)


@pytest.mark.skipif(not hasattr(getattr(torch._dynamo, "compiled_autograd", None), "_enable"),
                    reason="compiled autograd needs a newer torch")
def test_compiled_autograd(device):
    # Compiled autograd (the backward of an eager forward captured by torch.compile) traces the C++
    # autograd nodes: it needs nodes without non-differentiable outputs (csrc/autograd.cpp returns
    # mean and rstd beside the Function). Gradients match the ordinary backward's.
    from torch._dynamo import compiled_autograd

    torch.manual_seed(26)
    x = torch.randn(2, 8, 6, 5, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    r = torch.randn(2, 8, 6, 5, device=device, requires_grad=True)
    m = torch.randn(2, 8, 6, 5, device=device, requires_grad=True)
    calls = {
        "plain": lambda: fusednorm.group_norm(x, 4, w, None),
        "fused": lambda: fusednorm.group_norm(x, 4, w, None, activation="silu", residual=r, multiplier=m),
        "instance": lambda: fusednorm.instance_norm(x, weight=w, activation="gelu"),
        # Problem 3's (h + y) * y: one tensor as residual and multiplier, one summed gradient.
        "residual is multiplier": lambda: fusednorm.group_norm(x, 4, w, None, residual=r, multiplier=r),
    }
    for name, call in calls.items():
        leaves = (x, w, r, m)
        dz = torch.randn_like(x)
        want = torch.autograd.grad(call(), leaves, dz, allow_unused=True)
        torch._dynamo.reset()
        out = call()
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            out.backward(dz)
        for leaf, g in zip(leaves, want):
            if g is None:
                assert leaf.grad is None, name
            else:
                torch.testing.assert_close(leaf.grad, g, msg=lambda msg: f"{name}: {msg}")
            leaf.grad = None


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_inductor_module_train_and_eval(device, dynamic, no_tf32):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Block().to(device)
    compiled_model = Block().to(device)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, dynamic=dynamic)
    for step in range(2):
        x = torch.randn(2 + step, 8, 6, 6, device=device, requires_grad=True)
        out, ref = compiled(x), eager(x)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        ref.sum().backward()
    for (name, p), (_, q) in zip(compiled_model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
    # Running statistics were updated through the compiled graph exactly as in eager.
    torch.testing.assert_close(compiled_model.norm2.running_mean, eager.norm2.running_mean)
    torch.testing.assert_close(compiled_model.norm2.running_var, eager.norm2.running_var)
    compiled_model.eval()
    eager.eval()
    x = torch.randn(2, 8, 6, 6, device=device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_cuda_modes(mode):
    torch._dynamo.reset()
    x = torch.randn(2, 8, 16, 16, device="cuda")
    w = torch.randn(8, device="cuda")
    b = torch.randn(8, device="cuda")
    compiled = torch.compile(functional_pipeline, mode=mode, fullgraph=True)
    for _ in range(3):  # reduce-overhead records a CUDA graph on the second or third call
        out = compiled(x, w, b)
    torch.testing.assert_close(out, functional_pipeline(x, w, b))


def test_jit_trace(device, tmp_path):
    model = Block().to(device).eval()
    x = torch.randn(2, 8, 6, 6, device=device)
    traced = torch.jit.trace(model, x)
    path = tmp_path / "traced.pt"
    torch.jit.save(traced, str(path))
    loaded = torch.jit.load(str(path))
    y = torch.randn(3, 8, 5, 7, device=device)
    torch.testing.assert_close(loaded(y), model(y))


@pytest.mark.skipif(not HAS_EXPORT_SAVE, reason="torch.export.save needs torch >= 2.2 (export.Dim, export.save)")
def test_export_dynamic_save_load_fresh_process(device, tmp_path):
    torch.manual_seed(0)
    model = Block().to(device).eval()
    x = torch.randn(2, 8, 6, 6, device=device)
    dims = {"x": {0: torch.export.Dim("batch"), 2: torch.export.Dim("h", min=2), 3: torch.export.Dim("w", min=2)}}
    ep = torch.export.export(model, (x,), dynamic_shapes=dims)
    decomposed = ep.run_decompositions()
    targets = {str(n.target) for n in decomposed.graph.nodes}
    assert "fusednorm.group_norm_forward.default" in targets, targets
    path = tmp_path / "block.pt2"
    torch.export.save(ep, str(path))
    other = torch.randn(3, 8, 9, 4, device=device)
    torch.save(other, str(tmp_path / "input.pt"))
    out = run_fresh_process(f"""
        import torch, fusednorm
        ep = torch.export.load({str(path)!r})
        x = torch.load({str(tmp_path / 'input.pt')!r})
        torch.save(ep.module()(x), {str(tmp_path / 'out.pt')!r})
        print("ok")
    """)
    assert "ok" in out
    with torch.no_grad():
        torch.testing.assert_close(torch.load(str(tmp_path / "out.pt")), model(other))


@pytest.mark.skipif(not HAS_EXPORT_SAVE, reason="torch.export.save needs torch >= 2.2 (export.Dim, export.save)")
def test_export_every_argument_kind_survives_serialization(device, tmp_path):
    """Optional tensors given and omitted, ints, floats and bools of every op, through save/load."""

    class AllArgs(torch.nn.Module):
        def forward(self, x, w, rm, rv):
            a = torch.ops.fusednorm.group_norm(x, 2, w, None, 1e-3)
            b = torch.ops.fusednorm.group_norm(x, 4, None, w, 0.5)
            y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, 2, w, w, 1e-4)
            c = torch.ops.fusednorm.instance_norm(x, rm, rv, w, None, False, 0.3, 1e-2)
            dx, dw, db = torch.ops.fusednorm.group_norm_backward(y, x, mean, rstd, w, 2, [True, False, True])
            # The fused ops: str and float epilogue arguments, operands given and omitted.
            s = w[None].expand(x.shape[0], -1)
            d = torch.ops.fusednorm.group_norm(x, 2, w, None, 1e-3, activation="mish", negative_slope=0.2,
                                               scale=s, residual=x)
            e = torch.ops.fusednorm.instance_norm(x, None, None, w, None, True, 0.3, 1e-2, activation=None,
                                                  shift=s, multiplier=x)
            z, m2, r2 = torch.ops.fusednorm.fused_group_norm_forward(x, 4, w, w, 1e-4, s, None, x, "leaky_relu", 0.3, x)
            grads = torch.ops.fusednorm.fused_group_norm_backward(
                z, x, m2, r2, w, w, 4, s, None, x, "leaky_relu", 0.3, x, [True, True, False, True, False, True, True])
            return (a, b, y, c, dx, db, d, e, z) + tuple(g for g in grads if g.numel() > 0)

    args = (torch.randn(2, 8, 5, device=device), torch.randn(8, device=device),
            torch.randn(8, device=device), torch.rand(8, device=device) + 0.5)
    ep = torch.export.export(AllArgs(), args)
    path = tmp_path / "allargs.pt2"
    torch.export.save(ep, str(path))
    loaded = torch.export.load(str(path)).module()
    for got, want in zip(loaded(*args), AllArgs()(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(not HAS_AOTI_PACKAGE, reason="AOTInductor packaging needs torch >= 2.6")
def test_aoti_package_fresh_process(device, tmp_path):
    torch.manual_seed(0)
    model = Block().to(device).eval()
    x = torch.randn(2, 8, 6, 6, device=device)
    dims = {"x": {0: torch.export.Dim("batch")}}
    ep = torch.export.export(model, (x,), dynamic_shapes=dims)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "block.pt2"))
    other = torch.randn(3, 8, 6, 6, device=device)
    torch.save(other, str(tmp_path / "input.pt"))
    run_fresh_process(f"""
        import torch, fusednorm  # the ops' library must be loaded before the package
        runner = torch._inductor.aoti_load_package({package!r})
        x = torch.load({str(tmp_path / 'input.pt')!r})
        torch.save(runner(x), {str(tmp_path / 'out.pt')!r})
    """)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(str(tmp_path / "out.pt")), model(other), atol=1e-5, rtol=1e-5)
