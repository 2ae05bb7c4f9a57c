"""Times fusednorm's forward (or, with --backward, its backward) on the suite's cases under each
kernel path the environment knobs select (the default choice, one-pass wherever it fits, split
everywhere, and cluster limits), beside the copy-bandwidth roofline, so that a path's choice is
made on measurements:

    python tools/compare_paths.py [--filter REGEX] [--backward] [--paths default,split,one_pass,shared,noteam,team,cluster8]

(the paths: fusednorm.kernel_paths.PATHS)
"""

import argparse
import os
import re
import sys

import torch

# bench.py's suite and timers live in benchmarks/, beside the user-facing benchmark.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import copy_bandwidth, gpu_suite, grad_inputs, implementations, make_inputs, timer
from fusednorm.kernel_paths import PATHS, selected


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="")
    parser.add_argument("--paths", default="default,split,one_pass")
    parser.add_argument("--backward", action="store_true", help="time the backward (autograd) instead")
    args = parser.parse_args()
    paths = args.paths.split(",")
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {', '.join(PATHS)}")
    measure = timer("cuda")
    roof = copy_bandwidth("cuda", measure)
    print(f"copy bandwidth {roof:.0f} GB/s on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':<26} {'shape':<22} {'dtype':<9} {'layout':<6} " + " ".join(f"{p:>16}" for p in paths))
    for case in gpu_suite():
        if not re.search(args.filter, case.name):
            continue
        x, w, b, ops = make_inputs(case, "cuda")
        ours = implementations(case, with_compile=False)["fusednorm"]
        big = len({id(t) for k, t in ops.items() if k in ("residual", "multiplier")})
        # The floor: bench.py's (forward: x, operands, y; backward: x, dy, operands, dx, their grads).
        nbytes = ((3 + 2 * big) if args.backward else (2 + big)) * x.numel() * x.element_size()
        cells = []
        for path in paths:
            with selected(path):
                if args.backward:
                    xg, wg, bg, opsg, leaves = grad_inputs(case, x, w, b, ops)
                    y = ours(xg, wg, bg, opsg)
                    dy = torch.randn_like(y)
                    ms = measure(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True, allow_unused=True))
                    del y, dy, xg, leaves
                else:
                    with torch.no_grad():
                        ms = measure(lambda: ours(x, w, b, ops))
            cells.append(f"{ms:8.4f} ({100 * nbytes / (ms * 1e-3) / 1e9 / roof:3.0f}%)")
        layout = "CL" if case.channels_last else "CF"
        print(f"{case.name:<26} {str(tuple(case.shape)):<22} {str(case.dtype)[6:]:<9} {layout:<6} " + " ".join(
            f"{c:>16}" for c in cells), flush=True)
        del x, w, b, ops
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
