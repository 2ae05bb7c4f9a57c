"""The replication pad after a fused norm (docs/design.md, "Replication pad"): fusednorm's
`replication_pad` against ATen's and Inductor's pads and a copy of the padded output (the
roofline), alone and after GN32+SiLU, on the four pad shapes of the HunyuanVideo VAE's decoder,
fp16, in one run; with --channels-last, on channels_last_3d inputs (the pads then keep that
format); with --frames, on videos whose frames are contiguous, `frames.permute(0, 2, 1, 3, 4)`
(what a per-frame norm's output viewed back is in an NCDHW model, Mochi's), the pad alone
against ATen's and against a dense copy before it.

    python benchmarks/pad_bench.py [--channels-last | --frames]

GPU kernel time (`bench.kernel_ms`: L2 flushed, host time excluded), best of 3 of 10 calls, ms.
"GN+SiLU+pad compiled" is what plain torch.compile runs (the pad folded into its norm's output
kernel); "fused + ... pad" what the fusion backend runs. Needs a CUDA device.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusednorm  # noqa: E402
from bench import kernel_ms  # noqa: E402

PAD = (1, 1, 1, 1, 2, 0)  # a 3x3x3 causal convolution's
SHAPES = [(1, 128, 9, 480, 640), (1, 256, 9, 240, 320), (1, 512, 5, 120, 160), (1, 512, 3, 60, 80)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels-last", action="store_true", help="channels_last_3d inputs")
    parser.add_argument("--frames", action="store_true", help="videos of contiguous frames, viewed back")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pad_bench.py needs a CUDA device")
    fmt = torch.channels_last_3d if args.channels_last else torch.contiguous_format
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, float16, {fmt}, ms")
    flush = torch.zeros(512 * 2**20, dtype=torch.int8, device="cuda")

    def best(fn):
        return min(kernel_ms(fn, flush, iters=10) for _ in range(3))

    if args.frames:
        return frames(best)
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
        w, b = torch.randn(shape[1], device="cuda", dtype=x.dtype), torch.randn(shape[1], device="cuda", dtype=x.dtype)
        inductor_pad = torch.compile(lambda t: F.pad(t, PAD, mode="replicate"), dynamic=False)
        chain = torch.compile(lambda t: F.pad(F.silu(F.group_norm(t, 32, w, b, 1e-6)), PAD, mode="replicate"),
                              dynamic=False)
        ours = lambda t: torch.ops.fusednorm.replication_pad(t, list(PAD))  # noqa: E731
        fused = lambda: fusednorm.group_norm(x, 32, w, b, 1e-6, activation="silu")  # noqa: E731
        expected = F.pad(x, PAD, mode="replicate")
        assert torch.equal(ours(x), expected) and torch.equal(inductor_pad(x), expected)
        assert ours(x).is_contiguous(memory_format=fmt)
        expected = expected.contiguous(memory_format=fmt)
        copy_source = torch.empty_like(expected)
        with torch.no_grad():
            chain(x)
            times = {
                "ATen pad": best(lambda: F.pad(x, PAD, mode="replicate")),
                "Inductor pad": best(lambda: inductor_pad(x)),
                "copy of the output": best(lambda: expected.copy_(copy_source)),
                "fusednorm pad": best(lambda: ours(x)),
                "GN+SiLU+pad compiled": best(lambda: chain(x)),
                "fused + Inductor pad": best(lambda: inductor_pad(fused())),
                "fused + fusednorm pad": best(lambda: ours(fused())),
            }
        print(shape, "  ".join(f"{k} {v:.4f}" for k, v in times.items()), flush=True)


def frames(best):
    """The pads of videos (N, C, T, H, W) stored as their frames (N, T, C, H, W): Mochi's decoder
    shapes (7 and 13 frames of 480x848 at 128 channels, their halves and quarters at 256 / 512)."""
    for n, c, t, h, w in [(1, 128, 13, 480, 848), (1, 256, 13, 240, 424), (1, 512, 7, 120, 212), (1, 768, 3, 60, 106)]:
        x = torch.randn(n, t, c, h, w, device="cuda", dtype=torch.float16).permute(0, 2, 1, 3, 4)
        ours = lambda t: torch.ops.fusednorm.replication_pad(t, list(PAD))  # noqa: E731
        expected = F.pad(x, PAD, mode="replicate")
        assert torch.equal(ours(x), expected) and ours(x).is_contiguous()
        copy_source = torch.empty_like(expected)
        times = {
            "ATen pad": best(lambda: F.pad(x, PAD, mode="replicate")),
            "copy of the output": best(lambda: expected.copy_(copy_source)),
            "dense copy + fusednorm pad": best(lambda: ours(x.contiguous())),
            "fusednorm pad": best(lambda: ours(x)),
        }
        print((n, c, t, h, w), "  ".join(f"{k} {v:.4f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
