"""The fusion backend's layout pass (fusednorm/_conv3d_layout.py): the 3-D convolutions of an
inference graph get channels_last_3d weights, the 5-D concatenations channels_last_3d inputs, the
`.contiguous()` calls before ops that take any layout are dropped, and the graph computes what it
computed. On the CPU the pass is run on float32 graphs by widening the devices and dtypes it
takes; on a GPU, as the backend runs it, before Inductor."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fusednorm.nn as fnn
from fusednorm import _conv3d_layout, fusion

if _conv3d_layout._force_stride_order() is None:
    pytest.skip("this torch has no prims.inductor_force_stride_order (the pass is a no-op)",
                allow_module_level=True)
if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 2):
    pytest.skip("Dynamo keeps nn.Conv3d a module call before torch 2.2: the pass finds no convolution "
                "(docs/design.md, \"3-D convolutions in channels_last_3d\", its limits)", allow_module_level=True)


class Upsampler(nn.Module):
    """What a causal video VAE's decoder does around its 3-D convolutions (HunyuanVideo's
    upsampler and resnet): frames split, the first upsampled in 2-D, the others in 3-D, the two
    concatenated, then a replication pad and a convolution; a norm, SiLU, pad, convolution."""

    def __init__(self, channels=8):
        super().__init__()
        self.up_conv = nn.Conv3d(channels, channels, 3)
        self.norm = nn.GroupNorm(2, channels)
        self.conv = nn.Conv3d(channels, channels, 3)

    def forward(self, h):
        first, others = h.split((1, h.size(2) - 1), dim=2)
        first = F.interpolate(first.squeeze(2), scale_factor=(2, 2), mode="nearest").unsqueeze(2)
        others = F.interpolate(others.contiguous(), scale_factor=(2, 2, 2), mode="nearest")
        h = self.up_conv(F.pad(torch.cat((first, others), dim=2), (1, 1, 1, 1, 2, 0), mode="replicate"))
        h = h.contiguous()
        return self.conv(F.pad(F.silu(self.norm(h)), (1, 1, 1, 1, 2, 0), mode="replicate")) + h


class Flattens(Upsampler):
    """A `.contiguous()` before a view, which needs it: the pass keeps it."""

    def forward(self, h):
        h = self.up_conv(F.pad(h, (1, 1, 1, 1, 2, 0), mode="replicate")).contiguous()
        return h.view(h.size(0), h.size(1), -1)


class FramesOfAVideo(nn.Module):
    """Mochi's resnet after its upsampler: an NCDHW video from a depth-to-space (in time here),
    its frames normalized a few at a time, SiLU, pad, convolution, and the residual."""

    def __init__(self, channels=8):
        super().__init__()
        self.norm = nn.GroupNorm(2, channels)
        self.conv = nn.Conv3d(channels, channels, 3)

    def forward(self, h):
        n, c, t, height, width = h.shape
        h = h.view(n, c // 2, 2, t, height, width).permute(0, 1, 3, 2, 4, 5).contiguous()
        h = h.view(n, c // 2, t * 2, height, width)
        frames = h.permute(0, 2, 1, 3, 4).flatten(0, 1)
        y = torch.cat([self.norm(f) for f in frames.split(2)], dim=0)
        y = F.silu(y.unflatten(0, (n, -1)).permute(0, 2, 1, 3, 4))
        return self.conv(F.pad(y, (1, 1, 1, 1, 2, 0), mode="replicate")) + h


class FrameNormOfAVideo(FramesOfAVideo):
    """The same after fusednorm.convert: a FrameGroupNorm, the SiLU folded into it."""

    def __init__(self, channels=8):
        super().__init__(channels)
        self.frame_norm = fnn.FrameGroupNorm(2, channels, activation="silu")

    def forward(self, h):
        n, c, t, height, width = h.shape
        h = h.view(n, c // 2, 2, t, height, width).permute(0, 1, 3, 2, 4, 5).contiguous()
        h = h.view(n, c // 2, t * 2, height, width)
        return self.conv(F.pad(self.frame_norm(h), (1, 1, 1, 1, 2, 0), mode="replicate")) + h


class WeightStrides(fx.Interpreter):
    """Runs a graph, recording the strides of each 3-D convolution's weight."""

    def __init__(self, gm):
        super().__init__(gm)
        self.strides = []

    def call_function(self, target, args, kwargs):
        if target in (F.conv3d, torch.conv3d):
            self.strides.append(args[1].stride())
        return super().call_function(target, args, kwargs)


def capture(module, x):
    """The graph Dynamo captures of module(x) under no_grad, and its inputs (x and, where Dynamo
    inlines the modules, their parameters)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=keep)(x)
    assert len(graphs) == 1
    return graphs[0]


def cpu_float32(monkeypatch):
    monkeypatch.setattr(_conv3d_layout, "_DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(_conv3d_layout, "_DTYPES", (torch.float32, torch.float16, torch.bfloat16))


def test_weights_and_concatenation_inputs(monkeypatch):
    cpu_float32(monkeypatch)
    torch.manual_seed(0)
    module = Upsampler().eval()
    x = torch.randn(1, 8, 3, 4, 5)
    gm, inputs = capture(module, x)
    before = WeightStrides(gm)
    with torch.no_grad():
        (want,) = before.run(*inputs)
    assert _conv3d_layout.channels_last_3d_convolutions(gm) == 2
    forced = [n for n in gm.graph.nodes if n.target is _conv3d_layout._force_stride_order()]
    assert len(forced) == 5  # two weights, the two concatenated tensors, the output
    assert ".contiguous(" not in gm.code  # (its users take any layout)
    after = WeightStrides(gm)
    with torch.no_grad():
        (got,) = after.run(*inputs)
    cl3d = [w.contiguous(memory_format=torch.channels_last_3d).stride() for w in (module.up_conv.weight, module.conv.weight)]
    assert before.strides == [w.stride() for w in (module.up_conv.weight, module.conv.weight)] != cl3d
    assert after.strides == cl3d
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.stride() == want.stride()


def test_weights_already_channels_last_3d(monkeypatch):
    # A model the user converted: its weights stay as they are, the concatenation is still laid out.
    cpu_float32(monkeypatch)
    module = Upsampler().eval().to(memory_format=torch.channels_last_3d)
    x = torch.randn(1, 8, 3, 4, 5).to(memory_format=torch.channels_last_3d)
    gm, _ = capture(module, x)
    assert _conv3d_layout.channels_last_3d_convolutions(gm) == 2
    assert sum(n.target is _conv3d_layout._force_stride_order() for n in gm.graph.nodes) == 3  # cat inputs, output


def test_contiguous_before_a_view_kept(monkeypatch):
    cpu_float32(monkeypatch)
    module = Flattens().eval()
    x = torch.randn(1, 8, 3, 4, 5)
    gm, inputs = capture(module, x)
    assert _conv3d_layout.channels_last_3d_convolutions(gm) == 1
    assert gm.code.count(".contiguous(") == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], module(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("module, view, view_args, chains", [
    (FramesOfAVideo, "permute", (0, 2, 1, 3, 4), 1),  # Mochi's norms, fused by the backend first
    (FrameNormOfAVideo, "transpose", (1, 2), 0),      # a converted model's FrameGroupNorm
])
def test_normalized_frames_of_a_video(module, view, view_args, chains, monkeypatch):
    # The video whose frames a fused norm takes is asked for in channels_last_3d, so that the
    # norm's output, viewed back into a video, is channels_last_3d for the pad and convolution.
    cpu_float32(monkeypatch)
    torch.manual_seed(0)
    module = module().eval()
    x = torch.randn(1, 16, 3, 4, 5)
    gm, inputs = capture(module, x)
    with torch.no_grad():
        (want,) = gm(*inputs)
    assert fusion.fuse_graph(gm) == chains
    assert _conv3d_layout.channels_last_3d_convolutions(gm) == 1
    force = _conv3d_layout._force_stride_order()
    views = [n for n in gm.graph.nodes if n.target == view and n.args[0].target is force]
    assert len(views) == 1 and views[0].args[1:] == view_args
    with torch.no_grad():
        (got,) = gm(*inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, module(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["float32", "no 3-D convolution"])
def test_left_alone(case, monkeypatch):
    monkeypatch.setattr(_conv3d_layout, "_DEVICE_TYPES", ("cpu", "cuda"))
    if case == "float32":  # (on the GPU too: cuDNN's NDHWC convolutions were measured in half precision)
        module, x = Upsampler().eval(), torch.randn(1, 8, 3, 4, 5)
    else:
        module, x = nn.Conv2d(8, 8, 3).to(torch.bfloat16), torch.randn(1, 8, 5, 6, dtype=torch.bfloat16)
    gm, _ = capture(module, x)
    code = gm.code
    assert _conv3d_layout.channels_last_3d_convolutions(gm) == 0
    assert gm.code == code


def backend_with_aot_eager(**kwargs):
    """fusion.backend() as with Inductor (the pass runs), compiling with aot_eager (no Inductor
    compile on the CPU)."""
    backend = fusion.backend(**kwargs)
    backend.inner = "aot_eager"
    return backend


@pytest.mark.parametrize("grad", ["no_grad", "frozen", "training"])
def test_backend_runs_it_on_inference_graphs(grad, monkeypatch):
    cpu_float32(monkeypatch)
    torch.manual_seed(0)
    module = Upsampler().eval()
    if grad == "frozen":
        module.requires_grad_(False)
    x = torch.randn(1, 8, 3, 4, 5)
    want = module(x)
    backend = backend_with_aot_eager()
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad != "no_grad"):
        got = torch.compile(module, backend=backend)(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The prim the pass inserts has no backward: a graph that may need one is left alone.
    assert backend.channels_last_3d_convolutions == [0 if grad == "training" else 2]
    assert backend.fusions == [1]
    off = backend_with_aot_eager(conv3d_channels_last=False)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=off)(x)
    assert off.channels_last_3d_convolutions == [0]
    assert not fusion.backend("aot_eager").leave_to_inductor  # (the pass is for Inductor alone)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("module", ["upsampler", "frames of a video"])
def test_inductor_on_the_gpu(dtype, layout, module):
    torch.manual_seed(0)
    frames = module == "frames of a video"
    module = (FramesOfAVideo(channels=32) if frames else Upsampler(channels=32)).cuda().to(dtype).eval()
    x = torch.randn(1, 64 if frames else 32, 3, 12, 10, device="cuda", dtype=dtype)
    if layout == "channels_last_3d":
        module, x = module.to(memory_format=torch.channels_last_3d), x.to(memory_format=torch.channels_last_3d)
    backend = fusion.backend()
    torch._dynamo.reset()
    with torch.no_grad():
        want = module(x)
        got = torch.compile(module, backend=backend)(x)
    assert backend.channels_last_3d_convolutions == [1 if frames else 2] and backend.fusions == [1]
    assert got.stride() == want.stride()  # (Inductor gives a graph output eager's strides)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
