"""fusednorm against eager PyTorch on the CPU over a grid of awkward rows: where is it slower?

Every case of SHAPES x dtypes x layouts (contiguous, channels-last where the input has 4 or 5
dimensions) x activation (none, SiLU) x pass (forward without grad; forward + backward, the
gradients of input, weight and bias) is timed in one process, fusednorm.group_norm against
F.group_norm then F.silu, each the median of --repeat calls timed in turns
(benchmarks/bench.py's interleaved_cpu_times, freed memory kept in the process as bench.py
keeps it). Rows where fusednorm takes more than --flag times eager's time are marked. The shapes
are the UNet's and VAE's feature maps, small maps (7x7, 8x8) with many groups, rows shorter than a vector
(channels-last C = 3, 24), one channel a group, and a long 1-D row: the places CPU kernels lose
to fixed work a row rather than memory (docs/design.md, "CPU kernels"). A full run takes ~5 min on
2 cores; the machine should be otherwise idle (bench.py's load check says so; the VM's timings
are bimodal between processes: compare builds in several processes each).

    python tools/cpu_rows.py [--threads 2] [--filter REGEX] [--repeat 40] [--flag 0.95]
"""

import argparse
import itertools
import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402

import fusednorm  # noqa: E402

SHAPES = [  # input shape, groups
    ((8, 320, 32, 32), 32),
    ((2, 1280, 8, 8), 32),
    ((1, 128, 128, 128), 32),
    ((4, 64, 64, 64), 64),
    ((2, 64, 16, 16, 16), 32),
    ((1, 512, 64, 64), 32),
    ((16, 3, 224, 224), 1),
    ((2, 32, 4096), 8),
    ((4, 256, 1024), 32),
    ((1, 320, 8, 8), 320),
    ((64, 64, 7, 7), 32),
    ((2, 96, 33, 33), 3),
    ((1, 24, 5, 160, 160), 8),
    ((32, 32, 15, 15), 32),
    ((2, 1, 100000), 1),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def case_fns(shape, groups, dtype, channels_last, activation, backward):
    x = torch.randn(shape, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    w, b = torch.randn(shape[1], dtype=dtype), torch.randn(shape[1], dtype=dtype)
    leaves = (x, w, b)
    if backward:
        for t in leaves:
            t.requires_grad_()

    def run(forward):
        with torch.set_grad_enabled(backward):
            y = forward()
            if backward:
                torch.autograd.grad(y, leaves, torch.ones_like(y))

    def ours():
        run(lambda: fusednorm.group_norm(x, groups, w, b, activation=activation))

    def eager():
        run(lambda: F.silu(F.group_norm(x, groups, w, b)) if activation else F.group_norm(x, groups, w, b))

    return ours, eager


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--filter", default=None, help="only rows whose printed name matches this regular expression")
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--flag", type=float, default=0.95, help="mark rows below this speedup over eager")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench.keep_freed_memory_in_process()  # else calls page-fault their outputs by the order of frees
    bench.warn_if_busy()
    behind = 0
    for (shape, groups), dtype, channels_last, activation, backward in itertools.product(
            SHAPES, DTYPES, [False, True], [None, "silu"], [False, True]):
        if channels_last and len(shape) not in (4, 5):
            continue
        name = (f"{str(shape):22s} G={groups:<4d} {str(dtype)[6:]:9s} {'cl' if channels_last else 'cf'} "
                f"{activation or 'none':5s} {'fwd+bwd' if backward else 'fwd':7s}")
        if args.filter and not re.search(args.filter, name):
            continue
        ours, eager = case_fns(shape, groups, dtype, channels_last, activation, backward)
        times = bench.interleaved_cpu_times({"fusednorm": ours, "eager": eager}, args.repeat)
        t_ours, t_eager = times["fusednorm"], times["eager"]
        speedup = t_eager / t_ours
        mark = "   <-- behind eager" if speedup < args.flag else ""
        behind += bool(mark)
        print(f"{name}  fusednorm {t_ours:8.3f} ms  eager {t_eager:8.3f} ms  {speedup:5.2f}x{mark}", flush=True)
    print(f"{behind} rows behind eager (below {args.flag}x)")


if __name__ == "__main__":
    main()
