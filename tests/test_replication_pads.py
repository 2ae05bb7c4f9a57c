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
    # function calls, with an eager backend, may be routed_pads; Inductor's code calls ATen's kernels).
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
