"""The kernel planner (csrc/plan.h) without a GPU: the plan of every benchmark-suite shape on an
H200, forward and backward, pinned (a change of plan must be deliberate: it moves the benchmark),
the overrides that force each kernel path the tests cover, and the planner's argument checks.

The pinned plans are those the CUDA dispatcher carried out before the planner existed, its rules
transcribed, and since changed where measurements said (each change in git history): the team
grids (3 teams of 88 CTAs for the GroupNorm problem's forward, 13 teams of 20 for the InstanceNorm
problem's backward; its forward on clusters of 16 CTAs since 2026-12-01), the register kernel for
UNet's small groups and problem 3's tail, the channels-last shared-memory kernel for 2 groups a CTA
of 160 KB.
The residency the plans depend on (team CTAs an SM, parameter-gradient clusters at once) is
modeled from the device's properties here; on a GPU the dispatcher asks the driver."""

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Optional, Tuple

import pytest
import torch

import fusednorm
from fusednorm import kernel_paths
from fusednorm.kernel_paths import H200, TEST_PATHS, TUNING_KNOBS

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Row(NamedTuple):
    name: str
    shape: Tuple[int, ...]
    groups: int
    dtype: torch.dtype
    channels_last: bool
    activation: Optional[str]
    operands: Tuple[str, ...]
    affine: bool
    forward: str
    backward: str


# benchmarks/bench.py's GPU suite, then the rows of the video VAEs and of 8192 channels.
ROWS = [
    Row('GroupNorm problem', (112, 64, 512, 512), 8, F32, channels_last=False, activation=None, operands=(), affine=True,
        forward='path=team teams=3 team_size=88 chunk=5960 smem=95360 prefetch=4470 replicas=4 ctas=264',
        backward='path=split split=1 tiles=7168 param_grad_parts=2'),
    Row('InstanceNorm problem', (112, 64, 512, 512), 64, F32, channels_last=False, activation=None, operands=(), affine=False,
        forward='path=cluster cluster=16 chunk=4096 smem=65536 ctas=114688',
        backward='path=team teams=13 team_size=20 chunk=3280 smem=104960 prefetch=1640 replicas=16 ctas=260'),
    Row('SD UNet GN+SiLU b2', (2, 320, 64, 64), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=cluster cluster=4 chunk=1280 smem=20480 ctas=256',
        backward='path=team teams=64 team_size=4 chunk=1280 smem=40960 prefetch=0 replicas=4 ctas=256 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b2', (2, 320, 64, 64), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=cols_shared span=2 pack_bytes=4 smem=20480 ctas=256 buffer_packs=0 cluster=8',
        backward='path=split split=128 tiles=256 cols_act_kernel=1 param_grad_parts=4'),
    Row('SD UNet GN+SiLU b2', (2, 640, 32, 32), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=cluster cluster=2 chunk=1280 smem=20480 ctas=128',
        backward='path=team teams=64 team_size=4 chunk=640 smem=20480 prefetch=0 replicas=4 ctas=256 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b2', (2, 640, 32, 32), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=cols_shared span=1 pack_bytes=8 smem=40960 ctas=64 buffer_packs=0',
        backward='path=split split=64 tiles=128 cols_act_kernel=1 param_grad_parts=2'),
    Row('SD UNet GN+SiLU b2', (2, 1280, 16, 16), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=registers packs=4 extra_streams=0 threads=320 late=0 ctas=64',
        backward='path=one_cta threads=512 smem=40960 ctas=64 log_seg=5 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b2', (2, 1280, 16, 16), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=registers packs=4 extra_streams=0 threads=320 late=0 ctas=64',
        backward='path=split split=32 tiles=64 cols_act_kernel=1 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b2', (2, 1280, 8, 8), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=registers packs=2 extra_streams=0 threads=160 late=0 ctas=64',
        backward='path=one_cta threads=256 smem=10240 ctas=64 log_seg=3 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b2', (2, 1280, 8, 8), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=registers packs=2 extra_streams=0 threads=160 late=0 ctas=64',
        backward='path=split split=8 tiles=16 cols_act_kernel=1 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b8', (8, 320, 64, 64), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=cluster cluster=2 chunk=2560 smem=40960 ctas=512',
        backward='path=team teams=128 team_size=2 chunk=2560 smem=81920 prefetch=0 replicas=2 ctas=256 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b8', (8, 320, 64, 64), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=cols_shared span=2 pack_bytes=4 smem=163840 ctas=128 buffer_packs=0',
        backward='path=split split=64 tiles=512 cols_act_kernel=1 param_grad_parts=8'),
    Row('SD UNet GN+SiLU b8', (8, 640, 32, 32), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=shared cluster=1 chunk=2560 smem=40960 ctas=256',
        backward='path=one_cta threads=512 smem=81920 ctas=256 log_seg=7 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b8', (8, 640, 32, 32), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=cols_shared span=1 pack_bytes=8 smem=40960 ctas=256 buffer_packs=0',
        backward='path=split split=64 tiles=512 cols_act_kernel=1 param_grad_parts=5'),
    Row('SD UNet GN+SiLU b8', (8, 1280, 16, 16), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=registers packs=4 extra_streams=0 threads=320 late=0 ctas=256',
        backward='path=one_cta threads=512 smem=40960 ctas=256 log_seg=5 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b8', (8, 1280, 16, 16), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=registers packs=4 extra_streams=0 threads=320 late=0 ctas=256',
        backward='path=split split=32 tiles=256 cols_act_kernel=1 param_grad_parts=3'),
    Row('SD UNet GN+SiLU b8', (8, 1280, 8, 8), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=registers packs=2 extra_streams=0 threads=160 late=0 ctas=256',
        backward='path=one_cta threads=256 smem=10240 ctas=256 log_seg=3 param_grad_parts=1'),
    Row('SD UNet GN+SiLU b8', (8, 1280, 8, 8), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=registers packs=2 extra_streams=0 threads=160 late=0 ctas=256',
        backward='path=split split=8 tiles=64 cols_act_kernel=1 param_grad_parts=1'),
    Row('VAE GN+SiLU', (1, 128, 512, 512), 32, BF16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=team teams=11 team_size=24 chunk=5464 smem=87424 prefetch=2049 replicas=4 ctas=264',
        backward='path=team teams=6 team_size=44 chunk=2984 smem=95488 prefetch=1492 replicas=16 ctas=264 param_grad_parts=1'),
    Row('VAE GN+SiLU', (1, 256, 256, 256), 32, BF16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=team teams=16 team_size=16 chunk=4096 smem=65536 prefetch=1536 replicas=4 ctas=256',
        backward='path=team teams=11 team_size=24 chunk=2736 smem=87552 prefetch=1368 replicas=16 ctas=264 param_grad_parts=1'),
    Row('VAE GN+SiLU', (1, 512, 128, 128), 32, BF16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=team teams=32 team_size=8 chunk=4096 smem=65536 prefetch=0 replicas=4 ctas=256',
        backward='path=team teams=16 team_size=16 chunk=2048 smem=65536 prefetch=1024 replicas=16 ctas=256 param_grad_parts=1'),
    Row('VAE GN+SiLU', (1, 128, 1024, 1024), 32, F16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=team teams=3 team_size=88 chunk=5960 smem=95360 prefetch=4470 replicas=4 ctas=264',
        backward='path=team teams=1 team_size=264 chunk=1992 smem=63744 prefetch=996 replicas=16 ctas=264 param_grad_parts=1'),
    Row('VAE GN+SiLU', (1, 128, 512, 512), 32, F16, channels_last=True, activation='silu', operands=(), affine=True,
        forward='path=cols_sweep threads=512 split=264 tiles=264 output_tiles=792',
        backward='path=split split=512 tiles=512 cols_act_kernel=1 param_grad_parts=8'),
    Row('Attention GN', (16, 512, 4096), 32, BF16, channels_last=False, activation=None, operands=(), affine=True,
        forward='path=cluster cluster=2 chunk=4096 smem=65536 ctas=1024',
        backward='path=team teams=86 team_size=3 chunk=2736 smem=87552 prefetch=0 replicas=3 ctas=258 param_grad_parts=1'),
    Row('InstanceNorm3d affine', (2, 32, 128, 128, 128), 32, F32, channels_last=False, activation=None, operands=(), affine=True,
        forward='path=team teams=3 team_size=88 chunk=5960 smem=95360 prefetch=4470 replicas=4 ctas=264',
        backward='path=split split=33 tiles=2112 param_grad_parts=2'),
    Row('InstanceNorm3d affine', (2, 32, 128, 128, 128), 32, F32, channels_last=True, activation=None, operands=(), affine=True,
        forward='path=cols_sweep threads=512 split=132 tiles=264 output_tiles=792',
        backward='path=split split=256 tiles=512 param_grad_parts=8'),
    Row('SD AdaGN+SiLU b2', (2, 320, 64, 64), 32, F16, channels_last=False, activation='silu', operands=('scale', 'shift'), affine=True,
        forward='path=cluster cluster=4 chunk=1280 smem=20480 ctas=256',
        backward='path=team teams=64 team_size=4 chunk=1280 smem=40960 prefetch=0 replicas=4 ctas=256 param_grad_parts=1'),
    Row('SD AdaGN+SiLU b2', (2, 1280, 16, 16), 32, F16, channels_last=False, activation='silu', operands=('scale', 'shift'), affine=True,
        forward='path=registers packs=4 extra_streams=0 threads=320 late=0 ctas=64',
        backward='path=one_cta threads=512 smem=40960 ctas=64 log_seg=5 param_grad_parts=1'),
    Row('ResNet GN+residual+ReLU', (16, 256, 56, 56), 32, BF16, channels_last=True, activation='relu', operands=('residual',), affine=True,
        forward='path=cols_shared span=2 pack_bytes=16 smem=100352 ctas=256 buffer_packs=0',
        backward='path=split split=32 tiles=512 param_grad_parts=8'),
    Row('problem 3 tail (h+y)*y', (1024, 8192), 1, F32, channels_last=False, activation=None, operands=('multiplier=residual',), affine=False,
        forward='path=registers packs=4 extra_streams=1 threads=512 late=1 ctas=1024',
        backward='path=one_cta threads=512 smem=98304 ctas=1024 log_seg=0'),
    Row('video VAE GN+SiLU', (1, 128, 20, 256, 256), 32, BF16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=team teams=2 team_size=132 chunk=4968 smem=79488 prefetch=3726 replicas=4 ctas=264',
        backward='path=team teams=1 team_size=264 chunk=2488 smem=79616 prefetch=1244 replicas=16 ctas=264 param_grad_parts=1'),
    Row('video VAE GN+SiLU', (1, 512, 16, 90, 160), 32, BF16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=team teams=3 team_size=88 chunk=5240 smem=83840 prefetch=3930 replicas=4 ctas=264',
        backward='path=team teams=1 team_size=264 chunk=1752 smem=56064 prefetch=876 replicas=16 ctas=264 param_grad_parts=1'),
    # A video VAE decoder's last block on 49 frames of 480x720 at once: groups of 135 MB, which no
    # team holds (the sweep's).
    Row('video VAE GN+SiLU', (1, 128, 49, 480, 720), 32, BF16, channels_last=False, activation='silu', operands=(), affine=True,
        forward='path=sweep split=517 tiles=16544',
        backward='path=split split=17 tiles=2176 param_grad_parts=1'),
    Row('rows of 8192', (1024, 1, 1, 8192), 1, F32, channels_last=False, activation=None, operands=(), affine=True,
        forward='path=registers packs=4 extra_streams=0 threads=512 late=0 ctas=1024',
        backward='path=one_cta threads=512 smem=65536 ctas=1024 log_seg=8 param_grad_parts=8'),
]


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    """Every test starts from the defaults; the library reads the overrides again after it."""
    for name in kernel_paths.KNOBS:
        monkeypatch.delenv(name, raising=False)
    kernel_paths.reload_overrides()
    yield
    monkeypatch.undo()
    kernel_paths.reload_overrides()


def plan_of(row, backward, device=H200):
    return kernel_paths.plan(row.shape, row.groups, row.dtype, channels_last=row.channels_last,
                             activation=row.activation, operands=row.operands, backward=backward,
                             device=device, affine=row.affine)


def _id(row):
    layout = "-cl" if row.channels_last else ""
    return f"{row.name}-{'x'.join(map(str, row.shape))}-{str(row.dtype)[6:]}{layout}"


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_benchmark_shapes_plans(row):
    assert plan_of(row, backward=False) == row.forward
    assert plan_of(row, backward=True) == row.backward


def test_every_path_is_planned_for_some_benchmark_shape():
    paths = {p.split()[0] for row in ROWS for p in (row.forward, row.backward)}
    assert paths == {"path=" + p for p in ("team", "registers", "shared", "cluster", "one_cta", "split",
                                            "cols_shared", "sweep", "cols_sweep")}


def test_team_forward_takes_the_one_pass_groups_only_when_few_and_large():
    """docs/design.md, "Team or one-pass": of the groups the one-pass clusters hold, the team takes
    those of 512 KB and more in fewer groups than half the SMs; groups over 1 MB are the team's."""
    def forward(shape, dtype, G=32, **kw):
        return _path(kernel_paths.plan(shape, G, dtype, **kw))
    assert forward((1, 512, 128, 128), torch.bfloat16, activation="silu") == "team"     # 512 KB, 32 groups
    assert forward((1, 256, 256, 256), torch.bfloat16, activation="silu") == "team"     # 1 MB, 32 groups
    assert forward((1, 512, 64, 64), torch.bfloat16, activation="silu") == "cluster"    # 128 KB, 32 groups
    assert forward((8, 512, 128, 128), torch.bfloat16, activation="silu") == "cluster"  # 512 KB, 256 groups
    assert forward((2, 512, 128, 128), torch.float16, activation="silu") == "team"      # 64 groups: level
    assert forward((3, 512, 128, 128), torch.float16, activation="silu") == "cluster"   # 96 groups
    assert forward((16, 256, 128, 128), torch.float16) == "cluster"                     # 256 KB, 512 groups
    assert forward((16, 64, 512, 512), torch.float32, G=64) == "cluster"                # 1 MB, 1024 groups
    assert forward((4, 256, 256, 256), torch.bfloat16, activation="silu") == "cluster"  # 1 MB, 128 groups
    assert forward((16, 64, 512, 256), torch.float32, G=64) == "cluster"                # 512 KB, 1024 groups
    assert forward((4, 256, 256, 255), torch.bfloat16, activation="silu") == "cluster"  # just under 1 MB, 128
    assert forward((16, 64, 512, 512), torch.float32, G=32) == "team"                   # 2 MB


def test_sweep_takes_16_bit_groups_no_team_holds_whose_packs_keep_to_a_channel(monkeypatch):
    """docs/design.md, "Sweep path": the planner's rule and its overrides."""
    def forward(shape, dtype, **kw):
        return _path(kernel_paths.plan(shape, 32, dtype, activation="silu", **kw))
    # x alone: the groups the team grid does not hold (on the H200, from 28 MB: 264 CTAs of at
    # most 108 KB), 9 MB and more.
    assert forward((1, 128, 112, 128, 256), torch.bfloat16) == "sweep"  # 28 MB groups
    assert forward((1, 128, 110, 128, 256), torch.bfloat16) == "team"   # 27.5 MB: one team of 264
    assert forward((1, 128, 36, 128, 256), torch.bfloat16) == "team"    # 9 MB
    assert forward((1, 128, 20, 256, 256), torch.float16) == "team"     # the video VAE's 10 MB
    assert forward((1, 128, 1024, 1024), torch.float16) == "team"      # the VAE's 8 MB
    assert forward((1, 128, 512, 512), torch.bfloat16) == "team"       # 2 MB
    assert forward((1, 128, 36, 128, 256), torch.float32) == "team"    # 18 MB, float32
    assert forward((1, 128, 20, 256, 256), torch.half, channels_last=True) != "sweep"
    # With a residual or multiplier (the output sweep's operand kernel) from 4 MB.
    assert forward((1, 128, 64, 32, 256), torch.bfloat16, operands=True) == "sweep"
    assert forward((1, 128, 64, 32, 255), torch.bfloat16, operands=True) == "team"
    assert forward((1, 128, 64, 32, 256), torch.bfloat16, operands=["multiplier"]) == "sweep"
    assert forward((1, 128, 64, 32, 256), torch.bfloat16) == "team"
    # Groups of two channels of 7 * 1024 * 1024 + 4 elements (28 MB): packs of 8 straddle the
    # channels, which only a group without per-channel parameters allows.
    assert forward((1, 64, 7 * 1024 * 1024 + 4), torch.half) == "split"
    assert forward((1, 64, 7 * 1024 * 1024 + 4), torch.half, affine=False) == "sweep"
    assert forward((1, 64, 3 * 1024 * 1024 + 4), torch.half, affine=False) == "team"  # 12 MB
    assert forward((1, 128, 20, 256, 256), torch.bfloat16, operands=True) == "sweep"
    _set(monkeypatch, {"FUSEDNORM_SWEEP_FORWARD": "0"})
    assert forward((1, 128, 112, 128, 256), torch.bfloat16) == "split"
    assert forward((1, 128, 20, 256, 256), torch.bfloat16, operands=True) == "team"
    _set(monkeypatch, {"FUSEDNORM_SWEEP_FORWARD": "1"})
    assert forward((2, 64, 8, 8), torch.float16) == "sweep"  # any 16-bit group, forced
    plan = kernel_paths.plan((2, 64, 8, 8), 32, torch.float16)
    assert plan == "path=sweep split=1 tiles=64", plan
    assert forward((2, 64, 8, 8), torch.float32) == "registers"  # its kernels are 16-bit only
    monkeypatch.delenv("FUSEDNORM_SWEEP_FORWARD")
    _set(monkeypatch, {"FUSEDNORM_ONE_PASS_MAX_BYTES": "0"})
    # A forced one-pass limit keeps the paths the tests select with it.
    assert forward((1, 128, 20, 256, 256), torch.bfloat16) == "team"


def test_sweep_takes_strided_rows(monkeypatch):
    """docs/design.md, "Sweep path": an input whose rows are contiguous but not back to back (the
    frames of an NCDHW video) takes the sweep, at any size, where its rows are whole packs of 512
    and more; otherwise nothing (the dispatcher copies it dense and plans again)."""
    def forward(shape, dtype, operands=(), **kw):
        return kernel_paths.plan(shape, 32, dtype, activation="silu", operands=("strided_rows",) + operands, **kw)
    # Mochi's decoder frames at every resolution: 305 KB to 3.3 MB groups, which dense would be the
    # team's or the clusters'.
    assert forward((7, 128, 480, 848), torch.half) == "path=sweep split=13 tiles=2912"
    assert _path(forward((7, 768, 60, 106), torch.half)) == "sweep"
    assert _path(forward((7, 128, 480, 848), torch.bfloat16, operands=("residual",))) == "sweep"
    assert _path(kernel_paths.plan((7, 128, 480, 848), 32, torch.half, operands=("strided_rows",), affine=False)) == "sweep"
    # Not 16-bit, rows under 512 packs or not of whole packs: nothing.
    assert _path(forward((7, 128, 480, 848), torch.float32)) == "none"
    assert _path(forward((7, 128, 64, 63), torch.half)) == "none"
    assert _path(forward((7, 128, 60, 106, 1), torch.half)) == "sweep"
    assert _path(forward((7, 128, 4095), torch.half)) == "none"
    # The backward reads a dense copy: planned as ever; channels-last inputs have no such rows.
    assert kernel_paths.plan((7, 128, 480, 848), 32, torch.half, operands=("strided_rows",), backward=True) == \
        kernel_paths.plan((7, 128, 480, 848), 32, torch.half, backward=True)
    assert _path(forward((7, 128, 480, 848), torch.half, channels_last=True)) == "cols_sweep"
    _set(monkeypatch, {"FUSEDNORM_SWEEP_FORWARD": "0"})
    assert _path(forward((7, 128, 480, 848), torch.half)) == "none"
    monkeypatch.delenv("FUSEDNORM_SWEEP_FORWARD")
    _set(monkeypatch, {"FUSEDNORM_ONE_PASS_MAX_BYTES": "0"})  # (which keeps dense groups off the sweep)
    assert _path(forward((7, 128, 480, 848), torch.half)) == "sweep"


def test_cols_sweep_takes_the_channels_last_groups_the_one_pass_kernels_do_not(monkeypatch):
    """docs/design.md, "Channels-last sweep": the planner's rule and its overrides."""
    def forward(shape, dtype, G=32, **kw):
        return kernel_paths.plan(shape, G, dtype, activation="silu", channels_last=True, **kw)
    # The VAE's channels-last groups of 2 MB: moments tiles of whole rows in one wave of two CTAs
    # an SM, output tiles in two waves of three.
    assert forward((1, 128, 512, 512), torch.half) == \
        "path=cols_sweep threads=512 split=264 tiles=264 output_tiles=792"
    # 80 packs a row: CTAs of 6 rows (480 threads) for the moments.
    assert forward((2, 320, 128, 128), torch.float32) == \
        "path=cols_sweep threads=480 split=132 tiles=264 output_tiles=782"
    assert _path(forward((1, 128, 512, 512), torch.bfloat16, operands=True)) == "cols_sweep"
    # Small groups stay with the one-pass kernels, inputs under 32 MB with the one-pass kernels in
    # clusters or the split passes; rows of more than 256 packs, double and contiguous inputs never
    # take it.
    assert _path(forward((8, 1280, 8, 8), torch.half)) == "registers"
    assert _path(forward((1, 512, 128, 128), torch.half)) == "cols_shared"
    assert _path(forward((1, 512, 64, 64), torch.float32)) == "split"
    assert _path(forward((1, 4096, 128, 128), torch.half)) == "split"
    assert _path(forward((1, 2048, 128, 128), torch.float32)) == "split"
    assert _path(forward((1, 128, 512, 512), torch.float64)) == "split"
    _set(monkeypatch, {"FUSEDNORM_COLS_SWEEP": "0"})
    assert _path(forward((1, 128, 512, 512), torch.half)) == "split"
    _set(monkeypatch, {"FUSEDNORM_COLS_SWEEP": "1"})
    assert _path(forward((8, 1280, 8, 8), torch.half)) == "cols_sweep"  # forced: any group it can take
    assert _path(forward((1, 512, 128, 128), torch.half)) == "cols_sweep"
    assert _path(forward((1, 4096, 128, 128), torch.half)) == "split"
    monkeypatch.delenv("FUSEDNORM_COLS_SWEEP")  # (an empty value reads as 0: the sweep off)
    _set(monkeypatch, {"FUSEDNORM_ONE_PASS_MAX_BYTES": "0"})
    # A forced one-pass limit keeps the paths the tests select with it.
    assert _path(forward((1, 128, 512, 512), torch.half)) == "split"


def test_channels_last_clusters_take_the_16_bit_slabs_one_cta_does_not(monkeypatch):
    """docs/design.md, "Channels-last one-pass": slabs no CTA takes alone, or too few to fill the
    GPU one a CTA, in clusters on sm_90; 16-bit types without a residual or multiplier."""
    def forward(shape, dtype, G=32, device=H200, **kw):
        return kernel_paths.plan(shape, G, dtype, activation="silu", channels_last=True, device=device, **kw)
    # The VAE's 128 KB groups at 64x64: clusters of 8 CTAs of 16 KB (256 CTAs); its 512 KB groups
    # at 128x128: 8 of 64 KB; both in slabs of two groups over clusters of 16 (rows of 64 bytes, the
    # same CTAs) where the device schedules clusters of 16. The UNet's D = 10 at 64x64: two groups
    # a slab of 4-byte packs.
    assert forward((1, 512, 64, 64), torch.half) == \
        "path=cols_shared span=2 pack_bytes=16 smem=16384 ctas=256 buffer_packs=0 cluster=16"
    assert forward((1, 512, 128, 128), torch.bfloat16) == \
        "path=cols_shared span=2 pack_bytes=16 smem=65536 ctas=256 buffer_packs=0 cluster=16"
    no_clusters_of_16 = H200[:-1] + (0,)
    assert forward((1, 512, 64, 64), torch.half, device=no_clusters_of_16) == \
        "path=cols_shared span=1 pack_bytes=16 smem=16384 ctas=256 buffer_packs=0 cluster=8"
    assert forward((1, 512, 128, 128), torch.bfloat16, device=no_clusters_of_16) == \
        "path=cols_shared span=1 pack_bytes=16 smem=65536 ctas=256 buffer_packs=0 cluster=8"
    assert forward((2, 320, 64, 64), torch.half) == \
        "path=cols_shared span=2 pack_bytes=4 smem=20480 ctas=256 buffer_packs=0 cluster=8"
    # Slabs one CTA takes stay unclustered ((8, 320, 64, 64): 128 slabs of 160 KB).
    assert "cluster" not in forward((8, 320, 64, 64), torch.half)
    # float32, a residual or multiplier, more than one wave, no clusters (sm_80), the knob at 1:
    # the split passes.
    assert _path(forward((1, 512, 64, 64), torch.float32)) == "split"
    assert _path(forward((1, 512, 64, 64), torch.half, operands=["residual"])) == "split"
    assert _path(forward((1, 512, 64, 64), torch.half, operands=["multiplier"])) == "split"
    assert "cluster=16" in forward((1, 512, 64, 64), torch.half, operands=["scale", "shift"])
    assert _path(forward((2, 512, 96, 96), torch.half)) == "split"  # 512 CTAs
    a100 = (108, 8, 0, 163 * 1024, 164 * 1024, 40 * 1024 * 1024, 1, 0)
    assert _path(forward((1, 512, 64, 64), torch.half, device=a100)) == "split"
    if kernel_paths.tuning_knobs_compiled():
        _set(monkeypatch, {"FUSEDNORM_ONE_PASS_MAX_CLUSTER": "1"})
        assert _path(forward((1, 512, 64, 64), torch.half)) == "split"


def _set(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kernel_paths.reload_overrides()


def _path(plan):
    return plan.split()[0][len("path="):]


# Two shapes every path can take: (2, 1280, 8, 8) float16, by default in registers forward and one
# CTA backward, and (8, 320, 64, 64) float16, by default on clusters of 2 CTAs forward and the team
# kernel backward.
SMALL = ROWS[[r.shape for r in ROWS].index((2, 1280, 8, 8))]
MEDIUM = ROWS[[r.shape for r in ROWS].index((8, 320, 64, 64))]
VAE_CL = next(r for r in ROWS if r.shape == (1, 128, 512, 512) and r.channels_last)  # the channels-last sweep


def test_one_cta_backward_leaves_room_for_static_shared_memory(monkeypatch):
    # Forced (as the tests force it), a group of the whole opt-in shared memory (the H200's
    # 232448 bytes of x and dy) would not launch beside the kernel's static arrays: the planner
    # keeps kSmemReserveBytes free, as for the channels-last one-pass slabs.
    _set(monkeypatch, TEST_PATHS["one_pass"])
    def backward(C):
        return plan_of(Row("edge", (132, C, 16, 16), 1, BF16, channels_last=False, activation=None, operands=(),
                           affine=True, forward="", backward=""), True)
    assert backward(226).startswith("path=one_cta threads=512 smem=231424 "), backward(226)
    assert _path(backward(227)) != "one_cta", backward(227)


@pytest.mark.parametrize("path", list(TEST_PATHS))
def test_overrides_force_each_test_path(path, monkeypatch):
    _set(monkeypatch, TEST_PATHS[path])
    for row in (SMALL, MEDIUM):
        forward, backward = plan_of(row, False), plan_of(row, True)
        if path == "one_pass":
            assert _path(forward) in ("registers", "shared", "cluster"), forward
            assert _path(backward) == "one_cta", backward
        elif path == "one_pass_shared":
            assert _path(forward) in ("shared", "cluster"), forward
            assert _path(backward) == "one_cta", backward
        elif path == "split":
            assert _path(forward) == "split", forward
            assert _path(backward) == "split" and backward.endswith("param_grad_parts=8"), backward
        elif path == "sweep":
            assert _path(forward) == "sweep", forward
            assert backward == row.backward, backward  # the default's: no sweep backward
        elif path == "cols_sweep":
            # Contiguous rows: the default's (test_cols_sweep_takes_the_channels_last_groups_...).
            assert (forward, backward) == (row.forward, row.backward), (forward, backward)
        else:
            assert _path(forward) == "team" and _path(backward) == "team", (forward, backward)


def test_overrides_are_read_once_until_reloaded(monkeypatch):
    default = plan_of(SMALL, False)
    monkeypatch.setenv("FUSEDNORM_TEAM_FORWARD", "1")
    monkeypatch.setenv("FUSEDNORM_ONE_PASS_MAX_BYTES", "0")
    assert plan_of(SMALL, False) == default
    state = kernel_paths.reload_overrides()
    assert "team_forward=1" in state and "one_pass_max_bytes=0" in state
    assert _path(plan_of(SMALL, False)) == "team"
    monkeypatch.delenv("FUSEDNORM_TEAM_FORWARD")
    monkeypatch.delenv("FUSEDNORM_ONE_PASS_MAX_BYTES")
    kernel_paths.reload_overrides()
    assert plan_of(SMALL, False) == default


def test_selected_sets_and_restores_the_overrides():
    default = plan_of(MEDIUM, False)
    with kernel_paths.selected("split"):
        assert _path(plan_of(MEDIUM, False)) == "split"
    assert plan_of(MEDIUM, False) == default


def test_tuning_knobs_are_ignored_by_a_default_build(monkeypatch):
    if kernel_paths.tuning_knobs_compiled():
        pytest.skip("built with FUSEDNORM_TUNING_KNOBS")
    def plans():
        return plan_of(MEDIUM, False), plan_of(MEDIUM, True), plan_of(SMALL, True), plan_of(VAE_CL, False)
    default = plans()
    _set(monkeypatch, {"FUSEDNORM_TEAM_CTA_KB": "16", "FUSEDNORM_BACKWARD_THREADS": "512",
                       "FUSEDNORM_ONE_PASS_MAX_CLUSTER": "1", "FUSEDNORM_COLS_ACT_KERNEL": "0",
                       "FUSEDNORM_COLS_SWEEP_WAVES": "4", "FUSEDNORM_COLS_SWEEP_OUTPUT_WAVES": "8",
                       "FUSEDNORM_TEAM_COUNT": "1"})
    assert set(TUNING_KNOBS) == {"FUSEDNORM_TEAM_CTA_KB", "FUSEDNORM_TEAM_COUNT", "FUSEDNORM_BACKWARD_THREADS",
                                 "FUSEDNORM_ONE_PASS_MAX_CLUSTER", "FUSEDNORM_COLS_ACT_KERNEL",
                                 "FUSEDNORM_COLS_SWEEP_WAVES", "FUSEDNORM_COLS_SWEEP_OUTPUT_WAVES"}
    assert plans() == default


def test_team_knobs_size_the_grid(monkeypatch):
    gn, instance = ROWS[0], ROWS[1]  # teams of 88 / 264 CTAs (GroupNorm), of 10 / 20 (InstanceNorm)
    _set(monkeypatch, {"FUSEDNORM_TEAM_PREFETCH": "0", "FUSEDNORM_TEAM_REPLICAS": "1"})
    assert "prefetch=0 replicas=1" in plan_of(gn, False)
    assert "teams=13 team_size=20 chunk=3280 smem=104960 prefetch=0 replicas=1" in plan_of(instance, True)
    # One team on the whole grid without the L2 prefetch: the plain backward takes the split
    # passes, which were faster there; with an activation the team kernel stays.
    assert _path(plan_of(gn, True)) == "split"
    assert _path(plan_of(gn._replace(activation="silu"), True)) == "team"
    if kernel_paths.tuning_knobs_compiled():
        # 32 groups of 4 MB: 6 teams of 44 CTAs by team_count, 4 of 66 asked for, 6 at most.
        def forward():
            return kernel_paths.plan((1, 256, 512, 512), 32, F16, activation="silu", device=H200)
        assert "teams=6 team_size=44" in forward()
        _set(monkeypatch, {"FUSEDNORM_TEAM_COUNT": "4"})
        assert "teams=4 team_size=66" in forward()
        _set(monkeypatch, {"FUSEDNORM_TEAM_COUNT": "100"})
        assert "teams=6 team_size=44" in forward()


@pytest.mark.parametrize("shape, dtype, teams", [
    # 32 groups of 4.7 MB, at most 6 teams: 6 rounds of 6 teams (4 idle in the last) beat 8 of 4
    # (H200, 0.114 against 0.128 ms).
    ((1, 128, 768, 768), F16, "teams=6 team_size=44"),
    ((1, 256, 512, 512), F16, "teams=6 team_size=44"),
    # 32 groups of 1 MB, at most 26 teams: two rounds either way, in 16 teams of smaller chunks
    # (0.034 against 0.045 ms).
    ((1, 256, 256, 256), BF16, "teams=16 team_size=16"),
    # 256 groups of 2 MB, at most 13 teams: 20 rounds need all 13.
    ((8, 128, 512, 512), BF16, "teams=13 team_size=20"),
])
def test_team_count_takes_the_fewest_rounds_then_the_fewest_teams(shape, dtype, teams):
    # docs/design.md, "Team count".
    assert teams + " " in kernel_paths.plan(shape, 32, dtype, activation="silu", device=H200)


def test_a_device_without_clusters(monkeypatch):
    # An sm_80 card (108 SMs, 163 KB a CTA): no clusters, so 512 KB groups are not taken in one
    # pass, and the parameter gradients take one CTA a channel block.
    a100 = (108, 8, 0, 163 * 1024, 164 * 1024, 40 << 20, 1, 0)
    _set(monkeypatch, {"FUSEDNORM_TEAM_FORWARD": "0", "FUSEDNORM_TEAM_BACKWARD": "0"})
    assert _path(kernel_paths.plan((1, 8, 128, 128), 1, F32, device=a100)) == "split"
    assert _path(kernel_paths.plan((1, 8, 128, 128), 1, F32, device=H200)) == "cluster"
    assert kernel_paths.plan((8, 320, 64, 64), 32, F16, channels_last=True, backward=True,
                             device=a100).endswith("param_grad_parts=1")


def test_double_takes_the_split_passes():
    for backward in (False, True):
        assert _path(kernel_paths.plan((2, 64, 8, 8), 32, torch.float64, backward=backward, device=H200)) == "split"


def test_plan_without_device_is_an_h200s_where_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("plans for the visible GPU")
    assert kernel_paths.plan(MEDIUM.shape, 32, F16, activation="silu") == MEDIUM.forward


def test_plan_rejects_bad_arguments():
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        kernel_paths.plan((2, 30, 4, 4), 4, F32, device=H200)
    with pytest.raises(RuntimeError, match="not implemented for 'Int'"):
        kernel_paths.plan((2, 32, 4, 4), 4, torch.int32, device=H200)
    with pytest.raises(ValueError, match="unknown operand"):
        kernel_paths.plan((2, 32, 4, 4), 4, F32, operands=("bias2",), device=H200)
    with pytest.raises((ValueError, RuntimeError), match="activation"):
        kernel_paths.plan((2, 32, 4, 4), 4, F32, activation="swish", device=H200)
    assert fusednorm  # the package loads the library the plan op lives in


# ---------------------------------------------------------------------------------------------
# Each path's margin (docs/design.md, "Path margins"): the GPU kernel time of every suite
# row under the planner's default and under each path the tests can force, measured on an H200 by
# tools/path_margins.py into data/path_margins.json. The planner must still make the plans
# measured, and pick the fastest of them: a change of plan needs new measurements, and a path
# that loses where it is planned, or never clearly beats the split passes, fails here.
MARGINS = json.loads((Path(__file__).parent / "data" / "path_margins.json").read_text())
# Kernel times of one plan differ by up to ~3% between runs on the H200.
NOISE = 1.04
# What "clearly beats the split passes" means for a path somewhere among the rows it serves.
CLEAR_MARGIN = 1.2


# A kernel each path launches: the kernels recorded with a plan show that it is the plan the CUDA
# dispatcher made there (with the driver's residency, where the plan op models it).
PATH_KERNELS = {
    "registers": {"group_norm_registers_kernel"},
    "shared": {"group_norm_one_pass_kernel"},
    "cluster": {"group_norm_one_pass_kernel"},
    "cols_shared": {"group_norm_cols_one_pass_kernel"},
    "team": {"group_norm_team_kernel", "group_norm_team_backward_kernel"},
    "one_cta": {"group_norm_backward_one_pass_kernel"},
    "sweep": {"group_norm_sweep_moments_kernel"},
    "cols_sweep": {"cols_sweep_moments_kernel"},
    "split": {"reduce_rows_kernel", "reduce_cols_kernel"},
}


def _margin_id(row):
    layout = "-cl" if row["channels_last"] else ""
    return f"{row['name']}-{'x'.join(map(str, row['shape']))}-{row['dtype']}{layout}-{row['direction']}"


def _planned(args):
    args = dict(args)
    return kernel_paths.plan(args.pop("shape"), args.pop("num_groups"), getattr(torch, args.pop("dtype")),
                             device=H200, **args)


@pytest.mark.parametrize("row", MARGINS["rows"], ids=_margin_id)
def test_the_planned_path_is_the_fastest_measured(row):
    default = row["paths"]["default"]
    assert _planned(row["plan_args"]) == default["plan"], \
        "the plan differs from the one measured: run tools/path_margins.py on an H200"
    for measured in row["paths"].values():
        assert PATH_KERNELS[_path(measured["plan"])] & set(measured["kernels"]), measured
    best = min(row["paths"].values(), key=lambda p: p["ms"])
    assert default["ms"] <= NOISE * best["ms"], \
        f"{best['plan']} took {best['ms']} ms where the planned {default['plan']} took {default['ms']} ms"


def test_every_planned_path_clearly_beats_the_split_passes_somewhere():
    best_margin = {}
    for row in MARGINS["rows"]:
        path = _path(row["paths"]["default"]["plan"])
        margin = row["paths"]["split"]["ms"] / row["paths"]["default"]["ms"]
        best_margin[path] = max(best_margin.get(path, 0.0), margin)
    best_margin.pop("split")
    # (The sweep forward serves no suite row: since the team's chunks start on 128-byte lines,
    # the team holds the video VAEs' groups faster; docs/design.md, "Sweep path".)
    assert set(best_margin) >= {"registers", "cluster", "cols_shared", "team", "one_cta"}
    losers = {path: round(m, 2) for path, m in best_margin.items() if m < CLEAR_MARGIN}
    assert not losers, f"paths that never beat the split passes by {CLEAR_MARGIN}x on the rows they serve: {losers}"


def test_path_margins_merge_puts_a_partial_run_in_place(tmp_path):
    # tools/path_margins.py --merge (no GPU): a partial run's rows replace the whole file's rows of
    # the same case and direction, in place, new cases come after, and the run is noted.
    rows = copy.deepcopy(MARGINS["rows"][:3])
    head = {k: v for k, v in MARGINS.items() if k != "rows"}
    remeasured = copy.deepcopy(rows[1])
    remeasured["paths"]["default"]["ms"] = 1.5
    added = dict(copy.deepcopy(rows[2]), name="a case the file has not")
    partial = dict(head, date="2099-01-01", command="python tools/path_margins.py --filter x", rows=[remeasured, added])
    (tmp_path / "new.json").write_text(json.dumps(partial))
    (tmp_path / "whole.json").write_text(json.dumps(dict(head, rows=rows)))
    tool = Path(__file__).parents[1] / "tools" / "path_margins.py"
    subprocess.run([sys.executable, str(tool), "--merge", str(tmp_path / "new.json"), str(tmp_path / "whole.json")],
                   check=True)
    merged = json.loads((tmp_path / "whole.json").read_text())
    assert merged["rows"] == rows[:1] + [remeasured] + rows[2:] + [added]
    assert merged["updated"].startswith(MARGINS["updated"] + "; 2099-01-01, ")
    assert merged["updated"].endswith(": python tools/path_margins.py --filter x")


def test_knob_sweep_plans_each_value():
    # tools/knob_sweep.py --plans (no GPU needed): for each row the default plan (the knob unset),
    # then each value's; an unknown knob is refused as argparse refuses an argument.
    tool = Path(__file__).parents[1] / "tools" / "knob_sweep.py"
    done = subprocess.run([sys.executable, str(tool), "FUSEDNORM_TEAM_PREFETCH", "0,6", "--row", "1,128,768,768:float16:silu",
                           "--row", "1,128,512,512:bfloat16:silu", "--backward", "--plans"],
                          check=True, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    default = kernel_paths.plan((1, 128, 768, 768), 32, F16, activation="silu", backward=True)
    assert lines[0].split()[-len(default.split()):] == default.split()
    assert "default" in lines[0] and "prefetch=0 " in lines[1] and "prefetch=0 " not in lines[2]
    assert all("path=team" in line for line in lines), done.stdout
    # Operand fields: the plan of the row with its residual or multiplier (the sweep before the
    # team), and without the knob's sweep the team's.
    done = subprocess.run([sys.executable, str(tool), "FUSEDNORM_SWEEP_FORWARD", "0", "--plans",
                           "--row", "1,128,1024,1024:float16:gelu:multiplier"], check=True, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and "gelu multiplier" in lines[0], done.stdout
    assert lines[0].split()[-1] == kernel_paths.plan((1, 128, 1024, 1024), 32, F16, activation="gelu",
                                                     operands=["multiplier"]).split()[-1]
    assert "path=sweep" in lines[0] and "path=team" in lines[1], done.stdout
    bad = subprocess.run([sys.executable, str(tool), "FUSEDNORM_NOT_A_KNOB", "1", "--row", "1,32,8,8", "--plans"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not one of" in bad.stderr
