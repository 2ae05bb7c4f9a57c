"""Where the time of a small case goes: torch.profiler over repeated forward and backward calls of
fusednorm and of the eager composition, printing per-op CPU and CUDA totals. Small shapes are
bound by launches and host code rather than by the kernels, which Nsight Compute does not show.

    python tools/trace_small.py --filter "SD UNet GN\\+SiLU b2" --shape 2,1280,8,8 [--channels-last]
"""

import argparse
import os
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

# bench.py's suite and timers live in benchmarks/, beside the user-facing benchmark.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import gpu_suite, grad_inputs, implementations, make_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="")
    parser.add_argument("--shape", default="")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--channels-last", action="store_true", help="the channels_last cases instead")
    parser.add_argument("--sort", default="self_cpu_time_total", help="key_averages column to sort by")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(",")) if args.shape else None
    for case in gpu_suite():
        if not re.search(args.filter, case.name) or (shape is not None and tuple(case.shape) != shape) or case.channels_last != args.channels_last:
            continue
        x, w, b, ops = make_inputs(case, "cuda")
        for name, fn in implementations(case, with_compile=False).items():
            if name not in ("fusednorm", "eager"):
                continue
            xg, wg, bg, opsg, leaves = grad_inputs(case, x, w, b, ops)
            y = fn(xg, wg, bg, opsg)
            dy = torch.randn_like(y)
            for _ in range(5):
                torch.autograd.grad(fn(xg, wg, bg, opsg), leaves, dy)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    torch.autograd.grad(fn(xg, wg, bg, opsg), leaves, dy)
                torch.cuda.synchronize()
            print(f"== {name}: {case.name} {case.shape} {case.dtype}, {args.reps} x (forward + backward)")
            print(prof.key_averages().table(sort_by=args.sort, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
