"""fusednorm.replication_pad, the fusion backend's pad after a fused op: F.pad(mode="replicate")
exactly (a copy: compared for equality), on every dtype, padding rank and awkward shape, in the
input's suggested memory format (channels-last kept); its errors are PyTorch's; autograd, opcheck."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from torch._prims_common import suggest_memory_format

import fusednorm  # noqa: F401  (registers the ops)

pad_op = torch.ops.fusednorm.replication_pad


def reference(x, padding):
    return F.pad(x, tuple(padding), mode="replicate")


@st.composite
def pad_cases(draw):
    dims = draw(st.integers(1, 3))
    batched = draw(st.booleans())
    lead = [draw(st.integers(1, 3)) for _ in range(2 if batched else 1)]
    # The last dimension short (the rows kernel) or long (the lines kernel, from 256-byte rows).
    sizes = [draw(st.integers(1, 9)) for _ in range(dims - 1)] + [draw(st.one_of(st.integers(1, 9),
                                                                                  st.integers(120, 300)))]
    padding = [draw(st.integers(0, 11)) for _ in range(2 * dims)]  # wider than the input, too
    return lead + sizes, padding


@given(case=pad_cases(), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
@example(case=([1, 3, 2, 7, 9], [1, 1, 1, 1, 2, 0]), dtype=torch.float16, seed=0)  # a causal conv's pad
@example(case=([2, 1], [0, 0]), dtype=torch.float32, seed=0)  # unbatched 1-d, no padding
def test_matches_f_pad(case, dtype, seed, device):
    sizes, padding = case
    offset = seed % 4  # the first element 0-3 elements past a 16-byte line
    numel = torch.Size(sizes).numel()
    x = torch.randn(numel + offset, generator=torch.Generator().manual_seed(seed)).to(device, dtype)[offset:].view(sizes)
    out = pad_op(x, padding)
    ref = reference(x, padding)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.stride() == ref.stride()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape, padding", [
    ((1, 128, 9, 48, 64), (1, 1, 1, 1, 2, 0)),
    ((3, 5, 1300), (3, 0)),  # rows of several of the kernel's 2 KiB items
    ((1, 2, 3, 4, 1100), (2, 1, 0, 3, 1, 1)),
])
@pytest.mark.parametrize("offset", [0, 1, 3])  # the input's first element that far past a 16-byte line
def test_long_rows_and_unaligned_inputs(shape, padding, dtype, offset, device):
    numel = torch.Size(shape).numel()
    x = torch.randn(numel + offset, device=device).to(dtype)[offset:].view(shape)
    assert x.is_contiguous()
    assert torch.equal(pad_op(x, list(padding)), reference(x, padding))


@pytest.mark.parametrize("make", [
    lambda x: x.to(memory_format=torch.channels_last_3d),
    lambda x: x.transpose(-1, -2),
    lambda x: x[..., ::2],
    lambda x: x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4),  # Mochi's frames, permuted back
    lambda x: x.to(memory_format=torch.channels_last_3d)[..., 1:],  # channels-last strides, not dense
])
def test_non_contiguous_input(make, device):
    x = make(torch.randn(2, 3, 4, 5, 6, device=device))
    out = pad_op(x, [1, 2, 0, 1, 2, 0])
    ref = reference(x, [1, 2, 0, 1, 2, 0])
    assert torch.equal(out, ref) and out.stride() == ref.contiguous(memory_format=suggest_memory_format(x)).stride()


@st.composite
def strided_rows_cases(draw):
    """An input whose rows are contiguous but whose other dimensions have any strides: a permutation
    of the dimensions before the last (a video's frames viewed back is one), then slices of them."""
    sizes, padding = draw(pad_cases())
    order = draw(st.permutations(range(len(sizes) - 1))) + [len(sizes) - 1]
    steps = [draw(st.integers(1, 2)) for _ in range(len(sizes) - 1)] + [1]
    return sizes, padding, order, steps


@given(case=strided_rows_cases(), dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
@example(case=([1, 4, 3, 5, 130], [1, 1, 1, 1, 2, 0], [0, 2, 1, 3, 4], [1, 1, 1, 1, 1]), dtype=torch.float16, seed=0)
def test_strided_rows_match_f_pad(case, dtype, seed, device):
    sizes, padding, order, steps = case
    # Allocated in the permuted order and sliced, then viewed in the given one.
    big = [sizes[d] * steps[d] for d in order]
    base = torch.randn(big, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    x = base[tuple(slice(None, None, steps[d]) for d in order)].permute(*[order.index(d) for d in range(len(sizes))])
    assert x.shape == tuple(sizes) and (x.stride(-1) == 1 or x.shape[-1] == 1)
    out = pad_op(x, padding)
    ref = reference(x, padding)
    assert torch.equal(out, ref)
    want = torch.empty(ref.shape, memory_format=suggest_memory_format(x)).stride()
    assert all(a == b for a, b, n in zip(out.stride(), want, out.shape) if n > 1), (out.stride(), want)


def test_strided_rows_are_not_copied_first(device):
    """A video's frames viewed back (rows contiguous, dense in no layout) is padded from where it
    is: the call allocates its output alone, no dense copy of the input (which the kernels' rows
    path made before it read strides)."""
    if device != "cuda":
        pytest.skip("the CPU op is ATen's pad")
    frames = torch.randn(1, 9, 64, 20, 130, device=device, dtype=torch.float16)  # (N, T, C, H, W)
    x = frames.permute(0, 2, 1, 3, 4)  # (N, C, T, H, W), dense in no layout
    padding = [1, 1, 1, 1, 2, 0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = pad_op(x, padding)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < out.numel() * out.element_size() + x.numel() * x.element_size() // 2, peak
    assert torch.equal(out, reference(x, padding)) and out.is_contiguous()


@st.composite
def channels_last_cases(draw):
    spatial = draw(st.integers(2, 3))
    # Channel counts whose vectors take every unit width (2-16 bytes) on every dtype.
    channels = draw(st.one_of(st.integers(1, 20), st.sampled_from([24, 64, 72, 128])))
    sizes = [draw(st.integers(1, 4)), channels] + [draw(st.integers(1, 7)) for _ in range(spatial)]
    padding = [draw(st.integers(0, 9)) for _ in range(2 * spatial)]
    return sizes, padding


@given(case=channels_last_cases(), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       offset=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_channels_last_matches_f_pad(case, dtype, offset, seed, device):
    # Random channels-last inputs, the input `offset` batch entries into a larger tensor (its
    # address then a vector's bytes times the spatial size past the allocation's).
    sizes, padding = case
    fmt = torch.channels_last if len(sizes) == 4 else torch.channels_last_3d
    big = torch.randn([sizes[0] + offset] + sizes[1:], generator=torch.Generator().manual_seed(seed))
    x = big.to(device, dtype).contiguous(memory_format=fmt)[offset:]
    out = pad_op(x, padding)
    ref = reference(x, padding)
    assert torch.equal(out, ref)
    want = torch.empty(ref.shape, memory_format=suggest_memory_format(x)).stride()
    assert all(a == b for a, b, n in zip(out.stride(), want, out.shape) if n > 1), (out.stride(), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape, padding", [
    ((1, 128, 9, 12, 16), (1, 1, 1, 1, 2, 0)),  # a causal convolution's pad, 16-byte channel vectors
    ((2, 3, 4, 5, 6), (2, 0, 1, 3, 0, 4)),  # 3 channels: vectors of 6-24 bytes
    ((3, 12, 2, 3, 4), (5, 5, 4, 4, 3, 3)),  # padding wider than the input
    ((2, 1, 3, 4, 5), (1, 1, 1, 1, 1, 1)),  # one channel
    ((2, 20, 7, 9), (1, 2, 3, 0)),  # 4-D, channels_last
    ((1, 6, 1, 1), (2, 3, 1, 0)),
])
@pytest.mark.parametrize("offset", [0, 1])  # the input one batch entry into a larger tensor
def test_channels_last_input(shape, padding, dtype, offset, device):
    # A batched input dense in channels_last(_3d), padded in every spatial dimension: the
    # channels-last kernel (its units of 2-16 bytes by the vectors' bytes and the input's address),
    # and the output in the same format.
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    big = torch.randn((shape[0] + offset,) + shape[1:], device=device).to(dtype).to(memory_format=fmt)
    x = big[offset:]
    assert suggest_memory_format(x) == fmt and x.is_contiguous(memory_format=fmt)
    out = pad_op(x, list(padding))
    ref = reference(x, padding)
    assert torch.equal(out, ref)
    # The strides of an empty tensor in that format (those of dimensions of size 1 are free).
    want = torch.empty(ref.shape, memory_format=fmt).stride()
    assert out.is_contiguous(memory_format=fmt)
    assert all(a == b for a, b, n in zip(out.stride(), want, out.shape) if n > 1), (out.stride(), want)


def test_nan_and_inf_are_copied(device):
    x = torch.tensor([[[float("nan"), float("inf"), -float("inf"), -0.0]]], device=device)
    out = pad_op(x, [2, 3])
    assert torch.equal(out.isnan(), reference(x, [2, 3]).isnan())
    torch.testing.assert_close(out, reference(x, [2, 3]), equal_nan=True)
    assert torch.signbit(out[0, 0, -1])


def outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (the type and message are what is compared)
        return e


@pytest.mark.parametrize("shape, padding, dtype", [
    ((2, 3, 4), (-1, 1), torch.float32),                 # negative padding crops
    ((2, 3, 4), (1, 1, 1), torch.float32),               # odd length
    ((2, 3, 4), (1, 1, 1, 1, 1, 1, 1, 1), torch.float32),  # four padded dimensions
    ((4,), (1, 1), torch.float32),                       # too few dimensions
    ((1, 2, 3, 4, 5), (1, 1), torch.float32),            # too many for a 1-d pad
    ((2, 0, 4), (1, 1), torch.float32),                  # an empty batch dimension
    ((2, 3, 0), (1, 1), torch.float32),                  # an empty padded dimension
    ((2, 3, 4), (1, 1), torch.int64),                    # an integer dtype
    ((2, 3, 4), (1, 1), torch.complex64),
])
def test_other_calls_are_atens(shape, padding, dtype, device):
    # Same result, or the same exception type and message, as F.pad.
    x = torch.ones(shape, device=device, dtype=dtype)
    got, want = outcome(lambda: pad_op(x, list(padding))), outcome(lambda: reference(x, padding))
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
    else:
        assert torch.equal(got, want)


def test_gradients_are_atens(device):
    x = torch.randn(2, 3, 4, 5, device=device, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: pad_op(t, [1, 2, 3, 0]), (x,))
    torch.autograd.gradgradcheck(lambda t: pad_op(t, [1, 2, 3, 0]), (x,))
    with torch.no_grad():  # no graph: the kernel op
        assert torch.equal(pad_op(x, [1, 2, 3, 0]), reference(x, [1, 2, 3, 0]))


def test_forward_mode_and_vmap(device):
    x, t = torch.randn(2, 3, 5, device=device, dtype=torch.float64), torch.randn(2, 3, 5, device=device,
                                                                                dtype=torch.float64)
    out, tangent = torch.func.jvp(lambda a: pad_op(a, [2, 1]), (x,), (t,))
    assert torch.equal(out, reference(x, [2, 1])) and torch.equal(tangent, reference(t, [2, 1]))
    batched = torch.func.vmap(lambda a: pad_op(a, [2, 1]))(x)
    assert torch.equal(batched, reference(x, [2, 1]))


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(requires_grad, device):
    x = torch.randn(2, 3, 4, 5, 6, device=device, requires_grad=requires_grad)
    torch.library.opcheck(pad_op.default, (x, [1, 1, 1, 1, 2, 0]))
    torch.library.opcheck(pad_op.default, (x[0, 0], [0, 3]))
    # A channels-last input: the fake's strides are the kernel's (the input's format, kept).
    torch.library.opcheck(pad_op.default, (x.detach().to(memory_format=torch.channels_last_3d).requires_grad_(requires_grad),
                                           [1, 1, 1, 1, 2, 0]))
    torch.library.opcheck(pad_op.default, (x[:, :, 0].detach().to(memory_format=torch.channels_last).requires_grad_(requires_grad),
                                           [1, 2, 0, 1]))


def test_compiled_with_dynamic_shapes(device):
    # Under torch.compile the fake kernel gives Inductor the op's output strides (either format),
    # shapes symbolic; a wrong stride would fail Inductor's assert_size_stride or the values.
    compiled = torch.compile(lambda t: pad_op(t, [1, 1, 1, 1, 2, 0]) * 2, dynamic=True, fullgraph=True)
    for shape in [(2, 8, 3, 4, 5), (3, 8, 4, 6, 7), (1, 3, 2, 5, 5)]:
        for fmt in [torch.contiguous_format, torch.channels_last_3d]:
            x = torch.randn(shape, device=device).contiguous(memory_format=fmt)
            out = compiled(x)
            assert torch.equal(out, reference(x, (1, 1, 1, 1, 2, 0)) * 2)
            assert out.is_contiguous(memory_format=fmt)
