"""fusednorm.replication_pads(): inside the block, F.pad(x, padding, mode="replicate") runs
fusednorm's replication pad (the same values bit for bit, and the strides of ATen's pad but where
ATen's CUDA pad drops an input's channels_last_3d); every other call,
and every call outside the block, under deterministic algorithms or under torch.compile, runs as
it was made. On the CPU the routing is checked by widening the devices it takes (the op is then
ATen's pad); on a GPU, as users run it."""

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import _replication_pads


def same(got, want):
    return torch.equal(got, want) and got.stride() == want.contiguous(
        memory_format=torch._prims_common.suggest_memory_format(want)).stride()


@pytest.mark.parametrize("shape, call", [
    ((2, 3, 4, 5, 6), lambda x: F.pad(x, (1, 1, 1, 1, 2, 0), mode="replicate")),  # a causal 3-D convolution's
    ((2, 3, 4), lambda x: F.pad(x, [1, 2], "replicate")),                          # positional mode, 1-d
    ((3, 4, 5), lambda x: F.pad(input=x, pad=(0, 3, 2, 1), mode="replicate")),     # keywords, 2-d unbatched
    ((2, 3, 4, 5, 6), lambda x: torch._C._nn.pad(x, (1, 1, 1, 1, 2, 0), "replicate", None)),
    ((2, 3, 4, 5, 6), lambda x: F.pad(x.transpose(1, 2), (1, 1, 1, 1, 2, 0), mode="replicate")),  # strided
])
def test_replicate_pads_are_routed(shape, call, routed_pads, device):
    x = torch.randn(shape, device=device)
    want = call(x)
    with fusednorm.replication_pads():
        got = call(x)
    assert same(got, want) and len(routed_pads) == 1


def test_channels_last_3d_input_keeps_its_format(routed_pads, device):
    # ATen's CUDA pad returns it contiguous (its CPU pad keeps the format): values compared alone.
    x = torch.randn(1, 8, 3, 4, 5, device=device).to(memory_format=torch.channels_last_3d)
    with fusednorm.replication_pads():
        got = F.pad(x, (1, 1, 1, 1, 2, 0), mode="replicate")
    assert torch.equal(got, F.pad(x, (1, 1, 1, 1, 2, 0), mode="replicate")) and len(routed_pads) == 1
    assert got.is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("call", [
    lambda x: F.pad(x, (1, 1), mode="constant", value=2.0),
    lambda x: F.pad(x, (1, 1)),
    lambda x: F.pad(x, (1, 1), mode="reflect"),
    lambda x: F.pad(x, (1, 1), mode="circular"),
    lambda x: torch.sin(x),
])
def test_other_calls_run_as_made(call, routed_pads, device):
    x = torch.randn(2, 3, 4, device=device)
    with fusednorm.replication_pads():
        got = call(x)
    assert torch.equal(got, call(x)) and not routed_pads


def test_errors_are_f_pads(routed_pads, device):
    x = torch.randn(2, 3, 4, device=device)
    with pytest.raises(Exception) as want:
        F.pad(x, (1, 1), mode="replicate", value=1.0)
    with fusednorm.replication_pads(), pytest.raises(type(want.value)) as got:
        F.pad(x, (1, 1), mode="replicate", value=1.0)
    assert str(got.value) == str(want.value)
    with pytest.raises(Exception) as want:
        F.pad(x, (1, 1, 1), mode="replicate")
    with fusednorm.replication_pads(), pytest.raises(type(want.value)) as got:
        F.pad(x, (1, 1, 1), mode="replicate")
    assert str(got.value) == str(want.value)


def test_only_inside_the_block(routed_pads, device):
    x = torch.randn(2, 3, 4, device=device)
    with fusednorm.replication_pads():
        with fusednorm.replication_pads():  # nested
            F.pad(x, (1, 1), mode="replicate")
        F.pad(x, (1, 1), mode="replicate")
    F.pad(x, (1, 1), mode="replicate")
    assert len(routed_pads) == 2


def test_gradients(routed_pads, device):
    x = torch.randn(2, 3, 4, 5, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 5, 9, device=device, dtype=torch.float64)
    (want,) = torch.autograd.grad((F.pad(x, (2, 2, 1, 0), mode="replicate") * w).sum(), x)
    with fusednorm.replication_pads():
        (got,) = torch.autograd.grad((F.pad(x, (2, 2, 1, 0), mode="replicate") * w).sum(), x)
    torch.testing.assert_close(got, want)
    assert len(routed_pads) == 1


def test_not_under_deterministic_algorithms(routed_pads, device):
    x = torch.randn(2, 3, 4, device=device)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with fusednorm.replication_pads():
            got = F.pad(x, (1, 1), mode="replicate")
    finally:
        torch.use_deterministic_algorithms(saved)
    assert torch.equal(got, F.pad(x, (1, 1), mode="replicate")) and not routed_pads


def test_compiled_code_inside_the_block(routed_pads, device):
    # Code Dynamo compiled runs as it would outside the block: the same values (its torch
    # function calls, with an eager backend, may be routed; Inductor's code calls ATen's kernels).
    x = torch.randn(2, 3, 4, device=device)
    pad = torch.compile(lambda t: F.pad(t, (1, 1), mode="replicate") * 2, backend="eager")
    torch._dynamo.reset()
    with fusednorm.replication_pads():
        got = pad(x)
    torch.testing.assert_close(got, F.pad(x, (1, 1), mode="replicate") * 2)


def test_a_module_under_convert(routed_pads, device):
    # What a video VAE's causal convolution does after a converted norm and SiLU.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.GroupNorm(2, 8), torch.nn.SiLU()).to(device)
    conv = torch.nn.Conv3d(8, 8, 3).to(device)
    x = torch.randn(1, 8, 3, 4, 5, device=device)
    with torch.no_grad():
        want = conv(F.pad(model(x), (1, 1, 1, 1, 2, 0), mode="replicate"))
        model = fusednorm.convert(model)
        with fusednorm.replication_pads():
            got = conv(F.pad(model(x), (1, 1, 1, 1, 2, 0), mode="replicate"))
    torch.testing.assert_close(got, want)
    assert len(routed_pads) == 1


class CausalConv(torch.nn.Module):
    """A causal convolution that pads in its own forward, as diffusers' video VAEs' do."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(3, 4, 3)

    def forward(self, x):
        return self.conv(F.pad(x, (1, 1, 1, 1, 2, 0), mode="replicate"))


def test_padded_forward_class(routed_pads, device):
    # What convert gives diffusers' causal convolutions: their forward inside the block, the rest
    # of the model outside it; one class a class, pickled and copied as itself.
    import copy
    import inspect
    import pickle

    torch.manual_seed(0)
    module = CausalConv().to(device)
    x = torch.randn(2, 3, 4, 5, 6, device=device)
    with torch.no_grad():
        want = module(x)
        assert routed_pads == []
        padded = _replication_pads.padded_forward_class(CausalConv)
        assert padded is _replication_pads.padded_forward_class(CausalConv) and issubclass(padded, CausalConv)
        assert padded.__name__ == "CausalConvWithReplicationPads"
        assert inspect.signature(padded.forward) == inspect.signature(CausalConv.forward)
        module.__class__ = padded
        assert torch.equal(module(x), want) and routed_pads == [(2, 3, 6, 7, 8)]
        F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate")  # outside the module's forward
        assert len(routed_pads) == 1
        for again in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
            assert type(again) is padded and torch.equal(again(x), want)
        assert len(routed_pads) == 3
        torch._dynamo.reset()
        compiled = torch.compile(module, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), want) and len(routed_pads) == 3  # Dynamo traces F.pad as written


def test_padded_conv_class(routed_pads, device):
    # What convert gives torch's convolutions of padding_mode "replicate" (Kandinsky KVAE's): their
    # pad on fusednorm's op, the convolution unpadded after it; the rest as torch's.
    import copy
    import pickle

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "1d": torch.nn.Conv1d(3, 4, 3, padding=1, padding_mode="replicate"),
        "2d": torch.nn.Conv2d(3, 4, 3, padding=(2, 1), stride=2, padding_mode="replicate"),
        "3d": torch.nn.Conv3d(3, 4, 3, padding=1, padding_mode="replicate"),
        "zeros": torch.nn.Conv2d(3, 4, 3, padding=1),
    }).to(device)
    inputs = {"1d": torch.randn(2, 3, 7, device=device), "2d": torch.randn(2, 3, 6, 5, device=device),
              "3d": torch.randn(2, 3, 4, 5, 6, device=device), "zeros": torch.randn(2, 3, 6, 5, device=device)}
    reference = copy.deepcopy(model)
    fusednorm.convert(model)
    assert [type(m).__name__ for m in model.values()] == [
        "Conv1dWithReplicationPads", "Conv2dWithReplicationPads", "Conv3dWithReplicationPads", "Conv2d"]
    assert all(isinstance(m, type(reference[k])) for k, m in model.items())

    def outputs(m):
        return [m[k](x) for k, x in inputs.items()]

    with torch.no_grad():
        want = outputs(reference)
        assert routed_pads == []
        assert all(torch.equal(a, b) for a, b in zip(outputs(model), want))
        assert routed_pads == [(2, 3, 9), (2, 3, 10, 7), (2, 3, 6, 7, 8)]
        for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert type(again["2d"]) is type(model["2d"]) and torch.equal(again["2d"](inputs["2d"]), want[1])
        # torch.jit.script scripts them as torch's own class, ATen's pads.
        scripted = torch.jit.script(model["3d"])
        assert torch.equal(scripted(inputs["3d"]), want[2]) and len(routed_pads) == 5
        # Compiled, they are torch's convolutions as written: Dynamo traces _conv_forward's torch
        # branch, F.pad. (Before torch.compiler.is_compiling, torch 2.1-2.2, AOTAutograd runs the
        # module again on plain functional tensors, where the op goes into the graph, its values
        # the same.)
        torch._dynamo.reset()
        compiled = torch.compile(model["2d"], backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(inputs["2d"]), want[1])
        if _replication_pads._IS_COMPILING is not None:
            assert len(routed_pads) == 5
    # Gradients through the routed pad are ATen's pad's (a call that records a graph is ATen's).
    x = inputs["2d"].clone().requires_grad_()
    y = inputs["2d"].clone().requires_grad_()
    model["2d"](x).square().sum().backward()
    reference["2d"](y).square().sum().backward()
    assert torch.equal(x.grad, y.grad) and torch.equal(model["2d"].weight.grad, reference["2d"].weight.grad)
