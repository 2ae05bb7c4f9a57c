"""End-to-end timings of real diffusers models with fusednorm (the adoption section of the README,
issue 38's table). The models are built from their published configs with random weights (nothing
is downloaded); on a GPU, in fp16:

    VAE decode 512     Stable Diffusion (1.x) VAE decode: latents (1, 4, 64, 64) -> 512 px
    VAE decode 1024    the same VAE: latents (1, 4, 128, 128) -> 1024 px
    UNet step b2       one SD1.5 UNet step at batch 2: sample (2, 4, 64, 64), context (2, 77, 768)
    UNet step b8       the same at batch 8: sample (8, 4, 64, 64), context (8, 77, 768)
    video VAE decode   HunyuanVideo's VAE (AutoencoderKLHunyuanVideo, its default config) decode:
                       latents (1, 16, 3, 60, 80) -> 9 frames of 480x640 px, tiling, slicing and
                       frame-wise decoding off; its decoder's nn.GroupNorms see 5-D inputs
    CogVideoX VAE decode
                       CogVideoX's VAE (AutoencoderKLCogVideoX, its default config) decode:
                       latents (1, 16, 3, 60, 90) -> 9 frames of 480x720 px, tiling and slicing
                       off; its decoder's norms are spatial norms, silu(group_norm(f) * y + b),
                       of which the fusion backend fuses group_norm(f) * y (the add comes
                       before the SiLU, out of the fused epilogue's order)
    Mochi VAE decode   Mochi's VAE (AutoencoderKLMochi, its default config) decode: latents
                       (1, 12, 2, 60, 106) -> 7 frames of 480x848 px (12 decoded, the first 5
                       dropped as decode does), tiling, slicing and frame-wise decoding off; its
                       norms are group norms of 8 frames at a time, concatenated, which the
                       fusion backend makes one norm of the frames, fused with its SiLU

each as

    eager                          the model as diffusers builds it
    eager + convert                fusednorm.convert(model): torch.nn norms swapped for fusednorm's
                                   (and diffusers' causal convolutions' replicate pads on its kernels)
    eager + convert + pads         the same, called under fusednorm.replication_pads() (every other
                                   replicate pad of the model on fusednorm's kernels too)
    compile                        torch.compile(model)
    compile + fusion               torch.compile(model, backend=fusednorm.fusion.backend()): norms and
                                   their epilogues fused into fusednorm's op, the rest compiled by Inductor
    compile (cudagraphs)           torch.compile(model, mode="reduce-overhead")      (GPU only)
    compile + fusion (cudagraphs)  torch.compile(model, backend=fusednorm.fusion.backend(
                                   mode="reduce-overhead")): the same with Inductor's CUDA graphs (GPU only)

and checks every variant's output against eager's (max |diff| printed and saved; a CUDA-graph
variant's is that of a replayed call). Times are medians of benchmarks/bench.py's timer (CUDA
events after an L2 flush; on the CPU, of 5 calls). A variant that raises is reported, the run goes
on, and the exit status is 1. Writes DIR/diffusers_<device>.json, rewritten after each workload
("complete" false until the end): {date, card, torch, diffusers, dtype, complete, rows: [{workload,
ms: {variant: ms}, max_abs_diff: {variant: diff}, fusions (the norm chains compile + fusion
rewrote; its CUDA-graph twin's when only that ran), fusions_by_variant, and where any: errors:
{variant: message}, cudagraph_skips: {variant: graphs Inductor ran without CUDA graphs}, with
--profile kernel_ms: {variant: {category: ms}}, with --float32-reference error_vs_float32:
{variant: [max, mean]}, and with --rounds ms_rounds: {variant: [ms of each round]}}]}. A run
given --workloads or --variants merges into an existing file of the same card, torch, diffusers and
dtype (its other workloads and variants kept), so that the table can be measured in parts.

On a CPU it runs tiny configs of every model (2 blocks of 32-64 channels, latents of 8-16 px, in
fp32) and says so: a smoke test of the variants that can run there (not the CUDA-graph ones), since
the real models take minutes a call there; those times say nothing about the real models. There,
VAE decode 1024 and UNet step b8 run the eager variants only unless --workloads is given
(their compiled variants would compile VAE decode 512's and UNet step b2's graphs again at another
size, a minute each on 2 cores). Needs diffusers; without it, says so and exits 0.

    python benchmarks/diffusers_bench.py [--out DIR] [--device cuda|cpu] [--no-compile]
                                         [--workloads NAMES] [--variants LABELS] [--profile [--top N]]
                                         [--channels-last] [--no-conv3d-channels-last] [--more]
                                         [--float32-reference] [--rounds N]

--workloads: comma-separated workload names or parts of them, case-insensitive, an exact name
picking that workload alone ("VAE" picks the five VAE rows, "b8" the batch-8 UNet, "video" the
HunyuanVideo and CogVideoX decodes, "video VAE decode" HunyuanVideo's alone); --variants:
comma-separated variant labels as above, case-insensitive. Default: all. Each compiled variant
compiles its model anew, so all of it most likely takes more than 10 minutes on a GPU machine (an
estimate); for calls of 10 minutes run it in parts, e.g. a workload a call (--workloads 512, then
1024, b2, b8, "video VAE decode", CogVideoX, Mochi), the same --out.

--more: instead of the models above, the decodes of eight more diffusers autoencoders with group
norms (MORE_WORKLOADS: FLUX.2's VAE at 1024 px, Stable Video Diffusion's temporal decoder on 14
frames of 576x1024, Kandinsky's KVAE at 1024 px and its video VAE, EasyAnimate's, Cosmos' and
Allegro's on a few frames, HunyuanImage 2.1's at 2048 px) and a step of three video UNets at
batch 2 (ModelScope's UNet3D on 16 frames of 256x256, AnimateDiff's on 16 of 512x512, SVD's on 14
of 576x1024), written to diffusers_<device>_more.json; --workloads picks among them.

--float32-reference: each variant's max and mean |error| against a float32 copy of the model on
the same inputs (saved as error_vs_float32: {variant: [max, mean]}): whether a variant's
difference from eager is eager's rounding or its own.

--rounds N: a workload's variants are all kept alive and timed N times each, in turns, and each
one's median round is its time: for host-bound steps (e.g. the video UNets without CUDA graphs) on a
host whose speed drifts (on the H100 machine of 2026-12-05 a ModelScope step's host time went from
~33 to ~50 ms within a minute, under every variant alike), where variants timed one after the other
or in two processes can differ by that drift alone. Costs the memory of all variants at once.

--channels-last: the models' 4-D and 5-D weights and inputs in channels_last / channels_last_3d
(as users of convolutional models often run them); written to diffusers_<device>_channels_last.json.
--no-conv3d-channels-last: the fusion backend with `conv3d_channels_last=False` (3-D convolutions
in the layout Inductor picks; docs/design.md, "3-D convolutions in channels_last_3d"), for an A/B
of the video decode; written to diffusers_<device>[_channels_last]_conv3d_inductor_layout.json.

--profile (GPU only): after timing a variant, its GPU kernel time a call by category (fusednorm,
convolution, attention, GEMM, Inductor's generated kernels, other; torch.profiler over 5 calls,
kernels' durations summed): where a model's time goes, e.g. which kernels a fusion replaced. The
part of Inductor's that carries a norm op in its kernel names is also given ("inductor,
norm-related": the norms Inductor computes, and the passes that feed fusednorm's ops). With --top
N, also the N kernels that take the most time, each with its launches a call (so were found the
transposes and pads that bound the video decode: docs/design.md, "Replication pad").
"""

import argparse
import copy
import functools
import gc
import json
import os
import sys
import time
import traceback

import torch
from torch._dynamo.utils import counters

import fusednorm
from bench import timer  # the suite's timer: CUDA events after an L2 flush, medians

SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=32, layers_per_block=2,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
SD_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, cross_attention_dim=768,
    block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8, norm_num_groups=32,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
)
VIDEO_VAE = {}  # AutoencoderKLHunyuanVideo's defaults: HunyuanVideo's VAE (16 latent channels, 8x / 4x)
COGVIDEOX_VAE = {}  # AutoencoderKLCogVideoX's defaults: CogVideoX's VAE (16 latent channels, 8x / 4x)
MOCHI_VAE = {}  # AutoencoderKLMochi's defaults: Mochi's VAE (12 latent channels, 8x / 6x)
TINY_VAE = dict(SD_VAE, block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
                down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
TINY_UNET = dict(SD_UNET, sample_size=16, block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
                 cross_attention_dim=32, attention_head_dim=4,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
TINY_VIDEO_VAE = dict(block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
                      spatial_compression_ratio=4,  # (2 blocks: both upsample 2x in space, the first in time)
                      down_block_types=("HunyuanVideoDownBlock3D",) * 2, up_block_types=("HunyuanVideoUpBlock3D",) * 2)
TINY_COGVIDEOX_VAE = dict(block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
                          temporal_compression_ratio=2,  # (2 blocks: the first upsamples 2x in space and time)
                          down_block_types=("CogVideoXDownBlock3D",) * 2, up_block_types=("CogVideoXUpBlock3D",) * 2)
TINY_MOCHI_VAE = dict(decoder_block_out_channels=(32, 64, 64, 64), encoder_block_out_channels=(32,) * 4,
                      layers_per_block=(1,) * 5)

VARIANTS = ("eager", "eager + convert", "eager + convert + pads", "compile", "compile + fusion",
            "compile (cudagraphs)", "compile + fusion (cudagraphs)")
COMPILED = tuple(v for v in VARIANTS if v.startswith("compile"))
CUDA_GRAPHS = ("compile (cudagraphs)", "compile + fusion (cudagraphs)")
FUSION = ("compile + fusion", "compile + fusion (cudagraphs)")
# On the CPU, unless --workloads names them, these run the eager variants only: their
# compiled variants are the graphs of VAE decode 512 / UNet step b2 at another size, and each
# Inductor compile costs a minute there on 2 cores (cold cache).
CPU_EAGER_ONLY = ("VAE decode 1024", "UNet step b8")


class VAEDecode(torch.nn.Module):
    """What a pipeline runs of the VAE: decode latents to an image, with decode's `keywords` if any
    (torch.compile compiles forward)."""

    def __init__(self, vae, **keywords):
        super().__init__()
        self.vae, self.keywords = vae, keywords

    def forward(self, latents):
        return self.vae.decode(latents, **self.keywords).sample


class UNetStep(torch.nn.Module):
    """One step of a diffusers UNet: sample, timestep, context, then the inputs named `extra` (the
    keywords of its forward, e.g. SVD's added_time_ids)."""

    def __init__(self, unet, extra=()):
        super().__init__()
        self.unet, self.extra = unet, tuple(extra)

    def forward(self, sample, timestep, context, *extra):
        return self.unet(sample, timestep, encoder_hidden_states=context, **dict(zip(self.extra, extra))).sample


def _build(cls, config, device, dtype):
    torch.manual_seed(0)
    return cls(**config).to(device, dtype).eval()


def sd_vae_decode(size):
    def build(device, dtype, full):
        from diffusers import AutoencoderKL

        vae = _build(AutoencoderKL, SD_VAE if full else TINY_VAE, device, dtype)
        side = size // 8 if full else size // 64  # latents: 64 / 128 px; tiny: 8 / 16 px
        return VAEDecode(vae), (torch.randn(1, 4, side, side, device=device, dtype=dtype),)

    return build


def sd_unet_step(batch):
    def build(device, dtype, full):
        from diffusers import UNet2DConditionModel

        unet = _build(UNet2DConditionModel, SD_UNET if full else TINY_UNET, device, dtype)
        size = 64 if full else 16
        sample = torch.randn(batch, 4, size, size, device=device, dtype=dtype)
        context = torch.randn(batch, 77, 768 if full else 32, device=device, dtype=dtype)
        t = torch.full((batch,), 500, device=device)
        return UNetStep(unet), (sample, t, context)

    return build


def video_vae_decode(device, dtype, full):
    from diffusers import AutoencoderKLHunyuanVideo

    vae = _build(AutoencoderKLHunyuanVideo, VIDEO_VAE if full else TINY_VIDEO_VAE, device, dtype)
    # One decoder call over the whole clip, as decode_latents of a short clip does: no spatial
    # tiles, no batch slices, no frame-wise (temporal tile) decoding.
    vae.use_tiling = vae.use_slicing = vae.use_framewise_decoding = False
    # 3 latent frames -> 1 + 4 * 2 = 9 frames; 60x80 latents -> 480x640 px (tiny: 8x8 -> 32x32).
    shape = (1, 16, 3, 60, 80) if full else (1, 16, 3, 8, 8)
    return VAEDecode(vae), (torch.randn(*shape, device=device, dtype=dtype),)


def cogvideox_vae_decode(device, dtype, full):
    from diffusers import AutoencoderKLCogVideoX

    vae = _build(AutoencoderKLCogVideoX, COGVIDEOX_VAE if full else TINY_COGVIDEOX_VAE, device, dtype)
    # One decoder call: 3 latent frames are one of decode's frame batches; no spatial tiles, no
    # batch slices.
    vae.use_tiling = vae.use_slicing = False
    # 3 latent frames -> 1 + 4 * 2 = 9 frames; 60x90 latents -> 480x720 px (tiny: 8x8 -> 16x16).
    shape = (1, 16, 3, 60, 90) if full else (1, 16, 3, 8, 8)
    return VAEDecode(vae), (torch.randn(*shape, device=device, dtype=dtype),)


def mochi_vae_decode(device, dtype, full):
    from diffusers import AutoencoderKLMochi

    vae = _build(AutoencoderKLMochi, MOCHI_VAE if full else TINY_MOCHI_VAE, device, dtype)
    vae.use_tiling = vae.use_slicing = vae.use_framewise_decoding = False
    # 2 latent frames -> 12 frames, of which decode drops the first 5; 60x106 latents -> 480x848 px
    # (tiny: 8x8 -> 64x64).
    shape = (1, 12, 2, 60, 106) if full else (1, 12, 2, 8, 8)
    return VAEDecode(vae), (torch.randn(*shape, device=device, dtype=dtype),)


WORKLOADS = {  # name -> build(device, dtype, full) -> (module, inputs)
    "VAE decode 512": sd_vae_decode(512),
    "VAE decode 1024": sd_vae_decode(1024),
    "UNet step b2": sd_unet_step(2),
    "UNet step b8": sd_unet_step(8),
    "video VAE decode": video_vae_decode,
    "CogVideoX VAE decode": cogvideox_vae_decode,
    "Mochi VAE decode": mochi_vae_decode,
}


def decode_of(cls_name, config, tiny_config, shape, tiny_shape, tiles=False, **keywords):
    """build(device, dtype, full) of the decode of diffusers' `cls_name` (tiling, slicing and
    frame-wise decoding off, unless `tiles`: tiling on), latents of `shape` (tiny: `tiny_shape`);
    a keyword given as a function is its value of `full`."""
    def build(device, dtype, full):
        import diffusers

        vae = _build(getattr(diffusers, cls_name), config if full else tiny_config, device, dtype)
        for flag in ("use_tiling", "use_slicing", "use_framewise_decoding"):
            if hasattr(vae, flag):
                setattr(vae, flag, tiles and flag == "use_tiling")
        called = {k: v(full) if callable(v) else v for k, v in keywords.items()}
        return VAEDecode(vae, **called), (torch.randn(*(shape if full else tiny_shape), device=device, dtype=dtype),)

    return build


def unet_step_of(cls_name, config, tiny_config, shapes, tiny_shapes):
    """build(device, dtype, full) of one step of diffusers' UNet `cls_name` at timestep 500: its
    inputs (sample, context, then the keywords named) random of `shapes` (tiny: `tiny_shapes`),
    {"sample": shape, "context": shape, keyword: shape...}."""
    def build(device, dtype, full):
        import diffusers

        unet = _build(getattr(diffusers, cls_name), config if full else tiny_config, device, dtype)
        chosen = dict(shapes if full else tiny_shapes)
        sample, context = chosen.pop("sample"), chosen.pop("context")
        t = torch.full((sample[0],), 500, device=device)
        extra = [torch.randn(*shape, device=device, dtype=dtype) for shape in chosen.values()]
        return UNetStep(unet, chosen), (torch.randn(*sample, device=device, dtype=dtype), t,
                                        torch.randn(*context, device=device, dtype=dtype), *extra)

    return build


_TINY_2D = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8)
_TINY_UNET_3D = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=16,
                     sample_size=8)
# --more: other diffusers autoencoders with group norms, each decode from its default config (SVD's
# from the published one: the class's default is a one-block toy) at a size its pipelines decode.
MORE_WORKLOADS = {
    "Flux2 VAE decode 1024": decode_of(  # FLUX.2's VAE: 32 latent channels -> 1024 px
        "AutoencoderKLFlux2", {}, dict(_TINY_2D, down_block_types=("DownEncoderBlock2D",) * 2,
                                       up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=8),
        (1, 32, 128, 128), (1, 8, 16, 16)),
    "SVD VAE decode": decode_of(  # Stable Video Diffusion's temporal decoder: 14 frames of 576x1024
        "AutoencoderKLTemporalDecoder",
        dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4, layers_per_block=2),
        dict(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2, layers_per_block=1),
        (14, 4, 72, 128), (2, 4, 16, 16), num_frames=lambda full: 14 if full else 2),
    "KVAE decode 1024": decode_of(  # Kandinsky's KVAE: replicate-padded 2-D convolutions
        "AutoencoderKLKVAE", {}, dict(channels=32, ch_mult=(1, 2), num_enc_blocks=1, num_dec_blocks=1, z_channels=4),
        (1, 16, 128, 128), (1, 4, 16, 16)),
    "KVAE video decode": decode_of(  # 3 latent frames -> 9 frames of 480x640
        "AutoencoderKLKVAEVideo", {},
        dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, temporal_compress_times=2),
        (1, 16, 3, 60, 80), (1, 4, 3, 16, 16)),
    "EasyAnimate VAE decode": decode_of(  # AutoencoderKLMagvit: 3 latent frames -> 9 of 480x640
        "AutoencoderKLMagvit", {},
        dict(_TINY_2D, down_block_types=("SpatialDownBlock3D", "SpatialTemporalDownBlock3D"),
             up_block_types=("SpatialUpBlock3D", "SpatialTemporalUpBlock3D"), latent_channels=4),
        (1, 16, 3, 60, 80), (1, 4, 3, 16, 16)),
    "Cosmos VAE decode": decode_of(  # 2 latent frames -> 9 frames of 480x640
        "AutoencoderKLCosmos", {},
        dict(encoder_block_out_channels=(32, 64), decode_block_out_channels=(32, 64), attention_resolutions=(),
             resolution=32, num_layers=1, spatial_compression_ratio=4, temporal_compression_ratio=4,
             latents_mean=None, latents_std=None),
        (1, 16, 2, 60, 80), (1, 16, 3, 8, 8)),
    "Allegro VAE decode": decode_of(  # one tile (its decode needs tiles): 6 latent frames -> 24 of 320x320
        "AutoencoderKLAllegro", {},
        dict(_TINY_2D, down_block_types=("AllegroDownBlock3D",) * 2, up_block_types=("AllegroUpBlock3D",) * 2,
             temporal_downsample_blocks=(True, False), temporal_upsample_blocks=(False, True), sample_size=32,
             temporal_compression_ratio=2),
        (1, 4, 6, 40, 40), (1, 4, 12, 16, 16), tiles=True),
    "HunyuanImage VAE decode 2048": decode_of(  # HunyuanImage 2.1's VAE (32x, 64 latent channels): 2048 px
        "AutoencoderKLHunyuanImage",
        dict(in_channels=3, out_channels=3, latent_channels=64, block_out_channels=(128, 256, 512, 512, 1024, 1024),
             layers_per_block=2, spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289),
        dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(32, 64), layers_per_block=1,
             spatial_compression_ratio=2, sample_size=16),
        (1, 64, 64, 64), (1, 8, 8, 8)),
    # Video UNets, one denoising step with classifier-free guidance's batch of 2, random weights.
    "ModelScope UNet3D step": unet_step_of(  # UNet3DConditionModel's defaults: 16 frames of 256x256
        "UNet3DConditionModel", {},
        dict(_TINY_UNET_3D, attention_head_dim=8, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
             up_block_types=("UpBlock3D", "CrossAttnUpBlock3D")),
        dict(sample=(2, 4, 16, 32, 32), context=(2, 77, 1024)), dict(sample=(2, 4, 3, 8, 8), context=(2, 5, 16))),
    "AnimateDiff UNet step": unet_step_of(  # SD1.5 with motion modules: 16 frames of 512x512
        "UNetMotionModel", dict(cross_attention_dim=768),
        dict(_TINY_UNET_3D, down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
             up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"), num_attention_heads=2,
             motion_num_attention_heads=2, motion_max_seq_length=8),
        # (its pipelines repeat the context a frame: (batch * frames, L, D))
        dict(sample=(2, 4, 16, 64, 64), context=(32, 77, 768)), dict(sample=(2, 4, 3, 8, 8), context=(6, 5, 16))),
    "SVD UNet step": unet_step_of(  # Stable Video Diffusion's defaults: 14 frames of 576x1024
        "UNetSpatioTemporalConditionModel", {},
        dict(block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=16, num_attention_heads=(2, 4),
             down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
             up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), sample_size=8,
             projection_class_embeddings_input_dim=3 * 8, addition_time_embed_dim=8),
        dict(sample=(2, 14, 8, 72, 128), context=(2, 1, 1024), added_time_ids=(2, 3)),
        dict(sample=(2, 3, 8, 8, 8), context=(2, 1, 16), added_time_ids=(2, 3))),
}
ALL_WORKLOADS = {**WORKLOADS, **MORE_WORKLOADS}  # (the tools and tests take either set by name)


def pick(spec, known, what, substrings):
    """The entries of `known` that comma-separated `spec` names (each an exact name, or with
    `substrings` a case-insensitive part of names), in `known`'s order; all when spec is None."""
    if spec is None:
        return list(known)
    chosen = set()
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        exact = [k for k in known if k.lower() == token.lower()]
        found = exact or ([k for k in known if token.lower() in k.lower()] if substrings else [])
        if not found:
            raise SystemExit(f"unknown {what} {token!r}; known: {', '.join(known)}")
        chosen.update(found)
    return [k for k in known if k in chosen]


def to_channels_last(model, inputs):
    """The model's and inputs' 4-D and 5-D floating-point tensors in channels_last and
    channels_last_3d (nn.Module.to(memory_format=...) takes one format for both ranks)."""
    def convert(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() in (4, 5):
            return t.to(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        return t

    for p in model.parameters():
        p.data = convert(p.data)
    return model, tuple(convert(t) for t in inputs)


def make_variant(label, model, conv3d_channels_last=True):
    """(callable, fusion backend or None) of one variant of `model`."""
    if label == "eager":
        return model, None
    if label == "eager + convert":
        return fusednorm.convert(copy.deepcopy(model)), None
    if label == "eager + convert + pads":
        converted = fusednorm.convert(copy.deepcopy(model))

        def with_pads(*args):
            with fusednorm.replication_pads():
                return converted(*args)

        return with_pads, None
    if label == "compile":
        return torch.compile(model), None
    if label == "compile (cudagraphs)":
        return torch.compile(model, mode="reduce-overhead"), None
    backend = fusednorm.fusion.backend(mode="reduce-overhead" if label in CUDA_GRAPHS else None,
                                       conv3d_channels_last=conv3d_channels_last)
    return torch.compile(model, backend=backend), backend


def mark_step_begin():
    """Tell CUDA graph trees that a new call begins: the previous call's outputs may be overwritten."""
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    if mark is None:  # torch < 2.2
        from torch._inductor.cudagraph_trees import mark_step_begin as mark
    mark()


def free_memory(device):
    torch._dynamo.reset()  # compiled code, and CUDA graph trees with their memory pools
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# Kernel categories of --profile, by substrings of the profiler's (demangled) kernel names, the
# first that matches: fusednorm's kernels live in its namespace; Inductor's are Triton kernels,
# named after the ops they fused (triton_poi_fused_convolution_...), so they come before the rest.
KERNEL_CATEGORIES = (
    ("fusednorm", ("fusednorm",)),
    ("inductor", ("triton",)),
    ("attention", ("flash", "fmha", "attention")),
    ("convolution", ("conv", "implicit_gemm", "implicit_convolve", "cudnn", "nchw", "nhwc", "xmma_fprop")),
    # (nvjet: cuBLAS's Hopper GEMMs, e.g. the 1x1x1 convolutions Inductor runs as matmuls)
    ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "sm80_xmma", "nvjet")),
)


# Inductor's kernels whose names carry a norm op (its own group / instance norms' reductions and
# applies, with what it fused into them; under compile + fusion also the passes that feed a fused
# op, e.g. a convolution's bias, "triton_poi_fused_convolution_fused_group_norm_forward"): shown
# as a part of "inductor".
NORM_RELATED = ("group_norm", "instance_norm", "batch_norm", "var_mean")


def kernel_category(name):
    """The --profile category of a CUDA kernel named `name`."""
    lowered = name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(k in lowered for k in keys):
            return category
    return "other"


def norm_related(name):
    """Whether an Inductor kernel named `name` computes (part of) a norm or feeds a fused one."""
    lowered = name.lower()
    return any(k in lowered for k in NORM_RELATED)


def kernel_ms_by_name(call, iters=5):
    """{kernel name: (GPU ms a call, launches a call)} of call() (torch.profiler over `iters` calls,
    after one more)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    by = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            ms, count = by.get(e.name, (0.0, 0))
            by[e.name] = (ms + (e.time_range.end - e.time_range.start) / iters / 1000.0, count + 1)
    return {name: (ms, count / iters) for name, (ms, count) in by.items()}


def by_category(kernels):
    """kernel_ms_by_name's times summed by kernel_category, ms, largest first, with the
    norm-related part of Inductor's."""
    by, norms = {}, 0.0
    for name, (ms, _) in kernels.items():
        category = kernel_category(name)
        by[category] = by.get(category, 0.0) + ms
        if category == "inductor" and norm_related(name):
            norms += ms
    by["total"] = sum(by.values())
    if "inductor" in by:
        by["inductor, norm-related"] = norms  # (a part of "inductor", not in the total twice)
    return {k: round(v, 4) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}


def longest(kernels, n):
    """The n kernels of kernel_ms_by_name that take the most time, as printable lines."""
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:n]
    return [f"{ms:9.3f} ms {count:5.0f}x  {name[:150]}" for name, (ms, count) in top]


def float32_output(model, inputs):
    """The output of a float32 copy of `model` on the inputs in float32: the reference of
    --float32-reference."""
    copied = copy.deepcopy(model).float()
    out = copied(*(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs))
    del copied
    return out


def run_workload(name, model, inputs, labels, measure, device, errors, profile=False, top=0,
                 conv3d_channels_last=True, float32_reference=False, rounds=1):
    row = {"workload": name, "ms": {}, "max_abs_diff": {}}
    fusions = {}
    kept = {}  # label: its timing, with rounds > 1: every variant kept alive for the later rounds
    want = model(*inputs)
    reference = float32_output(model, inputs) if float32_reference else None
    for label in labels:
        m = backend = got = call = timed = None
        failed = False
        try:
            m, backend = make_variant(label, model, conv3d_channels_last)
            cuda_graphs = label in CUDA_GRAPHS

            def call(m=m, cuda_graphs=cuda_graphs):
                if cuda_graphs:
                    mark_step_begin()
                return m(*inputs)

            skips = counters["inductor"]["cudagraph_skips"]
            start = time.perf_counter()
            got = call()  # compiles on the first call
            if cuda_graphs:  # the first call warms up, the second records: compare a replay
                got = None
                call()
                got = call()
            if device == "cuda":
                torch.cuda.synchronize()
            first = time.perf_counter() - start
            skips = counters["inductor"]["cudagraph_skips"] - skips
            if cuda_graphs and skips:
                row.setdefault("cudagraph_skips", {})[label] = skips
                print(f"  {name:16s} {label}: Inductor ran {skips} graph(s) without CUDA graphs "
                      f"(Inductor's 'skipping cudagraphs due to ...' warning says why)", flush=True)
            got = got.clone()  # (a CUDA graph's output is overwritten by the next call)
            row["max_abs_diff"][label] = float((got.float() - want.float()).abs().max())
            if reference is not None:
                error = (got.float() - reference).abs()
                row.setdefault("error_vs_float32", {})[label] = [float(error.max()), float(error.mean())]
                print(f"  {name:16s} {label}: max / mean |error| against the float32 model "
                      f"{float(error.max()):.2e} / {float(error.mean()):.2e}", flush=True)
                del error
            got = None

            def timed(call=call):
                call()  # keeps no output from one call to the next

            row["ms"][label] = measure(timed)
            compiling = f", first calls {first:.1f} s" if label in COMPILED else ""
            print(f"  {name:16s} {label:29s} {row['ms'][label]:10.3f} ms  (max |diff| vs eager "
                  f"{row['max_abs_diff'][label]:.2e}{compiling})", flush=True)
            if profile:
                kernels = kernel_ms_by_name(timed)
                row.setdefault("kernel_ms", {})[label] = by_category(kernels)
                print(f"  {name:16s} {label} GPU kernel ms by category: {row['kernel_ms'][label]}", flush=True)
                for line in longest(kernels, top):
                    print(f"  {name:16s} {label} {line}", flush=True)
            if backend is not None:
                fusions[label] = sum(backend.fusions)
                print(f"  {name:16s} {label} rewrote {fusions[label]} norm chains", flush=True)
        except Exception as e:  # noqa: BLE001 -- report it, and go on with the other variants
            failed = True
            traceback.print_exc()
            errors.append(f"{name} / {label}: {type(e).__name__}: {e}")
            row.setdefault("errors", {})[label] = f"{type(e).__name__}: {e}"
            first_line = (str(e).splitlines() or [""])[0]
            print(f"  {name:16s} {label:29s} FAILED: {type(e).__name__}: {first_line}", flush=True)
        if rounds > 1 and not failed:
            kept[label] = functools.partial(measure, timed)  # (what time_in_rounds calls again)
        del m, backend, got, call, timed  # (the variant's model, e.g. a converted copy, with them)
        if (label in COMPILED or failed) and rounds == 1:
            free_memory(device)
    if kept:
        time_in_rounds(name, row, kept, rounds)
        kept = None
        free_memory(device)
    if fusions:
        row["fusions"] = fusions.get("compile + fusion", next(iter(fusions.values())))
        row["fusions_by_variant"] = fusions
    return row


def time_in_rounds(name, row, kept, rounds):
    """--rounds: times the variants of `kept` ({label: a call that times it}, each timed once
    already) rounds - 1 more times, in turns (forward, then backward order), and makes row["ms"]
    each one's median round (all rounds in row["ms_rounds"]): on a host whose speed drifts in a
    minute, which moves a host-bound step's time by a third, every variant sees the drift alike."""
    times = {label: [row["ms"][label]] for label in kept}
    for r in range(1, rounds):
        for label in (list(kept)[::-1] if r % 2 else list(kept)):
            times[label].append(kept[label]())
        print(f"  {name:16s} round {r + 1}: " + ", ".join(f"{label} {times[label][-1]:.3f}" for label in kept),
              flush=True)
    for label, ms in times.items():
        row["ms"][label] = sorted(ms)[(len(ms) - 1) // 2]
        row.setdefault("ms_rounds", {})[label] = ms
        print(f"  {name:16s} {label:29s} {row['ms'][label]:10.3f} ms  (median of {len(ms)} rounds, "
              f"{min(ms):.3f} to {max(ms):.3f})", flush=True)


def merge(old_rows, new_rows):
    """old_rows with new_rows over them: what a new row says of a variant (measured or failed)
    replaces what the old one said of it; in WORKLOADS (then MORE_WORKLOADS) order."""
    merged = {r["workload"]: copy.deepcopy(r) for r in old_rows}
    for r in new_rows:
        o = merged.setdefault(r["workload"], {"workload": r["workload"]})
        ran = set(r["ms"]) | set(r.get("errors", {}))
        for key in ("ms", "max_abs_diff", "error_vs_float32", "fusions_by_variant", "errors", "cudagraph_skips",
                    "kernel_ms", "ms_rounds"):
            values = {**{v: x for v, x in o.get(key, {}).items() if v not in ran}, **r.get(key, {})}
            o[key] = dict(sorted(values.items(), key=lambda item: VARIANTS.index(item[0])
                                 if item[0] in VARIANTS else len(VARIANTS)))
            if not o[key] and key not in ("ms", "max_abs_diff"):
                del o[key]
        if "fusions_by_variant" in o:
            by_variant = o["fusions_by_variant"]
            o["fusions"] = by_variant.get("compile + fusion", next(iter(by_variant.values())))
        elif ran & set(FUSION):  # (an old row's count, of a fusion variant that failed now)
            o.pop("fusions", None)
    order = {name: i for i, name in enumerate(ALL_WORKLOADS)}
    return sorted(merged.values(), key=lambda r: order.get(r["workload"], len(order)))


def table(rows):
    labels = [v for v in VARIANTS if any(v in r["ms"] for r in rows)]
    lines = ["| workload | " + " | ".join(f"{v} ms" for v in labels) + " |", "|---|" + "---|" * len(labels)]
    for r in rows:
        cells = [f"{r['ms'][v]:.3f}" if v in r["ms"] else "" for v in labels]
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="only the eager variants (eager, eager + convert [+ pads])")
    parser.add_argument("--workloads", help="comma-separated names or parts of names (default: all)")
    parser.add_argument("--variants", help="comma-separated variant labels (default: all)")
    parser.add_argument("--profile", action="store_true", help="GPU kernel time by category (GPU only)")
    parser.add_argument("--top", type=int, default=0, metavar="N", help="with --profile, the N longest kernels too")
    parser.add_argument("--channels-last", action="store_true",
                        help="4-D / 5-D weights and inputs in channels_last / channels_last_3d")
    parser.add_argument("--no-conv3d-channels-last", action="store_true",
                        help="the fusion backend with conv3d_channels_last=False")
    parser.add_argument("--more", action="store_true",
                        help="other diffusers autoencoders and video UNets (MORE_WORKLOADS) instead of the default models")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="time a workload's variants N times each, in turns, all kept alive (median round)")
    parser.add_argument("--float32-reference", action="store_true",
                        help="each variant's max and mean |error| against a float32 copy of the model too")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    workloads = MORE_WORKLOADS if args.more else WORKLOADS
    names = pick(args.workloads, workloads, "workload", substrings=True)
    labels = pick(args.variants, VARIANTS, "variant", substrings=False)
    try:
        import diffusers
    except ImportError:
        print("diffusers is not installed: no end-to-end diffusers timings")
        return 0
    device = args.device
    full = device == "cuda"
    dtype = torch.float16 if full else torch.float32
    # On the CPU the rows are a smoke test, not a measurement: the median of a few calls.
    measure = timer(device) if full else functools.partial(timer("cpu"), reps=5, warmup=1)
    card = torch.cuda.get_device_name() if full else "cpu"
    print(f"diffusers {diffusers.__version__} models on {card}, torch {torch.__version__}, {dtype}"
          + (", channels_last" if args.channels_last else ""))
    if not full:
        print("  on the CPU these are tiny configs of each model (2 blocks of 32-64 channels, latents of "
              "8-16 px), not the real ones, which take minutes a call here. The rows check that convert "
              "and compile + fusion run and match eager; their times (medians of 5 calls) say nothing "
              "about the real models.")
    if args.profile and not full:
        print("  --profile needs a GPU: no kernel times on the CPU")
    profile = args.profile and full
    if args.no_compile:
        labels = [v for v in labels if v not in COMPILED]
    if not full and any(v in CUDA_GRAPHS for v in labels):
        skipped = " and ".join(v for v in labels if v in CUDA_GRAPHS)
        print(f"  skipped on the CPU: {skipped} (CUDA graphs need a GPU)")
        labels = [v for v in labels if v not in CUDA_GRAPHS]
    if not labels:
        print(f"  no variant to run on the {device}")
        return 0

    layout = ("_more" if args.more else "") + ("_channels_last" if args.channels_last else "") \
        + ("_conv3d_inductor_layout" if args.no_conv3d_channels_last else "")
    path = os.path.join(args.out, f"diffusers_{device}{layout}.json")
    meta = {"card": card, "torch": torch.__version__, "diffusers": diffusers.__version__, "dtype": str(dtype),
            "channels_last": args.channels_last, "conv3d_channels_last": not args.no_conv3d_channels_last}
    old_rows = []
    if (args.workloads or args.variants) and os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = {}
        if all(old.get(k) == v for k, v in meta.items()):
            old_rows = old.get("rows", [])
            print(f"  merging into {path} (of {old.get('date')}, {len(old_rows)} rows): what this run measures "
                  f"replaces the same workloads' same variants there")
    os.makedirs(args.out, exist_ok=True)

    def save(rows, complete):
        with open(path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), **meta, "complete": complete,
                       "rows": merge(old_rows, rows)}, f, indent=1)

    eager_only = []
    if not full and not args.workloads and any(v in COMPILED for v in labels):
        eager_only = [name for name in names if name in CPU_EAGER_ONLY]
        print(f"  on the CPU, {' and '.join(eager_only)} run without the compiled variants (the graphs "
              f"of VAE decode 512 and UNet step b2 at another size; a compile costs a minute here): "
              f"name them in --workloads for those")

    rows, errors = [], []
    with torch.no_grad():
        for name in names:
            try:
                model, inputs = workloads[name](device, dtype, full)
                if args.channels_last:
                    model, inputs = to_channels_last(model, inputs)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                errors.append(f"{name}: {type(e).__name__}: {e}")
                print(f"  {name:16s} FAILED to build: {type(e).__name__}: {e}", flush=True)
                free_memory(device)
                continue
            free_memory(device)
            these = [v for v in labels if not (name in eager_only and v in COMPILED)]
            rows.append(run_workload(name, model, inputs, these, measure, device, errors, profile, args.top,
                                     conv3d_channels_last=not args.no_conv3d_channels_last,
                                     float32_reference=args.float32_reference, rounds=args.rounds))
            del model, inputs
            free_memory(device)
            save(rows, complete=False)
    print(table(rows))
    if old_rows:
        print(f"merged with the earlier rows of {path}:")
        print(table(merge(old_rows, rows)))
    save(rows, complete=True)
    if errors:
        print(f"{len(errors)} failed:\n  " + "\n  ".join(errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
