"""fusednorm.fusion: the torch.compile backend that rewrites PyTorch's group_norm / instance_norm
plus elementwise epilogues into fusednorm's fused ops, and leaves everything else alone."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusednorm import fusion
from test_convert import DIFFUSERS_AUTOENCODERS, DIFFUSERS_VIDEO_UNETS, UNetCall, WholeCall, import_or_skip


class Recording(fusion.FusionBackend):
    """The fusion backend, also keeping the code of each graph after the rewrite."""

    def __init__(self, inner="aot_eager"):
        super().__init__(inner)
        self.code = []

    def __call__(self, gm, example_inputs):
        compiled = super().__call__(gm, example_inputs)
        self.code.append(gm.code)
        return compiled


def compile_and_compare(module, inputs, backend, backward=True, dynamic=False, atol=1e-5, rtol=1e-5):
    """Eager vs compiled with `backend`: outputs, gradients of inputs and parameters, buffers."""
    torch._dynamo.reset()
    compiled_module = torch.compile(module, backend=backend, dynamic=dynamic)
    leaves = [t for t in inputs if t.is_floating_point()] + [p for p in module.parameters()]
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    results = []
    for fn in (module, compiled_module):
        args = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
        out = fn(*args)
        out = out.sample if hasattr(out, "sample") else out
        grads = None
        if backward:
            arg_leaves = [a for a in args if a.requires_grad] + list(module.parameters())
            grads = torch.autograd.grad(out, arg_leaves, torch.ones_like(out), allow_unused=True)
        results.append((out, grads, [b.clone() for b in module.buffers()]))
    (out_ref, g_ref, b_ref), (out, g, b) = results
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=rtol)
    for x, y in zip(b, b_ref):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)
    if backward:
        assert len(g) == len(leaves)
        for x, y in zip(g, g_ref):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(x, y, atol=10 * atol, rtol=10 * rtol)
    return out


# -- hand-written modules ------------------------------------------------------------------------


class Epilogues(nn.Module):
    def __init__(self, case, C=8):
        super().__init__()
        self.case = case
        self.gn = nn.GroupNorm(4, C)
        self.inorm = nn.InstanceNorm2d(C, affine=True, track_running_stats=True)
        self.act = nn.LeakyReLU(0.2)
        self.emb = nn.Linear(C, 2 * C)

    def forward(self, x, r):
        c = self.case
        scale, shift = self.emb(x.mean((2, 3)))[:, :, None, None].chunk(2, dim=1)
        if c == "scale_shift_silu":  # AdaGN: 1 fusion with scale, shift, silu
            return F.silu(self.gn(x) * (1 + scale) + shift)
        if c == "residual_relu":  # 1 fusion with residual, relu (in place)
            return F.relu(r + self.gn(x), inplace=True)
        if c == "instance_all":  # running stats updated; residual, leaky_relu module, multiplier
            return r * self.act(self.inorm(x) + r)
        if c == "aten_gelu":  # torch.group_norm, +=, gelu(tanh), Tensor.mul by a multiplier
            y = torch.group_norm(x, 2, self.gn.weight, None, 1e-3)
            y += r
            return F.gelu(y, approximate="tanh").mul(r)
        if c == "functional_instance_mish":  # F.instance_norm without stats, shift then mish
            return F.mish(F.instance_norm(x, eps=1e-4) + shift) - 1
        if c == "used_twice":  # the norm output has two users: nothing fused
            y = self.gn(x)
            return F.silu(y) + y
        if c == "in_place_method":  # y.add_(r) then F.relu(y): y has two users, nothing fused
            y = self.gn(x)
            y.add_(r)
            return F.relu(y)
        if c == "mutated_operand":  # r2 is modified in place later: not taken as an operand
            r2 = r.clone()
            y = F.silu(self.gn(x) + r2)
            r2.mul_(2)
            return y * r2
        if c == "mutation_between":  # (forward only) r2 changes through an alias before the
            r2 = r.clone()           # activation: only norm + residual are fused
            alias = r2[:]
            y = self.gn(x) + r2
            alias.mul_(2)
            return F.silu(y) * r2
        if c == "scale_computed_early":  # s changes (through an alias) after 1 + s: no scale taken
            s = scale.clone()
            alias = s[:]
            factor = 1 + s
            alias.zero_()
            return F.silu(self.gn(x) * factor + shift + s)
        if c == "grad_mode":  # the norm runs without grad, its activation with it: nothing fused
            with torch.no_grad():
                y = self.gn(x)
            return F.silu(y) + x
        if c == "promotion":  # a float64 residual would promote: nothing fused
            return F.relu(self.gn(x) + r.double()).float()
        if c == "reordered":  # residual before shift: only the residual is fused, shift stays outside
            return F.silu(self.gn(x) + r + shift)
        if c == "broadcast":  # a (1, C, 1, 1) shift and a scalar scale are not epilogue operands
            return F.silu(self.gn(x) * 2.0 + self.gn.bias[None, :, None, None])
        raise ValueError(c)


CASES = {  # case -> expected number of fusions, and text expected in the rewritten graph
    "scale_shift_silu": (1, "scale = ", "shift = ", "activation = 'silu'"),
    "residual_relu": (1, "residual = ", "activation = 'relu'"),
    "instance_all": (1, "fusednorm.instance_norm", "residual = ", "activation = 'leaky_relu'",
                     "negative_slope = 0.2", "multiplier = "),
    "aten_gelu": (1, "residual = ", "activation = 'gelu_tanh'", "multiplier = "),
    "functional_instance_mish": (1, "fusednorm.instance_norm", "shift = ", "activation = 'mish'"),
    "used_twice": (0,),
    "in_place_method": (0,),
    "mutated_operand": (0,),
    "mutation_between": (1, "residual = ", "torch.nn.functional.silu"),
    "scale_computed_early": (0,),
    "grad_mode": (0,),
    "promotion": (0,),
    "reordered": (1, "residual = ", "torch.nn.functional.silu"),
    "broadcast": (0,),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hand_written(case, device):
    torch.manual_seed(0)
    module = Epilogues(case).to(device)
    x, r = torch.randn(2, 8, 5, 6, device=device), torch.randn(2, 8, 5, 6, device=device)
    backend = Recording()
    if case == "mutation_between":  # backward would see the saved residual modified, and raise
        with torch.no_grad():
            compile_and_compare(module, [x, r], backend, backward=False)
    else:
        compile_and_compare(module, [x, r], backend)
    expected, *snippets = CASES[case]
    assert backend.fusions == [expected]
    for snippet in snippets:
        assert snippet in backend.code[0], (snippet, backend.code[0])
    if expected == 0:
        assert "fusednorm" not in backend.code[0]
    else:
        assert "torch.nn.functional.group_norm" not in backend.code[0]


def test_dynamic_shapes():
    torch.manual_seed(0)
    module = Epilogues("scale_shift_silu")
    backend = Recording()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, dynamic=True)
    for shape in [(2, 8, 5, 6), (3, 8, 7, 4)]:
        x, r = torch.randn(shape), torch.randn(shape)
        torch.testing.assert_close(compiled(x, r), module(x, r), atol=1e-5, rtol=1e-5)
    assert backend.fusions == [1]


def test_module_calls_and_sequential():
    # nn.GroupNorm / nn.SiLU modules (inlined by Dynamo, or module calls on older torch).
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(2, 8), nn.SiLU(), nn.GroupNorm(4, 8, affine=False),
                           nn.GELU(), nn.Conv2d(8, 8, 1))
    backend = Recording()
    compile_and_compare(module, [torch.randn(2, 3, 4, 4)], backend)
    assert backend.fusions == [2]


def test_inductor():
    # The one Inductor compile of the suite: the fused op inside an Inductor-compiled graph.
    torch.manual_seed(0)
    module = Epilogues("scale_shift_silu")
    backend = fusion.backend()
    compile_and_compare(module, [torch.randn(2, 8, 5, 6), torch.randn(2, 8, 5, 6)], backend)
    assert backend.fusions == [1]


def test_backend_accepts_a_callable_and_fuse_graph_counts():
    seen = []

    def inner(gm, example_inputs):
        seen.append(sum(n.target is torch.ops.fusednorm.group_norm.default for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    module = Epilogues("residual_relu")
    x = torch.randn(2, 8, 3, 3)
    torch.testing.assert_close(torch.compile(module, backend=fusion.backend(inner))(x, x), module(x, x))
    assert seen == [1]


def chains_with_and_without_leaving(module, *inputs):
    """[(True, chains), (False, chains)]: the chains fuse_graph rewrites in `module`'s graph with
    leave_to_inductor and without, each compiled call checked against the module's own output."""
    counts = []
    for leave in (True, False):
        def compile_graph(gm, example_inputs, leave=leave):
            counts.append((leave, fusion.fuse_graph(gm, leave_to_inductor=leave)))
            return gm.forward

        torch._dynamo.reset()
        got = torch.compile(module, backend=compile_graph, dynamic=False)(*inputs)
        torch.testing.assert_close(got, module(*inputs))
    return counts


class SpatialNorm(nn.Module):
    """silu(group_norm(f) * y + b): the spatial norms of Kandinsky's KVAE and CogVideoX's decoders
    (y and b convolutions of the latents), the add out of the epilogue's order."""

    def forward(self, f, y, b):
        return F.silu(F.group_norm(f, 4, eps=1e-6) * y + b)


@pytest.mark.parametrize("shape, fused", [
    ((2, 8, 5, 6), 0),         # an image's: Inductor computes the add in its norm kernel
    ((2, 8, 3, 5, 6), 1),      # a video's: fused (Inductor's norms over channels_last_3d are slow)
])
def test_leave_to_inductor_chains_that_end_in_an_elementwise_op(shape, fused):
    f, y, b = (torch.randn(shape) for _ in range(3))
    assert chains_with_and_without_leaving(SpatialNorm(), f, y, b) == [(True, fused), (False, 1)]


class AttentionNorm(nn.Module):
    """group_norm(x) into a transformer's tokens: a norm with nothing to fuse."""

    def forward(self, x):
        n, c, h, w = x.shape
        return F.group_norm(x, 4, eps=1e-6).permute(0, 2, 3, 1).reshape(n, h * w, c)


def test_a_norm_with_nothing_to_fuse_is_left(monkeypatch):
    x = torch.randn(2, 8, 5, 6)
    assert chains_with_and_without_leaving(AttentionNorm(), x) == [(True, 0), (False, 0)]
    # tools/fusion_rule_ab.py's other choice: the op alone, the same values.
    monkeypatch.setattr(fusion, "_bare_norm_left", lambda node: False)
    assert chains_with_and_without_leaving(AttentionNorm(), x) == [(True, 1), (False, 1)]


def test_the_rule_ab_tool_names_rules_of_the_backend():
    path = Path(__file__).resolve().parents[1] / "tools" / "fusion_rule_ab.py"
    source = path.read_text()
    rules = source.split("RULES = (", 1)[1].split(")", 1)[0]
    names = [r.strip().strip('"') for r in rules.split(",") if r.strip()]
    assert names and all(callable(getattr(fusion, name, None)) for name in names)
    assert all(f"    {name} " in source for name in names)  # each in the docstring's list


class Prologue(nn.Module):
    """silu(group_norm(x + t)), t per channel: the UNet's conv(h) + temb before its second norm;
    with `keep`, x + t is also returned (a second user)."""

    def __init__(self, keep=False):
        super().__init__()
        self.keep = keep

    def forward(self, x, t):
        s = x + t
        y = F.silu(F.group_norm(s, 4, eps=1e-5))
        return (y, s) if self.keep else y


@pytest.mark.parametrize("shape, keep, fused", [
    ((2, 8, 5, 6), False, 0),                    # small, the add used by the norm alone: Inductor's
    ((2, 8, 5, 6), True, 1),                     # the add used twice: written out either way
    ((2, 8, 512, 256), False, 1),                # 8 MiB of float32: the fused op
])
def test_leave_to_inductor_small_single_use_prologues(shape, keep, fused):
    assert 2 * 8 * 512 * 256 * 4 == fusion.INDUCTOR_PROLOGUE_MAX_BYTES
    x, t = torch.randn(shape), torch.randn(shape[0], shape[1], 1, 1)
    assert chains_with_and_without_leaving(Prologue(keep), x, t) == [(True, fused), (False, 1)]
    assert fusion.backend().leave_to_inductor and fusion.backend(mode="default").leave_to_inductor
    assert not fusion.backend("aot_eager").leave_to_inductor
    assert not fusion.backend(lambda gm, example_inputs: gm.forward).leave_to_inductor


class CausalConvs(nn.Module):
    """A causal 3-D convolution's replication pad after norm -> SiLU (-> eval-mode dropout), as in
    the HunyuanVideo VAE's resnets (also on a channels-last input), plus pads the rule must leave:
    another mode, a pad whose input has a second user, a negative (cropping) pad."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.norm, self.dropout, self.conv = nn.GroupNorm(2, 4), nn.Dropout(0.5), nn.Conv3d(4, 4, 3)

    def forward(self, h):
        y = self.dropout(F.silu(self.norm(h))) if self.case == "dropout" else F.silu(self.norm(h))
        if self.case == "reflect":
            return self.conv(F.pad(y, (1, 1, 1, 1, 1, 1), mode="reflect"))
        if self.case == "negative":
            return F.pad(y, (1, 1, 1, 1, 2, -1), mode="replicate")
        padded = self.conv(F.pad(y, (1, 1, 1, 1, 2, 0), mode="replicate"))
        return padded + y.sum() if self.case == "second_user" else padded


@pytest.mark.parametrize("case, taken", [("plain", True), ("dropout", True), ("reflect", False),
                                         ("second_user", False), ("negative", False), ("channels_last", True)])
def test_replication_pad_after_a_fused_op(case, taken, device, monkeypatch):
    if device == "cpu":  # the rule takes CUDA tensors alone (fusion._replication_pad_pays)
        monkeypatch.setattr(fusion, "_replication_pad_pays", lambda value: True)
    torch.manual_seed(0)
    module = CausalConvs(case).to(device).eval()
    backend = Recording()
    x = torch.randn(2, 4, 3, 5, 6, device=device)
    if case == "channels_last":
        x = x.to(memory_format=torch.channels_last_3d)
    compile_and_compare(module, [x], backend, atol=1e-4, rtol=1e-4)
    assert backend.fusions == [1]
    assert ("torch.ops.fusednorm.replication_pad" in backend.code[0]) == taken, backend.code[0]
    with torch.no_grad():  # without a graph, the kernel op itself
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(module, backend=Recording())(torch.ones(1, 4, 2, 3, 4, device=device)),
                                   module(torch.ones(1, 4, 2, 3, 4, device=device)), atol=1e-4, rtol=1e-4)


def test_replication_pad_left_on_the_cpu():
    module = CausalConvs("plain").eval()
    backend = Recording()
    compile_and_compare(module, [torch.randn(2, 4, 3, 5, 6)], backend, atol=1e-4, rtol=1e-4, backward=False)
    assert "replication_pad" not in backend.code[0] and backend.fusions == [1]


@pytest.mark.parametrize("how", ["backend", "torch.compile"])
def test_inductor_mode_and_options_reach_compile_fx(how, monkeypatch):
    # backend(mode=..., options=...) compiles with Inductor's compile_fx under the config patches
    # torch.compile(mode=..., options=...) would apply (CUDA graphs here), checked without a GPU by
    # recording what compile_fx is given; torch.compile hands its own mode / options to the
    # registered "fusednorm" backend (dynamo_backend) the same way.
    import torch._inductor.compile_fx

    calls = []

    def compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        fused = sum(n.target is torch.ops.fusednorm.group_norm.default for n in gm.graph.nodes)
        calls.append((config_patches, fused))
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", compile_fx)
    torch._dynamo.reset()
    module = Epilogues("scale_shift_silu")
    x, r = torch.randn(2, 8, 5, 6), torch.randn(2, 8, 5, 6)
    if how == "backend":  # both: the options over the mode's patches, "-" read as "_"
        backend = fusion.backend(mode="max-autotune", options={"max-autotune": False, "epilogue_fusion": False})
        compiled = torch.compile(module, backend=backend)
        expected = dict(torch._inductor.list_mode_options("max-autotune"), max_autotune=False,
                        epilogue_fusion=False)
        assert expected["triton.cudagraphs"] is True
    else:  # (torch.compile takes a mode or options, not both)
        compiled = torch.compile(module, backend=fusion.dynamo_backend, mode="reduce-overhead")
        expected = {"triton.cudagraphs": True}
    torch.testing.assert_close(compiled(x, r), module(x, r))
    assert calls == [(expected, 1)]
    if how == "backend":
        assert backend.config_patches == expected and backend.fusions == [1]
        assert fusion.backend(mode="reduce-overhead").config_patches == {"triton.cudagraphs": True}
        assert fusion.backend(options={"triton.cudagraphs": True}).config_patches == {"triton.cudagraphs": True}
        assert fusion.backend(mode="default").config_patches == {} and fusion.backend().config_patches is None


def test_inductor_mode_errors():
    with pytest.raises(ValueError, match="inner='inductor'"):
        fusion.backend("aot_eager", mode="reduce-overhead")
    with pytest.raises(ValueError, match="unknown Inductor mode"):
        fusion.backend(mode="fastest")
    with pytest.raises(ValueError, match="unknown Inductor option"):
        fusion.backend(options={"no_such_option": True})


def test_cudagraph_trees_reset_with_dynamo(monkeypatch):
    # torch._dynamo.reset() calls a backend's reset(); with CUDA graphs it drops the graph trees.
    import torch._inductor.cudagraph_trees as trees

    resets = []
    monkeypatch.setattr(trees, "reset_cudagraph_trees", lambda: resets.append(1))
    fusion.backend().reset()
    assert resets == []
    fusion.backend(mode="reduce-overhead").reset()
    assert resets == [1]


# -- diffusers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("time_embedding_norm", ["default", "scale_shift"])
def test_diffusers_resnet_block(time_embedding_norm, device):
    resnet = import_or_skip("diffusers.models.resnet")
    torch.manual_seed(0)
    block = resnet.ResnetBlock2D(in_channels=16, out_channels=16, temb_channels=8, groups=4,
                                 time_embedding_norm=time_embedding_norm).to(device)
    backend = Recording()
    x, temb = torch.randn(2, 16, 6, 6, device=device), torch.randn(2, 8, device=device)
    compile_and_compare(block, [x, temb], backend, backward=time_embedding_norm == "scale_shift")
    # norm1 + SiLU, and norm2 (+ scale / shift) + SiLU.
    assert backend.fusions == [2]
    if time_embedding_norm == "scale_shift":
        assert "scale = " in backend.code[0] and "shift = " in backend.code[0]


def test_diffusers_unet():
    diffusers = import_or_skip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        norm_num_groups=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8,
    ).eval()
    backend = fusion.backend("aot_eager")
    with torch.no_grad():
        compile_and_compare(unet, [torch.randn(2, 3, 8, 8), torch.tensor([3, 50])], backend, backward=False,
                            atol=1e-4, rtol=1e-4)
    resnets = sum(type(m).__name__ == "ResnetBlock2D" for m in unet.modules())
    # Two per ResnetBlock2D, plus conv_norm_out + conv_act; attention's group norms stay unfused.
    assert sum(backend.fusions) == 2 * resnets + 1


# The chains the backend rewrites in the models test_convert converts whole (small configs): the
# rules on real graphs. EasyAnimate's and Cosmos' norms run on frames viewed back before their
# activation, which moves before the views (docs/design.md, "Group norms of frames").
WHOLE_MODEL_CHAINS = {"flux2": 22, "svd_temporal_decoder": 30, "kvae": 22, "kvae_video": 22, "easyanimate": 69,
                      "cosmos": 16, "allegro_decode": 41, "unet_3d": 49, "unet_spatio_temporal": 33, "unet_motion": 17,
                      "hunyuanimage": 22}


@pytest.mark.parametrize("name", list(WHOLE_MODEL_CHAINS))
def test_diffusers_models_whole(name):
    diffusers = import_or_skip("diffusers")
    torch.manual_seed(0)
    if name in DIFFUSERS_AUTOENCODERS:
        cls_name, config, shape, keywords = DIFFUSERS_AUTOENCODERS[name]
        vae = getattr(diffusers, cls_name)(**config)
        vae.use_tiling = cls_name == "AutoencoderKLAllegro"  # (its decode has no other way)
        model, inputs = WholeCall(vae, **keywords), [torch.randn(*shape)]
    else:
        cls_name, config, (sample, context), keywords = DIFFUSERS_VIDEO_UNETS[name]
        model = UNetCall(getattr(diffusers, cls_name)(**config), **keywords)
        inputs = [torch.randn(*sample), torch.randn(*context), *(torch.randn(*s) for s in keywords.values())]
    backend = fusion.backend("aot_eager")
    with torch.no_grad():
        compile_and_compare(model.eval(), inputs, backend, backward=False, atol=1e-4, rtol=1e-4)
    assert sum(backend.fusions) == WHOLE_MODEL_CHAINS[name]


def test_unfused_norms_tool():
    # tools/unfused_norms.py on the SD VAE decode's real config, traced on the meta device.
    import_or_skip("diffusers")
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("unfused_norms", root / "tools" / "unfused_norms.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    module, inputs = tool.db.ALL_WORKLOADS["VAE decode 512"]("meta", torch.float16, True)
    [(norms, fused, left, calls)] = tool.census(module, inputs)
    # 30 norms: every resnet's two and the decoder's norm_out fused with their SiLU; the mid-block
    # attention's norm left (a view and its projections after it).
    assert (norms, fused, sum(left.values())) == (30, 29, 1)
    # --fused: each fused chain one call, with the plan an H200 gives it.
    assert sum(calls.values()) == 29 and all(call[0] == "group_norm" and call[4] == "silu" for call in calls)
    assert all(tool.plan_of(call).startswith("path=") for call in calls)
