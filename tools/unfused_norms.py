"""The norms the fusion backend leaves in a real model's graph, and what is around each: which
chains a rule could still take. Traces benchmarks/diffusers_bench.py's workloads in their real
configs on the meta device (no GPU, no memory, a few seconds to a minute on a CPU), runs the
fusion backend's rewrites on a copy of each graph Dynamo captures, as it runs them before Inductor
(a `fusion.FusionBackend` with `leave_to_inductor`, Inductor replaced by a census of the graph),
and prints, per graph, the norms and the chains fused, then the norms left, grouped by their
input's op, their users' ops and their shape:

    python tools/unfused_norms.py "WORKLOAD[,WORKLOAD...]" [--fused]

With --fused it also lists the calls of fusednorm's ops the backend wrote (shape, dtype,
activation, operands: `input_bias`, `residual`, ...) with the kernel plan an H200 gives each
(`fusednorm.kernel_paths.plan`): which chains take a path that adds `input_bias` itself
(docs/design.md, "Input bias"). The layout is the graph's before Inductor, which may make the
convolutions around a norm channels-last (the SD UNet's are; AnimateDiff's are not), so the plans
are those of channels-first inputs.

e.g. `python tools/unfused_norms.py "AnimateDiff UNet step"` lists its attention and motion-module
norms, which have nothing after them to fuse (docs/design.md, "Compile-time
fusion"). Workloads by name or part of one, as its --workloads (WORKLOADS and
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

from fusednorm import fusion, kernel_paths  # noqa: E402
from fusednorm._fx_nodes import example_value  # noqa: E402

_EPILOGUE = kernel_paths._OPERANDS + ("input_bias",)  # the planner's operand names, and the prologue
_GROUPS_ARG = {"group_norm": 1, "add_group_norm": 2}  # where num_groups is among an op's arguments


def _op(node):
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    return f"{node.op}:{getattr(node.target, '__name__', node.target)}"


def _fused_call(node):
    """(op, shape, dtype, groups, activation, operands) of a call of fusednorm's group norm ops
    that the backend wrote, or None."""
    name = getattr(node.target, "__name__", "").split(".")[0]
    if node.op != "call_function" or not str(node.target).startswith("fusednorm.") or name not in _GROUPS_ARG:
        return None
    value = example_value(node.args[0])
    if value is None:
        return None
    operands = tuple(k for k in _EPILOGUE if node.kwargs.get(k) is not None)
    return (name, tuple(value.shape), value.dtype, node.args[_GROUPS_ARG[name]], node.kwargs.get("activation"),
            operands)


def census(module, inputs):
    """[(norms, fused, Counter of the norms left by (input op, user ops, shape), Counter of the
    fused calls by _fused_call)] a graph; norms counted after the backend made Mochi's chunks one
    norm (a fused chain takes one norm)."""
    lefts, calls = [], []

    def count_left(gm, example_inputs):  # (in Inductor's place)
        left, fused = collections.Counter(), collections.Counter()
        for node in gm.graph.nodes:
            if fusion._norm(node) is not None:
                value = example_value(node)
                left[(_op(node.args[0]) if node.args else "?", tuple(_op(u) for u in node.users),
                      tuple(value.shape) if value is not None else None)] += 1
            call = _fused_call(node)
            if call is not None:
                fused[call] += 1
        lefts.append(left)
        calls.append(fused)
        return gm.forward

    rewrite = fusion.FusionBackend(count_left)
    rewrite.leave_to_inductor = True  # (its rules as before Inductor, which count_left stands for)

    def backend(gm, example_inputs):
        original = copy.deepcopy(gm)
        rewrite(gm, example_inputs)
        return original.forward  # (runs the unfused graph on meta tensors)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=backend)(*inputs)
    return [(fused + sum(left.values()), fused, left, called)
            for fused, left, called in zip(rewrite.fusions, lefts, calls)]


def plan_of(call):
    """The H200's kernel plan of a fused call (_fused_call's tuple), channels-first."""
    _, shape, dtype, groups, activation, operands = call
    others = [k for k in operands if k != "input_bias"]
    return kernel_paths.plan(shape, groups, dtype, activation=activation, operands=others, device=kernel_paths.H200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", help="comma-separated names of diffusers_bench.py's workloads, or parts of names (as its "
                        "--workloads)")
    parser.add_argument("--fused", action="store_true", help="also list the fused calls and their H200 kernel plans")
    args = parser.parse_args()
    names = db.pick(args.workloads, db.ALL_WORKLOADS, "workload", substrings=True)
    for name in names:
        module, inputs = db.ALL_WORKLOADS[name]("meta", torch.float16, True)
        for i, (norms, fused, left, calls) in enumerate(census(module, inputs)):
            print(f"{name}, graph {i}: {norms} norms, {fused} chains fused, {sum(left.values())} norms left")
            for (source, users, shape), count in left.most_common():
                print(f"  {count:4d} x input {source}, users {list(users)}, shape {shape}")
            if args.fused:
                print("  fused calls (H200 plans of channels-first inputs):")
                for call, count in calls.most_common():
                    op, shape, dtype, groups, activation, operands = call
                    print(f"  {count:4d} x {op} {shape} {str(dtype).replace('torch.', '')} G={groups} "
                          f"activation={activation} operands={list(operands)}: {plan_of(call).split(' ')[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
