"""A/B of one of the fusion backend's rules on diffusers models: compile + fusion as it is, compile +
fusion with the rule's predicate forced to False, and plain compile, in one process, timed in turns.

The rules are predicates of ops/fusion.py that decide whether a chain is rewritten:

    _inductor_epilogue    leave a chain whose output goes to an elementwise op to Inductor
    _inductor_prologue    leave a chain whose input is a small single-use elementwise op to Inductor
    _residual_add_pays    take the residual add before a group norm (add_group_norm)
    _replication_pad_pays take the replication pad after a fused op
    _bare_norm_left       leave a norm with nothing to fuse (no epilogue step, prologue or add)

Forcing one to False turns off what it does (a "leave to Inductor" rule then fuses, a "pays"
rule then never takes its op). Each model is compiled twice with the backend (once a setting,
each compile with its own `fusion.backend()`) and once plainly, then the three are timed in turns
(`--rounds`, default 2) with benchmarks/bench.py's timer; the chains each rewrote and each
output's max |difference| from eager are printed first. Models: benchmarks/diffusers_bench.py's
workloads by name or part of one, as its --workloads (WORKLOADS and MORE_WORKLOADS; their real
configs in fp16 on a GPU, the tiny ones in fp32 on the CPU, as there).

    python tools/fusion_rule_ab.py RULE "WORKLOAD[,WORKLOAD...]" [--rounds N]

e.g. `python tools/fusion_rule_ab.py _inductor_epilogue "KVAE decode 1024,CogVideoX VAE decode"`
(docs/design.md, "Compile-time fusion").
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import diffusers_bench as db  # noqa: E402

from fusednorm import fusion  # noqa: E402

RULES = ("_inductor_epilogue", "_inductor_prologue", "_residual_add_pays", "_replication_pad_pays", "_bare_norm_left")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rule", choices=RULES)
    parser.add_argument("workloads", help="comma-separated names of diffusers_bench.py's workloads, or parts of names (as its "
                        "--workloads)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    names = db.pick(args.workloads, db.ALL_WORKLOADS, "workload", substrings=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = device == "cuda"
    dtype = torch.float16 if full else torch.float32
    measure = db.timer(device)
    rule = getattr(fusion, args.rule)
    with torch.no_grad():
        for name in names:
            model, inputs = db.ALL_WORKLOADS[name](device, dtype, full)
            want = model(*inputs)
            calls = {}
            for label, forced_off in (("compile + fusion", False), (f"compile + fusion, {args.rule} off", True)):
                setattr(fusion, args.rule, (lambda *a, **k: False) if forced_off else rule)
                try:
                    backend = fusion.backend()
                    compiled = torch.compile(model, backend=backend)
                    out = compiled(*inputs)  # compiles here, under this setting
                finally:
                    setattr(fusion, args.rule, rule)
                diff = (out.float() - want.float()).abs().max().item()
                print(f"{name}: {label}: {sum(backend.fusions)} chains, max |diff| vs eager {diff:.2e}", flush=True)
                calls[label] = compiled
            calls["compile"] = torch.compile(model)
            calls["compile"](*inputs)
            times = {label: [] for label in calls}
            for _ in range(args.rounds):
                for label, call in calls.items():
                    times[label].append(measure(lambda call=call: call(*inputs)))
            for label, ms in times.items():
                print(f"{name}: {label:40s} " + " / ".join(f"{t:.2f}" for t in ms) + " ms", flush=True)
            del calls, model, inputs, want
            db.free_memory(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
