"""diffusers' ResnetBlockCondNorm2D ("ada_group" resnets: AdaGroupNorm norms, SiLU) eager against
the same block after fusednorm.convert, float16, no grad: the A/B behind the AdaGroupNorm figures
(docs/design.md, "convert"). A row per shape: the largest difference between the two, wall time by
`triton.testing.do_bench` (L2 flushed; the best of three rounds in turns) and GPU kernel time by
torch.profiler (L2 flushed, host excluded) with the longest kernels. Needs a CUDA device,
diffusers and Triton.

    python tools/ada_group_block.py      # on the GPU machine: tools/gpu_prebuilt.sh py tools/ada_group_block.py
"""
import copy
import os
import sys

import torch
import triton.testing
from diffusers.models.resnet import ResnetBlockCondNorm2D

import fusednorm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import kernel_profile  # noqa: E402

SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (8, 320, 64, 64)]  # SD1.5-sized feature maps
TEMB = 1280  # SD1.5's time-embedding width


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    for n, c, h, w in SHAPES:
        block = ResnetBlockCondNorm2D(in_channels=c, out_channels=c, temb_channels=TEMB, groups=32,
                                      time_embedding_norm="ada_group").to(dev, dt).eval()
        converted = fusednorm.convert(copy.deepcopy(block))
        x = torch.randn(n, c, h, w, device=dev, dtype=dt)
        temb = torch.randn(n, TEMB, device=dev, dtype=dt)
        with torch.no_grad():
            diff = (converted(x, temb).float() - block(x, temb).float()).abs().max().item()
            fns = {"eager": lambda: block(x, temb), "convert": lambda: converted(x, temb)}
            ms = {k: [] for k in fns}
            for _ in range(3):
                for k, f in fns.items():
                    ms[k].append(triton.testing.do_bench(f, warmup=25, rep=200))
            prof = {k: kernel_profile(f, flush) for k, f in fns.items()}
        eager, conv = min(ms["eager"]), min(ms["convert"])
        print(f"({n},{c},{h},{w}) max|diff| {diff:.2e}  eager {eager:.4f} ms  convert {conv:.4f} ms"
              f"  ({eager / conv:.2f}x)", flush=True)
        for k, (total, by) in prof.items():
            top = ", ".join(f"{name} {t * 1e3:.1f}" for name, t in sorted(by.items(), key=lambda i: -i[1])[:6])
            print(f"   {k} kernel time {total:.4f} ms; us: {top}", flush=True)


if __name__ == "__main__":
    main()
