"""fusednorm.convert: torch.nn (and timm / diffusers) norm layers swapped for fusednorm's, with the
same parameters, buffers, hooks, modes and state_dict, activations folded only where provably
safe, and the same results forward and backward, in train and eval mode."""

import copy
import importlib

import pytest
import torch
from torch import nn

import fusednorm
import fusednorm.nn as fnn

FUSED = (fnn.GroupNorm, fnn.InstanceNorm1d, fnn.InstanceNorm2d, fnn.InstanceNorm3d, fnn.AdaGroupNorm)


def import_or_skip(name):
    """The module, or a skip naming why (not installed, or e.g. timm without a torchvision)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"optional test dependency {name} not importable: {e}")


@pytest.fixture
def float32_convolutions():
    """Convolutions and matmuls in full float32 for the test, the flags restored after it.

    The model tests compare a converted model with its unconverted copy: the same convolutions
    and matmuls, only the norms differ, and their outputs by float32 rounding (~1e-7). cuDNN runs
    float32 convolutions in TF32 by default (torch.backends.cudnn.allow_tf32 is True), rounding
    their inputs to 10 mantissa bits: a last-bit difference in a norm's output then flips an
    occasional TF32 rounding, a 2^-11 relative step, and the models' outputs drift apart by
    1e-4 to 1e-3 on a GPU (diffusers' tiny UNet 3.2e-4, the autoencoder 1.1e-3) whoever computes
    the norm. In float32 the comparison measures the norms again."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def fused_modules(model):
    return [m for m in model.modules() if isinstance(m, FUSED)]


def assert_equivalent(reference, converted, make_inputs, device, atol=1e-5, rtol=1e-5):
    """Same outputs and parameter gradients, in train then eval mode (two train steps' worth of
    running-statistics updates included), for `converted` and its unconverted copy `reference`."""
    for train in (True, False):
        reference.train(train)
        converted.train(train)
        for _ in range(2):
            torch.manual_seed(0)
            inputs = make_inputs(device)
            out_ref, out = reference(*inputs), converted(*inputs)
            out_ref = out_ref.sample if hasattr(out_ref, "sample") else out_ref
            out = out.sample if hasattr(out, "sample") else out
            torch.testing.assert_close(out, out_ref, atol=atol, rtol=rtol)
            grad = torch.randn_like(out)
            ref_params = [p for p in reference.parameters() if p.requires_grad]
            params = [p for p in converted.parameters() if p.requires_grad]
            g_ref = torch.autograd.grad(out_ref, ref_params, grad, allow_unused=True)
            g = torch.autograd.grad(out, params, grad, allow_unused=True)
            for a, b in zip(g, g_ref):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, atol=10 * atol, rtol=10 * rtol)
        for (name, b), (name_ref, b_ref) in zip(converted.named_buffers(), reference.named_buffers()):
            assert name == name_ref
            torch.testing.assert_close(b, b_ref, atol=atol, rtol=rtol)


def convert_and_check(model, make_inputs, device, atol=1e-5, rtol=1e-5):
    """Converts `model` in place; checks identity of parameters and buffers, state_dict keys and
    equivalence with a deep copy of the original. Returns the converted model."""
    model = model.to(device)
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keys = list(model.state_dict())
    converted = fusednorm.convert(model)
    assert converted is model
    assert list(converted.state_dict()) == keys
    assert all(p is params[name] for name, p in converted.named_parameters())
    assert list(dict(converted.named_parameters())) == list(params)
    assert all(b is buffers[name] for name, b in converted.named_buffers())
    # (A FrameGroupNorm keeps its torch.nn.GroupNorm as the holder of its parameters.)
    holders = {id(m.norm_layer) for m in converted.modules() if type(m) is fnn.FrameGroupNorm}
    assert not any(type(m) in (nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
                   and id(m) not in holders for m in converted.modules())
    assert_equivalent(reference, converted, make_inputs, device, atol, rtol)
    return converted


# -- plain PyTorch -------------------------------------------------------------------------------


class Overriding(nn.GroupNorm):
    def forward(self, input):
        return super().forward(input) * 2


class Plain(nn.GroupNorm):
    """A subclass that keeps torch's forward: converted."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
        self.inorm = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.act = nn.ReLU()  # registered twice: also inside `block`, so never folded
        self.block = nn.Sequential(nn.GroupNorm(4, 8), self.act)
        self.hooked = nn.Sequential(nn.GroupNorm(2, 8), nn.GELU(approximate="tanh"))  # norm gets a forward hook
        self.tail = nn.Sequential(Plain(2, 8), nn.LeakyReLU(0.2), Overriding(2, 8), nn.Mish())
        self.in1 = nn.InstanceNorm1d(8)
        self.in3 = nn.Sequential(nn.InstanceNorm3d(8, affine=True), nn.ReLU(inplace=True))

    def forward(self, x):
        h = self.inorm(self.stem(x))
        h = self.act(self.block(h)) + self.hooked(h)
        h = self.tail(h)
        h = h + self.in1(h.flatten(2)).view_as(h)
        return self.in3(h.unsqueeze(2)).squeeze(2)


def test_plain_model(device):
    torch.manual_seed(0)
    model = Net()
    calls = []
    handle = model.hooked[0].register_forward_hook(lambda m, i, o: calls.append("fwd"))
    model.inorm.register_forward_pre_hook(lambda m, i: calls.append("pre"))
    model.inorm._register_state_dict_hook(lambda m, sd, prefix, local: sd.update({prefix + "extra": torch.ones(1)}))
    model = convert_and_check(model, lambda d: (torch.randn(2, 3, 6, 6, device=d),), device)

    assert len(fused_modules(model)) == 7
    # Folded: Sequential(norm, activation) whose modules are used once and carry no hooks.
    assert model.stem[1].activation == "silu" and type(model.stem[2]) is nn.Identity
    assert model.tail[0].activation == "leaky_relu" and model.tail[0].negative_slope == 0.2
    assert type(model.tail[1]) is nn.Identity
    assert model.in3[0].activation == "relu" and type(model.in3[1]) is nn.Identity
    # Not folded: a reused activation, a hooked norm, the activation after an overriding subclass.
    assert model.block[0].activation is None and model.block[1] is model.act
    assert model.hooked[0].activation is None and type(model.hooked[1]) is nn.GELU
    assert type(model.tail[2]) is Overriding and type(model.tail[3]) is nn.Mish
    # Converted classes, running stats, hooks.
    assert type(model.tail[0]) is fnn.GroupNorm and type(model.in1) is fnn.InstanceNorm1d
    assert type(model.inorm) is fnn.InstanceNorm2d and model.inorm.track_running_stats
    calls.clear()
    model(torch.randn(2, 3, 6, 6, device=device))
    assert calls == ["pre", "fwd"]
    assert "inorm.extra" in model.state_dict()
    handle.remove()  # a handle taken before the conversion still works
    calls.clear()
    model(torch.randn(2, 3, 6, 6, device=device))
    assert calls == ["pre"]


def test_dtype_device_mode_and_optimizer(device):
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.GroupNorm(2, 4), nn.SiLU()).to(device, torch.float64).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fusednorm.convert(model)
    norm = model[1]
    assert type(norm) is fnn.GroupNorm and not norm.training
    assert norm.weight.dtype == torch.float64 and norm.weight.device.type == device
    before = norm.weight.detach().clone()
    model(torch.randn(2, 2, 3, 3, device=device, dtype=torch.float64)).square().sum().backward()
    opt.step()  # the optimizer holds the converted module's parameters
    assert not torch.equal(norm.weight.detach(), before)


def test_inplace_false_leaves_original_untouched():
    model = nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU(), nn.InstanceNorm2d(4))
    converted = fusednorm.convert(model, inplace=False)
    assert converted is not model
    assert [type(m) for m in model] == [nn.GroupNorm, nn.SiLU, nn.InstanceNorm2d]
    assert [type(m) for m in converted] == [fnn.GroupNorm, nn.Identity, fnn.InstanceNorm2d]
    assert converted[0].weight is not model[0].weight
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(converted(x), model(x))


def test_shared_module_stays_shared_and_is_not_folded():
    norm = nn.GroupNorm(2, 4)
    model = nn.ModuleDict({"a": nn.Sequential(norm, nn.SiLU()), "b": nn.Sequential(norm)})
    fusednorm.convert(model)
    assert model["a"][0] is model["b"][0] and type(model["a"][0]) is fnn.GroupNorm
    assert model["a"][0].activation is None and type(model["a"][1]) is nn.SiLU


def test_root_norm_and_fusednorm_modules():
    converted = fusednorm.convert(nn.InstanceNorm3d(4, affine=True))
    assert type(converted) is fnn.InstanceNorm3d and converted.affine
    own = fnn.GroupNorm(2, 4, activation="gelu")
    model = nn.Sequential(own, nn.ReLU())
    fusednorm.convert(model)
    assert model[0] is own and own.activation == "gelu" and type(model[1]) is nn.ReLU
    plain = fnn.GroupNorm(2, 4)
    model = nn.Sequential(plain, nn.GELU())
    fusednorm.convert(model)
    assert model[0] is plain and plain.activation == "gelu" and type(model[1]) is nn.Identity


def test_hooks_block_folding():
    model = nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU(), nn.GroupNorm(2, 4), nn.ReLU())
    model[0].register_full_backward_hook(lambda m, gi, go: None)  # sees the norm's own output gradient
    model[3].register_forward_pre_hook(lambda m, i: None)
    fusednorm.convert(model)
    assert [type(m) for m in model] == [fnn.GroupNorm, nn.SiLU, fnn.GroupNorm, nn.ReLU]
    assert model[0].activation is None and model[2].activation is None


def test_parametrized_norm_is_left_alone():
    model = nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU())
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", nn.Softplus())
    fusednorm.convert(model)
    assert not isinstance(model[0], fnn.GroupNorm) and type(model[1]) is nn.SiLU
    model(torch.randn(2, 4, 3, 3))


# -- diffusers -----------------------------------------------------------------------------------


def tiny_unet():
    diffusers = import_or_skip("diffusers")
    return diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        norm_num_groups=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8,
    )


def test_diffusers_unet(device, float32_convolutions):
    torch.manual_seed(0)
    unet = tiny_unet()
    n_norms = sum(isinstance(m, nn.GroupNorm) for m in unet.modules())
    unet = convert_and_check(unet, lambda d: (torch.randn(2, 3, 8, 8, device=d), torch.tensor([3, 50], device=d)),
                             device, atol=1e-4, rtol=1e-4)
    assert len(fused_modules(unet)) == n_norms > 0
    # ResnetBlock2D.nonlinearity is called on several tensors: never folded.
    assert all(m.activation is None for m in fused_modules(unet))
    assert all(type(m.nonlinearity) is nn.SiLU for m in unet.modules() if type(m).__name__ == "ResnetBlock2D")


def tiny_autoencoder():
    diffusers = import_or_skip("diffusers")
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        norm_num_groups=8, sample_size=8, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )


def test_diffusers_autoencoder(device, float32_convolutions):
    torch.manual_seed(0)
    vae = tiny_autoencoder()
    n_norms = sum(isinstance(m, nn.GroupNorm) for m in vae.modules())
    # Decode a deterministic latent: the posterior sample would draw random numbers.
    vae = convert_and_check(vae, lambda d: (torch.randn(2, 3, 8, 8, device=d),), device, atol=1e-4, rtol=1e-4)
    assert len(fused_modules(vae)) == n_norms > 0


def tiny_k_unet():
    """A UNet2DConditionModel of diffusers' K blocks (the SD x2 latent upscaler's layout, as
    diffusers' own tests build it): ResnetBlockCondNorm2D and KAttentionBlock, whose norms are
    AdaGroupNorm modules modulated by the time embedding."""
    diffusers = import_or_skip("diffusers")
    return diffusers.UNet2DConditionModel(
        act_fn="gelu", attention_head_dim=8, norm_num_groups=None, block_out_channels=(32, 32, 64, 64),
        time_cond_proj_dim=40, conv_in_kernel=1, conv_out_kernel=1, cross_attention_dim=16,
        down_block_types=("KDownBlock2D",) + ("KCrossAttnDownBlock2D",) * 3, in_channels=8, mid_block_type=None,
        out_channels=5, layers_per_block=1, resnet_time_scale_shift="scale_shift", time_embedding_type="fourier",
        timestep_post_act="gelu", up_block_types=("KCrossAttnUpBlock2D",) * 3 + ("KUpBlock2D",),
    )


def k_unet_inputs(device):
    return (torch.randn(2, 8, 16, 16, device=device), torch.tensor([10.0, 500.0], device=device),
            torch.randn(2, 4, 16, device=device), None, torch.randn(2, 40, device=device))


def test_diffusers_ada_group_norm(device, float32_convolutions, caplog):
    import logging

    torch.manual_seed(0)
    unet = tiny_k_unet()
    ada = type(unet.down_blocks[0].resnets[0].norm1)
    n_norms = sum(type(m) is ada for m in unet.modules())
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        unet = convert_and_check(unet, k_unet_inputs, device, atol=1e-4, rtol=1e-4)
    assert f"replaced {n_norms} module(s): {n_norms} AdaGroupNorm -> fusednorm.nn.AdaGroupNorm;" in caplog.text
    assert n_norms == sum(type(m) is fnn.AdaGroupNorm for m in unet.modules()) > 0
    # ResnetBlockCondNorm2D's nonlinearity follows its two norms and nothing else: folded into both.
    resnets = [m for m in unet.modules() if type(m).__name__ == "ResnetBlockCondNorm2D"]
    assert resnets and all(r.norm1.activation == r.norm2.activation == "gelu" and type(r.nonlinearity) is nn.Identity
                           for r in resnets)


def test_diffusers_ada_group_norm_left_alone(device):
    normalization = import_or_skip("diffusers.models.normalization")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model.overriding = type("Other", (normalization.AdaGroupNorm,), {"forward": lambda self, x, emb: x})(6, 8, 2)
    model.kept = type("Kept", (normalization.AdaGroupNorm,), {})(6, 8, 2)
    model.rejected = normalization.AdaGroupNorm(6, 8, 2)
    fusednorm.convert(model, filter_fn=lambda name, m: name != "rejected")
    assert type(model.overriding).__name__ == "Other" and type(model.kept) is fnn.AdaGroupNorm
    assert type(model.rejected) is normalization.AdaGroupNorm


class MochiBlock(nn.Module):
    """diffusers' Mochi resnet block, its output tensor alone (it also returns a cache dict)."""

    def __init__(self, channels=32, chunk_size=2):
        super().__init__()
        mochi = import_or_skip("diffusers.models.autoencoders.autoencoder_kl_mochi")
        self.block = mochi.MochiResnetBlock3D(channels)
        for norm in (self.block.norm1, self.block.norm2):
            norm.chunk_size = chunk_size  # several chunks of frames, concatenated

    def forward(self, x):
        return self.block(x)[0]


def mochi_inputs(device):
    return (torch.randn(2, 32, 5, 4, 3, device=device),)  # 10 frames: chunks of 2, 2 samples


def test_diffusers_mochi_chunked_group_norm(device, float32_convolutions, caplog):
    import logging

    torch.manual_seed(0)
    model = MochiBlock()
    norm_layers = [model.block.norm1.norm_layer, model.block.norm2.norm_layer]
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        model = convert_and_check(model, mochi_inputs, device, atol=1e-4, rtol=1e-4)
    assert ("replaced 4 module(s): 2 CogVideoXCausalConv3d -> CogVideoXCausalConv3dWithReplicationPads, "
            "2 MochiChunkedGroupNorm3D -> fusednorm.nn.FrameGroupNorm;") in caplog.text
    block = model.block
    # Each per-frame norm is one FrameGroupNorm over the same norm_layer, the SiLU after both folded.
    assert type(block.norm1) is type(block.norm2) is fnn.FrameGroupNorm
    assert [block.norm1.norm_layer, block.norm2.norm_layer] == norm_layers
    assert block.norm1.activation == block.norm2.activation == "silu" and type(block.nonlinearity) is nn.Identity


def test_diffusers_mochi_chunked_group_norm_left_alone(device):
    torch.manual_seed(0)
    model = MochiBlock().to(device)
    reference = copy.deepcopy(model)
    chunked = type(model.block.norm1)
    # Its norm_layer rejected by filter_fn: norm1 stays as it is, and so the SiLU it shares with norm2.
    fusednorm.convert(model, filter_fn=lambda name, m: name != "block.norm1.norm_layer")
    assert type(model.block.norm1) is chunked and type(model.block.norm1.norm_layer) is nn.GroupNorm
    assert type(model.block.norm2) is fnn.FrameGroupNorm and model.block.norm2.activation is None
    assert type(model.block.nonlinearity) is nn.SiLU
    assert_equivalent(reference, model, mochi_inputs, device, atol=1e-4, rtol=1e-4)
    # A hook on its norm_layer would see one call instead of one a chunk: not converted either.
    model = MochiBlock()
    model.block.norm2.norm_layer.register_forward_hook(lambda *args: None)
    fusednorm.convert(model)
    assert type(model.block.norm1) is fnn.FrameGroupNorm and type(model.block.norm2) is chunked
    # A subclass overriding forward is not Mochi's computation.
    model = MochiBlock()
    model.block.norm1.__class__ = type("Other", (chunked,), {"forward": lambda self, x: x})
    fusednorm.convert(model)
    assert type(model.block.norm1).__name__ == "Other" and type(model.block.norm2) is fnn.FrameGroupNorm


def hunyuan_inputs(device):
    return (torch.randn(1, 8, 3, 6, 5, device=device),)


def test_diffusers_causal_convolutions_pad_on_fusednorm(device, float32_convolutions, routed_pads, caplog):
    import logging
    import pickle

    import_or_skip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import (
        HunyuanVideoCausalConv3d, HunyuanVideoResnetBlockCausal3D)

    torch.manual_seed(0)
    block = HunyuanVideoResnetBlockCausal3D(8, 16, groups=4)
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        without_pads = fusednorm.convert(copy.deepcopy(block), filter_fn=lambda name, m: not name.startswith("conv"))
        block = convert_and_check(block, hunyuan_inputs, device, atol=1e-4, rtol=1e-4)
    assert "left 3 module(s) alone as filter_fn asked" in caplog.records[0].getMessage()
    assert "3 HunyuanVideoCausalConv3d -> HunyuanVideoCausalConv3dWithReplicationPads" in caplog.records[1].getMessage()
    convs = (block.conv1, block.conv2, block.conv_shortcut)
    assert all(isinstance(c, HunyuanVideoCausalConv3d) and type(c).__name__ == "HunyuanVideoCausalConv3dWithReplicationPads"
               for c in convs)
    assert type(without_pads.conv1) is HunyuanVideoCausalConv3d
    # Every pad of the converted block's convolutions is fusednorm's, the values bit for bit the same.
    (x,) = hunyuan_inputs(device)
    block.eval(), without_pads.to(device).eval()
    routed_pads.clear()
    with torch.no_grad():
        want = without_pads(x)
        assert routed_pads == []
        # conv1, conv2, and the 1x1x1 shortcut's pad by nothing.
        assert torch.equal(block(x), want) and routed_pads == [(1, 8, 5, 8, 7), (1, 16, 5, 8, 7), (1, 8, 3, 6, 5)]
        # Outside their forward nothing is routed; pickled or copied, the module stays converted.
        torch.nn.functional.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate")
        assert len(routed_pads) == 3
        for again in (pickle.loads(pickle.dumps(block)), copy.deepcopy(block)):
            assert type(again.conv1) is type(block.conv1) and torch.equal(again(x), want)
        assert len(routed_pads) == 9
        # Converted again: nothing more to do.
        assert fusednorm.convert(block) is block and type(block.conv1) is type(convs[0])
        # Under torch.compile the convolutions' own forward is traced, with F.pad as written.
        compiled = torch.compile(block, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), want) and len(routed_pads) == 9


def test_diffusers_mochi_causal_convolutions(device, routed_pads):
    import_or_skip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d

    torch.manual_seed(0)
    # Mochi's causal convolutions: CogVideoX's in pad_mode "replicate", whose call returns
    # (output, conv_cache); in CogVideoX's own pad_mode "constant" they pad nothing by replication.
    model = nn.ModuleDict({"mochi": CogVideoXCausalConv3d(4, 6, 3, pad_mode="replicate"),
                           "cogvideox": CogVideoXCausalConv3d(4, 6, 3)}).to(device)
    reference = copy.deepcopy(model)
    fusednorm.convert(model)
    assert all(isinstance(c, CogVideoXCausalConv3d) and type(c) is not CogVideoXCausalConv3d for c in model.values())
    x = torch.randn(2, 4, 3, 5, 6, device=device)

    def outputs(m):
        return [t for c in m.values() for t in c(x)]

    with torch.no_grad():
        got, want = outputs(model), outputs(reference)
        assert got[1] is None and got[3] is not None
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(got, want)) and len(routed_pads) == 1
        # diffusers' framewise decoding finds Mochi's causal convolutions by isinstance and
        # switches them to pad_mode "constant": a converted one follows, and routes nothing then.
        for m in (model, reference):
            for c in m.modules():
                if isinstance(c, CogVideoXCausalConv3d):
                    c.pad_mode = "constant"
        got, want = outputs(model), outputs(reference)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(routed_pads) == 1


def test_diffusers_more_causal_convolutions(device, routed_pads):
    import_or_skip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_kvae_video import KVAECachedCausalConv3d, KVAECausalConv3d
    from diffusers.models.autoencoders.autoencoder_kl_magvit import EasyAnimateCausalConv3d

    torch.manual_seed(0)
    # EasyAnimate's pads time by replication and runs a convolution a frame; KVAE's pad all three
    # dimensions, or height and width with the first frame's copies before time (the cached one).
    model = nn.ModuleDict({"easyanimate": EasyAnimateCausalConv3d(4, 6, 3), "kvae": KVAECausalConv3d(4, 6, 3),
                           "kvae_cached": KVAECachedCausalConv3d(4, 6, 3)}).to(device)
    reference = copy.deepcopy(model)
    classes = {name: type(c) for name, c in model.items()}
    fusednorm.convert(model)
    assert all(isinstance(c, classes[name]) and type(c).__name__ == classes[name].__name__ + "WithReplicationPads"
               for name, c in model.items())
    x = torch.randn(2, 4, 3, 5, 6, device=device)

    def outputs(m):
        m.easyanimate._clear_conv_cache()
        return [m.easyanimate(x), m.kvae(x), m.kvae_cached(x, {"padding": None})]

    with torch.no_grad():
        want = outputs(reference)
        assert routed_pads == []
        got = outputs(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert routed_pads == [(2, 4, 5, 5, 6), (2, 4, 5, 7, 8), (2, 4, 3, 7, 8)]


# diffusers' autoencoders whole, from small configs (their published configs are the ones
# benchmarks/diffusers_bench.py measures): what convert replaces and folds in them, checked
# against the unconverted model forward and backward. name -> (class, config, input shape, keywords
# of the call); a model whose forward does not decode whole (Allegro's encoder needs tiles) is
# called by its decode, its input a latent.
_TINY = dict(block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8)
DIFFUSERS_AUTOENCODERS = {
    "flux2": ("AutoencoderKLFlux2", dict(_TINY, down_block_types=("DownEncoderBlock2D",) * 2,
                                         up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=8),
              (1, 3, 16, 16), {}),
    "svd_temporal_decoder": ("AutoencoderKLTemporalDecoder",
                             dict(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                                  layers_per_block=1), (2, 3, 16, 16), {"num_frames": 2}),
    "kvae": ("AutoencoderKLKVAE", dict(channels=32, ch_mult=(1, 2), num_enc_blocks=1, num_dec_blocks=1, z_channels=4),
             (1, 3, 16, 16), {}),
    "kvae_video": ("AutoencoderKLKVAEVideo",
                   dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, temporal_compress_times=2),
                   (1, 3, 5, 16, 16), {}),
    "easyanimate": ("AutoencoderKLMagvit",
                    dict(_TINY, down_block_types=("SpatialDownBlock3D", "SpatialTemporalDownBlock3D"),
                         up_block_types=("SpatialUpBlock3D", "SpatialTemporalUpBlock3D"), latent_channels=4),
                    (1, 3, 5, 16, 16), {}),
    "cosmos": ("AutoencoderKLCosmos",
               dict(encoder_block_out_channels=(16, 32), decode_block_out_channels=(16, 32), attention_resolutions=(),
                    resolution=16, num_layers=1, spatial_compression_ratio=4, temporal_compression_ratio=4,
                    latents_mean=None, latents_std=None), (1, 3, 5, 16, 16), {}),
    "allegro_decode": ("AutoencoderKLAllegro",
                       dict(_TINY, down_block_types=("AllegroDownBlock3D",) * 2,
                            up_block_types=("AllegroUpBlock3D",) * 2, temporal_downsample_blocks=(True, False),
                            temporal_upsample_blocks=(False, True), sample_size=16, temporal_compression_ratio=2),
                       (1, 4, 12, 8, 8), {"decode": True}),
    "hunyuanimage": ("AutoencoderKLHunyuanImage",  # (its GroupNorms take 32 groups whatever the config)
                     dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(32, 64),
                          layers_per_block=1, spatial_compression_ratio=2, sample_size=16), (1, 3, 16, 16), {}),
}


class WholeCall(nn.Module):
    """An autoencoder's forward (or decode), its output tensor alone."""

    def __init__(self, vae, decode=False, **keywords):
        super().__init__()
        self.vae, self.decode, self.keywords = vae, decode, keywords

    def forward(self, x):
        if self.decode:
            return self.vae.decode(x).sample
        return self.vae(x, **self.keywords).sample


@pytest.mark.parametrize("name", list(DIFFUSERS_AUTOENCODERS))
def test_diffusers_autoencoders_whole(name, device, float32_convolutions, routed_pads):
    diffusers = import_or_skip("diffusers")
    cls_name, config, shape, keywords = DIFFUSERS_AUTOENCODERS[name]
    torch.manual_seed(0)
    vae = getattr(diffusers, cls_name)(**config)
    if cls_name == "AutoencoderKLAllegro":
        vae.use_tiling = True  # (its decode has no other way)
    for m in vae.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # (Allegro's temporal convolutions': train mode would draw two masks)
    n_norms = sum(isinstance(m, nn.GroupNorm) for m in vae.modules())
    model = convert_and_check(WholeCall(vae, **keywords), lambda d: (torch.randn(*shape, device=d),), device,
                              atol=1e-4, rtol=1e-4)
    assert len(fused_modules(model)) == n_norms > 0
    # The convolutions that pad by replication (the video VAEs' causal ones, KVAE's torch convolutions
    # of padding_mode "replicate") route their pads (here on the CPU too).
    padded = [m for m in model.modules() if type(m).__name__.endswith("WithReplicationPads")]
    assert bool(padded) == (name in ("kvae", "kvae_video", "easyanimate")) and bool(routed_pads) == bool(padded)


# diffusers' video UNets, from small configs: ModelScope's UNet3DConditionModel (whose temporal
# convolutions are nn.Sequential(GroupNorm, SiLU, ...), folded), Stable Video Diffusion's
# UNetSpatioTemporalConditionModel and AnimateDiff's UNetMotionModel. name -> (class, config, (sample, context) shapes, keywords'
# shapes); the timestep is fixed.
DIFFUSERS_VIDEO_UNETS = {
    "unet_3d": ("UNet3DConditionModel",
                dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=16,
                     attention_head_dim=8, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                     up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), sample_size=8, in_channels=4,
                     out_channels=4),
                ((1, 4, 3, 8, 8), (1, 5, 16)), {}),
    "unet_spatio_temporal": ("UNetSpatioTemporalConditionModel",
                             dict(block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=16,
                                  num_attention_heads=(2, 4),
                                  down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                                  up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
                                  sample_size=8, in_channels=8, out_channels=4,
                                  projection_class_embeddings_input_dim=3 * 8, addition_time_embed_dim=8),
                             ((1, 3, 8, 8, 8), (1, 1, 16)), {"added_time_ids": (1, 3)}),
    # (its callers repeat the context a frame: (N * F, L, D))
    "unet_motion": ("UNetMotionModel",
                    dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=16,
                         down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
                         up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"), sample_size=8, in_channels=4,
                         out_channels=4, num_attention_heads=2, motion_num_attention_heads=2,
                         motion_max_seq_length=8),
                    ((1, 4, 3, 8, 8), (3, 5, 16)), {}),
}


class UNetCall(nn.Module):
    """A diffusers UNet at a fixed timestep, its sample alone."""

    def __init__(self, unet, **keywords):
        super().__init__()
        self.unet, self.keywords = unet, keywords

    def forward(self, sample, context, *extra):
        extra = dict(zip(self.keywords, extra))
        return self.unet(sample, torch.tensor([10.0], device=sample.device), context, **extra).sample


@pytest.mark.parametrize("name", list(DIFFUSERS_VIDEO_UNETS))
def test_diffusers_video_unets_whole(name, device, float32_convolutions):
    diffusers = import_or_skip("diffusers")
    cls_name, config, (sample, context), keywords = DIFFUSERS_VIDEO_UNETS[name]
    torch.manual_seed(0)
    unet = getattr(diffusers, cls_name)(**config)
    for m in unet.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    n_norms = sum(isinstance(m, nn.GroupNorm) for m in unet.modules())

    def inputs(d):
        return (torch.randn(*sample, device=d), torch.randn(*context, device=d),
                *(torch.randn(*shape, device=d) for shape in keywords.values()))

    model = convert_and_check(UNetCall(unet, **keywords), inputs, device, atol=1e-4, rtol=1e-4)
    assert len(fused_modules(model)) == n_norms > 0
    folded = [m for m in fused_modules(model) if m.activation is not None]
    assert bool(folded) == (name == "unet_3d")


# -- timm ----------------------------------------------------------------------------------------


def test_timm_group_norm_act(device, float32_convolutions):
    timm = import_or_skip("timm")
    from timm.layers import GroupNormAct

    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet_gn", pretrained=False, num_classes=10, drop_rate=0.0)
    acts = [type(m.act) for m in model.modules() if isinstance(m, GroupNormAct)]
    assert acts and nn.SiLU in acts
    model = convert_and_check(model, lambda d: (torch.randn(2, 3, 32, 32, device=d),), device, atol=1e-4, rtol=1e-4)
    norms = fused_modules(model)
    assert len(norms) == len(acts)
    assert [m.activation for m in norms] == ["silu" if a is nn.SiLU else None for a in acts]
    assert not any(isinstance(m, GroupNormAct) for m in model.modules())


def test_timm_group_norm_act_variants():
    import_or_skip("timm")
    from timm.layers import GroupNorm1Act, GroupNormAct

    model = nn.Sequential(
        GroupNormAct(8, 2, act_layer="gelu_tanh"),
        GroupNorm1Act(8, act_layer="leaky_relu"),
        GroupNormAct(8, 2, act_layer="hard_swish"),  # unsupported activation: left alone
        GroupNormAct(8, 2, act_layer="relu", drop_layer=nn.Dropout),  # a drop layer: left alone
        GroupNormAct(8, 4, apply_act=False),
        GroupNormAct(8, 2, act_layer="silu"),  # its act has a hook: left alone
    )
    model[5].act.register_forward_hook(lambda m, i, o: None)
    reference = copy.deepcopy(model)
    fusednorm.convert(model)
    assert [getattr(m, "activation", "unconverted") for m in model] == [
        "gelu_tanh", "leaky_relu", "unconverted", "unconverted", None, "unconverted"]
    assert list(model.state_dict()) == list(reference.state_dict())
    x = torch.randn(2, 8, 4, 4)
    torch.testing.assert_close(model.eval()(x), reference.eval()(x))


# -- filter_fn and the logged summary ------------------------------------------------------------


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 8, 1), nn.GroupNorm(2, 8), nn.SiLU())
        self.skip = nn.Sequential(nn.InstanceNorm2d(8, affine=True), nn.ReLU())
        self.head = nn.Sequential(nn.GroupNorm(4, 8), nn.GELU())

    def forward(self, x):
        h = self.block(x)
        return self.head(self.skip(h) + h)


def test_filter_fn_chooses_what_is_converted(device):
    torch.manual_seed(0)
    model = Encoder().to(device)
    reference = copy.deepcopy(model)
    asked = []

    def filter_fn(name, module):
        asked.append((name, type(module)))
        return not name.startswith("head.")

    fusednorm.convert(model, filter_fn=filter_fn)
    # Asked about the norm layers only, by their qualified names.
    assert asked == [("block.1", nn.GroupNorm), ("skip.0", nn.InstanceNorm2d), ("head.0", nn.GroupNorm)]
    assert type(model.block[1]) is fnn.GroupNorm and model.block[1].activation == "silu"
    assert type(model.block[2]) is nn.Identity
    assert type(model.skip[0]) is fnn.InstanceNorm2d and model.skip[0].activation == "relu"
    # Rejected: left as it is, its activation not folded.
    assert type(model.head[0]) is nn.GroupNorm and type(model.head[1]) is nn.GELU
    assert_equivalent(reference, model, lambda d: (torch.randn(2, 4, 5, 5, device=d),), device)


def test_filter_fn_on_shared_fused_and_root_modules():
    norm = nn.GroupNorm(2, 4)
    model = nn.ModuleDict({"a": nn.Sequential(norm), "b": nn.Sequential(norm)})
    fusednorm.convert(model, filter_fn=lambda name, m: name == "a.0")  # rejected under "b.0"
    assert model["a"][0] is norm and model["b"][0] is norm and type(norm) is nn.GroupNorm
    fusednorm.convert(model, filter_fn=lambda name, m: name in ("a.0", "b.0"))
    assert model["a"][0] is model["b"][0] and type(model["a"][0]) is fnn.GroupNorm
    # A fusednorm module already there gets no activation folded when rejected.
    own = fnn.GroupNorm(2, 4)
    seq = nn.Sequential(own, nn.SiLU())
    fusednorm.convert(seq, filter_fn=lambda name, m: False)
    assert own.activation is None and type(seq[1]) is nn.SiLU
    root = nn.InstanceNorm1d(4)
    assert fusednorm.convert(root, filter_fn=lambda name, m: name != "") is root


def test_convert_logs_a_summary(caplog):
    import logging

    model = Encoder()
    with caplog.at_level(logging.DEBUG, logger="fusednorm"):
        fusednorm.convert(model, filter_fn=lambda name, m: name != "head.0")
    infos = [r for r in caplog.records if r.name == "fusednorm" and r.levelno == logging.INFO]
    assert len(infos) == 1
    message = infos[0].getMessage()
    assert "replaced 2 module(s): 1 GroupNorm -> fusednorm.nn.GroupNorm, " \
           "1 InstanceNorm2d -> fusednorm.nn.InstanceNorm2d" in message
    assert "folded 2 activation(s): 'block.2' (SiLU) into 'block.1', 'skip.1' (ReLU) into 'skip.0'" in message
    assert "left 1 module(s) alone as filter_fn asked" in message
    debugs = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert "fusednorm.convert: 'block.1': GroupNorm -> fusednorm.nn.GroupNorm (activation='silu')" in debugs
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        fusednorm.convert(nn.Sequential(nn.Conv2d(2, 2, 1)))
    assert [r.getMessage() for r in caplog.records] == ["fusednorm.convert: replaced 0 module(s); folded 0 activation(s)"]
