"""What `fusednorm.convert` does to a real model, and what it leaves: builds
benchmarks/diffusers_bench.py's workloads in their real configs on the meta device (no GPU, no
memory, seconds on a CPU), converts each, and prints the fused modules by class (how many took a
folded activation) and the norm-like modules left (classes whose name has "Norm" in it, not
fusednorm's, and not the torch.nn.GroupNorm a FrameGroupNorm holds its parameters in): where eager
mode still runs a norm, or its activation, outside fusednorm's kernels.

    python tools/convert_census.py ["WORKLOAD[,WORKLOAD...]"]

Workloads by name or part of one, as tools/unfused_norms.py takes them; all of WORKLOADS and
MORE_WORKLOADS without an argument. e.g. CogVideoX's decode leaves its CogVideoXSpatialNorm3D
modules (their inner GroupNorms converted, the modulation and the SiLU after it in eager ops):
docs/design.md, "convert".
"""

import argparse
import collections
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import diffusers_bench as db  # noqa: E402

import fusednorm  # noqa: E402
import fusednorm.nn as fnn  # noqa: E402
from fusednorm.convert import _FUSED  # noqa: E402  (the classes convert makes and folds into)


def census(module: torch.nn.Module):
    """({fused class: (count, with activation)}, Counter of the norm-like classes left) of
    `module` after fusednorm.convert (in place)."""
    fusednorm.convert(module)
    holders = {id(m.norm_layer) for m in module.modules() if type(m) is fnn.FrameGroupNorm}
    fused = collections.defaultdict(lambda: [0, 0])
    left = collections.Counter()
    for m in module.modules():
        name = type(m).__name__
        if isinstance(m, _FUSED):
            fused[name][0] += 1
            fused[name][1] += m.activation is not None
        elif "norm" in name.lower() and id(m) not in holders:
            left[name] += 1
    return dict(fused), left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="?", help="comma-separated names of diffusers_bench.py's workloads, or "
                        "parts of names (default: all)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name in db.pick(args.workloads, db.ALL_WORKLOADS, "workload", substrings=True):
        module, _ = db.ALL_WORKLOADS[name]("meta", torch.float16, True)
        fused, left = census(module)
        fused_text = ", ".join(f"{count} {cls} ({folded} with an activation)" for cls, (count, folded) in fused.items())
        left_text = ", ".join(f"{count} {cls}" for cls, count in left.most_common()) or "none"
        print(f"{name}: fused {fused_text or 'none'}; left {left_text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
