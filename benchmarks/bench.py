"""Times fusednorm against PyTorch eager and torch.compile (and Liger-Kernel when installed).

On a GPU: the suite of the performance issue, forward and backward, with the device-to-device
copy bandwidth measured in the same run as the roofline. On a CPU: a small suite against ATen,
the implementations timed in turns, with freed memory kept in the process (see
keep_freed_memory_in_process); the rows fit in the last-level cache, so each row's roofline is a
copy of its own bytes timed in turns with it (see cpu_copy_roofline), not the DRAM copy.
Prints a table (ms, effective GB/s, % of roofline, speedups) and writes it, JSON and an SVG chart
(benchmarks/chart.py, no plotting library needed) under --out. The JSON is rewritten after every
case (with "complete": false until the end), so a run cut short keeps what it measured.

    python benchmarks/bench.py [--out DIR] [--device cuda|cpu] [--no-compile] [--filter TEXT] [--budget S]
"""

import argparse
import ctypes
import glob
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import fusednorm
from chart import chart_from_results


@dataclass
class Case:
    name: str
    shape: tuple
    dtype: torch.dtype
    kind: str  # "group" or "instance"
    groups: int = 32
    affine: bool = True
    channels_last: bool = False
    # The epilogue: fusednorm fuses it into the norm; eager and compile run the composed code.
    activation: Optional[str] = None
    operands: tuple = ()  # of "scale", "shift", "residual", "multiplier"
    same_operand: bool = False  # residual and multiplier are one tensor (problem 3's (h + y) * y)

    def plan_operands(self) -> List[str]:
        """The operands as fusednorm.kernel_paths.plan names them."""
        return ["multiplier=residual"] if self.same_operand else list(self.operands)


def gpu_suite() -> List[Case]:
    cases = [
        Case("GroupNorm problem", (112, 64, 512, 512), torch.float32, "group", groups=8),
        Case("InstanceNorm problem", (112, 64, 512, 512), torch.float32, "instance", affine=False),
    ]
    for batch in (2, 8):
        for c, hw in ((320, 64), (640, 32), (1280, 16), (1280, 8)):
            for cl in (False, True):
                cases.append(Case(f"SD UNet GN+SiLU b{batch}", (batch, c, hw, hw), torch.float16, "group",
                                  channels_last=cl, activation="silu"))
    for c, hw in ((128, 512), (256, 256), (512, 128)):
        cases.append(Case("VAE GN+SiLU", (1, c, hw, hw), torch.bfloat16, "group", activation="silu"))
    cases.append(Case("VAE GN+SiLU", (1, 128, 1024, 1024), torch.float16, "group", activation="silu"))
    # What a VAE's norms receive under torch.compile, whose convolutions output channels-last.
    cases.append(Case("VAE GN+SiLU", (1, 128, 512, 512), torch.float16, "group", activation="silu",
                      channels_last=True))
    # Video VAEs (HunyuanVideo / CogVideoX-style decoders): GroupNorm over (C, T, H, W) groups.
    for shape in ((1, 128, 20, 256, 256), (1, 512, 16, 90, 160)):
        cases.append(Case("Video VAE GN+SiLU", shape, torch.bfloat16, "group", activation="silu"))
    cases.append(Case("Attention GN", (16, 512, 4096), torch.bfloat16, "group"))
    for cl in (False, True):
        cases.append(Case("InstanceNorm3d affine", (2, 32, 128, 128, 128), torch.float32, "instance", channels_last=cl))
    # Fused epilogues beyond SiLU.
    for c, hw in ((320, 64), (1280, 16)):
        cases.append(Case("SD AdaGN+SiLU b2", (2, c, hw, hw), torch.float16, "group", activation="silu",
                          operands=("scale", "shift")))
    cases.append(Case("ResNet GN+residual+ReLU", (16, 256, 56, 56), torch.bfloat16, "group", activation="relu",
                      operands=("residual",), channels_last=True))
    cases.append(Case("problem 3 tail (h+y)*y", (1024, 8192), torch.float32, "group", groups=1, affine=False,
                      operands=("residual", "multiplier"), same_operand=True))
    return cases


def cpu_suite() -> List[Case]:
    return [
        Case("GN CPU", (8, 320, 32, 32), torch.float32, "group"),
        Case("GN CPU", (8, 320, 32, 32), torch.float32, "group", channels_last=True),
        Case("IN CPU", (4, 64, 64, 64), torch.float32, "instance", affine=False),
        # bfloat16 on the CPU converts in vectors (it had been 3-4x ATen's time element by element).
        Case("GN CPU bf16", (8, 320, 32, 32), torch.bfloat16, "group"),
        Case("GN CPU bf16", (8, 320, 32, 32), torch.bfloat16, "group", channels_last=True),
        Case("GN+SiLU CPU", (8, 320, 32, 32), torch.float32, "group", activation="silu"),
        Case("AdaGN+SiLU CPU", (8, 320, 32, 32), torch.float32, "group", activation="silu", operands=("scale", "shift")),
        Case("problem 3 tail CPU", (256, 8192), torch.float32, "group", groups=1, affine=False,
             operands=("residual", "multiplier"), same_operand=True),
    ]


ACTIVATIONS = {None: lambda t: t, "silu": F.silu, "relu": F.relu, "gelu": F.gelu, "mish": F.mish}


def composed_epilogue(z, case: Case, ops: Dict[str, torch.Tensor]):
    """The epilogue as a model writes it: one elementwise op (one pass over memory) per step."""
    shape = z.shape[:2] + (1,) * (z.dim() - 2)
    if "scale" in ops:
        z = z * (1 + ops["scale"].reshape(shape))
    if "shift" in ops:
        z = z + ops["shift"].reshape(shape)
    if "residual" in ops:
        z = z + ops["residual"]
    z = ACTIVATIONS[case.activation](z)
    if "multiplier" in ops:
        z = z * ops["multiplier"]
    return z


def implementations(case: Case, with_compile: bool) -> Dict[str, Callable]:
    if case.kind == "group":
        def eager(x, w, b, ops):
            return composed_epilogue(F.group_norm(x, case.groups, w, b, 1e-5), case, ops)

        def ours(x, w, b, ops):
            return fusednorm.group_norm(x, case.groups, w, b, 1e-5, activation=case.activation, **ops)
    else:
        def eager(x, w, b, ops):
            return composed_epilogue(F.instance_norm(x, weight=w, bias=b, eps=1e-5), case, ops)

        def ours(x, w, b, ops):
            return fusednorm.instance_norm(x, weight=w, bias=b, eps=1e-5, activation=case.activation, **ops)
    impls = {"fusednorm": ours, "eager": eager}
    if case.activation is not None or case.operands:
        # The fused-ops target: a fused call costs the plain norm plus its operands' bytes.
        if case.kind == "group":
            impls["plain norm"] = lambda x, w, b, ops: fusednorm.group_norm(x, case.groups, w, b, 1e-5)
        else:
            impls["plain norm"] = lambda x, w, b, ops: fusednorm.instance_norm(x, weight=w, bias=b, eps=1e-5)
    if with_compile:
        # Backward is timed by calling it repeatedly on one graph (retain_graph=True), which
        # compiled backward graphs with donated buffers refuse.
        functorch_config = getattr(getattr(torch, "_functorch", None), "config", None)
        if functorch_config is not None and hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        # Every case's `eager` shares one code object: without a reset, Dynamo's recompile limit
        # (8 per code object) is reached after a few cases and later ones silently run eager.
        torch._dynamo.reset()
        impls["compile"] = torch.compile(eager)
    try:
        from liger_kernel.ops.group_norm import LigerGroupNormFunction  # type: ignore

        if case.kind == "group" and case.affine and not case.channels_last:
            impls["liger"] = lambda x, w, b, ops: composed_epilogue(
                LigerGroupNormFunction.apply(x, w, b, x.shape[1], case.groups, 1e-5), case, ops)
    except Exception:
        pass
    return impls


def kernel_name(event_name: str) -> str:
    """A CUDA kernel's name as the profiler reports it, templates and arguments left out."""
    m = re.search(r"(\w+_kernel)\b", event_name)
    return m.group(1) if m else event_name.split("(")[0].split("<")[0]


def kernel_profile(fn, flush, iters=20):
    """(milliseconds of GPU kernel time an iteration of fn(), {kernel name: milliseconds an
    iteration}), by torch.profiler's CUDA events, host time not counted, flush.bitwise_not_() (an
    L2 flush) before each iteration and excluded. Kernels that overlap (a programmatic dependent
    launch starts before its primary ends) count once in the total: it is the union of the
    kernels' intervals, not the sum of their durations (the per-kernel times are durations)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and "bitwise_not" not in e.name]
    total_us, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events):
        if stop > end:
            total_us += stop - max(start, end)
            end = stop
    by_kernel: Dict[str, float] = {}
    for e in events:
        name = kernel_name(e.name)
        by_kernel[name] = by_kernel.get(name, 0.0) + (e.time_range.end - e.time_range.start) / iters / 1000.0
    return total_us / iters / 1000.0, by_kernel


def kernel_ms(fn, flush, iters=20):
    """Milliseconds of GPU kernel time an iteration of fn() (kernel_profile's total)."""
    return kernel_profile(fn, flush, iters)[0]


def call_case(shape, groups, dtype, activation=None, channels_last=False, operands=()) -> Case:
    """The Case of a kernel-time tool's call (tools/kernel_time.py, tools/knob_sweep.py).
    `operands`: epilogue operand names ("residual", "multiplier", ...), or ("same",) for one tensor
    as residual and multiplier (problem 3's (h + y) * y)."""
    same = tuple(operands) == ("same",)
    return Case("call", tuple(shape), dtype, "group", groups, channels_last=channels_last, activation=activation,
                operands=("residual", "multiplier") if same else tuple(operands), same_operand=same)


def fused_call(shape, groups, dtype, activation=None, channels_last=False, operands=(), backward=False,
               device="cuda"):
    """A fusednorm.group_norm call on random inputs (make_inputs / grad_inputs of call_case's Case):
    fn() runs the forward under no_grad or, with `backward`, the backward (autograd.grad of one
    random dy, the graph kept for repeated calls)."""
    case = call_case(shape, groups, dtype, activation, channels_last, operands)
    x, w, b, ops = make_inputs(case, device)
    if not backward:

        def forward():
            with torch.no_grad():
                return fusednorm.group_norm(x, groups, w, b, activation=activation, **ops)

        return forward
    xg, wg, bg, opsg, leaves = grad_inputs(case, x, w, b, ops)
    y = fusednorm.group_norm(xg, groups, wg, bg, activation=activation, **opsg)
    dy = torch.randn_like(y)
    return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)


def timer(device: str):
    """Median milliseconds of fn(); on CUDA with CUDA events after an L2 flush."""
    if device == "cuda":
        try:
            from triton.testing import do_bench

            def do_bench_time(fn):
                # do_bench repeats rep / (its estimate of a call) times: at least 10 for calls
                # longer than 20 ms too (a 140 ms video decode got one repeat with rep=200).
                fn()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                estimate = start.elapsed_time(end)
                return do_bench(fn, warmup=max(25, 2 * estimate), rep=max(200, 10 * estimate),
                                return_mode="median")

            return do_bench_time
        except ImportError:
            pass

        def cuda_time(fn, reps=50):
            flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
            for _ in range(5):
                fn()
            times = []
            for _ in range(reps):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)

        return cuda_time

    def cpu_time(fn, reps=30, warmup=3):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_time


def keep_freed_memory_in_process() -> bool:
    """On glibc, keeps freed memory in the process (no trimming, no mmap a large block), as a
    caching allocator would. Otherwise a call can page-fault its outputs afresh, depending on
    what the calls before it freed: on this 2-core machine F.silu(F.group_norm(x)) on
    (8, 320, 32, 32) took 5.9 ms instead of 0.56, and fusednorm's plain norm timed in turns with
    it 2.1 ms instead of 0.17; which implementation paid depended on the order of allocations,
    not on its kernel. True where glibc's mallopt took both settings."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return libc.mallopt(m_trim_threshold, 2**31 - 1) == 1 and libc.mallopt(m_mmap_max, 0) == 1


def warn_if_busy() -> None:
    """Says so when the machine has more runnable threads than cores. A call that runs two OpenMP
    threads then waits whenever one of them is descheduled: on a 2-core machine at a load average
    of 15, calls took either ~0.3 ms or 20-25 ms (a scheduler time slice), fusednorm and ATen
    alike, and the table measured the machine, not the kernels."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(f"load average {load:.1f} on {cores} cores, {torch.get_num_threads()} threads a call")
    if load > cores:
        print(f"  warning: the machine is busy (load {load:.1f} > {cores} cores): CPU timings will be "
              "inflated and bimodal; rerun on an idle machine", file=sys.stderr)


def interleaved_cpu_times(fns: Dict[str, Callable], reps: int = 40) -> Dict[str, float]:
    """Median milliseconds of each fn, timed in turns (a, b, c, b, c, a, ...): this 2-core machine's
    load drifts (one implementation's timings spread up to 1.5x between runs), and timed one after
    the other the implementations met different loads; in turns the drift falls on all alike."""
    names = list(fns)
    for name in names:
        for _ in range(3):
            fns[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def last_level_cache_bytes() -> int:
    """The CPU's largest cache, from sysfs (32 MB if unknown)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def copy_bandwidth(device: str, measure) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read plus bytes written, over buffers four
    times the size of any cache (1 GB each on a GPU), so that it is the memory's bandwidth."""
    nbytes = 1 << 30 if device == "cuda" else max(4 * last_level_cache_bytes(), 64 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def cpu_copy_roofline(nbytes: int) -> Callable:
    """A copy of `nbytes` (read plus written) to time in turns with a row's implementations: its
    roofline. The CPU rows' tensors (10 MB and less) stay in the last-level cache between calls,
    where the norm runs 3-4x faster than the DRAM copy allows; against a copy of the same bytes,
    in the same cache state, "% roof" means what it means on the GPU."""
    src = torch.randn(max(nbytes // 8, 1))
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


@dataclass
class Row:
    case: str
    shape: str
    dtype: str
    layout: str
    direction: str
    ms: Dict[str, float] = field(default_factory=dict)
    gbps: float = 0.0
    roofline_pct: float = 0.0
    roofline_gbps: float = 0.0  # the copy bandwidth this row is compared with


def make_inputs(case: Case, device: str):
    """x, weight, bias and the epilogue operands of a case, on random data."""
    x = torch.randn(case.shape, dtype=case.dtype, device=device)
    if case.channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    C = case.shape[1]
    w = torch.randn(C, dtype=case.dtype, device=device) if case.affine else None
    b = torch.randn(C, dtype=case.dtype, device=device) if case.affine else None
    ops = {}
    for name in case.operands:
        if name in ("scale", "shift"):
            ops[name] = 0.1 * torch.randn(case.shape[0], C, dtype=case.dtype, device=device)
        elif name == "input_bias":  # a convolution's bias plus a time embedding, (N, C)
            ops[name] = torch.randn(case.shape[0], C, dtype=case.dtype, device=device)
        elif case.same_operand and ops.get("residual") is not None:
            ops[name] = ops["residual"]
        else:
            ops[name] = torch.randn_like(x)
    return x, w, b, ops


def grad_inputs(case: Case, x, w, b, ops):
    """Copies of x, weight, bias and the operands that require grad (problem 3's residual and
    multiplier stay one tensor), and the distinct leaves among them to differentiate."""
    xg = x.detach().requires_grad_()
    wg, bg = (None if p is None else p.detach().requires_grad_() for p in (w, b))
    opsg = {k: t.detach().requires_grad_() for k, t in ops.items()}
    if case.same_operand and "multiplier" in opsg:
        opsg["multiplier"] = opsg["residual"]
    leaves = [xg] + [p for p in (wg, bg) if p is not None] + list({id(t): t for t in opsg.values()}.values())
    return xg, wg, bg, opsg, leaves


def run_case(case: Case, device: str, measure, roofline: float, with_compile: bool) -> List[Row]:
    x, w, b, ops = make_inputs(case, device)
    elem = x.element_size()
    numel = x.numel()
    # Tensor-sized operands read (forward) and, with their gradients, read and written (backward).
    big = len({id(t) for k, t in ops.items() if k in ("residual", "multiplier")})
    rows = []
    layout = "channels_last" if case.channels_last else "contiguous"
    fwd = Row(case.name, str(tuple(case.shape)), str(case.dtype).replace("torch.", ""), layout, "forward")
    bwd = Row(case.name, str(tuple(case.shape)), str(case.dtype).replace("torch.", ""), layout, "backward")
    def backward_call(fn):
        xg, wg, bg, opsg, leaves = grad_inputs(case, x, w, b, ops)
        y = fn(xg, wg, bg, opsg)
        dy = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True, allow_unused=True)

    if device == "cpu":
        # Every implementation's calls set up first, then timed in turns (interleaved_cpu_times).
        forward, backward = {}, {}
        for name, fn in implementations(case, with_compile).items():
            try:
                with torch.no_grad():
                    fn(x, w, b, ops)  # compiles, or fails, before any timing
                forward[name] = (lambda fn=fn: fn(x, w, b, ops))
                backward[name] = backward_call(fn)
                backward[name]()
            except Exception as e:  # one implementation failing must not hide the others
                forward.pop(name, None)
                backward.pop(name, None)
                print(f"  {name} failed on {case.name} {case.shape}: {type(e).__name__}: {e}", file=sys.stderr)
        # The roofline: copies of each direction's bytes, in turns with the implementations.
        forward["copy"] = cpu_copy_roofline((2 + big) * numel * elem)
        backward["copy"] = cpu_copy_roofline((3 + 2 * big) * numel * elem)
        # torch.compile's calls apart, after the others: timed in turns with them, they slowed
        # every other column of the row (the channels-last forward 0.23 -> 0.41 ms).
        for group in ([n for n in forward if n != "compile"], [n for n in forward if n == "compile"]):
            if not group:
                continue
            with torch.no_grad():
                fwd.ms.update(interleaved_cpu_times({n: forward[n] for n in group}))
            bwd.ms.update(interleaved_cpu_times({n: backward[n] for n in group}))
        for row, passes in ((fwd, 2 + big), (bwd, 3 + 2 * big)):
            copy_ms = row.ms.pop("copy")
            row.roofline_gbps = passes * numel * elem / (copy_ms * 1e-3) / 1e9
    else:
        # One implementation at a time: the large rows' graphs do not fit the GPU together.
        for name, fn in implementations(case, with_compile).items():
            try:
                with torch.no_grad():
                    fwd.ms[name] = measure(lambda: fn(x, w, b, ops))
                call = backward_call(fn)
                bwd.ms[name] = measure(call)
                del call
            except Exception as e:  # one implementation failing must not hide the others
                print(f"  {name} failed on {case.name} {case.shape}: {type(e).__name__}: {e}", file=sys.stderr)
            torch.cuda.empty_cache()
    # Floor: forward reads x and the operands and writes y; backward reads x, dy and the operands
    # and writes dx and the operands' gradients.
    for row, passes in ((fwd, 2 + big), (bwd, 3 + 2 * big)):
        row.roofline_gbps = row.roofline_gbps or roofline
        if "fusednorm" in row.ms:
            row.gbps = passes * numel * elem / (row.ms["fusednorm"] * 1e-3) / 1e9
            # A norm reads x at least as often as a copy does, so a share above 100% is timing
            # noise against the copy (seen within ~5% on the CPU): reported as 100%.
            row.roofline_pct = min(100.0, 100 * row.gbps / row.roofline_gbps)
        rows.append(row)
    return rows


def problem3_model_rows(device: str, measure, with_compile: bool) -> List[Row]:
    """The third benchmark problem end to end (Linear(8192, 8192) then the fused tail): the
    reference Model eager and compiled against ModelNew. GEMM-bound: no GB/s."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "export_examples"))
    from benchmark_problems import LinearInstanceNormModel, LinearInstanceNormModelNew

    rows_n = 1024 if device == "cuda" else 64
    ref = LinearInstanceNormModel(8192, 8192).to(device)
    new = LinearInstanceNormModelNew(8192, 8192).to(device)
    new.load_state_dict(ref.state_dict(), strict=False)
    x, y = torch.rand(rows_n, 8192, device=device), torch.rand(rows_n, 8192, device=device)
    row = Row("problem 3 full model", str((rows_n, 8192)), "float32", "contiguous", "forward")
    impls = {"fusednorm": new, "eager": ref}
    if with_compile:
        impls["compile"] = torch.compile(ref)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference warns about num_features on every call
        for name, model in impls.items():
            row.ms[name] = measure(lambda: model(x, y))
    return [row]


def print_table(rows: List[Row], impls: List[str]) -> str:
    head = ["case", "shape", "dtype", "layout", "dir"] + [f"{i} ms" for i in impls] + ["GB/s", "% roof", "x eager", "x compile"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours = r.ms.get("fusednorm")
        cells = [r.case, r.shape, r.dtype, r.layout, r.direction]
        cells += [f"{r.ms[i]:.4f}" if i in r.ms else "-" for i in impls]
        cells += [f"{r.gbps:.0f}", f"{r.roofline_pct:.0f}%"] if r.gbps else ["-", "-"]
        for base in ("eager", "compile"):
            cells.append(f"{r.ms[base] / ours:.2f}" if ours and base in r.ms else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def geomean(values):
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (saves minutes of compile time)")
    parser.add_argument("--filter", default="", help="only cases whose name matches this regular expression")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="start no new case after this many seconds (results so far are kept)")
    args = parser.parse_args()

    device = args.device
    if device == "cpu":
        kept = keep_freed_memory_in_process()
        print(f"glibc keeps freed memory in the process: {'yes' if kept else 'no (not glibc?)'}")
        warn_if_busy()
    measure = timer(device)
    roofline = copy_bandwidth(device, measure)
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    where = "(the roofline)" if device == "cuda" else "(memory; each CPU row's roofline is a copy of its own bytes)"
    print(f"fusednorm benchmark on {card}, torch {torch.__version__}; copy bandwidth {roofline:.0f} GB/s {where}")
    cases = [c for c in (gpu_suite() if device == "cuda" else cpu_suite()) if re.search(args.filter, c.name)]
    rows = []
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    json_path = os.path.join(args.out, f"bench_{device}.json")

    def save(complete: bool) -> None:
        with open(json_path + ".tmp", "w") as f:
            json.dump({"date": stamp, "card": card, "torch": torch.__version__, "roofline_gbps": roofline,
                       "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                       "complete": complete, "rows": [asdict(r) for r in rows]}, f, indent=1)
        os.replace(json_path + ".tmp", json_path)

    started = time.time()
    for case in cases:
        if time.time() - started > args.budget:
            print(f"  time budget spent: skipping {case.name} {case.shape}", flush=True)
            continue
        print(f"  {case.name} {case.shape} {case.dtype} {'channels_last' if case.channels_last else ''}", flush=True)
        rows += run_case(case, device, measure, roofline, not args.no_compile)
        save(complete=False)
    if re.search(args.filter, "problem 3 full model") and time.time() - started <= args.budget:
        print("  problem 3 full model", flush=True)
        rows += problem3_model_rows(device, measure, not args.no_compile)
    impls = [i for i in ("fusednorm", "plain norm", "eager", "compile", "liger") if any(i in r.ms for r in rows)]
    table = print_table(rows, impls)
    print(table)
    for direction in ("forward", "backward"):
        sel = [r for r in rows if r.direction == direction and "fusednorm" in r.ms and r.case != "problem 3 full model"]
        for base in ("eager", "compile"):
            ratios = [r.ms[base] / r.ms["fusednorm"] for r in sel if base in r.ms]
            if ratios:
                print(f"geomean speedup {direction} vs {base}: {geomean(ratios):.2f}x ({len(ratios)} rows)")

    save(complete=True)
    roof_note = ("% roof: against a copy of the row's own bytes timed in turns with it (the rows fit in "
                 "the cache); capped at 100%" if device == "cpu" else "% roof: against the copy bandwidth above")
    with open(os.path.join(args.out, f"bench_{device}.md"), "w") as f:
        f.write(f"{stamp}, {card}, torch {torch.__version__}, copy bandwidth {roofline:.0f} GB/s\n"
                f"{roof_note}\n\n{table}\n")
    if rows:
        svg_path = os.path.join(args.out, f"bench_{device}.svg")
        with open(svg_path, "w") as f:
            f.write(chart_from_results({"date": stamp, "card": card, "torch": torch.__version__,
                                        "rows": [asdict(r) for r in rows]}, impls))
        print(f"chart: {svg_path}")


if __name__ == "__main__":
    main()
