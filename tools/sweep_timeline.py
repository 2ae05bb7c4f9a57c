"""Where a channels-last sweep call's time goes (docs/design.md, "Channels-last
sweep"): the three kernels' torch.profiler timestamps, medians over the calls, in us.
For each shape, float16 GN32+SiLU channels-last: the moments kernel's duration, the finalize's
end after the moments kernel's end (the gap between the two sweeps), the output kernel's end
after the finalize's, and the call; with x rewritten by a copy before each call ("written", as a
convolution before the norm leaves it) and after an L2 flush ("flush", benchmarks/bench.py's,
whose write-back the first kernel pays). Beside them, a device-to-device copy of the same tensor
(the output sweep's roofline).

    python tools/sweep_timeline.py [--shapes 1,128,512,512 1,256,256,256] [--add] [--iters N]

--add: add_group_norm of x and a second tensor with a (C,) input_bias (the residual-add
prologue's moments kernel) instead of group_norm.
"""

import argparse
import statistics

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fusednorm

ROLES = ("moments", "finalize", "output")


def role(name):
    """Which of the sweep's kernels a profiler kernel name is, or None."""
    if "finalize_moments" in name:
        return "finalize"
    if "cols_sweep_output" in name:
        return "output"
    if "cols_sweep" in name and "moments" in name:  # (cols_sweep_add_moments_kernel too)
        return "moments"
    return None


def kernel_intervals(fn, before, iters):
    """[(start, end, name)] of the CUDA kernels of `iters` calls of fn(), before() ahead of each."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            before()
            fn()
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == DeviceType.CUDA)


def sweep_calls(intervals):
    """Per call, {moments, finalize, output: (start, end)}: a moments kernel begins each."""
    calls = []
    for start, end, name in intervals:
        r = role(name)
        if r == "moments":
            calls.append({})
        if r is not None and calls:
            calls[-1][r] = (start, end)
    return [c for c in calls if len(c) == len(ROLES)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1,256,256,256", "1,128,512,512", "1,256,512,512"])
    parser.add_argument("--add", action="store_true", help="add_group_norm instead of group_norm")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us, medians of {args.iters} calls")
    flush = torch.empty(512 << 20, dtype=torch.int8, device="cuda")
    for spec in args.shapes:
        shape = tuple(int(v) for v in spec.split(","))
        x = torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        source = x.clone()
        channels = shape[1]
        w, b = (torch.randn(channels, device="cuda", dtype=torch.float16) for _ in range(2))
        if args.add:
            other = torch.randn_like(x)
            ib = torch.randn(channels, device="cuda", dtype=torch.float16)

            def call():
                return fusednorm.add_group_norm(x, other, 32, w, b, activation="silu", input_bias=ib)
        else:
            def call():
                return fusednorm.group_norm(x, 32, w, b, activation="silu")
        for mode, before in (("written", lambda: x.copy_(source)), ("flush", flush.bitwise_not_)):
            calls = sweep_calls(kernel_intervals(call, before, args.iters))
            if not calls:
                print(f"{spec} {mode}: no channels-last sweep kernels (the planner gave another path)")
                continue

            def med(f):
                return statistics.median(f(c) for c in calls)

            print(f"{spec} {mode:7s}: moments {med(lambda c: c['moments'][1] - c['moments'][0]):7.2f}, "
                  f"finalize's end after the moments' {med(lambda c: c['finalize'][1] - c['moments'][1]):5.2f}, "
                  f"output's end after the finalize's {med(lambda c: c['output'][1] - c['finalize'][1]):7.2f}, "
                  f"call {med(lambda c: c['output'][1] - c['moments'][0]):7.2f}", flush=True)
        copies = [e - s for s, e, name in kernel_intervals(lambda: x.clone(), flush.bitwise_not_, args.iters)
                  if "bitwise_not" not in name]
        print(f"{spec} copy of x after the flush: {statistics.median(copies):7.2f}", flush=True)


if __name__ == "__main__":
    main()
