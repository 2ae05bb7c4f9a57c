"""fusednorm.nn.GroupNorm / InstanceNorm1d/2d/3d against their torch.nn counterparts: construction,
parameters and buffers, checkpoints, numerics in train and eval mode, input checks, TorchScript."""

import functools
import io
import inspect
import json
import math
import re
import subprocess
import sys
import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fusednorm
import fusednorm.nn as fnn
from reference import _f64, activation_reference, assert_close, assert_compiles_like_eager, group_norm_reference

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")

INSTANCE_NORMS = {1: (fnn.InstanceNorm1d, torch.nn.InstanceNorm1d),
                  2: (fnn.InstanceNorm2d, torch.nn.InstanceNorm2d),
                  3: (fnn.InstanceNorm3d, torch.nn.InstanceNorm3d)}
PAIRS = {"GroupNorm": (fnn.GroupNorm, torch.nn.GroupNorm),
         **{f"InstanceNorm{d}d": INSTANCE_NORMS[d] for d in (1, 2, 3)}}
TOL = dict(atol=1e-5, rtol=1e-5)


def _torch_accepts_momentum_none() -> bool:
    # torch.nn.InstanceNorm passes momentum=None on to F.instance_norm, and so raises TypeError,
    # before torch 2.2; fusednorm follows the later behaviour (running stats untouched).
    try:
        torch.nn.InstanceNorm1d(2, momentum=None, track_running_stats=True)(torch.randn(2, 2, 3))
        return True
    except TypeError:
        return False


TORCH_ACCEPTS_MOMENTUM_NONE = _torch_accepts_momentum_none()


def assert_same_tensors(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and a[k].device == b[k].device, k
        assert torch.equal(a[k], b[k]), k


def randomize_(module, seed):
    """Random non-default parameters and running statistics (and a non-zero num_batches_tracked)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if name == "num_batches_tracked":
                t.fill_(int(torch.randint(1, 100, (1,), generator=g)))
            elif name == "running_var":
                t.copy_(torch.rand(t.shape, generator=g) * 2 + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=g))
    return module


def make_pair(name, *args, seed=0, device="cpu", **kwargs):
    """(fusednorm module, torch module) with the torch module's random state loaded into the
    fusednorm one."""
    ours_cls, torch_cls = PAIRS[name]
    theirs = randomize_(torch_cls(*args, **kwargs), seed).to(device)
    ours = ours_cls(*args, **kwargs).to(device)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def random_input(shape, seed, device, requires_grad=True, group_numel=None):
    """Random values whose normalization groups (runs of `group_numel` consecutive elements; by
    default one (n, c) instance, prod(shape[2:])) each have a mean in [-2, 2] and a standard
    deviation in [0.5, 2], so rstd stays O(1) and fp32 tolerances can stay tight."""
    g = torch.Generator().manual_seed(seed)
    if group_numel is None:
        group_numel = math.prod(shape[2:])
    z = torch.randn(shape, generator=g, dtype=torch.float64).reshape(-1, group_numel)
    if group_numel > 1 and z.numel():
        z = (z - z.mean(1, keepdim=True)) / z.std(1, unbiased=False, keepdim=True)
    mu = torch.rand(z.shape[0], 1, generator=g, dtype=torch.float64) * 4 - 2
    sigma = torch.rand(z.shape[0], 1, generator=g, dtype=torch.float64) * 1.5 + 0.5
    x = (z * sigma + mu).reshape(shape).float()
    return x.to(device).requires_grad_(requires_grad)


def compare_step(ours, theirs, x, seed):
    """Forward + backward through both modules on copies of x; compares outputs, the input and
    parameter gradients and the buffers."""
    x1 = x.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    exc = None
    try:
        y2 = theirs(x2)
    except Exception as e:  # torch rejects it: so must we, with the same type
        exc = e
    if exc is not None:
        with pytest.raises(type(exc)):
            ours(x1)
        return
    y1 = ours(x1)
    assert y1.shape == y2.shape and y1.dtype == y2.dtype
    torch.testing.assert_close(y1, y2, **TOL)
    g = torch.randn(y2.shape, generator=torch.Generator().manual_seed(seed)).to(y2.device)
    for p in list(ours.parameters()) + list(theirs.parameters()):
        p.grad = None
    y1.backward(g)
    y2.backward(g)
    scale = max(1.0, float(x2.grad.abs().max()))
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5 * scale, rtol=1e-5)
    assert len(list(ours.parameters())) == len(list(theirs.parameters()))
    assert len(list(ours.buffers())) == len(list(theirs.buffers()))
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert n1 == n2
        scale = max(1.0, float(p2.grad.abs().max()))
        torch.testing.assert_close(p1.grad, p2.grad, atol=1e-5 * scale, rtol=1e-5, msg=lambda m: f"grad {n1}: {m}")
    for (n1, b1), (n2, b2) in zip(ours.named_buffers(), theirs.named_buffers()):
        assert n1 == n2
        torch.testing.assert_close(b1, b2, atol=1e-6, rtol=1e-5, msg=lambda m: f"buffer {n1}: {m}")


# -- construction ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PAIRS))
def test_subclass_and_same_constructor_signature(name):
    ours_cls, torch_cls = PAIRS[name]
    assert issubclass(ours_cls, torch_cls)
    # torch's own parameters (whatever this torch version has), then the fused activation.
    ours, theirs = inspect.signature(ours_cls).parameters, inspect.signature(torch_cls).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    assert all(ours[k] == theirs[k] for k in theirs)
    assert list(ours)[len(theirs):] == ["activation", "negative_slope"]
    assert all(ours[k].kind == inspect.Parameter.KEYWORD_ONLY for k in ("activation", "negative_slope"))
    args = (2, 4) if name == "GroupNorm" else (4,)
    assert isinstance(ours_cls(*args), torch_cls)


def test_isinstance():
    assert isinstance(fnn.GroupNorm(2, 4), torch.nn.GroupNorm)
    for d, (ours_cls, torch_cls) in INSTANCE_NORMS.items():
        assert isinstance(ours_cls(3), torch_cls)
        assert isinstance(ours_cls(3), torch.nn.modules.instancenorm._InstanceNorm)


def check_same_module_state(ours, theirs):
    for attr in ("num_groups", "num_channels", "num_features", "eps", "momentum", "affine", "track_running_stats",
                 "training"):
        assert getattr(ours, attr, "absent") == getattr(theirs, attr, "absent"), attr
    p1, p2 = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert_same_tensors(p1, p2)
    assert [p.requires_grad for p in p1.values()] == [p.requires_grad for p in p2.values()]
    assert_same_tensors(dict(ours.named_buffers()), dict(theirs.named_buffers()))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert repr(ours) == repr(theirs)


@given(num_groups=st.integers(1, 5), per_group=st.integers(1, 4), eps=st.floats(1e-8, 0.5),
       affine=st.booleans(), dtype=st.sampled_from([None, torch.float32, torch.float64, torch.bfloat16]),
       positional=st.booleans())
def test_group_norm_constructor(num_groups, per_group, eps, affine, dtype, positional, device):
    C = num_groups * per_group
    if positional:
        ours, theirs = fnn.GroupNorm(num_groups, C, eps, affine, device, dtype), torch.nn.GroupNorm(num_groups, C, eps, affine, device, dtype)
    else:
        kw = dict(num_groups=num_groups, num_channels=C, eps=eps, affine=affine, device=device, dtype=dtype)
        ours, theirs = fnn.GroupNorm(**kw), torch.nn.GroupNorm(**kw)
    check_same_module_state(ours, theirs)
    assert (ours.weight is None) == (not affine)
    if affine:
        assert ours.weight.device.type == device and ours.weight.dtype == (dtype or torch.float32)


@pytest.mark.parametrize("ctor", ["default", "all"])
def test_group_norm_defaults(ctor):
    if ctor == "default":
        check_same_module_state(fnn.GroupNorm(3, 6), torch.nn.GroupNorm(3, 6))
    else:
        check_same_module_state(fnn.GroupNorm(3, 6, 1e-3, False), torch.nn.GroupNorm(3, 6, 1e-3, False))


@given(dim=st.sampled_from([1, 2, 3]), C=st.integers(1, 8), eps=st.floats(1e-8, 0.5),
       momentum=st.none() | st.floats(0, 1), affine=st.booleans(), track=st.booleans(),
       dtype=st.sampled_from([None, torch.float32, torch.float64]))
def test_instance_norm_constructor(dim, C, eps, momentum, affine, track, dtype, device):
    ours_cls, torch_cls = INSTANCE_NORMS[dim]
    kw = dict(eps=eps, momentum=momentum, affine=affine, track_running_stats=track, device=device, dtype=dtype)
    ours, theirs = ours_cls(C, **kw), torch_cls(C, **kw)
    check_same_module_state(ours, theirs)
    check_same_module_state(ours_cls(C, eps, momentum, affine, track, device, dtype),
                            torch_cls(C, eps, momentum, affine, track, device, dtype))
    if track:
        assert {"running_mean", "running_var", "num_batches_tracked"} <= set(ours.state_dict())
        assert ours.running_mean.device.type == device


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_instance_norm_defaults(dim):
    ours_cls, torch_cls = INSTANCE_NORMS[dim]
    ours, theirs = ours_cls(5), torch_cls(5)
    check_same_module_state(ours, theirs)
    assert (ours.eps, ours.momentum, ours.affine, ours.track_running_stats) == (1e-5, 0.1, False, False)


@pytest.mark.parametrize("num_groups,num_channels", [(4, 6), (5, 3), (3, 10)])
def test_group_norm_indivisible_channels_raise_at_construction(num_groups, num_channels):
    with pytest.raises(ValueError) as theirs:
        torch.nn.GroupNorm(num_groups, num_channels)
    with pytest.raises(ValueError, match=r"num_channels.*must be divisible by num_groups") as ours:
        fnn.GroupNorm(num_groups, num_channels)
    assert str(ours.value) == str(theirs.value)


# Inputs torch.nn.GroupNorm(4, 4) rejects, each taking another branch of the module's forward
# (its direct call of the op for plain tensors, F.group_norm for what the op would word otherwise).
GROUP_NORM_BAD_INPUTS = {
    "one dimension": (4,),
    "one dimension, 8 elements": (8,),
    "one value per channel": (1, 4),
    "one value per channel, spatial": (1, 4, 1, 1),
    "channels mismatch": (2, 8, 3),
}
# (C = 0 is left out: torch 2.11 words it as a weight-shape mismatch, 2.14 as no channels.)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("case", list(GROUP_NORM_BAD_INPUTS))
def test_group_norm_module_bad_input_raises_like_torch(case, activation, device):
    x = torch.randn(GROUP_NORM_BAD_INPUTS[case], device=device)
    with pytest.raises(Exception) as theirs:
        torch.nn.GroupNorm(4, 4, device=device)(x)
    with pytest.raises(type(theirs.value)) as ours:
        fnn.GroupNorm(4, 4, device=device, activation=activation)(x)
    assert type(ours.value) is type(theirs.value)
    # First lines: an error raised below the dispatcher may carry further lines of context.
    assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0], case


INSTANCE_NORM_BAD_INPUTS = {  # InstanceNorm2d(4, affine=True), training: (input shape, the module's mode)
    "one spatial element": ((2, 4, 1, 1), "train"),
    "one spatial element, no batch dimension": ((4, 1, 1), "train"),
    "channels mismatch": ((2, 3, 5, 5), "train"),
    "channels mismatch, no batch dimension": ((3, 5, 5), "eval"),
    "two dimensions": ((2, 4), "train"),
    "five dimensions": ((1, 2, 4, 5, 5), "train"),
}


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("case", list(INSTANCE_NORM_BAD_INPUTS))
def test_instance_norm_module_bad_input_raises_like_torch(case, activation, device):
    # The module calls the op directly on a plain batched input of num_features channels with
    # more than one spatial element; everything else must still fail as torch.nn's module does.
    shape, mode = INSTANCE_NORM_BAD_INPUTS[case]
    x = torch.randn(shape, device=device)
    theirs_module = torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True, device=device)
    ours_module = fnn.InstanceNorm2d(4, affine=True, track_running_stats=True, device=device, activation=activation)
    theirs_module.train(mode == "train")
    ours_module.train(mode == "train")
    with pytest.raises(Exception) as theirs:
        theirs_module(x)
    with pytest.raises(type(theirs.value)) as ours:
        ours_module(x)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0], case


@pytest.mark.parametrize("track", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 3, 5), (4, 3, 5), (2, 4, 1, 7)])
def test_instance_norm_module_direct_call_matches_torch(shape, track, device):
    # The module's direct op call (batched, >1 spatial element) and its path through
    # F.instance_norm (no batch dimension) against torch.nn's module, running statistics included.
    torch.manual_seed(0)
    x = torch.randn(shape, device=device)
    ours = randomize_(fnn.InstanceNorm2d(4, affine=True, track_running_stats=track), seed=3).to(device)
    theirs = randomize_(torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=track), seed=3).to(device)
    for mode in (True, False):
        ours.train(mode)
        theirs.train(mode)
        torch.testing.assert_close(ours(x), theirs(x))
        if track:
            torch.testing.assert_close(ours.running_mean, theirs.running_mean)
            torch.testing.assert_close(ours.running_var, theirs.running_var)


REPR_CASES = [("GroupNorm", affine, False) for affine in (True, False)] + [
    (f"InstanceNorm{d}d", affine, track) for d in (1, 2, 3) for affine in (True, False) for track in (True, False)]


@pytest.mark.parametrize("name,affine,track", REPR_CASES)
def test_repr(name, affine, track):
    ours_cls, torch_cls = PAIRS[name]
    if name == "GroupNorm":
        args, kw = (2, 6), dict(eps=1e-3, affine=affine)
    else:
        args, kw = (6,), dict(eps=1e-3, momentum=0.3, affine=affine, track_running_stats=track)
    ours, theirs = ours_cls(*args, **kw), torch_cls(*args, **kw)
    assert repr(ours) == repr(theirs)
    assert repr(torch.nn.Sequential(ours)) == repr(torch.nn.Sequential(theirs))


# -- checkpoints ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,args,kwargs", [
    ("GroupNorm", (3, 6), {}),
    ("GroupNorm", (3, 6), dict(affine=False)),
    ("InstanceNorm1d", (5,), dict(affine=True, track_running_stats=True)),
    ("InstanceNorm2d", (5,), dict(affine=True, track_running_stats=True)),
    ("InstanceNorm3d", (5,), dict(affine=False, track_running_stats=True)),
    ("InstanceNorm2d", (5,), dict(affine=True)),
])
def test_checkpoint_roundtrip(name, args, kwargs, device):
    ours_cls, torch_cls = PAIRS[name]
    theirs = randomize_(torch_cls(*args, **kwargs), seed=7).to(device)
    sd = theirs.state_dict()
    if kwargs.get("track_running_stats"):
        assert "num_batches_tracked" in sd and int(sd["num_batches_tracked"]) != 0
        assert not torch.equal(sd["running_var"], torch.ones_like(sd["running_var"]))

    ours = ours_cls(*args, **kwargs).to(device)
    result = ours.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_tensors(ours.state_dict(), sd)

    back = torch_cls(*args, **kwargs).to(device)
    back.load_state_dict(ours.state_dict(), strict=True)
    assert_same_tensors(back.state_dict(), sd)

    # Through a file too, as a real checkpoint would travel.
    buf = io.BytesIO()
    torch.save(theirs.state_dict(), buf)
    buf.seek(0)
    again = ours_cls(*args, **kwargs).to(device)
    again.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    assert_same_tensors(again.state_dict(), sd)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_checkpoint_missing_running_stats_is_rejected_like_torch(dim):
    """A checkpoint without running stats loaded into a tracking module fails strict loading the
    same way for both."""
    ours_cls, torch_cls = INSTANCE_NORMS[dim]
    sd = torch_cls(4, affine=True).state_dict()
    with pytest.raises(RuntimeError) as theirs:
        torch_cls(4, affine=True, track_running_stats=True).load_state_dict(sd, strict=True)
    with pytest.raises(RuntimeError) as ours:
        ours_cls(4, affine=True, track_running_stats=True).load_state_dict(sd, strict=True)
    assert "running_mean" in str(ours.value)
    assert str(ours.value).replace("fusednorm.nn.", "").replace("InstanceNorm", "X") == str(theirs.value).replace("InstanceNorm", "X")


# -- numerics -------------------------------------------------------------------------------------------


@given(num_groups=st.integers(1, 4), per_group=st.integers(1, 3), N=st.integers(1, 3),
       spatial=st.lists(st.integers(1, 5), min_size=0, max_size=3), affine=st.booleans(),
       eps=st.sampled_from([1e-5, 1e-3, 0.1]), train=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_group_norm_module_matches_torch(num_groups, per_group, N, spatial, affine, eps, train, seed, device):
    C = num_groups * per_group
    group_numel = per_group * math.prod(spatial)
    # A group of one element has zero variance: y = bias exactly, where torch's result is rounding
    # noise times 1/sqrt(eps); test_group_norm.py covers it against the exact reference.
    assume(group_numel > 1)
    ours, theirs = make_pair("GroupNorm", num_groups, C, eps=eps, affine=affine, seed=seed, device=device)
    ours.train(train)
    theirs.train(train)
    x = random_input((N, C) + tuple(spatial), seed + 1, device, group_numel=group_numel)
    compare_step(ours, theirs, x, seed + 2)


@st.composite
def instance_norm_module_cases(draw):
    dim = draw(st.sampled_from([1, 2, 3]))
    spatial = draw(st.lists(st.integers(1, 6), min_size=dim, max_size=dim).filter(lambda s: math.prod(s) > 1))
    return dict(
        dim=dim,
        spatial=tuple(spatial),
        N=draw(st.integers(1, 3)),
        C=draw(st.integers(1, 6)),
        batched=draw(st.booleans()),
        affine=draw(st.booleans()),
        track=draw(st.booleans()),
        momentum=draw(st.none() | st.sampled_from([0.1, 1.0]) | st.floats(0, 1)),
        eps=draw(st.sampled_from([1e-5, 1e-3])),
        steps=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(case=instance_norm_module_cases())
def test_instance_norm_module_matches_torch(case, device):
    """Several train steps (outputs, grads, running statistics), then eval with the running
    statistics, batched or not."""
    c = case
    assume(c["momentum"] is not None or TORCH_ACCEPTS_MOMENTUM_NONE)
    ours, theirs = make_pair(f"InstanceNorm{c['dim']}d", c["C"], eps=c["eps"], momentum=c["momentum"],
                             affine=c["affine"], track_running_stats=c["track"], seed=c["seed"], device=device)
    shape = ((c["N"],) if c["batched"] else ()) + (c["C"],) + c["spatial"]
    gn = math.prod(c["spatial"])
    for step in range(c["steps"]):
        x = random_input(shape, c["seed"] + 10 * step, device, group_numel=gn)
        compare_step(ours, theirs, x, c["seed"] + 10 * step + 1)
    ours.eval()
    theirs.eval()
    x = random_input(shape, c["seed"] + 100, device, group_numel=gn)
    compare_step(ours, theirs, x, c["seed"] + 101)
    assert_same_tensors({k: v for k, v in ours.state_dict().items() if k == "num_batches_tracked"},
                        {k: v for k, v in theirs.state_dict().items() if k == "num_batches_tracked"})


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_running_stats_update_over_train_steps_then_eval(dim, device):
    """Running statistics actually move in training (so the comparison is not vacuous) and equal
    torch's after every step; eval then uses them."""
    ours, theirs = make_pair(f"InstanceNorm{dim}d", 3, momentum=0.3, affine=True, track_running_stats=True,
                             seed=dim, device=device)
    shape = (4, 3) + (5,) * dim
    for step in range(4):
        before = ours.running_mean.clone()
        x = random_input(shape, 100 * dim + step, device) * (step + 1) + step
        compare_step(ours, theirs, x, step)
        assert not torch.allclose(ours.running_mean, before)
        torch.testing.assert_close(ours.running_mean, theirs.running_mean, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.running_var, theirs.running_var, atol=1e-6, rtol=1e-6)
    ours.eval()
    theirs.eval()
    x = random_input(shape, 999, device)
    compare_step(ours, theirs, x, 5)
    # eval normalizes with the running statistics, not the input's
    y = ours(x)
    stats = F.instance_norm(x, None, None, ours.weight, ours.bias)
    assert not torch.allclose(y, stats, atol=1e-3)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_momentum_none_leaves_running_stats_untouched(dim, device):
    if not TORCH_ACCEPTS_MOMENTUM_NONE:
        pytest.skip("this torch's nn.InstanceNorm rejects momentum=None: nothing to compare with")
    ours, theirs = make_pair(f"InstanceNorm{dim}d", 3, momentum=None, affine=True, track_running_stats=True,
                             seed=dim, device=device)
    # a fresh (default) state, as in REFERENCE.md, plus the random one loaded above
    for fresh in (False, True):
        if fresh:
            ours, theirs = (cls(3, momentum=None, affine=True, track_running_stats=True).to(device)
                            for cls in INSTANCE_NORMS[dim])
        rm0, rv0 = ours.running_mean.clone(), ours.running_var.clone()
        nbt0 = int(ours.num_batches_tracked)
        for step in range(3):
            compare_step(ours, theirs, random_input((2, 3) + (4,) * dim, step, device) + 3, step)
        for m in (ours, theirs):
            assert torch.equal(m.running_mean, rm0) and torch.equal(m.running_var, rv0)
            assert int(m.num_batches_tracked) == nbt0
        if fresh:
            assert nbt0 == 0
        ours.eval()
        theirs.eval()
        compare_step(ours, theirs, random_input((2, 3) + (4,) * dim, 9, device), 9)
        ours.train()
        theirs.train()


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("track", [False, True])
def test_unbatched_input(dim, track, device):
    ours, theirs = make_pair(f"InstanceNorm{dim}d", 4, affine=True, track_running_stats=track, seed=3, device=device)
    x = random_input((4,) + (3,) * dim, 11, device, group_numel=3**dim)
    compare_step(ours, theirs, x, 1)
    with torch.no_grad():
        assert ours(x).shape == theirs(x).shape == x.shape  # (both: a train step moves running stats)
    if track:  # and in eval, with the running statistics
        ours.eval()
        theirs.eval()
        compare_step(ours, theirs, x, 2)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_unbatched_equals_batch_of_one(dim, device):
    ours = make_pair(f"InstanceNorm{dim}d", 4, affine=True, seed=5, device=device)[0]
    x = random_input((4,) + (3,) * dim, 12, device, requires_grad=False, group_numel=3**dim)
    torch.testing.assert_close(ours(x), ours(x.unsqueeze(0)).squeeze(0), atol=0, rtol=0)


@pytest.mark.parametrize("dim,rank", [(d, r) for d in (1, 2, 3) for r in range(1, 7) if r not in (d + 1, d + 2)])
def test_wrong_rank_raises_torch_value_error(dim, rank):
    ours_cls, torch_cls = INSTANCE_NORMS[dim]
    x = torch.randn((2,) * rank)
    with pytest.raises(ValueError) as theirs:
        torch_cls(2)(x)
    with pytest.raises(ValueError, match=re.escape(str(theirs.value))):
        ours_cls(2)(x)
    assert "input" in str(theirs.value)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("batched", [True, False])
def test_num_features_mismatch(dim, batched, device):
    ours_cls, torch_cls = INSTANCE_NORMS[dim]
    shape = ((2,) if batched else ()) + (5,) + (3,) * dim
    x = random_input(shape, 0, device, requires_grad=False, group_numel=3**dim)
    # affine: ValueError with torch's message
    with pytest.raises(ValueError) as theirs:
        torch_cls(4, affine=True).to(device)(x)
    with pytest.raises(ValueError, match=re.escape(str(theirs.value))):
        ours_cls(4, affine=True).to(device)(x)
    # not affine: a UserWarning, and the result is still torch's
    with pytest.warns(UserWarning, match="does not match num_features"):
        y = ours_cls(4).to(device)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y_t = torch_cls(4).to(device)(x)
    torch.testing.assert_close(y, y_t, **TOL)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("batched", [True, False])
def test_single_spatial_element_in_training_raises(dim, batched, device):
    ours_cls, torch_cls = INSTANCE_NORMS[dim]
    x = torch.randn(((3,) if batched else ()) + (4,) + (1,) * dim, device=device)
    with pytest.raises(ValueError) as theirs:
        torch_cls(4)(x)
    with pytest.raises(ValueError, match="Expected more than 1 spatial element when training"):
        ours_cls(4)(x)
    assert "more than 1 spatial element" in str(theirs.value)
    # eval with running statistics does not need input statistics: fine, and torch's result
    ours, theirs_m = make_pair(f"InstanceNorm{dim}d", 4, track_running_stats=True, affine=True, seed=1, device=device)
    ours.eval()
    theirs_m.eval()
    compare_step(ours, theirs_m, x, 0)


# -- TorchScript -----------------------------------------------------------------------------------

SCRIPT_CONFIGS = {
    "GroupNorm": ((3, 6), dict(eps=1e-4), (2, 6, 5, 3)),
    "GroupNorm_noaffine": ((2, 6), dict(affine=False), (2, 6, 7)),
    "InstanceNorm1d": ((4,), dict(affine=True, track_running_stats=True, momentum=0.3), (3, 4, 7)),
    "InstanceNorm2d": ((4,), dict(affine=True), (3, 4, 5, 3)),
    "InstanceNorm2d_track": ((4,), dict(track_running_stats=True), (2, 4, 5, 3)),
    "InstanceNorm3d": ((4,), dict(affine=True, track_running_stats=True), (2, 4, 3, 2, 3)),
}


def script_pair(key, device, seed=0):
    name = key.split("_")[0]
    args, kwargs, shape = SCRIPT_CONFIGS[key]
    ours, _ = make_pair(name, *args, seed=seed, device=device, **kwargs)
    scripted = torch.jit.script(make_pair(name, *args, seed=seed, device=device, **kwargs)[0])
    return ours, scripted, shape


@pytest.mark.parametrize("key", list(SCRIPT_CONFIGS))
def test_scripted_module_equals_eager(key, device):
    ours, scripted, shape = script_pair(key, device)
    assert isinstance(scripted, torch.jit.ScriptModule)
    for train in (True, True, False):
        ours.train(train)
        scripted.train(train)
        x = random_input(shape, 3, device)
        compare_step(scripted, ours, x, 4)
    # unbatched through the scripted module
    if not key.startswith("GroupNorm"):
        x = random_input(shape[1:], 5, device, requires_grad=False, group_numel=math.prod(shape[2:]))
        torch.testing.assert_close(scripted(x), ours(x), **TOL)


def checksums(module, x):
    out = []
    for train in (True, False):
        module.train(train)
        xi = x.clone().requires_grad_()
        y = module(xi)
        w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)
        y.backward(w)
        out.append(float((y * w).sum().detach()))
        out.append(float((xi.grad * w).sum()))
        for p in module.parameters():
            out.append(float(p.grad.sum()))
            p.grad = None
        for name, b in module.named_buffers():
            out.append(float(b.double().sum()))
    return out


@pytest.mark.parametrize("key", ["GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"])
def test_scripted_module_saved_and_loaded_in_fresh_process(key, device, tmp_path):
    ours, scripted, shape = script_pair(key, device, seed=11)
    path, xpath = tmp_path / "m.pt", tmp_path / "x.pt"
    torch.jit.save(scripted, str(path))
    x = random_input(shape, 13, "cpu", requires_grad=False)
    torch.save(x, str(xpath))

    expected = checksums(ours, x.to(device))  # the in-process eager module
    # The fresh process imports only torch and fusednorm; it runs the same checksums() source.
    code = "\n".join([
        "import json, torch, fusednorm",
        inspect.getsource(checksums),
        f"m = torch.jit.load({str(path)!r}, map_location={device!r})",
        f"x = torch.load({str(xpath)!r}, weights_only=True).to({device!r})",
        "print(json.dumps(checksums(m, x)))",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == len(expected)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               atol=1e-4, rtol=1e-5)


# Scripted code calls the functional API as users write it; TorchScript compiles those calls to
# the fusednorm ops (the functions are registered as builtins, see ops/functional.py).
def _scriptable_group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    return fusednorm.group_norm(x, num_groups, weight, bias, eps)


def _scriptable_instance_norm(x: torch.Tensor, running_mean: Optional[torch.Tensor] = None,
                              running_var: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
                              bias: Optional[torch.Tensor] = None, use_input_stats: bool = True,
                              momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
    return fusednorm.instance_norm(x, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)


@functools.lru_cache(maxsize=None)
def scripted_functions():
    return torch.jit.script(_scriptable_group_norm), torch.jit.script(_scriptable_instance_norm)


@settings(max_examples=10)
@given(num_groups=st.integers(1, 3), per_group=st.integers(1, 3), N=st.integers(1, 3),
       spatial=st.lists(st.integers(2, 4), min_size=0, max_size=2), affine=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_scripted_group_norm_function(num_groups, per_group, N, spatial, affine, seed, device):
    gn, _ = scripted_functions()
    C = num_groups * per_group
    assume(per_group * math.prod(spatial) > 1)
    x = random_input((N, C) + tuple(spatial), seed, device, requires_grad=False,
                     group_numel=per_group * math.prod(spatial))
    w = torch.randn(C, device=device) if affine else None
    b = torch.randn(C, device=device) if affine else None
    torch.testing.assert_close(gn(x, num_groups, w, b, 1e-3), fusednorm.group_norm(x, num_groups, w, b, 1e-3),
                               atol=0, rtol=0)
    torch.testing.assert_close(gn(x, num_groups), F.group_norm(x, num_groups), **TOL)
    with pytest.raises(Exception, match="num_groups"):
        gn(x, 0)


@settings(max_examples=10)
@given(C=st.integers(1, 4), N=st.integers(1, 3), spatial=st.lists(st.integers(2, 4), min_size=1, max_size=3),
       use_input_stats=st.booleans(), momentum=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_scripted_instance_norm_function(C, N, spatial, use_input_stats, momentum, seed, device):
    _, inn = scripted_functions()
    x = random_input((N, C) + tuple(spatial), seed, device, requires_grad=False)
    w, b = torch.randn(C, device=device), torch.randn(C, device=device)
    rm1, rv1 = torch.randn(C, device=device), torch.rand(C, device=device) + 0.5
    rm2, rv2 = rm1.clone(), rv1.clone()
    y1 = inn(x, rm1, rv1, w, b, use_input_stats, momentum, 1e-5)
    y2 = fusednorm.instance_norm(x, rm2, rv2, w, b, use_input_stats, momentum, 1e-5)
    torch.testing.assert_close(y1, y2, atol=0, rtol=0)
    torch.testing.assert_close(rm1, rm2, atol=0, rtol=0)
    torch.testing.assert_close(rv1, rv2, atol=0, rtol=0)
    torch.testing.assert_close(inn(x), F.instance_norm(x), **TOL)


# -- FrameGroupNorm ------------------------------------------------------------------------------


def frame_group_norm_reference(x, num_groups, weight, bias, eps, activation, negative_slope=0.01):
    """Each frame x[n, :, t] group-normalized on its own, in float64 (from the definitions)."""
    N, C, T = x.shape[:3]
    frames = x.double().transpose(1, 2).reshape((N * T, C) + x.shape[3:])
    y = group_norm_reference(frames, num_groups, weight.double(), bias.double(), eps)
    y = activation_reference(y, activation, negative_slope)
    return y.reshape((N, T, C) + x.shape[3:]).transpose(1, 2)


@settings(max_examples=25, deadline=None)
@given(num_groups=st.integers(1, 3), per_group=st.integers(1, 3), N=st.integers(1, 3), T=st.integers(1, 4),
       spatial=st.lists(st.integers(1, 5), min_size=1, max_size=2), activation=st.sampled_from([None, "silu", "gelu"]),
       channels_last=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_frame_group_norm_matches_per_frame_reference(num_groups, per_group, N, T, spatial, activation,
                                                      channels_last, seed, device):
    C = num_groups * per_group
    assume(per_group * math.prod(spatial) > 1)
    torch.manual_seed(seed)
    norm = fnn.FrameGroupNorm(num_groups, C, eps=1e-3, activation=activation).to(device)
    torch.nn.init.normal_(norm.norm_layer.weight)
    torch.nn.init.normal_(norm.norm_layer.bias)
    x = random_input((N, C, T) + tuple(spatial), seed, device, requires_grad=False)
    if channels_last and x.dim() == 5:
        x = x.to(memory_format=torch.channels_last_3d)
    x.requires_grad_()
    y = norm(x)
    w, b = norm.norm_layer.weight, norm.norm_layer.bias
    ref = frame_group_norm_reference(x.detach().cpu(), num_groups, w.detach().cpu(), b.detach().cpu(), 1e-3, activation)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, ref, torch.float32)
    # Gradients of the input and of norm_layer's parameters against the reference's.
    x64, w64, b64 = _f64(x), _f64(w), _f64(b)
    grad = torch.randn(y.shape, dtype=torch.float64)
    want = torch.autograd.grad(frame_group_norm_reference(x64, num_groups, w64, b64, 1e-3, activation), [x64, w64, b64],
                               grad)
    got = torch.autograd.grad(y, [x, w, b], grad.to(device, torch.float32))
    for g, r in zip(got, want):
        assert_close(g, r, torch.float32, scale=10 * (1 + r.abs().max().item()))


def test_frame_group_norm_module(device):
    norm = fnn.FrameGroupNorm(2, 4, activation="silu", device=device)
    assert list(norm.state_dict()) == ["norm_layer.weight", "norm_layer.bias"]
    assert type(norm.norm_layer) is torch.nn.GroupNorm and norm.norm_layer.weight.device.type == device
    assert repr(norm) == f"FrameGroupNorm(\n  activation='silu'\n  (norm_layer): {torch.nn.GroupNorm(2, 4)!r}\n)"
    assert "activation" not in repr(fnn.FrameGroupNorm(2, 4))
    x = torch.randn(2, 4, 3, 5, device=device)
    scripted = torch.jit.script(norm)
    torch.testing.assert_close(scripted(x), norm(x), atol=0, rtol=0)
    # Empty batches and videos keep their shape; a bad input raises what F.group_norm of its frames raises.
    assert norm(x[:0]).shape == (0, 4, 3, 5) and norm(x[:, :, :0]).shape == (2, 4, 0, 5)
    with pytest.raises(RuntimeError, match="Expected weight to be a vector of size equal to the number of channels"):
        norm(torch.randn(2, 6, 3, 5, device=device))
    with pytest.raises(ValueError, match="Unknown activation"):
        fnn.FrameGroupNorm(2, 4, activation="tanh")


# -- AdaGroupNorm -------------------------------------------------------------------------------


def ada_group_norm_reference(x, emb, num_groups, linear_weight, linear_bias, eps, embedding_activation, activation):
    """diffusers' AdaGroupNorm written from its definition in float64: the embedding through its
    activation and the linear map, split into scale and shift, modulating the plain group norm."""
    e = activation_reference(emb, embedding_activation, 0.01) @ linear_weight.t() + linear_bias
    scale, shift = e.chunk(2, dim=1)
    y = group_norm_reference(x, num_groups, None, None, eps)
    y = y * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
    return activation_reference(y, activation, 0.01)


@settings(max_examples=25, deadline=None)
@given(num_groups=st.integers(1, 3), per_group=st.integers(1, 3), N=st.integers(1, 3),
       H=st.integers(1, 5), W=st.integers(1, 5), embedding_dim=st.integers(1, 6),
       act_fn=st.sampled_from([None, "silu", "gelu", "relu"]), activation=st.sampled_from([None, "silu", "gelu"]),
       one_embedding=st.booleans(), channels_last=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_ada_group_norm_matches_reference(num_groups, per_group, N, H, W, embedding_dim, act_fn, activation,
                                          one_embedding, channels_last, seed, device):
    C = num_groups * per_group
    assume(per_group * H * W > 1)
    torch.manual_seed(seed)
    norm = fnn.AdaGroupNorm(embedding_dim, C, num_groups, act_fn, eps=1e-3, activation=activation).to(device)
    x = random_input((N, C, H, W), seed, device, requires_grad=False)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    emb = torch.randn(1 if one_embedding else N, embedding_dim, device=device, requires_grad=True)
    y = norm(x, emb)
    assert y.shape == x.shape and y.dtype == x.dtype
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last)
    w, b = norm.linear.weight, norm.linear.bias
    args = (num_groups, _f64(w), _f64(b), 1e-3, act_fn, activation)
    x64, e64 = _f64(x), _f64(emb)
    ref = ada_group_norm_reference(x64, e64, *args)
    assert_close(y, ref, torch.float32, scale=4)
    # Gradients of the input, the embedding and the linear map against the reference's.
    grad = torch.randn(y.shape, dtype=torch.float64)
    want = torch.autograd.grad(ref, [x64, e64, args[1], args[2]], grad)
    got = torch.autograd.grad(y, [x, emb, w, b], grad.to(device, torch.float32))
    for g, r in zip(got, want):
        assert_close(g, r, torch.float32, scale=10 * (1 + r.abs().max().item()))


def test_ada_group_norm_takes_diffusers_composition_elsewhere(device):
    """Other ranks, and an embedding of another dtype than the input, get diffusers' composition
    (emb[:, :, None, None] broadcast, torch's type promotion), then the activation."""
    torch.manual_seed(0)
    norm = fnn.AdaGroupNorm(6, 4, 2, "silu", activation="gelu", device=device)

    def composition(x, emb):
        e = norm.linear(F.silu(emb))[:, :, None, None]
        scale, shift = e.chunk(2, dim=1)
        return F.gelu(F.group_norm(x, 2, eps=1e-5) * (1 + scale) + shift)

    x64 = torch.randn(2, 4, 3, 5, device=device, dtype=torch.float64)
    emb = torch.randn(2, 6, device=device)
    y = norm(x64, emb)  # float64 input, float32 embedding: promoted as diffusers' module promotes
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, composition(x64, emb), atol=0, rtol=0)
    # A video, an embedding of another batch, one without a batch: diffusers' error.
    for x, e in ((torch.randn(2, 4, 2, 3, 5, device=device), emb), (torch.randn(3, 4, 3, 5, device=device), emb),
                 (torch.randn(8, 4, 3, 5, device=device), emb[0])):  # linear(emb[0]): 8 values
        with pytest.raises((RuntimeError, IndexError)) as want:
            composition(x, e)
        with pytest.raises(type(want.value), match=re.escape(str(want.value))):
            norm(x, e)
    # One embedding for two samples is broadcast, as diffusers' composition does.
    x = torch.randn(2, 4, 3, 5, device=device)
    torch.testing.assert_close(norm(x, emb[:1]), composition(x, emb[:1]))


def test_ada_group_norm_module(device):
    norm = fnn.AdaGroupNorm(6, 4, 2, act_fn="swish", eps=1e-6, activation="silu", device=device)
    assert list(norm.state_dict()) == ["linear.weight", "linear.bias"]
    assert norm.linear.weight.shape == (8, 6) and norm.linear.weight.device.type == device
    assert type(norm.act) is torch.nn.SiLU and fnn.AdaGroupNorm(6, 4, 2).act is None
    assert repr(norm).startswith("AdaGroupNorm(\n  num_groups=2, eps=1e-06, activation='silu'\n  (act): SiLU()")
    with pytest.raises(ValueError, match="activation function tanh not found"):
        fnn.AdaGroupNorm(6, 4, 2, act_fn="tanh")
    with pytest.raises(ValueError, match="Unknown activation"):
        fnn.AdaGroupNorm(6, 4, 2, activation="tanh")
    # A group count that does not divide the channels raises what F.group_norm raises.
    x, emb = torch.randn(2, 6, 3, 3, device=device), torch.randn(2, 6, device=device)
    with pytest.raises(RuntimeError, match="Expected number of channels in input to be divisible by num_groups"):
        fnn.AdaGroupNorm(6, 6, 4, device=device)(x, emb)
    # TorchScript compiles it, both paths (a float64 input with a float32 embedding: the composition).
    x, emb = torch.randn(2, 4, 3, 3, device=device), torch.randn(2, 6, device=device)
    scripted = torch.jit.script(norm)
    for a, e in ((x, emb), (x, emb[:1]), (x.double(), emb)):
        torch.testing.assert_close(scripted(a, e), norm(a, e), atol=0, rtol=0)
    # One fused graph under torch.compile, dynamic shapes, forward and backward.
    inputs = lambda shape: (torch.randn(shape, device=device, requires_grad=True),
                            torch.randn(shape[0], 6, device=device, requires_grad=True))
    assert_compiles_like_eager(fnn.AdaGroupNorm(6, 8, 2, "silu", activation="silu").to(device), inputs)


def test_ada_group_norm_matches_diffusers(device):
    diffusers_norm = pytest.importorskip("diffusers.models.normalization").AdaGroupNorm
    torch.manual_seed(0)
    theirs = diffusers_norm(6, 8, 4, act_fn="silu", eps=1e-6).to(device, torch.float64)
    ours = fnn.AdaGroupNorm(6, 8, 4, act_fn="silu", eps=1e-6).to(device, torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 8, 5, 4, device=device, dtype=torch.float64)
    emb = torch.randn(3, 6, device=device, dtype=torch.float64)
    torch.testing.assert_close(ours(x, emb), theirs(x, emb), atol=1e-12, rtol=1e-12)
