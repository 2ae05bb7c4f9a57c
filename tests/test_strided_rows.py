"""Inputs whose rows (n, c) are contiguous but not back to back: the frames of an NCDHW video as
Mochi's per-frame norms view them, a slice of channels, leading dimensions swapped in memory. In
16-bit types, with rows of whole 16-byte packs, 512 packs and more, the CUDA forward's sweep reads
them where they lie (docs/design.md, "Sweep path"); every other such input is copied dense first.
Either way the results are the float64 reference's within the dtype's tolerance, the statistics
too, with every epilogue operand; a call gives the same bits every time; and on the GPU the
qualifying inputs run the sweep's kernels and no copy."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import fusednorm
from fusednorm import kernel_paths
from reference import assert_close, epilogue_reference, group_norm_reference

FORWARD = torch.ops.fusednorm.group_norm_forward


def frames_of_a_video(video):
    """(N * T, C, *) frames of an (N, C, T, *) video: a view where N == 1 (Mochi's batch)."""
    return video.transpose(1, 2).flatten(0, 1)


def strided(x, kind):
    """x's values in a view whose rows are contiguous but not back to back."""
    if kind == "frames":  # x (T, C, *) as the frames of a contiguous (1, C, T, *) video
        video = x.unsqueeze(0).transpose(1, 2).contiguous()
        u = frames_of_a_video(video)
    elif kind == "swapped":  # the batch and channel dimensions swapped in memory
        u = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif kind == "channel slice":  # channels C..2C of a tensor of 3C channels
        wide = torch.cat([torch.zeros_like(x), x, torch.zeros_like(x)], dim=1)
        u = wide[:, x.shape[1]:2 * x.shape[1]]
    else:
        raise ValueError(kind)
    assert torch.equal(u, x) and u.stride(-1) == 1
    return u


KINDS = ["frames", "swapped", "channel slice"]


@st.composite
def cases(draw):
    G = draw(st.sampled_from([1, 2, 4, 32]))
    C = G * draw(st.integers(1, 3))
    N = draw(st.integers(1, 3))
    # Rows of 512 packs and more (the sweep's), of fewer (copied), of a partial pack (copied).
    spatial = draw(st.sampled_from([(64, 64), (60, 106), (4104,), (2, 48, 50), (63, 64), (4100,), (5, 5, 165)]))
    return (N, C) + spatial, G


def reference_call(x, G, w, b, eps, ops):
    y = group_norm_reference(x.double().cpu(), G, None if w is None else w.double().cpu(),
                             None if b is None else b.double().cpu(), eps)
    return epilogue_reference(y, **{k: v.double().cpu() for k, v in ops.items()}, activation="silu")


@given(case=cases(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), kind=st.sampled_from(KINDS),
       affine=st.booleans(), operands=st.sampled_from([(), ("residual",), ("scale", "shift"), ("multiplier",)]))
def test_against_the_reference(case, dtype, kind, affine, operands, device):
    shape, G = case
    g = torch.Generator().manual_seed(hash((shape, G, kind)) % 2**31)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).to(device, dtype)
    C = shape[1]
    w = torch.randn(C, generator=g, dtype=torch.float64).to(device, dtype) if affine else None
    b = torch.randn(C, generator=g, dtype=torch.float64).to(device, dtype) if affine else None
    ops = {}
    for name in operands:
        size = (shape[0], C) if name in ("scale", "shift") else shape
        ops[name] = (torch.randn(size, generator=g, dtype=torch.float64) * 0.5).to(device, dtype)
    xs = strided(x, kind)
    assume(not xs.is_contiguous())  # (one frame or one channel: the view is dense)
    y = fusednorm.group_norm(xs, G, w, b, 1e-5, activation="silu", **ops)
    assert y.is_contiguous() and y.shape == x.shape
    assert_close(y, reference_call(x, G, w, b, 1e-5, ops), dtype, scale=4.0)
    assert torch.equal(fusednorm.group_norm(xs, G, w, b, 1e-5, activation="silu", **ops), y)  # the same bits
    # The statistics the backward reads.
    _, mean, rstd = FORWARD(xs, G, w, b, 1e-5)
    xg = x.double().cpu().reshape(shape[0], G, -1)
    torch.testing.assert_close(mean.double().cpu(), xg.mean(-1), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(rstd.double().cpu(), (xg.var(-1, unbiased=False) + 1e-5).rsqrt(), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_a_strided_input(kind, device):
    # The backward copies the saved input dense: the same gradients as the dense input's.
    torch.manual_seed(0)
    x = torch.randn(3, 8, 64, 64, device=device, dtype=torch.float16)
    w = torch.randn(8, device=device, dtype=torch.float16)
    dy = torch.randn_like(x)
    grads = []
    for view in (x, strided(x, kind)):
        xs = view.detach().requires_grad_()
        out = fusednorm.group_norm(xs, 4, w, None, activation="silu")
        grads.append(torch.autograd.grad(out, xs, dy)[0])
    assert_close(grads[1], grads[0], torch.float16, scale=8.0)


def gpu_kernels(call):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_the_sweep_reads_them_where_they_lie(kind, monkeypatch):
    # Mochi's frames at a middle resolution: the sweep's two kernels, no copy before them.
    x = strided(torch.randn(5, 256, 120, 212, device="cuda", dtype=torch.bfloat16), kind)
    assert not x.is_contiguous()
    names = gpu_kernels(lambda: fusednorm.group_norm(x, 32, activation="silu"))
    assert any("sweep_moments" in n for n in names) and any("sweep_output" in n for n in names), names
    assert not any("copy" in n.lower() or "replication_pad" in n for n in names), names
    # Without the sweep (its override off), the input is copied dense first and another path runs.
    monkeypatch.setenv("FUSEDNORM_SWEEP_FORWARD", "0")
    kernel_paths.reload_overrides()
    names = gpu_kernels(lambda: fusednorm.group_norm(x, 32, activation="silu"))
    assert any("replication_pad_lines_kernel" in n for n in names) and not any("sweep" in n for n in names), names


@pytest.mark.cuda
def test_frame_group_norm_of_a_video_reads_no_copy():
    # fusednorm.nn.FrameGroupNorm on an NCDHW video of one sample: its frames are such a view.
    norm = fusednorm.nn.FrameGroupNorm(32, 128, activation="silu").to("cuda", torch.float16)
    video = torch.randn(1, 128, 7, 60, 106, device="cuda", dtype=torch.float16)
    names = gpu_kernels(lambda: norm(video))
    assert any("sweep_moments" in n for n in names) and not any("copy" in n.lower() or "pad" in n for n in names), names
