"""GPU kernel time of GroupNorm rows under each value of one FUSEDNORM_* knob (docs/design.md,
"Kernel overrides"), beside the plan each value gives: the sweep behind a planner constant's
choice (team counts, prefetch eighths, CTA sizes, sweep waves). A value is set in os.environ and
read again (kernel_paths.reload_overrides); the planner's default (the knob unset) comes first.
Tuning knobs (kernel_paths.TUNING_KNOBS) need a build with -DFUSEDNORM_TUNING_KNOBS
(`CFLAGS=-DFUSEDNORM_TUNING_KNOBS tools/build_for_gpu_machine.sh`). Kernel time as
tools/kernel_time.py takes it (torch.profiler, L2 flushed, host excluded); the values are timed
in turns, --rounds times, and each line is one round.

    GPU_BUILD=DIR tools/gpu_prebuilt.sh py tools/knob_sweep.py FUSEDNORM_TEAM_COUNT 2,3,4,6 \\
        --row 1,128,768,768:float16:silu --row 1,256,512,512:bfloat16:silu \\
        [--set FUSEDNORM_TEAM_FORWARD=1] [--backward] [--rounds 2]
    python tools/knob_sweep.py FUSEDNORM_TEAM_COUNT 2,3,4,6 --row ... --plans   # plans only, no GPU

A row is SHAPE:DTYPE[:ACTIVATION][:channels_last][:residual][:multiplier][:same], 32 groups unless
--groups says otherwise (residual, multiplier: epilogue operands of x's shape; same: one tensor as
both, problem 3's (h + y) * y); --set fixes other knobs for every value (e.g. forcing the path whose
constant is swept).
"""
import argparse
import os
import sys

import torch

from fusednorm import kernel_paths

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import call_case, fused_call, kernel_ms  # noqa: E402


OPERAND_FIELDS = ("residual", "multiplier", "same")


def parse_row(text):
    fields = text.split(":")
    shape = tuple(int(v) for v in fields[0].split(","))
    dtype = getattr(torch, fields[1]) if len(fields) > 1 else torch.float32
    rest = fields[2:]
    channels_last = "channels_last" in rest
    operands = tuple(f for f in rest if f in OPERAND_FIELDS)
    activation = next((f for f in rest if f != "channels_last" and f not in OPERAND_FIELDS), None)
    return shape, dtype, activation, channels_last, operands


def apply(knob, value, fixed):
    for name in set(fixed) | {knob}:
        os.environ.pop(name, None)
    os.environ.update(fixed)
    if value is not None:
        os.environ[knob] = value
    kernel_paths.reload_overrides()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("knob", help="a FUSEDNORM_* knob of fusednorm.kernel_paths.KNOBS")
    parser.add_argument("values", help="comma-separated values to time beside the default")
    parser.add_argument("--row", action="append", required=True,
                        help="SHAPE:DTYPE[:ACTIVATION][:channels_last][:residual][:multiplier][:same]")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="another knob, every value")
    parser.add_argument("--backward", action="store_true", help="time the backward (autograd.grad) instead")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--plans", action="store_true", help="print the plans only (no GPU needed)")
    args = parser.parse_args()
    if args.knob not in kernel_paths.KNOBS:
        parser.error(f"{args.knob} is not one of fusednorm.kernel_paths.KNOBS")
    fixed = dict(item.split("=", 1) for item in args.set)
    unknown = sorted(set(fixed) - set(kernel_paths.KNOBS))
    if unknown:
        parser.error("not knobs: " + ", ".join(unknown))
    if {args.knob, *fixed} & set(kernel_paths.TUNING_KNOBS) and not kernel_paths.tuning_knobs_compiled():
        sys.exit("this build ignores the tuning knobs: build with -DFUSEDNORM_TUNING_KNOBS")
    values = [None] + args.values.split(",")
    rows = [parse_row(r) for r in args.row]
    if not args.plans:
        flush = torch.zeros(512 * 1024 * 1024, dtype=torch.int8, device="cuda")
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, GPU kernel time a call (ms)")
    for shape, dtype, activation, channels_last, operands in rows:
        label = (f"{shape} {str(dtype)[6:]} {activation or 'plain'}{' channels_last' if channels_last else ''}"
                 + "".join(" " + o for o in operands))
        case = call_case(shape, args.groups, dtype, activation, channels_last, operands)
        fn = None if args.plans else fused_call(shape, args.groups, dtype, activation, channels_last,
                                                operands=operands, backward=args.backward)
        for r in range(1 if args.plans else args.rounds):
            for value in values:
                apply(args.knob, value, fixed)
                plan = kernel_paths.plan(shape, args.groups, dtype, channels_last=channels_last,
                                         activation=activation, operands=case.plan_operands(),
                                         backward=args.backward)
                ms = "" if args.plans else f"{kernel_ms(fn, flush, args.iters):.4f}"
                print(f"{label:<44} {value or 'default':>8} {ms:>8}  {plan}", flush=True)
        del fn


if __name__ == "__main__":
    main()
