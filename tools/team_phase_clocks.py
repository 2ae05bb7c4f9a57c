"""Where a team kernel's rounds go: per-phase clocks of thread 0 of a few CTAs, printed by an
instrumented build of group_norm_team.cuh. Three steps (the third on the GPU machine):

    python tools/team_phase_clocks.py patch /tmp/phases   # a copy of the tree, instrumented
    (cd /tmp/phases && python setup.py build_ext --inplace)
    mkdir -p /tmp/phases_pkg && ln -sfn /tmp/phases/ops /tmp/phases_pkg/fusednorm
    PYTHONPATH=/tmp/phases_pkg python tools/team_phase_clocks.py run

`run` times one forward and one backward of a few cases (after a warm-up call) and prints, per
kernel and CTA, the share of its clock cycles in each phase and the microseconds per round, and
per kernel, by quarter of the rounds, the median CTA's cycles and barrier-wait share (whether the
teams drift into waiting at their barriers together over many rounds):
  forward:  barrier wait | partial loads (thread 0's loads of the team's partials) | CTA merge and
            rstd | outputs (and the next round's copies) | next moments
  backward: copy wait | coefficients wait (thread 0 waits on the first channel's coefficients) |
            sums and CTA fold | publish | barrier wait | team fold and dx coefficients |
            outputs and the channel parts
Each CTA reports; the table prints a few of them and, per kernel, how the barrier wait spreads
over all of them (which CTAs the others wait for). The patch inserts the clocks at fixed lines of the source: it stops with the line it could not
find when the kernels change, and must then be updated with them. Measured with it on an H100
(docs/design.md, "Team path"): no phase of the GroupNorm problem's backward round dominates; each round spends
~40% of its time with no DRAM traffic of its own (sums, publish, barrier, fold).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEAM = os.path.join("csrc", "cuda", "group_norm_team.cuh")

CLOCKS = r'''
__device__ __forceinline__ unsigned long long phase_clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define PH_DECL unsigned long long ph_acc[7] = {0, 0, 0, 0, 0, 0, 0}; unsigned long long ph_t = clock64(); \
  const unsigned long long ph_g0 = phase_clock_ns(); unsigned long long ph_qw[4] = {0, 0, 0, 0}; \
  unsigned long long ph_qt[4] = {0, 0, 0, 0};
// Inside the rounds' loop (round i of `rounds`): phase k's cycles, and by quarter of the rounds the
// cycles in all (ph_qt) and at the barrier (ph_qw; W: phase k is the barrier wait).
#define PH_Q(k, W) if (threadIdx.x == 0) { const unsigned long long now = clock64(); ph_acc[k] += now - ph_t; \
  const int ph_q = static_cast<int>(i * 4 / (rounds > 0 ? rounds : 1)); ph_qt[ph_q] += now - ph_t; \
  if (W) ph_qw[ph_q] += now - ph_t; ph_t = now; }
#define PH(k) PH_Q(k, false)
__device__ __forceinline__ unsigned phase_smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#define PH_END(NAME) if (threadIdx.x == 0) \
  printf("PH %s grid %d cta %d sm %u rounds %lld : %llu %llu %llu %llu %llu %llu %llu ns %llu q %llu %llu %llu %llu w %llu %llu %llu %llu\n", \
    NAME, gridDim.x, blockIdx.x, phase_smid(), (long long)rounds, ph_acc[0], ph_acc[1], ph_acc[2], ph_acc[3], ph_acc[4], \
    ph_acc[5], ph_acc[6], phase_clock_ns() - ph_g0, ph_qt[0], ph_qt[1], ph_qt[2], ph_qt[3], ph_qw[0], ph_qw[1], ph_qw[2], \
    ph_qw[3]);
'''

# (old, new): each `old` must occur once in group_norm_team.cuh.
def after(anchor, text):
    return anchor, anchor + text


def before(anchor, text):
    return anchor, text + anchor


EDITS = [
    before("template <typename scalar_t>\nstruct TeamArgs {", CLOCKS + "\n"),
    # forward
    after("    moments(0, K);\n  }\n", "  PH_DECL\n"),
    ("    t.wait(team, i);\n    const int64_t item = t.item_of(team, i);\n    const acc_t* team_part = t.read_part(team, i, rank);",
     "    t.wait(team, i);\n    PH_Q(0, true)\n    const int64_t item = t.item_of(team, i);\n    const acc_t* team_part = t.read_part(team, i, rank);"),
    # The team fold in two: thread 0's loads of the team's partials, then the CTA's merge of them
    # (parts_moments) and rstd (with a stamp between; the printf on the loaded value keeps the
    # loads before the stamp).
    ("""    const BlockMoments<acc_t> m = parts_moments<kTeamThreads>(t.team_size, static_cast<acc_t>(o.len),
        [&](int r) {
          const acc_t* p = team_part + r * kTeamPartials;
          return ChunkMoments<acc_t>{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)};
        },
        fold);
""", """    ChunkMoments<acc_t> ph_v{acc_t(0), acc_t(0), acc_t(0)};
    if (static_cast<int>(threadIdx.x) < t.team_size) {
      const acc_t* p = team_part + threadIdx.x * kTeamPartials;
      ph_v = ChunkMoments<acc_t>{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)};
    }
    if (threadIdx.x == 0 && ph_v.n == acc_t(-1.2345e-30f)) printf("-");
    PH(4)
    const BlockMoments<acc_t> m = parts_moments<kTeamThreads>(t.team_size, static_cast<acc_t>(o.len),
        [&](int r) {
          if (r == static_cast<int>(threadIdx.x)) return ph_v;
          const acc_t* p = team_part + r * kTeamPartials;
          return ChunkMoments<acc_t>{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)};
        },
        fold);
"""),
    after("    const acc_t rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + o.eps);\n", "    PH(1)\n"),
    after("        if (more) __pipeline_memcpy_async(&x[v], &xnext[v], sizeof(P));\n      }\n    });\n", "    PH(2)\n"),
    ("      moments(i + 1, K);\n    }\n  }\n}",
     "      moments(i + 1, K);\n    }\n    PH(3)\n  }\n  PH_END(\"fwd\")\n}"),
    # backward
    before("  for (int64_t i = 0; i < rounds; ++i) {\n    const int64_t item = t.item_of(team, i);\n", "  PH_DECL\n"),
    after("    __syncthreads();  // the sums read packs that other threads copied\n", "    PH(0)\n"),
    after("    if (c_lo + segment <= c_hi) k = channel_coefs(o, n, c_first + c_lo + segment, rstd);\n",
          "    if (threadIdx.x == 0 && k.ea == acc_t(-1.2345e-30f)) printf(\"-\");\n    PH(1)\n"),
    ("    t.publish_copies(team, rank, i, cta.dy[0], cta.dyxc[0], cta.xc[0]);\n",
     "    PH(2)\n    t.publish_copies(team, rank, i, cta.dy[0], cta.dyxc[0], cta.xc[0]);\n    PH(3)\n"),
    # the backward's barrier (the forward's t.wait is followed by PH(0) above)
    ("    t.wait(team, i);\n    const acc_t* team_part", "    t.wait(team, i);\n    PH_Q(4, true)\n    const acc_t* team_part"),
    after("    if (rank == 0 && threadIdx.x == 0 && o.rec != nullptr) coefs.store(o.rec + item * kRec, element.mean, rstd);\n",
          "    PH(5)\n"),
    ("          o.part_c[(n * o.C + c_first + cl) * 2 + 1] = dsc;\n        }\n      }\n    }\n  }\n}",
     "          o.part_c[(n * o.C + c_first + cl) * 2 + 1] = dsc;\n        }\n      }\n    }\n    PH(6)\n  }\n  PH_END(\"bwd\")\n}"),
]


def instrumented_copy(dst, source, edits):
    """Copies the tree's tracked files to `dst` and applies `edits` ((old, new) pairs, each `old`
    found exactly once) to its `source` (also used by tools/sweep_phase_clocks.py)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        os.makedirs(os.path.join(dst, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))
    path = os.path.join(dst, source)
    s = open(path).read()
    for old, new in edits:
        if s.count(old) != 1:
            sys.exit(f"found {s.count(old)} times (want 1), update the edits:\n{old}")
        s = s.replace(old, new)
    open(path, "w").write(s)
    print(f"instrumented copy in {dst}; build it there with `python setup.py build_ext --inplace`")


def patch(dst):
    """Copies the tree's tracked sources to `dst` and instruments its group_norm_team.cuh."""
    instrumented_copy(dst, TEAM, EDITS)


CASES = [  # label, shape, groups, dtype, knobs, activation
    # The GroupNorm problem's forward at 1/8 and full size: 37 and 299 rounds of its three teams.
    ("GroupNorm problem (14,64,512,512)", (14, 64, 512, 512), 8, "float32", {}, None),
    ("GroupNorm problem (112,64,512,512)", (112, 64, 512, 512), 8, "float32", {}, None),
    ("GroupNorm (8,64,512,512)", (8, 64, 512, 512), 8, "float32", {"FUSEDNORM_TEAM_BACKWARD": "1"}, None),
    ("InstanceNorm (8,64,512,512)", (8, 64, 512, 512), 64, "float32", {}, None),
    ("InstanceNorm3d (2,32,128^3)", (2, 32, 128, 128, 128), 32, "float32", {"FUSEDNORM_TEAM_BACKWARD": "1"}, None),
    ("VAE GN+SiLU (1,128,512,512)", (1, 128, 512, 512), 32, "bfloat16", {}, "silu"),
    ("Attention GN (16,512,4096)", (16, 512, 4096), 32, "bfloat16", {}, None),
    # 32 groups of 4.5 MB in 6 teams of 44 (6 rounds), and the video VAE's of 10.5 MB in 2 of 132
    # (16 rounds; the planner gives it the sweep).
    ("VAE GN+SiLU (1,128,768,768)", (1, 128, 768, 768), 32, "float16", {}, "silu"),
    ("Video VAE GN+SiLU (1,128,20,256,256)", (1, 128, 20, 256, 256), 32, "bfloat16",
     {"FUSEDNORM_SWEEP_FORWARD": "0"}, "silu"),
]


def run(only=None):
    import torch
    import fusednorm
    import fusednorm.kernel_paths
    for label, shape, G, dtype, knobs, act in CASES:
        if only and not any(o in label for o in only):
            continue
        for name in ("FUSEDNORM_TEAM_BACKWARD", "FUSEDNORM_TEAM_FORWARD", "FUSEDNORM_ONE_PASS_MAX_BYTES",
                     "FUSEDNORM_SWEEP_FORWARD"):
            os.environ.pop(name, None)
        os.environ.update(knobs)
        fusednorm.kernel_paths.reload_overrides()
        dt = getattr(torch, dtype)
        x = torch.randn(shape, device="cuda", dtype=dt)
        w = torch.rand(shape[1], device="cuda", dtype=dt) + 0.5
        b = torch.randn(shape[1], device="cuda", dtype=dt)
        dy = torch.randn_like(x)
        for rep in range(2):  # the second call's clocks are reported
            torch.cuda.synchronize()
            print(f"=== {label} rep {rep}", flush=True)
            xg = x.clone().requires_grad_()
            y = fusednorm.group_norm(xg, G, w, b, activation=act)
            torch.autograd.grad(y, xg, dy)
            torch.cuda.synchronize()


SAMPLED = (0, 1, 77, 150)  # and the last CTA


def table(lines):
    """The table of `run`'s output (the kernels' printf lines among its own): the phases of a few
    CTAs of each kernel, then the spread over all of them of the barrier wait (the phase in which
    a CTA waits for the slowest of its team) and the CTAs that waited least, with their SMs: if
    the same CTAs are last in every round, the round is as slow as they are."""
    label = None
    kernels = {}
    for line in lines:
        if line.startswith("=== "):
            label = line[4:].strip()
            continue
        m = re.match(r"PH (\w+) grid (\d+) cta (\d+) sm (\d+) rounds (\d+) : ([\d ]+) ns (\d+) q ([\d ]+) w ([\d ]+)", line)
        if m and label and label.endswith("rep 1"):
            kind, grid, cta, sm, rounds, cycles, ns, q, w = m.groups()
            cycles = [int(c) for c in cycles.split()]
            # The last two: the CTA's cycles and barrier-wait cycles by quarter of its rounds.
            kernels.setdefault((label[:-6], kind), []).append((int(cta), int(sm), int(rounds), cycles, int(ns), int(grid),
                                                               [int(c) for c in q.split()], [int(c) for c in w.split()]))
    for (label, kind), ctas in kernels.items():
        ctas.sort()
        grid = ctas[0][5]
        for cta, sm, rounds, cycles, ns, *_ in ctas:
            if cta in SAMPLED or cta == grid - 1:
                total = sum(cycles) or 1
                order = (0, 4, 1, 2, 3) if kind == "fwd" else range(7)  # the phases in round order
                shares = " ".join(f"{100 * cycles[k] / total:5.1f}" for k in order)
                print(f"{label:28} {kind} cta {cta:3d} rounds {rounds:3d} {ns / 1e3:8.1f} us  {shares}"
                      f"  | {ns / 1e3 / max(1, rounds):.2f} us a round")
        barrier = 0 if kind == "fwd" else 4
        waits = sorted((100 * c[barrier] / (sum(c) or 1), cta, sm) for cta, sm, _, c, *_ in ctas)
        q = [waits[int(f * (len(waits) - 1))][0] for f in (0, 0.1, 0.5, 0.9, 1)]
        print(f"{label:28} {kind} barrier wait over {len(waits)} CTAs: min {q[0]:.1f}%, p10 {q[1]:.1f}, median {q[2]:.1f}, "
              f"p90 {q[3]:.1f}, max {q[4]:.1f}; least waiting (cta/sm): "
              + " ".join(f"{cta}/{sm}" for _, cta, sm in waits[:8]))
        # Do the teams drift into waiting together over many rounds? The median CTA's cycles a
        # quarter of the rounds (relative to the first quarter) and its barrier share in each.
        qs = [(t, w) for *_, t, w in ctas]
        rel = [sorted(t[k] / (t[0] or 1) for t, _ in qs)[len(qs) // 2] for k in range(4)]
        share = [sorted(100 * w[k] / (t[k] or 1) for t, w in qs)[len(qs) // 2] for k in range(4)]
        print(f"{label:28} {kind} by quarter of the rounds (median CTA): cycles "
              + " ".join(f"{r:.2f}" for r in rel) + ", barrier wait " + " ".join(f"{v:.1f}%" for v in share))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("patch").add_argument("dst")
    sub.add_parser("run").add_argument("--only", action="append", help="the cases whose label contains this")
    sub.add_parser("table").add_argument("log", help="a saved output of `run`")
    args = parser.parse_args()
    if args.cmd == "patch":
        patch(args.dst)
    elif args.cmd == "table":
        table(open(args.log))
    else:
        # The kernels' printf lines reach stdout at synchronisations, interleaved with ours: let
        # the caller save them (`run > log`), then `table log`.
        run(args.only)


if __name__ == "__main__":
    main()
