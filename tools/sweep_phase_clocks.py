"""Where the channels-last sweep's moments kernel spends its time, phase by phase: per-CTA
`globaltimer` stamps of thread 0, printed by an instrumented build of cols_sweep_path.cuh (the
plain moments kernel, without input_bias). Three steps (the third on the GPU machine):

    python tools/sweep_phase_clocks.py patch /tmp/sweep_clocks   # a copy of the tree, instrumented
    (cd /tmp/sweep_clocks && python setup.py build_ext --inplace)
    mkdir -p /tmp/sweep_pkg && ln -sfn /tmp/sweep_clocks/ops /tmp/sweep_pkg/fusednorm
    PYTHONPATH=/tmp/sweep_pkg python tools/sweep_phase_clocks.py run > log; python tools/sweep_phase_clocks.py table log

(or build the copy with tools/build_for_gpu_machine.sh run from it, and carry its gpu_build.)
`run` calls fusednorm.group_norm (fp16 GN32+SiLU, channels-last) once per case with eps = 0.125,
which the stamps print for, after warm-up calls and either a copy that rewrites x ("written", as
a convolution before the norm leaves it) or a reading L2 flush ("flush"). `table` prints, over the
CTAs of each case, the spread of: the wait for the thread's first ring row, the loop, the shift
K's loads after it, the four reduction phases of cols_sweep_tile_moments (the per-channel sums'
store and barrier, their totals, the M2 step, its totals) and the group merges with the record's
stores. Stamps are in ns from the first CTA's start; the printf after the last stamp delays the
kernels after it, so only the moments kernel is stamped. Measured with it on an H200 (docs/design.md,
"Channels-last sweep"): the code after the loop took ~5.7 us of a 17 us kernel, every CTA alike,
bound by issue. The patch inserts the stamps at fixed lines of the source: it stops with the line
it could not find when the kernel changes, and must then be updated with it.
"""

import argparse
import collections
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from team_phase_clocks import after, before, instrumented_copy  # noqa: E402

SWEEP = os.path.join("csrc", "cuda", "cols_sweep_path.cuh")
EPS = 0.125  # the call whose stamps are printed

CLOCK = r'''__device__ __forceinline__ unsigned long long sweep_clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

'''


EDITS = [
    before("constexpr int kColsSweepThreads =", CLOCK),
    # cols_sweep_tile_moments: four stamps, into the caller's array
    ("unsigned char* smem) {\n  const OnePassArgs<scalar_t>& o = a.op;",
     "unsigned char* smem, unsigned long long* st = nullptr) {\n  const OnePassArgs<scalar_t>& o = a.op;"),
    after("  cols_sweep_store_lanes<V>(red1, static_cast<int64_t>(tile.r) * C + c0, v);\n  __syncthreads();\n",
          "  if (st) st[0] = sweep_clock_ns();\n"),
    after("  cols_sweep_channel_totals(red1, a.rows, C);\n", "  if (st) st[1] = sweep_clock_ns();\n"),
    after("  cols_sweep_store_lanes<V>(red2, static_cast<int64_t>(tile.r) * C + c0, v);\n  __syncthreads();\n",
          "  if (st) st[2] = sweep_clock_ns();\n"),
    after("  cols_sweep_channel_totals(red2, a.rows, C);\n", "  if (st) st[3] = sweep_clock_ns();\n"),
    # the plain moments kernel
    before("  // Row s_begin + r + i * step's pack at xs + i * stride.\n",
           "  const unsigned long long sw0 = sweep_clock_ns();\n"),
    ("  launch_dependents();\n  acc_t q1[V], q2[V];\n#pragma unroll\n  for (int j = 0; j < V; ++j) q1[j] = q2[j] = acc_t(0);\n"
     "  for (int64_t i = 0; i < nr; ++i) {\n",
     "  const unsigned long long sw1 = sweep_clock_ns();\n"
     "  launch_dependents();\n  acc_t q1[V], q2[V];\n#pragma unroll\n  for (int j = 0; j < V; ++j) q1[j] = q2[j] = acc_t(0);\n"
     "  for (int64_t i = 0; i < nr; ++i) {\n"),
    ("  __pipeline_wait_prior(0);  // (only empty groups can be left)\n",
     "  const unsigned long long sw2 = sweep_clock_ns();\n  __pipeline_wait_prior(0);  // (only empty groups can be left)\n"),
    ("  acc_t TK[V];  // loaded after the loop (registers); TK = T - K\n",
     "  const unsigned long long sw3 = sweep_clock_ns();\n  acc_t TK[V];  // loaded after the loop (registers); TK = T - K\n"),
    ("  cols_sweep_tile_moments<V>(a, tile, nr, TK, q1, q2, cols_sweep_smem);\n}\n\n// The residual-add prologue",
     "  const unsigned long long sw4 = sweep_clock_ns();\n  unsigned long long st[4];\n"
     "  cols_sweep_tile_moments<V>(a, tile, nr, TK, q1, q2, cols_sweep_smem, st);\n"
     "  const unsigned long long sw5 = sweep_clock_ns();\n"
     f"  if (o.eps == {EPS}f && threadIdx.x == 0) {{\n"
     "    printf(\"SW %d %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\\n\", (int)blockIdx.x, sw0, sw1, sw2, sw3, sw4,\n"
     "        sw5, st[0], st[1], st[2], st[3]);\n  }\n}\n\n// The residual-add prologue"),
]

SHAPES = ["1,256,256,256", "1,128,512,512", "1,512,256,256"]

# (name, first stamp, last stamp) over the printed fields sw0..sw5, st0..st3 (indices 0-9)
PHASES = [
    ("first row wait", 0, 1),
    ("loop", 1, 2),
    ("barrier", 2, 3),
    ("K loads", 3, 4),
    ("lanes + barrier", 4, 6),
    ("channel sums", 6, 7),
    ("M2 step", 7, 8),
    ("channel M2s", 8, 9),
    ("groups + record", 9, 5),
]


def run(shapes):
    import torch
    import fusednorm

    flush = torch.zeros(512 << 20, dtype=torch.int8, device="cuda")
    for spec in shapes:
        shape = tuple(int(s) for s in spec.split(","))
        x = torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        w = torch.randn(shape[1], device="cuda", dtype=torch.float16)
        b = torch.randn_like(w)
        y = torch.randn_like(x)
        for mode in ("written", "flush"):
            for _ in range(3):
                fusednorm.group_norm(x, 32, w, b, activation="silu")
            torch.cuda.synchronize()
            print(f"=== {spec} {mode}", flush=True)
            if mode == "written":
                x.copy_(y)
            else:
                flush.sum(dtype=torch.int32)
            fusednorm.group_norm(x, 32, w, b, eps=EPS, activation="silu")
            torch.cuda.synchronize()


def phase_table(lines, tag, phases, last, with_sm=False):
    """Prints, per case of a `run` log, the spread over its CTAs of each phase (name, first stamp,
    last stamp) of the lines `tag blockIdx [smid] stamps...`; `last`: the CTA's last stamp."""
    cases = {}
    label = None
    pattern = re.compile(rf"{tag} (\d+) ([\d ]+)$")
    for line in lines:
        if line.startswith("=== "):
            label = line[4:].strip()
        m = pattern.match(line.strip())
        if m and label:
            fields = [int(v) for v in m.group(2).split()]
            cases.setdefault(label, {})[int(m.group(1))] = (fields[0], fields[1:]) if with_sm else (None, fields)
    for label, ctas in cases.items():
        stamps = [s for _, s in ctas.values()]
        t0 = min(s[0] for s in stamps)
        begin = [(s[0] - t0) / 1e3 for s in stamps]
        end = [(s[last] - t0) / 1e3 for s in stamps]
        on = f" on {len({sm for sm, _ in ctas.values()})} SMs" if with_sm else ""
        print(f"{label}: {len(stamps)} CTAs{on}, the last done {max(end):.2f} us after the first began "
              f"(median CTA {statistics.median(end):.2f}; began after the first: median "
              f"{statistics.median(begin):.2f}, max {max(begin):.2f}); us a phase, min / median / max:")
        for name, a, b in phases:
            d = [(s[b] - s[a]) / 1e3 for s in stamps]
            print(f"  {name:16s} {min(d):6.2f} {statistics.median(d):6.2f} {max(d):6.2f}")
        if with_sm:
            placement_table(ctas, t0, last)


def placement_table(ctas, t0, last):
    """Where the CTAs landed: the SMs by how many CTAs each held, and when those CTAs ended (the
    SMs given more CTAs than the others end last: docs/design.md, "Channels-last
    one-pass")."""
    per_sm = collections.Counter(sm for sm, _ in ctas.values())
    ends = collections.defaultdict(list)
    for sm, s in ctas.values():
        ends[per_sm[sm]].append((s[last] - t0) / 1e3)
    for k in sorted(ends):
        sms = sum(1 for n in per_sm.values() if n == k)
        print(f"  SMs holding {k} CTA{'s' if k > 1 else ' '}: {sms:3d}, their CTAs end: median {statistics.median(ends[k]):6.2f}, "
              f"last {max(ends[k]):6.2f} us")


def table(lines):
    phase_table(lines, "SW", PHASES, 5)


def main(doc=__doc__, source=SWEEP, edits=EDITS, shapes=SHAPES, print_table=table):
    """patch / run / table (tools/cols_phase_clocks.py passes its own source, edits, shapes and
    table)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("patch").add_argument("dst")
    sub.add_parser("run").add_argument("--shapes", nargs="+", default=shapes)
    sub.add_parser("table").add_argument("log", help="a saved output of `run`")
    args = parser.parse_args()
    if args.cmd == "patch":
        instrumented_copy(args.dst, source, edits)
    elif args.cmd == "table":
        print_table(open(args.log))
    else:
        # The kernel's printf lines reach stdout at synchronisations: save them (`run > log`),
        # then `table log`.
        run(args.shapes)


if __name__ == "__main__":
    main()
