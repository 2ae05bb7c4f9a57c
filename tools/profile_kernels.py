"""Runs fusednorm's forward and backward of selected benchmark cases inside a profiler range, for
Nsight Compute. Only the timed calls are profiled (the warm-up runs outside the range):

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        python tools/profile_kernels.py --filter "VAE GN+SiLU" --shape 1,128,512,512

Each matching case runs `--reps` forward calls and `--reps` backward calls (one autograd.grad each).
"""

import argparse
import os
import sys

import torch

# bench.py's suite and timers live in benchmarks/, beside the user-facing benchmark.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import gpu_suite, grad_inputs, implementations, make_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="", help="cases whose name contains this text")
    parser.add_argument("--shape", default="", help="and whose shape is this, comma separated")
    parser.add_argument("--layout", choices=("any", "contiguous", "channels_last"), default="any")
    parser.add_argument("--direction", choices=("both", "forward", "backward"), default="both")
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(",")) if args.shape else None
    cases = [c for c in gpu_suite() if args.filter in c.name and (shape is None or tuple(c.shape) == shape)
             and (args.layout == "any" or c.channels_last == (args.layout == "channels_last"))]
    for case in cases:
        x, w, b, ops = make_inputs(case, "cuda")
        run = implementations(case, with_compile=False)["fusednorm"]
        xg, wg, bg, opsg, leaves = grad_inputs(case, x, w, b, ops)
        y = run(xg, wg, bg, opsg)
        dy = torch.randn_like(y)
        for _ in range(3):  # warm-up: first-call costs stay out of the profile
            run(x, w, b, ops)
            torch.autograd.grad(y, leaves, dy, retain_graph=True)
        torch.cuda.synchronize()
        print(f"profiling {case.name} {case.shape} {case.dtype} channels_last={case.channels_last}", flush=True)
        torch.cuda.profiler.start()
        for _ in range(args.reps):
            if args.direction != "backward":
                with torch.no_grad():
                    run(x, w, b, ops)
            if args.direction != "forward":
                torch.autograd.grad(y, leaves, dy, retain_graph=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
