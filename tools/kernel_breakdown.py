"""Where each benchmark row's time goes: for every case of the GPU suite (or those matching
--filter), fusednorm's and eager's forward and backward are run back to back without an L2 flush
and under torch.profiler, and one line per (case, implementation, direction) gives

    wall us   host-side time per call when calls are issued back to back (a row whose wall time
              exceeds its kernel time is bound by the host: Python, dispatch, launches)
    gpu us    the sum of the call's kernel (and memset / memcpy) times
    kernels   how many the call launches, and the three longest with their times

    python tools/kernel_breakdown.py [--filter REGEX] [--reps N] [--impls fusednorm,eager,compile,"plain norm"]
"""

import argparse
import collections
import os
import re
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# bench.py's suite and timers live in benchmarks/, beside the user-facing benchmark.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import gpu_suite, grad_inputs, implementations, make_inputs


def short(name: str, width: int = 42) -> str:
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(anonymous namespace\)::|at::native::|fusednorm::", "", name)
    return name[:width]


def breakdown(fn, reps: int):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / reps * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    count = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per_kernel[short(e.name)] += e.time_range.elapsed_us() / reps
            count += 1
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:3]
    return wall, sum(per_kernel.values()), count / reps, top


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--impls", default="fusednorm,eager")
    args = parser.parse_args()
    wanted = args.impls.split(",")
    print(f"{'case':<26} {'shape':<22} {'layout':<6} {'impl':<10} {'dir':<4} {'wall us':>8} {'gpu us':>8} "
          f"{'kern':>5}  longest kernels (us)")
    for case in gpu_suite():
        if not re.search(args.filter, case.name):
            continue
        x, w, b, ops = make_inputs(case, "cuda")
        for name, fn in implementations(case, with_compile="compile" in wanted).items():
            if name not in wanted:
                continue
            xg, wg, bg, opsg, leaves = grad_inputs(case, x, w, b, ops)

            def forward():
                with torch.no_grad():
                    fn(x, w, b, ops)

            y = fn(xg, wg, bg, opsg)
            dy = torch.randn_like(y)

            def backward():
                torch.autograd.grad(y, leaves, dy, retain_graph=True, allow_unused=True)

            layout = "CL" if case.channels_last else "CF"
            for direction, call in (("fwd", forward), ("bwd", backward)):
                wall, gpu, count, top = breakdown(call, args.reps)
                kernels = ", ".join(f"{k} {v:.1f}" for k, v in top)
                print(f"{case.name:<26} {str(tuple(case.shape)):<22} {layout:<6} {name:<10} {direction:<4} "
                      f"{wall:8.1f} {gpu:8.1f} {count:5.1f}  {kernels}", flush=True)
            del y, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
