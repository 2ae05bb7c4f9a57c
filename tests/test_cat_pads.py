"""The fusion backend's rewrite of concatenations that are replication pads
(fusednorm/_cat_pads.py): ``torch.cat([x[:, :, :1]] * k + [x], dim=2)``, CogVideoX's causal time
padding, becomes the ``F.pad(x, ..., mode="replicate")`` it equals; every other concatenation is
left as it is, and the graph computes the same values, bitwise."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusednorm import fusion
from fusednorm._cat_pads import replication_pad_concatenations


def targets(gm):
    """The names of the functions a graph calls."""
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


def rewritten(fn, *inputs):
    """(how many concatenations the rewrite took, the names of the functions the rewritten graph
    calls) of fn's graph, after checking that it computes fn's values bitwise."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(replication_pad_concatenations(gm))
        seen.append(targets(gm))
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(fn, backend=backend, dynamic=False)(*inputs)
    torch.testing.assert_close(got, fn(*inputs), rtol=0, atol=0)
    return seen[0], seen[1]


@pytest.mark.parametrize("dim, k, rank", [(2, 2, 5), (2, 1, 5), (-3, 2, 5), (3, 3, 5), (4, 1, 5), (2, 2, 4),
                                          (3, 1, 4), (2, 2, 3), (-1, 1, 3)])
def test_first_copies_become_a_replication_pad(dim, k, rank):
    x = torch.randn((2, 3, 4, 5, 6)[:rank])
    index = (slice(None),) * (dim % rank) + (slice(None, 1),)
    taken, called = rewritten(lambda t: torch.cat([t[index]] * k + [t], dim=dim) * 2, x)
    assert taken == 1 and "pad" in called and "cat" not in called and "getitem" not in called


@pytest.mark.parametrize("case", ["other_tensor", "two_first", "last_copies", "copy_after", "dim_1", "batch_dim",
                                  "two_dim", "strided", "alone"])
def test_other_concatenations_are_left(case):
    x, y = torch.randn(2, 3, 4, 5, 6), torch.randn(2, 3, 4, 5, 6)

    def fn(t, u):
        if case == "other_tensor":  # copies of another tensor's first frame
            return torch.cat([u[:, :, :1], t], dim=2)
        if case == "two_first":  # two frames, not copies of one
            return torch.cat([t[:, :, :2], t], dim=2)
        if case == "last_copies":  # the last frame's copies
            return torch.cat([t[:, :, -1:], t], dim=2)
        if case == "copy_after":  # the copies after x: a pad at the end (not rewritten)
            return torch.cat([t, t[:, :, :1]], dim=2)
        if case == "dim_1":  # channels: F.pad's replicate mode pads no channels
            return torch.cat([t[:, :1], t], dim=1)
        if case == "batch_dim":
            return torch.cat([t[:1], t], dim=0)
        if case == "two_dim":  # the first row of the first frame only
            return torch.cat([t[:, :, :1, :1].expand(-1, -1, -1, 5, -1), t], dim=2)
        if case == "strided":  # every other frame
            return torch.cat([t[:, :, ::2], t], dim=2)
        return torch.cat([t], dim=2)

    taken, called = rewritten(fn, x, y)
    assert taken == 0 and "cat" in called


def test_trailing_full_slices():
    x = torch.randn(1, 2, 3, 4, 4)
    taken, called = rewritten(lambda t: torch.cat([t[:, :, 0:1, :, :], t[:, :, :1]] + [t], dim=2), x)
    assert taken == 1 and "cat" not in called


def test_slices_used_elsewhere_stay():
    x = torch.randn(1, 2, 3, 4, 4)
    taken, called = rewritten(lambda t: (torch.cat([t[:, :, :1]] * 2 + [t], dim=2), t[:, :, :1] + 1), x)
    assert taken == 1 and "cat" not in called and "getitem" in called


class CausalConv(nn.Module):
    """CogVideoX's causal convolution after its spatial norm: group_norm(f) * y + b, SiLU, the first
    frame twice before the frames, a 3-D convolution."""

    def __init__(self, channels=8):
        super().__init__()
        self.norm = nn.GroupNorm(2, channels)
        self.conv = nn.Conv3d(channels, channels, 3, padding=(0, 1, 1))

    def forward(self, f, y, b):
        h = F.silu(self.norm(f) * y + b)
        return self.conv(torch.cat([h[:, :, :1]] * 2 + [h], dim=2))


def test_backend_rewrites_before_inductor_only(monkeypatch):
    """The backend rewrites the concatenations when Inductor compiles next (and before its
    fusions); with another inner backend it leaves the graph's concatenations alone."""
    calls = []
    original = fusion.replication_pad_concatenations
    monkeypatch.setattr(fusion, "replication_pad_concatenations", lambda gm: calls.append(1) or original(gm))
    module = CausalConv()
    inputs = [torch.randn(1, 8, 3, 5, 5) for _ in range(3)]
    for inductor in (True, False):
        before = len(calls)
        backend = fusion.backend() if inductor else fusion.backend(lambda gm, example_inputs: gm.forward)
        if inductor:  # the backend as before Inductor, with the graph run as it is
            backend.inner = lambda gm, example_inputs: gm.forward
        torch._dynamo.reset()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(module, backend=backend)(*inputs), module(*inputs))
        assert len(calls) - before == (1 if inductor else 0)


@pytest.mark.cuda
def test_pad_after_a_fused_op_is_the_pad_kernel():
    """On CUDA, a fused chain's output padded so goes to fusednorm's replication pad kernel."""

    class NormPad(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 8)

        def forward(self, f):
            h = F.silu(self.norm(f))
            return torch.cat([h[:, :, :1]] * 2 + [h], dim=2)

    module = NormPad().cuda()
    f = torch.randn(1, 8, 3, 5, 5, device="cuda")
    backend = fusion.backend()
    called = []

    def inner(gm, example_inputs):
        called.extend(targets(gm))
        return gm.forward

    backend.inner = inner
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(module, backend=backend)(f), module(f))
    assert "group_norm.default" in called and "replication_pad.default" in called and "cat" not in called
