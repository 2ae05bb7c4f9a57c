"""fusednorm.convert's second folding rule: an activation module called in its parent's own
forward on norm outputs alone (ops/_forward_folds.py) is folded into those norms, with the same
results, forward and backward; every form the proof does not cover is left alone."""

import copy
import importlib.util
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fusednorm
import fusednorm.nn as fnn
from test_convert import (assert_equivalent, convert_and_check, float32_convolutions, import_or_skip,  # noqa: F401
                          tiny_autoencoder)


def folded(norm, activation="silu"):
    return type(norm) is fnn.GroupNorm and norm.activation == activation


class Block(nn.Module):
    """diffusers' ResnetBlock2D in small: the activation after norm1, on the embedding when
    there is a projection (unless skip_act), and after norm2 whose branch the mode picks."""

    def __init__(self, mode="default", proj=False, skip_act=False):
        super().__init__()
        self.mode = mode
        self.skip_act = skip_act
        self.norm1 = nn.GroupNorm(2, 8)
        self.norm2 = nn.GroupNorm(2, 8)
        self.act = nn.SiLU()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.proj = nn.Linear(4, 8) if proj else None

    def forward(self, x, emb=None):
        h = self.norm1(x)
        h = self.act(h)
        h = self.conv(h)
        if self.proj is not None:
            if not self.skip_act:
                emb = self.act(emb)
            h = h + self.proj(emb)[:, :, None, None]
        if self.mode == "default":
            h = self.norm2(h)
        elif self.mode == "scale":
            h = self.norm2(h)
            h = h * 2
        else:
            if emb is None:  # not known at conversion: both branches end with norm2
                h = self.norm2(h)
            else:
                h = self.norm2(h + 1)
        h = self.act(h)
        return x + h


@pytest.mark.parametrize("mode, proj, skip_act, folds, facts", [
    ("default", False, False, True, {("proj", None), ("mode", "default")}),
    ("join", False, False, True, {("proj", None), ("mode", "join")}),
    ("scale", False, False, False, None),  # norm2's output is scaled before the activation
    ("default", True, False, False, None),  # the activation also runs on the embedding
    ("default", True, True, True, {("skip_act", True), ("mode", "default")}),
])
def test_block_branches(device, mode, proj, skip_act, folds, facts):
    torch.manual_seed(0)
    model = Block(mode, proj, skip_act)
    model = convert_and_check(
        model, lambda d: (torch.randn(2, 8, 5, 5, device=d), torch.randn(2, 4, device=d)), device)
    assert folded(model.norm1) == folded(model.norm2) == folds
    assert type(model.act) is (nn.Identity if folds else nn.SiLU)
    hooks = list(model._forward_pre_hooks.values())
    if not folds:
        assert not hooks
        return
    # The branches taken as known at conversion are checked on every call.
    assert [{(name, value if value is None or type(value) in (bool, str) else "module") for name, value in h.facts}
            for h in hooks] == [{(n, v) if n != "proj" or v is None else (n, "module") for n, v in facts}]
    copied = copy.deepcopy(model)  # the check goes along, on the copy's attributes
    model.mode = "scale"
    with pytest.raises(RuntimeError, match="assuming its attribute 'mode' is"):
        model(torch.randn(2, 8, 5, 5, device=device), torch.randn(2, 4, device=device))
    copied(torch.randn(2, 8, 5, 5, device=device), torch.randn(2, 4, device=device))


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.norm(x))


class Looped(nn.Module):
    """The pair inside a loop body, and a branch on `training`, which is never taken as known."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, 8)
        self.act = nn.GELU()

    def forward(self, x):
        h = x
        for _ in range(2):
            if self.training:
                h = self.norm(h)
            else:
                h = self.norm(h * 0.5)
            h = self.act(h)
        return h


@pytest.mark.parametrize("cls, activation", [(Nested, "relu"), (Looped, "gelu")])
def test_folded_forms(device, cls, activation):
    torch.manual_seed(0)
    model = convert_and_check(cls(), lambda d: (torch.randn(2, 8, 4, 4, device=d),), device)
    assert folded(model.norm, activation) and type(model.act) is nn.Identity
    assert not model._forward_pre_hooks  # nothing taken as known
    if cls is Nested:  # so it scripts as before
        x = torch.randn(2, 8, 4, 4, device=device)
        torch.testing.assert_close(torch.jit.script(model)(x), model(x))


class Frames(nn.Module):
    """EasyAnimate's resnet block in small: norms of frames, `(B, C, T, H, W)` viewed as
    `(B * T, C, H, W)` and back, the activation after the views; the branch on the config."""

    def __init__(self, spatial=True):
        super().__init__()
        self.spatial = spatial
        self.norm1 = nn.GroupNorm(2, 8)
        self.norm2 = nn.GroupNorm(4, 8)
        self.act = nn.SiLU()
        self.conv = nn.Conv3d(8, 8, 1)

    def forward(self, x):
        if self.spatial:
            b = x.size(0)
            h = x.permute(0, 2, 1, 3, 4).flatten(0, 1)
            h = self.norm1(h)
            h = h.unflatten(0, (b, -1)).permute(0, 2, 1, 3, 4)
        else:
            h = self.norm1(x)
        h = self.act(h)
        h = self.conv(h)
        h = self.norm2(h.reshape(h.shape[0], 8, -1))
        h = h.reshape(h.shape[0], -1)  # its own shape in the arguments
        h = h.unflatten(1, x.shape[1:])  # a view statement of its own, then the activation
        h = self.act(h)
        return x + h


@pytest.mark.parametrize("spatial", [True, False])
def test_views_between_norm_and_activation(device, spatial):
    torch.manual_seed(0)
    model = convert_and_check(Frames(spatial), lambda d: (torch.randn(2, 8, 3, 4, 5, device=d),), device)
    assert folded(model.norm1) and folded(model.norm2) and type(model.act) is nn.Identity


# Random view statements between a norm and its activation. The proof reads source, so each
# drawn forward is written to a module file of its own and imported.
_VIEW_KINDS = ("permute", "transpose", "flatten", "unflatten", "reshape", "view", "movedim", "unsqueeze", "squeeze")
_FOLD_ACTS = {"SiLU()": "silu", "GELU()": "gelu", "ReLU()": "relu", "Mish()": "mish",
              "GELU(approximate='tanh')": "gelu_tanh"}


def _view_call(kind, k, shape):
    """The source of one view call of `kind` on a tensor of `shape` (k picks the dimensions)."""
    d = len(shape)
    i = k % d
    if kind == "permute":
        return f".permute({', '.join(map(str, [0] + list(range(2, d)) + [1]))})" if d >= 2 else None
    if kind == "transpose":
        return f".transpose({i}, {(i + 1) % d})"
    if kind == "flatten":
        return f".flatten({i % (d - 1)}, {i % (d - 1) + 1})" if d >= 2 else None
    if kind == "unflatten":
        return f".unflatten({i}, (2, -1))" if shape[i] % 2 == 0 else None
    if kind == "reshape":
        return ".reshape(h.shape[0], -1)"
    if kind == "view":
        return f".view({', '.join(map(str, shape[:-1]))}, -1)" if d >= 2 else ".view(-1)"
    if kind == "movedim":
        return f".movedim({i}, -1)"
    if kind == "unsqueeze":
        return f".unsqueeze({i})"
    return f".squeeze({i})" if shape[i] == 1 else None


def _module_with_views(draws, act, folder):
    """A module whose forward is `h = self.norm(x)`, the drawn views in statements of their own
    or chained, then `h = self.act(h)`, written to a file in `folder`; None where no drawn view
    applies."""
    shape = torch.Size((2, 8, 4, 6))
    lines = []
    for kind, k, chained in draws:
        call = _view_call(kind, k, shape)
        if call is None:
            continue
        try:
            h = torch.empty(shape, device="meta")
            shape = eval("h" + call, {"h": h}).shape  # noqa: S307 (the call is built above)
        except RuntimeError:  # a view of strides it cannot take: not drawn
            continue
        if chained and lines and kind != "reshape":  # (its `h.shape` is the statement's input's)
            lines[-1] += call
        else:
            lines.append("h = h" + call)
    if not lines:
        return None
    body = "\n        ".join(["h = self.norm(x)"] + lines + ["h = self.act(h)", "return h"])
    source = f"""from torch import nn


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.{act}

    def forward(self, x):
        {body}
"""
    name = f"fusednorm_views_{abs(hash(source))}"
    (folder / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect.getsource finds a class through its module
    spec.loader.exec_module(module)
    return module.Views()


@given(draws=st.lists(st.tuples(st.sampled_from(_VIEW_KINDS), st.integers(0, 4), st.booleans()), min_size=1,
                      max_size=4),
       act=st.sampled_from(sorted(_FOLD_ACTS)))
@settings(max_examples=20, deadline=None)
def test_any_view_statements_fold(draws, act, tmp_path_factory):
    # The activation folds after whatever views lie between, with the same values and gradients.
    torch.manual_seed(0)
    model = _module_with_views(draws, act, tmp_path_factory.getbasetemp())
    if model is None:
        return
    model = convert_and_check(model, lambda d: (torch.randn(2, 8, 4, 6, device=d),), "cpu")
    assert folded(model.norm, _FOLD_ACTS[act]) and type(model.act) is nn.Identity


# Forms the proof refuses: the norm's output reaches something besides the activation, the
# activation something besides a norm's output, or the children are reached in ways it cannot see.


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.SiLU()


class OutputReused(Base):
    def forward(self, x):
        y = self.norm(x)
        z = self.act(y)
        return y + z


class AliasBetween(Base):
    def forward(self, x):
        h = self.norm(x)
        r = h
        h = self.act(h)
        return h + r


class ActOnInput(Base):
    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        return h + self.act(x)


class FirstInBranch(Base):
    def forward(self, x, flag=True):
        h = self.norm(x)
        if flag:
            h = self.act(h)
        return h


class OneBranchWithout(Base):
    def forward(self, x, flag=True):
        if flag:
            h = self.norm(x)
        else:
            h = x * 2
        h = self.act(h)
        return h


class TwoActivations(Base):
    def __init__(self):
        super().__init__()
        self.act2 = nn.ReLU()

    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        g = self.norm(x)
        g = self.act2(g)
        return h + g


class SecondNormUsedAlone(Base):
    """The activation follows both norms, but `norm2` is also called alone: folding the activation
    into `norm` only would take it away from `norm2`'s output."""

    def __init__(self):
        super().__init__()
        self.norm2 = nn.GroupNorm(2, 8)

    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        g = self.norm2(x)
        g = self.act(g)
        return h + g + self.norm2(x)


class ActOnOther(Base):
    def forward(self, x):
        h = self.norm(x)
        h = self.act(x)
        return h


class WalksChildren(Base):
    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        return self.extra(h)

    def extra(self, h):
        for m in self.children():
            if isinstance(m, nn.SiLU):
                h = h + m(h)
        return h


class ByName(Base):
    def forward(self, x):
        h = self.norm(x)
        h = getattr(self, "act")(h)
        return h


class Helper(Base):
    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        return self.extra(h)

    def extra(self, h):
        return h + self.act(h)


class SelfHandedOut(Base):
    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        return run_other(self, h)


def run_other(module, h):
    return module.act(h)


class LastInLoop(Base):
    def forward(self, x):
        h = x
        for _ in range(2):
            h = self.act(h)
            h = self.norm(h)
        return h


class Decorated(Base):
    @torch.no_grad()
    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        return h


class InLambda(Base):
    def forward(self, x):
        h = self.norm(x)
        h = self.act(h)
        f = lambda t: self.act(t)  # noqa: E731
        return f(h)


class ViewAsDtype(Base):
    def forward(self, x):
        h = self.norm(x)
        h = h.view(torch.int32)  # a reinterpretation: the activation must see the norm's values
        h = h.view(x.dtype)
        h = self.act(h)
        return h


class ViewAsDtypeKeyword(Base):
    def forward(self, x):
        h = self.norm(x)
        h = h.view(dtype=torch.int32)
        h = h.view(dtype=x.dtype)
        h = self.act(h)
        return h


class CallInView(Base):
    def forward(self, x):
        h = self.norm(x)
        h = h.reshape(self.shape_of(x))  # a call: not known to be a shape
        h = self.act(h)
        return h

    def shape_of(self, x):
        return x.shape


class ViewUsesOutput(Base):
    def forward(self, x):
        h = self.norm(x)
        h = h.reshape(h.shape[0], -1) + 1 if h.shape else h  # not a view statement
        h = self.act(h)
        return h


class ViewPassesOutput(Base):
    def forward(self, x):
        h = self.norm(x)
        h = h.reshape(h.size(0), -1)  # a call in the arguments
        h = self.act(h)
        return h


class ViewToOtherName(Base):
    def forward(self, x):
        h = self.norm(x)
        g = h.flatten(1)
        g = self.act(g)
        return g + h.flatten(1)


class CastBetween(Base):
    def forward(self, x):
        h = self.norm(x)
        h = h.float().flatten(1)
        h = self.act(h)
        return h


class ViewFirstInBranch(Base):
    def forward(self, x, flag=True):
        h = self.norm(x)
        if flag:
            h = h.flatten(2)
        h = self.act(h)
        return h


REFUSED = [OutputReused, AliasBetween, ActOnInput, FirstInBranch, OneBranchWithout, TwoActivations,
           SecondNormUsedAlone, ActOnOther, ByName, Helper, WalksChildren, SelfHandedOut, LastInLoop, Decorated,
           InLambda, ViewAsDtype, ViewAsDtypeKeyword, CallInView, ViewUsesOutput, ViewPassesOutput, ViewToOtherName,
           CastBetween, ViewFirstInBranch]


@pytest.mark.parametrize("cls", REFUSED, ids=[c.__name__ for c in REFUSED])
def test_refused_forms(cls):
    torch.manual_seed(0)
    model = cls()
    reference = copy.deepcopy(model)
    fusednorm.convert(model)
    assert type(model.norm) is fnn.GroupNorm and model.norm.activation is None
    assert type(model.act) is nn.SiLU
    x = torch.randn(2, 8, 3, 3)
    if cls in (Decorated, ActOnOther, ViewAsDtype, ViewAsDtypeKeyword):  # outputs without a gradient
        torch.testing.assert_close(model(x), reference(x))
    else:
        assert_equivalent(reference, model, lambda d: (x,), "cpu")


def test_refused_for_shared_hooked_or_filtered_modules():
    # The activation registered twice (here also in a Sequential of the parent).
    model = Block()
    model.extra = nn.Sequential(model.act)
    fusednorm.convert(model)
    assert model.norm1.activation is None and type(model.act) is nn.SiLU
    # A norm with a forward hook: it would see the activated output.
    model = Block()
    model.norm2.register_forward_hook(lambda m, i, o: None)
    fusednorm.convert(model)
    assert model.norm1.activation is None and model.norm2.activation is None and type(model.act) is nn.SiLU
    # A norm filter_fn rejects: the activation after it is not folded, so neither is the other.
    model = Block()
    fusednorm.convert(model, filter_fn=lambda name, m: name != "norm2")
    assert type(model.norm2) is nn.GroupNorm and model.norm1.activation is None and type(model.act) is nn.SiLU


def test_summary_names_forward_folds(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="fusednorm"):
        fusednorm.convert(nn.ModuleDict({"block": Block()}))
    assert "folded 2 activation(s): 'block.act' (SiLU) into 'block.norm1', 'block.act' (SiLU) into 'block.norm2'" \
        in caplog.records[0].getMessage()


def test_diffusers_blocks(device, float32_convolutions):  # noqa: F811
    import_or_skip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoResnetBlockCausal3D

    torch.manual_seed(0)
    vae = convert_and_check(tiny_autoencoder(), lambda d: (torch.randn(2, 3, 8, 8, device=d),), device, atol=1e-4,
                            rtol=1e-4)
    resnets = [m for m in vae.modules() if type(m).__name__ == "ResnetBlock2D"]
    assert resnets and all(folded(r.norm1) and folded(r.norm2) and type(r.nonlinearity) is nn.Identity
                           for r in resnets)
    assert folded(vae.decoder.conv_norm_out) and type(vae.decoder.conv_act) is nn.Identity
    # Attention's group norm has no activation after it.
    assert all(m.activation is None for m in vae.modules() if type(m) is fnn.GroupNorm and m not in
               {n for r in resnets for n in (r.norm1, r.norm2)} | {vae.decoder.conv_norm_out, vae.encoder.conv_norm_out})
    resnets[0].time_embedding_norm = "scale_shift"
    with pytest.raises(RuntimeError, match="time_embedding_norm"):
        vae(torch.randn(2, 3, 8, 8, device=device))

    block = HunyuanVideoResnetBlockCausal3D(8, 16, groups=4)
    block = convert_and_check(block, lambda d: (torch.randn(1, 8, 3, 6, 6, device=d),), device, atol=1e-4, rtol=1e-4)
    assert folded(block.norm1) and folded(block.norm2) and type(block.nonlinearity) is nn.Identity
    assert not block._forward_pre_hooks  # a straight line: nothing taken as known


def test_source_edited_after_import_is_not_trusted(tmp_path, monkeypatch):
    import importlib
    import linecache
    import sys

    running = '''
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.SiLU()

    def forward(self, x):
        h = self.norm(x)
        g = self.act(h)
        return h + g
'''
    path = tmp_path / "edited_block.py"
    path.write_text(running)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_block")
    # Kept in sys.modules for the test (inspect reads a class's source through it), gone after.
    monkeypatch.setitem(sys.modules, "edited_block", module)
    # The file now says what a fold would be exact for; the function that runs is the old one.
    path.write_text(running.replace("g = self.act(h)\n        return h + g", "h = self.act(h)\n        return h"))
    linecache.checkcache(str(path))
    model = module.Block()
    reference = copy.deepcopy(model)
    fusednorm.convert(model)
    assert model.norm.activation is None and type(model.act) is nn.SiLU
    x = torch.randn(2, 8, 3, 3)
    torch.testing.assert_close(model(x), reference(x))


def test_diffusers_frames_blocks(device, float32_convolutions):  # noqa: F811
    # EasyAnimate's resnet blocks: the activation after the frames' views (the module docstring).
    # Their causal convolutions keep the last call's frames (with its graph), so one call each.
    import_or_skip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_magvit import EasyAnimateResidualBlock3D

    torch.manual_seed(0)
    block = EasyAnimateResidualBlock3D(16, 32, norm_num_groups=4).to(device)
    reference = copy.deepcopy(block)
    fusednorm.convert(block)
    assert folded(block.norm1) and folded(block.norm2) and type(block.nonlinearity) is nn.Identity
    assert [h.facts for h in block._forward_pre_hooks.values()] == [(("spatial_group_norm", True),)]
    x = torch.randn(2, 16, 3, 6, 5, device=device)
    out, out_ref = block(x), reference(x)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(out)
    for g, g_ref in zip(torch.autograd.grad(out, list(block.parameters()), grad),
                        torch.autograd.grad(out_ref, list(reference.parameters()), grad)):
        torch.testing.assert_close(g, g_ref, atol=1e-3, rtol=1e-3)
