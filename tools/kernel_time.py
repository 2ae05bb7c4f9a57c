"""GPU kernel time of fused GroupNorm calls, forward and backward: the sum of the durations of the
kernels an iteration launches (torch.profiler, CUPTI), over 20 iterations with an L2 flush before
each (its kernel excluded). Host overhead is not counted, so A/B runs of two builds compare the
kernels themselves: bench.py's backward rows (autograd wall time) were host-bound on rows under
~0.3 ms, varying up to 2x between processes on an H200, where these sums agreed
within 0.5%. One line a case: label, forward ms, backward ms. On the GPU machine, a build each:

    GPU_BUILD=DIR tools/gpu_prebuilt.sh py tools/kernel_time.py [--filter REGEX] [--iters N]

The cases: the fused rows whose backward the one-CTA and team kernels take (ResNet, VAE, UNet
shapes), the channels-last split path, problem 3's tail and the GroupNorm problem, with plain rows
and a residual alone (dp = dz, its gradient written by the dx loop) as controls; the register
kernel's UNet rows, and calls with an (N, C) input_bias (AnimateDiff's frames).
"""
import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import fused_call, kernel_ms  # noqa: E402

CASES = [  # label, shape, groups, dtype, activation, operands, channels_last
    ("resnet bf16 res+relu", (16, 256, 56, 56), 32, torch.bfloat16, "relu", ("residual",), False),
    ("resnet fp16 res+mult+silu", (16, 256, 56, 56), 32, torch.float16, "silu", ("residual", "multiplier"), False),
    ("resnet fp16 silu", (16, 256, 56, 56), 32, torch.float16, "silu", (), False),
    ("vae bf16 res+silu", (1, 128, 512, 512), 32, torch.bfloat16, "silu", ("residual",), False),
    ("vae bf16 silu", (1, 128, 512, 512), 32, torch.bfloat16, "silu", (), False),
    ("vae fp16 mult+gelu 1024", (1, 128, 1024, 1024), 32, torch.float16, "gelu", ("multiplier",), False),
    ("vae fp16 gelu 1024", (1, 128, 1024, 1024), 32, torch.float16, "gelu", (), False),
    ("vae bf16 gelu", (1, 128, 512, 512), 32, torch.bfloat16, "gelu", (), False),
    ("fp32 gelu", (8, 512, 64, 64), 32, torch.float32, "gelu", (), False),
    ("fp32 plain", (8, 512, 64, 64), 32, torch.float32, None, (), False),
    ("vae bf16 plain", (1, 128, 512, 512), 32, torch.bfloat16, None, (), False),
    ("unet fp16 res+silu", (2, 320, 64, 64), 32, torch.float16, "silu", ("residual",), False),
    ("fp32 res+silu", (8, 512, 64, 64), 32, torch.float32, "silu", ("residual",), False),
    ("fp16 CL res+silu", (8, 320, 64, 64), 32, torch.float16, "silu", ("residual",), True),
    ("bf16 CL silu", (8, 320, 64, 64), 32, torch.bfloat16, "silu", (), True),
    ("vae fp16 plain 1024", (1, 128, 1024, 1024), 32, torch.float16, None, (), False),
    ("resnet bf16 plain", (16, 256, 56, 56), 32, torch.bfloat16, None, (), False),
    ("resnet bf16 residual", (16, 256, 56, 56), 32, torch.bfloat16, None, ("residual",), False),
    ("vae bf16 residual", (1, 128, 512, 512), 32, torch.bfloat16, None, ("residual",), False),
    ("p3 tail fp32 (h+y)*y", (1024, 8192), 1, torch.float32, None, ("same",), False),
    ("GN problem fp32 silu", (112, 64, 512, 512), 8, torch.float32, "silu", (), False),
    # The register kernel (one CTA a group, latency-bound): UNet's 8x8 and 16x16 groups.
    ("unet fp16 silu 8x8", (2, 1280, 8, 8), 32, torch.float16, "silu", (), False),
    ("unet fp16 silu 16x16", (2, 640, 16, 16), 32, torch.float16, "silu", (), False),
    ("unet fp16 silu 8x8 b8", (8, 1280, 8, 8), 32, torch.float16, "silu", (), False),
    ("unet fp16 silu 16x16 b8", (8, 640, 16, 16), 32, torch.float16, "silu", (), False),
    ("unet fp16 silu 16x16 R4", (2, 1280, 16, 16), 32, torch.float16, "silu", (), False),
    ("unet bf16 silu 8x8", (2, 1280, 8, 8), 32, torch.bfloat16, "silu", (), False),
    ("unet fp16 CL silu 8x8", (2, 1280, 8, 8), 32, torch.float16, "silu", (), True),
    # With an (N, C) input_bias (conv + time embedding): AnimateDiff's frames at batch 2.
    ("animatediff fp16 ib+silu 16x16", (32, 1280, 16, 16), 32, torch.float16, "silu", ("input_bias",), False),
    ("animatediff fp16 ib+silu 64x64", (32, 320, 64, 64), 32, torch.float16, "silu", ("input_bias",), False),
    ("unet fp16 ib+silu 8x8", (2, 1280, 8, 8), 32, torch.float16, "silu", ("input_bias",), False),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="", help="only the cases whose label matches this regex")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; GPU kernel ms an iteration")
    print(f"{'case':<28} {'forward':>8} {'backward':>8}")
    flush = torch.zeros(512 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for label, shape, G, dt, act, opnames, cl in CASES:
        if not re.search(args.filter, label):
            continue
        torch.manual_seed(0)
        forward = kernel_ms(fused_call(shape, G, dt, act, cl, opnames), flush, args.iters)
        backward = kernel_ms(fused_call(shape, G, dt, act, cl, opnames, backward=True), flush, args.iters)
        print(f"{label:<28} {forward:8.4f} {backward:8.4f}", flush=True)


if __name__ == "__main__":
    main()
