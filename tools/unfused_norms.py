"""The norms the fusion backend leaves in a real model's graph, and what is around each: which
chains a rule could still take. Traces benchmarks/diffusers_bench.py's workloads in their real
configs on the meta device (no GPU, no memory, a few seconds to a minute on a CPU), runs
the backend's rewrites before Inductor (the pads written as concatenations, then
`fusion.fuse_graph(gm, leave_to_inductor=True)`) on a copy of each graph Dynamo captures, and prints, per graph, the norms and the chains fused, then the
norms left, grouped by their input's op, their users' ops and their shape:

    python tools/unfused_norms.py "WORKLOAD[,WORKLOAD...]"

e.g. `python tools/unfused_norms.py "AnimateDiff UNet step"` lists its attention and motion-module
norms, which have nothing after them to fuse (docs/performance.md, "Video UNets, and every
autoencoder under compile"). Workloads by name or part of one, as its --workloads (WORKLOADS and
MORE_WORKLOADS).
"""

import argparse
import collections
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import diffusers_bench as db  # noqa: E402

from fusednorm import fusion  # noqa: E402
from fusednorm._fx_nodes import example_value  # noqa: E402


def _op(node):
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    return f"{node.op}:{getattr(node.target, '__name__', node.target)}"


def _is_norm(gm, node):
    return fusion._norm(gm, node) is not None


def census(module, inputs):
    """[(norms, fused, Counter of the norms left by (input op, user ops, shape))] a graph."""
    graphs = []

    def backend(gm, example_inputs):
        fused_gm = copy.deepcopy(gm)
        norms = sum(_is_norm(fused_gm, n) for n in fused_gm.graph.nodes)
        fusion.replication_pad_concatenations(fused_gm)
        fused = fusion.fuse_graph(fused_gm, leave_to_inductor=True)
        left = collections.Counter()
        for node in fused_gm.graph.nodes:
            if _is_norm(fused_gm, node):
                value = example_value(node)
                left[(_op(node.args[0]) if node.args else "?", tuple(_op(u) for u in node.users),
                      tuple(value.shape) if value is not None else None)] += 1
        graphs.append((norms, fused, left))
        return gm.forward  # (runs the unfused graph on meta tensors)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=backend)(*inputs)
    return graphs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", help="comma-separated names of diffusers_bench.py's workloads, or parts of names (as its --workloads)")
    args = parser.parse_args()
    known = {**db.WORKLOADS, **db.MORE_WORKLOADS}
    names = db.pick(args.workloads, known, "workload", substrings=True)
    for name in names:
        module, inputs = known[name]("meta", torch.float16, True)
        for i, (norms, fused, left) in enumerate(census(module, inputs)):
            print(f"{name}, graph {i}: {norms} norms, {fused} chains fused, {sum(left.values())} norms left")
            for (source, users, shape), count in left.most_common():
                print(f"  {count:4d} x input {source}, users {list(users)}, shape {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
