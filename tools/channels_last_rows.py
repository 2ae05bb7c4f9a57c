"""Channels-last GN32+SiLU float16 forward on the SD VAE decoder's shapes (what its norms receive
under torch.compile, whose convolutions output channels-last), and on the video VAE's: GPU kernel
time of fusednorm (by kernel), fusednorm without the channels-last sweep (the split passes),
torch.compile and fusednorm on the same input made contiguous, L2
flushed before each call, overlapping kernels counted once; % of a device copy of the bytes read
and written, the copy measured in the same run. Prints a line a shape, then the rows as JSON.

    python tools/channels_last_rows.py [N] [--fusednorm-only]    # N: only the first N shapes

--clusters: the channels-last one-pass clusters' rows instead (docs/design.md, "Channels-last
one-pass"): the default plan, the same with FUSEDNORM_ONE_PASS_MAX_CLUSTER=1 (the split passes;
a tuning knob: build with CFLAGS=-DFUSEDNORM_TUNING_KNOBS), each with and without a residual, and
torch.compile.

--one-pass: the channels-last shared-memory forward's rows (clustered or not; docs/design.md,
"Channels-last one-pass"): fusednorm's kernel time with x rewritten by a copy before
each call (as by a convolution before the norm) and after the L2 flush, without and with a (C,)
input_bias. Run it on two builds in one call for an A/B. With --contiguous, the ChannelsFirst
one-pass kernels' rows instead (shared memory, clusters, registers).
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import fusednorm
from fusednorm import kernel_paths

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import kernel_profile  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_timeline import kernel_intervals  # noqa: E402

SHAPES = [(1, 512, 64, 64), (1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 256, 256), (1, 256, 512, 512),
          (1, 128, 512, 512), (1, 128, 1024, 1024), (8, 320, 64, 64), (2, 320, 64, 64), (1, 128, 20, 256, 256),
          (2, 32, 128, 128, 128)]


CLUSTER_ROWS = [((1, 512, 64, 64), torch.float16), ((2, 320, 64, 64), torch.float16), ((1, 512, 128, 128), torch.float16),
                ((4, 512, 64, 64), torch.float16), ((2, 640, 64, 64), torch.float16), ((2, 960, 64, 64), torch.float16),
                ((1, 512, 64, 64), torch.float32), ((2, 320, 64, 64), torch.float32)]


def cluster_rows(flush):
    """The --clusters table: a line a row, then the rows as JSON."""
    if not kernel_paths.tuning_knobs_compiled():
        print("this build ignores FUSEDNORM_ONE_PASS_MAX_CLUSTER (build with CFLAGS=-DFUSEDNORM_TUNING_KNOBS): "
              "the split-pass columns repeat the default", file=sys.stderr)
    rows = []
    for shape, dtype in CLUSTER_ROWS:
        torch._dynamo.reset()
        x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        w = torch.randn(shape[1], device="cuda", dtype=dtype)
        b = torch.randn_like(w)
        r = torch.randn_like(x)
        compiled = torch.compile(lambda x, w, b: F.silu(F.group_norm(x, 32, w, b)))
        row = dict(shape=shape, dtype=str(dtype).replace("torch.", ""),
                   plan=kernel_paths.plan(shape, 32, dtype, channels_last=True, activation="silu", device="cuda"))
        with torch.no_grad():
            for label, knob in (("default", None), ("split", "1")):
                if knob is not None:
                    os.environ["FUSEDNORM_ONE_PASS_MAX_CLUSTER"] = knob
                kernel_paths.reload_overrides()
                try:
                    row[label] = kernel_profile(lambda: fusednorm.group_norm(x, 32, w, b, activation="silu"), flush, 20)[0]
                    row[label + " + residual"] = kernel_profile(
                        lambda: fusednorm.group_norm(x, 32, w, b, activation="silu", residual=r), flush, 20)[0]
                finally:
                    os.environ.pop("FUSEDNORM_ONE_PASS_MAX_CLUSTER", None)
                    kernel_paths.reload_overrides()
            row["compile"] = kernel_profile(lambda: compiled(x, w, b), flush, 20)[0]
        rows.append(row)
        print(f"{str(shape):20s} {row['dtype']:8s} " + "  ".join(
            f"{k} {v:.4f}" for k, v in row.items() if isinstance(v, float)) + f"  ({row['plan']})", flush=True)
    print(json.dumps(rows))


ONE_PASS_ROWS = [((1, 512, 64, 64), torch.float16), ((1, 512, 128, 128), torch.float16),
                 ((1, 512, 128, 128), torch.bfloat16), ((2, 320, 64, 64), torch.float16),
                 ((2, 960, 64, 64), torch.float16), ((8, 320, 64, 64), torch.float16),
                 ((32, 256, 56, 56), torch.bfloat16)]

# --one-pass --contiguous: the ChannelsFirst one-pass kernels' rows (shared memory, clustered or
# not; the UNet's 8x8 and 16x16 groups in registers; attention's (N, C, L)).
CONTIGUOUS_ROWS = [((1, 512, 64, 64), torch.float16), ((2, 320, 64, 64), torch.float16),
                   ((8, 320, 64, 64), torch.float16), ((2, 640, 32, 32), torch.float16),
                   ((2, 1280, 16, 16), torch.float16), ((2, 1280, 8, 8), torch.float16),
                   ((8, 1280, 8, 8), torch.float16), ((16, 512, 4096), torch.bfloat16),
                   ((32, 256, 56, 56), torch.bfloat16), ((4, 64, 128, 128), torch.float32)]


def fusednorm_us(fn, before, iters=30):
    """Median us of fusednorm's kernels a call of fn() (their intervals' union), before() ahead of
    each call and not counted."""
    calls, current = [], None
    for start, end, name in kernel_intervals(fn, before, iters):
        if "fusednorm" not in name:
            current = None  # another kernel (before()'s) ends a call
        elif current is None:
            current = [start, end]
            calls.append(current)
        else:
            current[1] = max(current[1], end)
    return statistics.median(end - start for start, end in calls)


def one_pass_rows(flush, channels_last=True):
    """The --one-pass table: a line a row (us, written / flush), then the rows as JSON."""
    rows = []
    for shape, dtype in ONE_PASS_ROWS if channels_last else CONTIGUOUS_ROWS:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        source = x.clone()
        w, b, p = (torch.randn(shape[1], device="cuda", dtype=dtype) for _ in range(3))
        row = dict(shape=shape, dtype=str(dtype).replace("torch.", ""),
                   plan=kernel_paths.plan(shape, 32, dtype, channels_last=channels_last, activation="silu", device="cuda"))
        with torch.no_grad():
            for label, extra in (("plain", {}), ("input_bias", {"input_bias": p})):
                def call(extra=extra):
                    return fusednorm.group_norm(x, 32, w, b, activation="silu", **extra)
                row[label] = [fusednorm_us(call, lambda: x.copy_(source)), fusednorm_us(call, flush.bitwise_not_)]
        rows.append(row)
        print(f"{str(shape):18s} {row['dtype']:8s} plain {row['plain'][0]:6.2f} / {row['plain'][1]:6.2f}  "
              f"input_bias {row['input_bias'][0]:6.2f} / {row['input_bias'][1]:6.2f}  ({row['plan']})", flush=True)
    print(json.dumps(rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("N", nargs="?", type=int, help="only the first N shapes")
    parser.add_argument("--fusednorm-only", action="store_true", help="the first column alone (tuning runs)")
    parser.add_argument("--clusters", action="store_true", help="the channels-last clusters' rows instead")
    parser.add_argument("--one-pass", action="store_true", help="the channels-last one-pass rows, written / flushed")
    parser.add_argument("--contiguous", action="store_true", help="with --one-pass: the ChannelsFirst one-pass rows")
    args = parser.parse_args()
    shapes = SHAPES[:args.N] if args.N is not None else SHAPES
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    if args.clusters:
        return cluster_rows(flush)
    if args.one_pass:
        return one_pass_rows(flush, channels_last=not args.contiguous)
    src = torch.empty(1 << 28, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    bandwidth = 2 * src.numel() * 2 / copy_ms / 1e9  # TB/s
    del src, dst
    print(f"copy {bandwidth:.2f} TB/s")
    rows = []
    for shape in shapes:
        torch._dynamo.reset()
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        x = torch.randn(shape, device="cuda", dtype=torch.float16).to(memory_format=fmt)
        w = torch.randn(shape[1], device="cuda", dtype=torch.float16)
        b = torch.randn_like(w)
        compiled = torch.compile(lambda x, w, b: F.silu(F.group_norm(x, 32, w, b)))
        ideal = 2 * x.numel() * 2 / bandwidth / 1e9
        def ours(x=x):
            return fusednorm.group_norm(x, 32, w, b, activation="silu")

        with torch.no_grad():
            f_ms, f_kernels = kernel_profile(ours, flush, iters=10)
            if args.fusednorm_only:
                print(f"{str(shape):22s} fusednorm {f_ms:.4f} ({ideal / f_ms:4.0%})  "
                      f"{ {k: round(v, 4) for k, v in f_kernels.items()} }", flush=True)
                continue
            with kernel_paths.selected("nocolssweep"):
                s_ms, _ = kernel_profile(ours, flush, iters=10)
            c_ms, c_kernels = kernel_profile(lambda: compiled(x, w, b), flush, iters=10)
            xc = x.contiguous()
            fc_ms, _ = kernel_profile(lambda: ours(xc), flush, iters=10)
        row = dict(shape=shape, fusednorm=f_ms, split=s_ms, compile=c_ms, contiguous=fc_ms, ideal=ideal,
                   fusednorm_kernels={k: round(v, 4) for k, v in f_kernels.items()},
                   compile_kernels={k: round(v, 4) for k, v in c_kernels.items()})
        rows.append(row)
        print(f"{str(shape):22s} fusednorm {f_ms:.4f} ({ideal / f_ms:4.0%})  split {s_ms:.4f}  compile {c_ms:.4f} ({ideal / c_ms:4.0%})  "
              f"fusednorm contiguous {fc_ms:.4f} ({ideal / fc_ms:4.0%})  {row['fusednorm_kernels']}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
