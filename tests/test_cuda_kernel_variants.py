"""Every variant of the CUDA kernels that the planner picks from runs here at least once, on a
shape the planner maps to it, against the float64 reference (forward and every gradient):

- the register forward: packs a thread (2, 4), extra operand streams (0-2), activation (none,
  SiLU, ReLU), channels-first or channels-last, operands loaded late (no channel parameters);
- the channels-last shared-memory forward: pack width (4, 8, 16 bytes), activation, streams;
- the one-CTA and team backwards: every activation, and what their sums phase keeps (nothing,
  dp, dp and the operands' gradients);
- the channels-last split passes on channel counts that no pack width divides.

The tests elsewhere draw shapes and epilogues at random or pick them for a path; a variant that
none of them reaches is never run (tools/kernel_coverage.sh lists those). Here the variants are
enumerated from the kernels' instantiation lists (csrc/cuda/one_pass_register_kernel.cuh,
launch_registers_planned; csrc/cuda/cols_one_pass_kernel.cuh, with_cols_one_pass_kernel;
csrc/cuda/common/keep.cuh), and a CPU test
checks on an H200's plan that each shape still reaches its variant, so that a planner change that
moves one off fails in CI rather than leaving the variant untested.
"""

import pytest
import torch

import kernel_paths
from fusednorm.kernel_paths import H200, plan
from test_fused import check_fused

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16)
COMMON_ACTIVATIONS = (None, "silu", "relu")  # the one-pass forwards' (csrc/plan.cpp, common_activation)
ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh", "relu", "leaky_relu", "mish")
STREAM_OPERANDS = ("residual", "multiplier")  # the tensor-sized operands: one stream each


def _name(dtype):
    return str(dtype)[6:]


class Variant:
    """A kernel variant, the call that reaches it and the plan that says so."""

    def __init__(self, label, shape, groups, dtype, layout, activation, operands, path, expect,
                 affine=True, operand_grads=True):
        self.label, self.shape, self.groups, self.dtype = label, shape, groups, dtype
        self.layout, self.activation, self.operands = layout, activation, list(operands)
        self.path, self.expect, self.affine, self.operand_grads = path, expect, affine, operand_grads

    def plan(self, device, backward):
        return plan(self.shape, self.groups, self.dtype, channels_last=self.layout == "channels_last",
                    activation=self.activation, operands=self.operands, backward=backward, affine=self.affine,
                    device=device)

    def __repr__(self):
        return self.label


def register_variants():
    # launch_registers_planned: (packs, extra streams) channels-first (2, 0), (2, 1), (4, 0), and
    # (2, 2), (4, 1) but in bfloat16; channels-last (2, 0), and (2, 1), (4, 0) but in bfloat16;
    # the late variant channels-first, not bfloat16.
    for dtype in DTYPES:
        small = dtype == BF16
        V = 4 if dtype == F32 else 8
        first = [(2, 0), (2, 1), (4, 0)] + ([] if small else [(2, 2), (4, 1)])
        last = [(2, 0)] + ([] if small else [(2, 1), (4, 0)])
        for act in COMMON_ACTIVATIONS:
            for cols in (False, True):
                for R, E in last if cols else first:
                    for late in (False,) if (cols or small) else (False, True):
                        if cols:  # one lane a row: 2 rows a thread up to 1024 rows, 4 up to 2048
                            D, spatial = V, (8, 8) if R == 2 else (32, 48)
                        else:  # 2 packs a thread up to 1024 packs a group, 4 up to 2048
                            D, spatial = 4, (8, 8) if R == 2 else (48, 32) if V == 4 else (64, 48)
                        # Enough groups that no cluster spreads them (one CTA a group).
                        shape = (17 if R == 4 and E else 2, 8 * D) + spatial
                        layout = "channels_last" if cols else "contiguous"
                        yield Variant(
                            f"registers-{_name(dtype)}-{act}-R{R}-E{E}-{'cl' if cols else 'cf'}{'-late' if late else ''}",
                            shape, 8, dtype, layout, act, STREAM_OPERANDS[:E], "one_pass",
                            f"path=registers packs={R} extra_streams={E} ", affine=not late)


def cols_one_pass_variants():
    # with_cols_one_pass_kernel: packs of 16, 8 or 4 bytes (the row of D channels), an activation
    # of the common ones, 1-3 streams.
    for dtype in DTYPES:
        elem = 4 if dtype == F32 else 2
        for pack in (4, 8, 16):
            D = pack // elem
            # 16-byte rows of a few rows would go to the register kernel: 2304 rows do not.
            spatial = (48, 48) if pack == 16 else (8, 8)
            for act in COMMON_ACTIVATIONS:
                for streams in (1, 2, 3):
                    yield Variant(f"cols_shared-{_name(dtype)}-{act}-pack{pack}-streams{streams}",
                                  (2, 8 * D) + spatial, 8, dtype, "channels_last", act,
                                  STREAM_OPERANDS[:streams - 1], "one_pass", f"pack_bytes={pack} ")


def backward_variants():
    # The one-CTA and team backwards: each activation with Keep::Dp and Keep::DpAndGrads, and
    # without one Keep::None too (csrc/cuda/common/keep.cuh): dp differs from dz with an
    # activation or a multiplier; the operands' gradients are kept where one is wanted.
    for dtype in DTYPES:
        for path, name in (("one_pass", "one_cta"), ("team", "team")):
            for act in ACTIVATIONS:
                for keep in ("none", "dp", "grads") if act is None else ("dp", "grads"):
                    operands = {"none": (), "dp": ("multiplier",) if act is None else (),
                                "grads": ("multiplier",) if act is None else ("residual",)}[keep]
                    yield Variant(f"{name}-{_name(dtype)}-{act}-keep_{keep}", (2, 32, 8, 8), 4, dtype,
                                  "contiguous", act, operands, path, f"path={name} ",
                                  operand_grads=keep == "grads")


def split_channels_last_variants():
    # The split passes on channels-last inputs whose channel count no pack width divides (C = 6,
    # packs of one element) and one that 8 does, with the apply kernel of an activation alone
    # (none with scale and shift, SiLU, ReLU) and the general one (residual, multiplier).
    epilogues = ((None, ("scale", "shift")), ("silu", ()), ("relu", ("scale",)), ("gelu", ("residual",)),
                 ("mish", ("residual", "multiplier")))
    for dtype in DTYPES:
        for C, G in ((6, 3), (16, 4)):
            for act, operands in epilogues:
                yield Variant(f"split-cl-{_name(dtype)}-C{C}-{act}-{'+'.join(operands) or 'plain'}",
                              (2, C, 5, 7), G, dtype, "channels_last", act, operands, "split", "path=split ")


VARIANTS = {
    "registers": list(register_variants()),
    "cols_one_pass": list(cols_one_pass_variants()),
    "backward": list(backward_variants()),
    "split_channels_last": list(split_channels_last_variants()),
}


def test_the_variant_lists_are_complete():
    # As many as csrc/cuda instantiates: 90 register kernels, 81 channels-last shared-memory
    # kernels, 45 one-CTA and 45 team backward kernels.
    assert len(VARIANTS["registers"]) == 90
    assert len(VARIANTS["cols_one_pass"]) == 81
    assert len(VARIANTS["backward"]) == 90
    assert len({v.label for vs in VARIANTS.values() for v in vs}) == sum(map(len, VARIANTS.values()))


@pytest.mark.parametrize("family", list(VARIANTS))
def test_each_variant_is_planned_on_an_h200(family, monkeypatch):
    # On the CPU too: the plans of an H200, so that CI sees a planner change that moves a shape off
    # its variant.
    for v in VARIANTS[family]:
        kernel_paths.set_path(monkeypatch, v.path)
        got = v.plan(H200, backward=family == "backward") + " "
        assert got.startswith("path=") and v.expect in got, (v, got)


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_every_kernel_variant_cuda(family, dtype, monkeypatch):
    torch.manual_seed(0)
    for v in VARIANTS[family]:
        if v.dtype != dtype:
            continue
        kernel_paths.set_path(monkeypatch, v.path)
        got = v.plan(None, backward=family == "backward") + " "
        assert v.expect in got, (v, got)
        check_fused(v.shape, v.groups, v.dtype, v.layout, v.operands, v.activation, "cuda", affine=v.affine,
                    operand_grads=v.operand_grads)
