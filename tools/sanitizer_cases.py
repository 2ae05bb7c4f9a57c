"""Runs each CUDA kernel path once on small inputs, for compute-sanitizer (tools/sanitize.sh):
both layouts, every dtype, with and without weight/bias, tails that are not multiples of the vector
width, groups split over several CTAs, misaligned (offset) storage, and empty inputs; the fused ops
with every epilogue operand, their forward on each of its paths (one pass with the group in
registers or in shared memory, split, team)."""

import argparse

import torch

import fusednorm  # noqa: F401
from fusednorm import kernel_paths

CASES = [
    # shape, groups
    ((2, 6, 5, 7), 3),
    ((3, 32, 33, 17), 8),
    ((1, 8, 257, 129), 2),  # large groups: the split reduction paths
    ((2, 320, 9, 9), 32),
    ((2, 32, 40, 40), 2),  # a 100 KB float32 group: the one-pass forward with opt-in shared memory
    ((1, 2, 256, 512), 1),  # a 1 MB float32 group: the one-pass forward's largest cluster (16 CTAs on H100)
    ((4, 13), 1),
    ((6, 3000), 1),  # S == 1 rows of 750 packs: the register forward with 2 packs a thread
    ((4, 6000), 1),  # 1500 packs (float32): 4 packs a thread, a partial last round
    ((2, 10, 3, 4, 5), 5),
    ((2, 80, 6, 5), 2),  # D = 40: channels_last groups in registers (2 rows a thread)
    ((40, 320, 2, 2), 32),  # 1280 channels_last groups of D = 10: CTAs of the shared-memory kernel take several, double-buffered
    ((2, 64, 6, 7), 16),  # D = 4: channels_last rows of 8 / 16 bytes, 4 / 2 groups a CTA of the shared-memory kernel
    ((0, 8, 4, 4), 4),
    ((2, 8, 0, 4), 4),
]


def run(x, groups, weight, bias):
    x = x.requires_grad_()
    y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, groups, weight, bias, 1e-5)
    dy = torch.randn_like(y)
    torch.ops.fusednorm.group_norm_backward(dy, x.detach(), mean, rstd, weight, groups, [True, True, True])
    torch.ops.fusednorm.group_norm_backward(dy.contiguous(), x.detach(), mean, rstd, weight, groups, [True, False, False])


def run_fused(x, groups, weight, bias, activation, operands):
    """The fused ops with an epilogue: every elementwise operand (misaligned too when x is)."""
    N, C = x.shape[:2]
    scale = torch.randn(N, C, device=x.device, dtype=x.dtype) if "scale" in operands else None
    shift = torch.randn(N, C, device=x.device, dtype=x.dtype) if "shift" in operands else None
    like_x = lambda: torch.randn_like(x) if x.is_contiguous() else torch.randn_like(x).movedim(1, -1).contiguous().movedim(-1, 1)  # noqa: E731
    residual = like_x() if "residual" in operands else None
    multiplier = like_x() if "multiplier" in operands else None
    y, mean, rstd = torch.ops.fusednorm.fused_group_norm_forward(
        x, groups, weight, bias, 1e-5, scale, shift, residual, activation, 0.1, multiplier)
    dy = torch.randn_like(y)
    # Every gradient; dx with the residual's gradient; the multiplier's alone; and every gradient but
    # the operands' (the one-CTA and team backwards' Keep::Dp: operands read, no gradients written).
    masks = ([True] * 7, [True, False, False, False, False, True, False], [False] * 6 + [True], [True] * 5 + [False] * 2)
    for mask in masks:
        torch.ops.fusednorm.fused_group_norm_backward(
            dy, x, mean, rstd, weight, bias, groups, scale, shift, residual, activation, 0.1, multiplier, mask)


# --shard I/N runs only every N-th (shape, dtype) unit from the I-th (0-based): racecheck over the
# whole list takes longer than one device call allows (over 530 s on an H100), its shards do not.
SHARD = (0, 1)
_units = 0


def in_shard():
    global _units
    _units += 1
    return (_units - 1) % SHARD[1] == SHARD[0]


def main():
    global SHARD
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th case from the I-th (0-based)")
    parser.add_argument("--fused-only", action="store_true", help="only the fused ops' cases")
    parser.add_argument("--shared-memory-backwards", action="store_true",
                        help="only the fused backwards of the one-CTA and team kernels, on a few shapes: dp kept "
                             "in shared memory over dz, every Keep variant (racecheck ~50 s on an H200)")
    args = parser.parse_args()
    i, n = (int(v) for v in args.shard.split("/"))
    if not 0 <= i < n:
        parser.error("--shard I/N needs 0 <= I < N")
    SHARD = (i, n)
    if args.shared_memory_backwards:
        run_shared_memory_backwards()
        return
    # The fused forward and backward on each test path: groups in one pass wherever they fit (up
    # to 1 MB, capped by the device's shared memory; in registers where they fit there), the same
    # without the register kernel, the split passes everywhere, and the team kernels for every
    # group.
    for path in kernel_paths.TEST_PATHS:
        with kernel_paths.selected(path):
            run_all_fused()
    if not args.fused_only:
        run_all_plain_paths()
    torch.cuda.synchronize()
    print(f"sanitizer cases done (shard {SHARD[0]}/{SHARD[1]}: {_units} units, every {SHARD[1]}-th run)")


def fused_units(cases):
    """(x, groups, weight) of each (case, float32 / bfloat16) unit of this shard."""
    for shape, groups in cases:
        for dtype in (torch.float32, torch.bfloat16):
            if in_shard():
                x = torch.randn(shape, device="cuda", dtype=dtype)
                yield x, groups, torch.randn(shape[1], device="cuda", dtype=dtype)


def run_shared_memory_backwards():
    cases = [((2, 16, 8, 8), 4), ((3, 32, 33, 17), 8), ((6, 3000), 1), ((4, 13), 1), ((2, 10, 3, 4, 5), 5),
             ((1, 2, 64, 64), 1)]
    for path in ("one_pass_shared", "team"):
        with kernel_paths.selected(path):
            for x, groups, w in fused_units(cases):
                run_fused(x, groups, w, w, "silu", ("scale", "shift", "residual", "multiplier"))
                run_fused(x, groups, None, None, "gelu", ("multiplier",))
                run_fused(x, groups, w, None, "none", ("residual",))
    torch.cuda.synchronize()
    print(f"sanitizer cases done (shard {SHARD[0]}/{SHARD[1]}: {_units} units, every {SHARD[1]}-th run)")


def run_all_plain_paths():
    run_all_plain()
    # The plain ops' team kernels, forward and backward, on every group (by default the backward
    # of a lone large group takes the split passes).
    with kernel_paths.selected("team"):
        run_all_plain()
    # The team kernels' L2 prefetch of each next chunk (by default only in teams of 16 CTAs and
    # more), here whole in teams of every size.
    with kernel_paths.selected("team_prefetch"):
        run_all_plain()


def run_all_fused():
    for x, groups, w in fused_units(CASES):
        run_fused(x, groups, w, w, "silu", ("scale", "shift", "residual", "multiplier"))
        run_fused(x, groups, None, None, "mish", ("residual",))
        run_fused(x, groups, None, None, "silu", ("residual",))
        torch.ops.fusednorm.group_norm_forward(x, groups, w, w, 1e-5)  # the plain instantiations
        if x.dim() == 2:  # problem 3's (h + y) * y: one tensor as the residual and the multiplier
            y = torch.randn_like(x)
            torch.ops.fusednorm.fused_group_norm_forward(x, groups, None, None, 1e-5, None, None, y, "none", 0.0, y)
        if x.dim() >= 3:
            cl = x.movedim(1, -1).contiguous().movedim(-1, 1)
            run_fused(cl, groups, w, None, "gelu", ("scale", "multiplier"))
            # SiLU with one tensor operand: the channels-last register forward where it fits.
            run_fused(cl, groups, w, w, "silu", ("scale", "shift", "residual"))
        flat = torch.randn(x.numel() + 1, device="cuda", dtype=x.dtype)
        run_fused(flat[1:].view(x.shape), groups, None, w, "leaky_relu", ("shift", "residual", "multiplier"))


def run_all_plain():
    for shape, groups in CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            if not in_shard():
                continue
            x = torch.randn(shape, device="cuda", dtype=dtype)
            w = torch.randn(shape[1], device="cuda", dtype=dtype)
            b = torch.randn(shape[1], device="cuda", dtype=dtype)
            run(x, groups, w, b)
            run(x, groups, None, None)
            if x.dim() >= 3:
                run(x.movedim(1, -1).contiguous().movedim(-1, 1), groups, w, None)
            # One element into the storage: no 16-byte alignment for the vector paths.
            flat = torch.randn(x.numel() + 1, device="cuda", dtype=dtype)
            run(flat[1:].view(shape), groups, None, b)
            if dtype in (torch.bfloat16, torch.float16):
                run(x, groups, w.float(), b.float())


if __name__ == "__main__":
    main()
