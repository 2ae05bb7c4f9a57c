"""The fusion backend's rewrites of per-frame group norms (fusednorm/_frame_norms.py):
``torch.cat([group_norm(c) for c in y.split(k)])`` becomes ``group_norm(y)``, an activation after
views of a group norm moves before them, and the norm and activation are then fused; every other
concatenation of norms, and an activation whose views are used twice, is left as it is; any chain
of views between a norm and its activation (hypothesis) gives the same values, fused."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fusednorm import fusion
from fusednorm._frame_norms import activations_before_views, one_norm_of_frames
from fusednorm._module_calls import lower_module_calls
from test_convert import float32_convolutions, import_or_skip  # noqa: F401 (a fixture)


class FrameNorms(nn.Module):
    """Mochi's chunked per-frame group norm, SiLU and causal pad (or a variant the rewrite must leave)."""

    def __init__(self, case="mochi", channels=8, chunk=2):
        super().__init__()
        self.case, self.chunk = case, chunk
        self.norm, self.other = nn.GroupNorm(4, channels), nn.GroupNorm(4, channels)

    def forward(self, x):
        n, case = x.size(0), self.case
        y = x.permute(0, 2, 1, 3, 4).flatten(0, 1)
        chunks = y.split(self.chunk, dim=0)
        norms = [self.norm(c) for c in chunks]
        if case == "other_weights":  # the last chunk normalized with other parameters
            norms[-1] = self.other(chunks[-1])
        if case == "reordered":  # the chunks concatenated out of order
            norms = norms[::-1]
        if case == "missing":  # a chunk left out
            norms = norms[:-1]
        z = torch.cat(norms, dim=0)
        if case == "chunk_reused":  # a chunk used again
            z = z + chunks[0].sum()
        z = z.unflatten(0, (n, -1)).permute(0, 2, 1, 3, 4)
        if case == "in_place":  # an in-place activation on the view: stays after it
            return F.pad(F.silu(z, inplace=True), (1, 1, 1, 1, 2, 0), mode="replicate")
        return F.pad(F.silu(z), (1, 1, 1, 1, 2, 0), mode="replicate")


class FramesInOneCall(nn.Module):
    """EasyAnimate's and Cosmos's per-frame group norm (all frames in one call), SiLU and a pad
    (or a variant the rewrite must leave)."""

    def __init__(self, case="easyanimate", channels=8):
        super().__init__()
        self.case, self.norm = case, nn.GroupNorm(4, channels)

    def forward(self, x):
        z = self.norm(x.permute(0, 2, 1, 3, 4).flatten(0, 1)).unflatten(0, (x.size(0), -1))
        v = z.permute(0, 2, 1, 3, 4)
        if self.case == "view_reused":  # a view used again: the activation stays after the views
            return F.silu(v) + z.sum()
        if self.case == "gelu_tanh":  # another activation, a constant argument
            return F.gelu(v, approximate="tanh")
        return F.pad(F.silu(v), (1, 1, 1, 1, 2, 0), mode="replicate")


def rewrite(module, x, first=one_norm_of_frames):
    """(norms `first` rewrote, fused chains, activations in the graph after) of module's graph,
    compiled through fuse_graph, checked against eager."""
    seen = []

    def backend(gm, example_inputs):
        lower_module_calls(gm)  # the backend's first step (module calls on torch < 2.2)
        seen.append(first(gm))
        seen.append(fusion.fuse_graph(gm))
        seen.append(sum(n.target in (F.silu, F.gelu) for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(module, backend=backend, dynamic=False)(x.clone()), module(x.clone()))
    return tuple(seen)


@pytest.mark.parametrize("frames, chunk", [(5, 2), (4, 2), (3, 8), (6, 1)])
def test_chunked_frame_norms_become_one_fused_norm(frames, chunk):
    # One norm, fused with its SiLU (fuse_graph's own call of the rewrite then finds nothing to do).
    x = torch.randn(2, 8, frames, 5, 6)
    assert rewrite(FrameNorms("mochi", chunk=chunk), x) == (1, 1, 0)


@pytest.mark.parametrize("case", ["other_weights", "reordered", "missing", "chunk_reused"])
def test_other_concatenations_of_norms_are_left(case):
    x = torch.randn(2, 8, 5, 5, 6)
    taken, fused, silus = rewrite(FrameNorms(case), x)
    assert (taken, fused, silus) == (0, 0, 1)


def test_in_place_activation_stays_after_the_views():
    taken, fused, silus = rewrite(FrameNorms("in_place"), torch.randn(1, 8, 4, 5, 6))
    assert taken == 1 and fused == 0 and silus == 1


@pytest.mark.parametrize("case, moved", [("easyanimate", 1), ("gelu_tanh", 1), ("view_reused", 0)])
def test_activation_after_views_of_a_norm_moves_before_them(case, moved):
    x = torch.randn(2, 8, 3, 5, 6)
    assert rewrite(FramesInOneCall(case), x, lambda gm: activations_before_views(gm, fusion._ACTIVATIONS)) \
        == (moved, moved, 1 - moved)


def test_backward_through_the_rewrite():
    module = FrameNorms("mochi")
    x = torch.randn(2, 8, 5, 5, 6, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=fusion.backend("aot_eager"))
    got = compiled(x)
    (g_x, g_w), want = torch.autograd.grad(got.square().sum(), (x, module.norm.weight)), module(x)
    w_x, w_w = torch.autograd.grad(want.square().sum(), (x, module.norm.weight))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_x, w_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_w, w_w, atol=1e-4, rtol=1e-4)


def test_backward_through_the_moved_activation():
    module = FramesInOneCall()
    x = torch.randn(2, 8, 3, 5, 6, requires_grad=True)
    torch._dynamo.reset()
    backend = fusion.backend("aot_eager")
    got = torch.compile(module, backend=backend)(x)
    (g_x, g_w), want = torch.autograd.grad(got.square().sum(), (x, module.norm.weight)), module(x)
    w_x, w_w = torch.autograd.grad(want.square().sum(), (x, module.norm.weight))
    assert backend.fusions == [1]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_x, w_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_w, w_w, atol=1e-4, rtol=1e-4)


def test_diffusers_mochi_resnet_block(device, float32_convolutions):
    mochi = import_or_skip("diffusers.models.autoencoders.autoencoder_kl_mochi")
    torch.manual_seed(0)
    block = mochi.MochiResnetBlock3D(32).to(device).eval()
    backend = fusion.backend("aot_eager")
    x = torch.randn(1, 32, 10, 6, 6, device=device)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lambda h: block(h)[0], backend=backend)(x)
        torch.testing.assert_close(got, block(x)[0], atol=1e-4, rtol=1e-4)
    assert backend.fusions == [2]  # norm1 + SiLU, norm2 + SiLU


_VIEWS = ("transpose", "permute", "flatten", "unflatten", "reshape")
_ACTS = (F.silu, F.relu, F.mish, functools.partial(F.gelu, approximate="tanh"),
         functools.partial(F.leaky_relu, negative_slope=0.2))


class ViewsThenActivation(nn.Module):
    """group_norm(x), views drawn by `draws` (an index a view), then an activation."""

    def __init__(self, draws, act):
        super().__init__()
        self.draws, self.act = draws, act

    def forward(self, x):
        y = F.group_norm(x, 2, eps=1e-5)
        for kind, k in self.draws:
            dims = y.dim()
            if kind == "transpose":
                y = y.transpose(k % dims, (k + 1) % dims)
            elif kind == "permute":
                y = y.permute(*reversed(range(dims)))
            elif kind == "flatten" and dims > 2:
                y = y.flatten(k % (dims - 1), k % (dims - 1) + 1)
            elif kind == "unflatten" and y.shape[k % dims] % 2 == 0:
                y = y.unflatten(k % dims, (2, -1))
            elif kind == "reshape":
                y = y.reshape(-1, y.shape[-1])
        return self.act(y)


@given(draws=st.lists(st.tuples(st.sampled_from(_VIEWS), st.integers(0, 4)), min_size=1, max_size=4),
       act=st.sampled_from(_ACTS), shape=st.sampled_from([(2, 4, 3, 6, 5), (1, 6, 4, 5), (3, 4, 10)]))
@settings(max_examples=15)
def test_an_activation_moves_before_any_views(draws, act, shape):
    # The same values, and the norm and its activation fused as one op, whatever views lie between.
    module = ViewsThenActivation(draws, act)
    x = torch.randn(shape)
    backend = fusion.backend("aot_eager")
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(module, backend=backend, dynamic=False)(x), module(x))
    assert backend.fusions == [1]
