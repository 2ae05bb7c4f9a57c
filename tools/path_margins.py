"""Measures each kernel path's margin on the benchmark suite: GPU kernel time (L2 flushed, host
excluded; benchmarks/bench.py's kernel_ms) of every suite row, forward and backward, under the
planner's default and under each path the tests can force, and of the Triton two-pass peer
(benchmarks/triton_two_pass.py) on the GN+SiLU rows it takes. Writes the JSON that
tests/test_plan.py checks the planner against (docs/design.md, "Path margins"), and a
table of each path's margins:

    python tools/path_margins.py --out tests/data/path_margins.json [--filter REGEX]
    python tools/path_margins.py --table tests/data/path_margins.json
    python tools/path_margins.py --merge NEW.json tests/data/path_margins.json

--merge puts the rows of a partial run (--filter, --no-backward) into the whole file: each
replaces the row of the same case and direction (or is added), and the file's "updated" note
gains the run's date, device, torch and command. It needs no GPU.

A forced path that cannot take a shape falls back to another plan; each timing records the plan
(as fusednorm.kernel_paths.plan models it) and the kernels that ran, and a plan is timed once
however many settings reach it.
"""

import argparse
import datetime
import json
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
from bench import gpu_suite, grad_inputs, implementations, kernel_ms, kernel_profile, make_inputs  # noqa: E402
from fusednorm.kernel_paths import plan, selected  # noqa: E402

FORWARD_PATHS = ("default", "split", "one_pass", "one_pass_shared", "team", "sweep", "cols_sweep", "noteam", "nosweep",
                 "nocolssweep", "shared")
BACKWARD_PATHS = ("default", "split", "one_pass", "team", "noteam")


def profiled(fn, flush):
    """(GPU kernel time a call of fn(), the names of the kernels it launched): one profile."""
    ms, by_kernel = kernel_profile(fn, flush)
    return ms, sorted(by_kernel)


def plan_args(case, backward):
    """The arguments of fusednorm.kernel_paths.plan for a suite case (the dtype by name)."""
    return {
        "shape": list(case.shape), "num_groups": case.groups if case.kind == "group" else case.shape[1],
        "dtype": str(case.dtype)[6:], "channels_last": case.channels_last, "activation": case.activation,
        "operands": case.plan_operands(),
        "backward": backward, "affine": case.affine,
    }


def plan_of(args, device=None):
    """The plan for plan_args' arguments."""
    kwargs = dict(args)
    return plan(kwargs.pop("shape"), kwargs.pop("num_groups"), getattr(torch, kwargs.pop("dtype")), device=device,
                **kwargs)


def path_of(plan_string):
    return plan_string.split()[0][len("path="):]


def dumps(result):
    """The JSON text of a result, one suite row a line (a measurement changes the lines of its rows)."""
    head = {k: v for k, v in result.items() if k != "rows"}
    rows = ",\n".join("  " + json.dumps(row) for row in result["rows"])
    return json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + rows + "\n ]\n}\n"


def table(result):
    """Markdown: each path the planner takes, its rows, and its margin (time of the alternative over
    the planned path's) over the split passes, over the next best measured plan and over the peer."""
    served = {}
    for row in result["rows"]:
        default = row["paths"]["default"]
        others = [v["ms"] for v in row["paths"].values() if v["plan"] != default["plan"]]
        margins = served.setdefault((path_of(default["plan"]), row["direction"]), {"rows": 0, "split": [], "next": [], "peer": []})
        margins["rows"] += 1
        if path_of(default["plan"]) != "split":
            margins["split"].append(row["paths"]["split"]["ms"] / default["ms"])
        if others:
            margins["next"].append(min(others) / default["ms"])
        if "peer_ms" in row:
            margins["peer"].append(row["peer_ms"] / default["ms"])

    def span(v):
        return f"{min(v):.2f}-{max(v):.2f}x" if v else "-"

    lines = ["| path | direction | suite rows | over the split passes | over the next best plan | over the Triton peer |",
             "|---|---|---|---|---|---|"]
    for (path, direction), m in sorted(served.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {path} | {direction} | {m['rows']} | {span(m['split'])} | {span(m['next'])} | {span(m['peer'])} |")
    return "\n".join(lines)


def row_key(row):
    """A row's case and direction: what a re-measured row replaces."""
    return (row["name"], tuple(row["shape"]), row["dtype"], row["channels_last"], row["direction"])


def merge(partial, whole):
    """`whole` with the rows of `partial` in place of (or beside) its rows of the same key, and
    a line of `partial`'s provenance in its "updated" note."""
    new = {row_key(row): row for row in partial["rows"]}
    rows = [new.pop(row_key(row), row) for row in whole["rows"]] + list(new.values())
    note = f"{partial['date']}, {partial['device']}, torch {partial['torch']}: {partial['command']}"
    merged = dict(whole, rows=rows)
    merged["updated"] = f"{whole['updated']}; {note}" if whole.get("updated") else note
    return merged


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the JSON file to write")
    parser.add_argument("--table", metavar="JSON", help="only print the margins table of a JSON written before")
    parser.add_argument("--filter", default="", help="only the suite rows whose name matches this regex")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--merge", nargs=2, metavar=("NEW", "WHOLE"),
                        help="merge the rows of the JSON NEW into the JSON WHOLE (rewritten)")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return
    if args.merge:
        with open(args.merge[0]) as f:
            partial = json.load(f)
        with open(args.merge[1]) as f:
            whole = json.load(f)
        with open(args.merge[1], "w") as f:
            f.write(dumps(merge(partial, whole)))
        return
    if not args.out:
        parser.error("--out is required")
    if not torch.cuda.is_available():
        sys.exit("path_margins.py needs a CUDA device")
    try:
        import triton_two_pass
    except ImportError:
        triton_two_pass = None
    flush = torch.empty(512 * 2**20, dtype=torch.int8, device="cuda")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python tools/path_margins.py " + " ".join(sys.argv[1:]),
        "timing": "GPU kernel time a call, ms (torch.profiler, L2 flushed before each call, overlapping kernels counted once)",
        "rows": [],
    }
    for case in gpu_suite():
        if not re.search(args.filter, case.name):
            continue
        x, w, b, ops = make_inputs(case, "cuda")
        ours = implementations(case, with_compile=False)["fusednorm"]
        for backward in (False, True) if not args.no_backward else (False,):
            times = {}  # plan -> ms
            launched = {}  # plan -> kernels
            paths = {}  # setting -> plan
            for setting in BACKWARD_PATHS if backward else FORWARD_PATHS:
                with selected(setting):
                    ran = plan_of(plan_args(case, backward))
                    paths[setting] = ran
                    if ran in times:
                        continue
                    if backward:
                        xg, wg, bg, opsg, leaves = grad_inputs(case, x, w, b, ops)
                        y = ours(xg, wg, bg, opsg)
                        dy = torch.randn_like(y)
                        def call():
                            torch.autograd.grad(y, leaves, dy, retain_graph=True, allow_unused=True)
                        times[ran], launched[ran] = profiled(call, flush)
                        del y, dy, xg, leaves, call
                    else:
                        with torch.no_grad():
                            times[ran], launched[ran] = profiled(lambda: ours(x, w, b, ops), flush)
            row = {
                "name": case.name, "shape": list(case.shape), "dtype": str(case.dtype)[6:],
                "kind": case.kind, "groups": case.groups, "channels_last": case.channels_last,
                "activation": case.activation, "operands": list(case.operands), "same_operand": case.same_operand,
                "affine": case.affine, "direction": "backward" if backward else "forward",
                "plan_args": plan_args(case, backward),
                "paths": {s: {"plan": p, "ms": round(times[p], 5), "kernels": launched[p]} for s, p in paths.items()},
            }
            peer_ok = (triton_two_pass is not None and not backward and case.kind == "group"
                       and case.activation == "silu" and not case.operands and not case.channels_last)
            if peer_ok:
                with torch.no_grad():
                    row["peer_ms"] = round(kernel_ms(lambda: triton_two_pass.group_norm_silu(x, case.groups, w, b), flush), 5)
            result["rows"].append(row)
            best = min(times.values())
            print(f"{case.name:<26} {str(tuple(case.shape)):<22} {row['dtype']:<9} "
                  f"{'CL' if case.channels_last else 'CF'} {row['direction']:<8} default {times[paths['default']]:.4f} "
                  f"best {best:.4f} split {times[paths['split']]:.4f}"
                  + (f" peer {row['peer_ms']:.4f}" if "peer_ms" in row else ""), flush=True)
        del x, w, b, ops
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write(dumps(result))
    print(table(result))


if __name__ == "__main__":
    main()
