"""Where the channels-last shared-memory forward (group_norm_cols_one_pass_kernel; the SD VAE's
(1,512,64,64) and (1,512,128,128) norms run it in clusters of 8) spends its time, phase by phase:
per-CTA `globaltimer` stamps of thread 0, printed with the CTA's SM by an instrumented build of
cols_one_pass_kernel.cuh. Three steps (the third on the GPU machine), as tools/sweep_phase_clocks.py:

    python tools/cols_phase_clocks.py patch /tmp/cols_clocks   # a copy of the tree, instrumented
    (cd /tmp/cols_clocks && python setup.py build_ext --inplace)
    mkdir -p /tmp/cols_pkg && ln -sfn /tmp/cols_clocks/ops /tmp/cols_pkg/fusednorm
    PYTHONPATH=/tmp/cols_pkg python tools/cols_phase_clocks.py run > log; python tools/cols_phase_clocks.py table log

(or build the copy with tools/build_for_gpu_machine.sh run from it, and carry its gpu_build.)
`run` calls fusednorm.group_norm (fp16 GN32+SiLU, channels-last, without input_bias) once per case
with eps = 0.125, which the stamps print for, after warm-up calls and either a copy that rewrites x
("written", as a convolution before the norm leaves it) or a reading L2 flush ("flush"). `table`
prints, over the CTAs of each case, when they began after the first (the launch's ramp), and the
spread of: the copy's issue, the wait for the thread's copies, the moments pass, the CTA's two
block sums, the cluster's exchange and merge (st.async stores, the wait for the others', butterflies),
and the output loop; then, by how many CTAs an SM held, when those SMs' CTAs ended (the cluster
scheduler gives some SMs three CTAs, and they end last: docs/design.md, "Channels-last
one-pass").
Stamps are in ns from the first CTA's start; the printf after the last stamp delays the kernels
after it, so only this kernel is stamped (the instrumented kernel spills 16 bytes under its
80-register cap). The patch inserts the stamps at fixed lines of the source: it stops with the
line it could not find when the kernel changes, and must then be updated with it
(tests/test_suite_hygiene.py runs it).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_phase_clocks  # noqa: E402  (its run and its patch / run / table command line)
from team_phase_clocks import after, before  # noqa: E402

COLS_ONE_PASS = os.path.join("csrc", "cuda", "cols_one_pass_kernel.cuh")
EPS = sweep_phase_clocks.EPS  # the call whose stamps are printed (run's)

CLOCK = r'''__device__ __forceinline__ unsigned long long cols_clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

'''

EDITS = [
    before("// Rows whose residual / multiplier packs a thread of group_norm_cols_one_pass_kernel loads at once.",
           CLOCK),
    after("  P* buffers = reinterpret_cast<P*>(one_pass_smem);  // slabs dense (ColsPlace::dense)\n",
          "  unsigned long long cs[7] = {};\n  cs[0] = cols_clock_ns();\n"),
    after("  copy_in(first_item, buffers);\n", "  cs[1] = cols_clock_ns();\n"),
    before("    acc_t KL[kBias ? V : 1];\n", "    cs[2] = cols_clock_ns();\n"),
    before("    const acc_t total = static_cast<acc_t>(a.len);\n    const PartMoments<acc_t> part =\n",
           "    cs[3] = cols_clock_ns();\n"),
    before("    const BlockMoments<acc_t> gm =\n        one_pass_cluster_moments(part,", "    cs[4] = cols_clock_ns();\n"),
    after("    const acc_t var = gm.m2 / total;\n", "    cs[5] = cols_clock_ns();\n"),
    ("      }\n    }\n  }\n}\n\n// The channels-last shared-memory forward as planned",
     "      }\n    }\n  }\n"
     "  cs[6] = cols_clock_ns();\n"
     f"  if (a.eps == {EPS}f && threadIdx.x == 0) {{\n"
     "    unsigned smid;\n    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "    printf(\"CP %d %u %llu %llu %llu %llu %llu %llu %llu\\n\", (int)blockIdx.x, smid, cs[0], cs[1], cs[2],\n"
     "        cs[3], cs[4], cs[5], cs[6]);\n  }\n}\n\n// The channels-last shared-memory forward as planned"),
]

SHAPES = ["1,512,64,64", "1,512,128,128", "2,320,64,64"]

# (name, first stamp, last stamp) over the printed stamps cs0..cs6 (indices 0-6)
PHASES = [
    ("copy issue", 0, 1),
    ("copy wait", 1, 2),
    ("moments pass", 2, 3),
    ("block sums", 3, 4),
    ("cluster merge", 4, 5),
    ("output", 5, 6),
]


def table(lines):
    sweep_phase_clocks.phase_table(lines, "CP", PHASES, 6, with_sm=True)


if __name__ == "__main__":
    sweep_phase_clocks.main(__doc__, COLS_ONE_PASS, EDITS, SHAPES, table)
