"""fusednorm against torch.compile and the simple Triton two-pass design (`triton_two_pass.py`) on
GroupNorm(32) + SiLU inference rows, in one run, beside a device-to-device copy of the same bytes.

    python benchmarks/peer_bench.py [--filter REGEX] [--no-compile]

Two timings a row: `triton.testing.do_bench` medians (L2 flushed before each call; host time
included, as a user sees it) and the GPU kernel time by torch.profiler (L2 flushed; host time
excluded: the kernels themselves). "% of copy" is the copy's time over fusednorm's (both move the
same bytes at least). Each row also prints the largest error against float64, and fusednorm's
plan (`fusednorm.kernel_paths.plan`). Needs a CUDA device and Triton.
"""
import argparse
import math
import os
import re
import sys

import torch
import torch.nn.functional as F

ROWS = [  # label, shape, dtype, groups
    ("video VAE", (1, 128, 20, 256, 256), torch.bfloat16, 32),
    ("video VAE", (1, 512, 16, 90, 160), torch.bfloat16, 32),
    ("VAE", (1, 128, 512, 512), torch.bfloat16, 32),
    ("VAE", (1, 512, 128, 128), torch.bfloat16, 32),
    ("VAE 1024", (1, 128, 1024, 1024), torch.float16, 32),
    ("SD", (8, 320, 64, 64), torch.float16, 32),
    ("SD", (2, 1280, 8, 8), torch.float16, 32),
    ("SD", (2, 640, 16, 16), torch.float16, 32),
    ("SD", (2, 320, 32, 32), torch.float16, 32),
    ("GroupNorm problem", (112, 64, 512, 512), torch.float32, 8),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="", help="only the rows whose label or shape matches this regex")
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peer_bench.py needs a CUDA device")
    try:
        from triton.testing import do_bench
    except ImportError:
        sys.exit("peer_bench.py needs Triton")

    import fusednorm
    from fusednorm.kernel_paths import plan
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import triton_two_pass
    from bench import kernel_ms

    flush = torch.empty(512 * 2**20, dtype=torch.int8, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; GN+SiLU inference, ms")
    print(f"{'row':<44} {'copy':>7} {'compile':>8} {'peer':>8} {'fused':>8} {'f/peer':>6} {'f/comp':>6} | "
          f"{'kernels: peer':>13} {'fused':>7} | %copy | max error peer / fused | plan")
    ratios, kernel_ratios = [], []
    for label, shape, dtype, groups in ROWS:
        name = f"{label} {tuple(shape)} {str(dtype)[6:]}"
        if not re.search(args.filter, name):
            continue
        torch.manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 0.5
        w = torch.randn(shape[1], device="cuda", dtype=dtype)
        b = torch.randn_like(w)
        copy_out = torch.empty_like(x)
        copy = do_bench(lambda: copy_out.copy_(x), rep=100)

        def eager(x, w, b):
            return F.silu(F.group_norm(x, groups, w, b))

        fns = {"peer": lambda: triton_two_pass.group_norm_silu(x, groups, w, b),
               "fused": lambda: fusednorm.group_norm(x, groups, w, b, activation="silu")}
        if not args.no_compile:
            # Anew for each row, static shapes: one compiled function over every row would
            # recompile with dynamic shapes, whose host time swamps the small rows.
            torch._dynamo.reset()
            compiled = torch.compile(eager, dynamic=False)
            fns["compile"] = lambda: compiled(x, w, b)
        with torch.no_grad():
            ref = eager(x.double(), w.double(), b.double())
            err = {k: (fns[k]().double() - ref).abs().max().item() for k in ("peer", "fused")}
            ms = {k: do_bench(f, warmup=25, rep=200) for k, f in fns.items()}
            kms = {k: kernel_ms(fns[k], flush) for k in ("peer", "fused")}
        ratios.append(ms["peer"] / ms["fused"])
        kernel_ratios.append(kms["peer"] / kms["fused"])
        comp = f"{ms['compile']:8.4f}" if "compile" in ms else f"{'-':>8}"
        comp_ratio = f"{ms['compile'] / ms['fused']:6.2f}" if "compile" in ms else f"{'-':>6}"
        print(f"{name:<44} {copy:7.4f} {comp} {ms['peer']:8.4f} {ms['fused']:8.4f} {ms['peer'] / ms['fused']:6.2f} "
              f"{comp_ratio} | {kms['peer']:13.4f} {kms['fused']:7.4f} | {100 * copy / ms['fused']:4.0f}% | "
              f"{err['peer']:.1e} / {err['fused']:.1e} | {plan(shape, groups, dtype, activation='silu')}", flush=True)
        del x, copy_out
        torch.cuda.empty_cache()
    if ratios:
        def geomean(v):
            return math.exp(sum(map(math.log, v)) / len(v))
        print(f"geometric mean, fusednorm over the peer: {geomean(ratios):.2f}x (do_bench), "
              f"{geomean(kernel_ratios):.2f}x (kernel time)")


if __name__ == "__main__":
    main()
