"""Runs each CUDA kernel path once on small inputs, for compute-sanitizer (scripts/sanitize.sh):
both layouts, every dtype, with and without weight/bias, tails that are not multiples of the vector
width, groups split over several CTAs, misaligned (offset) storage, and empty inputs."""

import torch

import fusednorm  # noqa: F401

CASES = [
    # shape, groups
    ((2, 6, 5, 7), 3),
    ((3, 32, 33, 17), 8),
    ((1, 8, 257, 129), 2),  # large groups: the split reduction paths
    ((2, 320, 9, 9), 32),
    ((4, 13), 1),
    ((2, 10, 3, 4, 5), 5),
    ((0, 8, 4, 4), 4),
    ((2, 8, 0, 4), 4),
]


def run(x, groups, weight, bias):
    x = x.requires_grad_()
    y, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, groups, weight, bias, 1e-5)
    dy = torch.randn_like(y)
    torch.ops.fusednorm.group_norm_backward(dy, x.detach(), mean, rstd, weight, groups, [True, True, True])
    torch.ops.fusednorm.group_norm_backward(dy.contiguous(), x.detach(), mean, rstd, weight, groups, [True, False, False])


def main():
    for shape, groups in CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
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
    torch.cuda.synchronize()
    print("sanitizer cases done")


if __name__ == "__main__":
    main()
