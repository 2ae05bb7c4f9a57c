"""Host time per call: fusednorm against the eager composition on an input so small that the
kernels cost next to nothing, forward with grad and backward (torch.autograd.grad), plain and
fused (GN+SiLU), with the raw kernel ops beside them, and the modules (fusednorm.nn against
torch.nn) under no_grad. The small rows of the GPU suite are bound by
this time, not by their kernels.

    python tools/host_overhead.py [--device cpu|cuda] [--threads 1] [--reps 2000]
        [--shape 2,320,64,64 --dtype float16 --channels-last] [--enqueue] [--compiled]

Calls are timed in turns (the order rotating) and each figure is the median in microseconds; on
CUDA each call is followed by a synchronize, so a figure is its host time plus one tiny kernel's
latency. With --enqueue the clock stops when the call returns (the synchronize comes after it,
so each call starts on an idle GPU): the host time alone, which is what bounds a call whose
kernels take less, on an input of any size (--shape).

With --compiled, instead: two norm chains of a UNet compiled under Inductor (`torch.compile`) and
under `fusion.backend()`, under no_grad: `silu(group_norm(conv(h) + temb))` (on 8 MiB or more the
backend gives the convolution's bias and the embedding to the fused op as input_bias; under that it
leaves the chain to Inductor, which computes them in its norm kernels: the chains each rewrote are
printed) and `silu(group_norm(x))`. In a step without CUDA graphs whose host is the bound
(the SD1.5 UNet at batch 2), what a fused chain costs the host over Inductor's kernels is what the
backend's rewrite costs the step (docs/performance.md, "End to end").
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fusednorm


def timed_in_turns(fns, reps, sync, enqueue=False):
    times = {k: [] for k in fns}
    keys = list(fns)
    for _ in range(50):
        for f in fns.values():
            f()
    sync()
    for i in range(reps):
        for k in keys[i % len(keys):] + keys[:i % len(keys)]:
            t0 = time.perf_counter()
            fns[k]()
            if not enqueue:
                sync()
            times[k].append(time.perf_counter() - t0)
            if enqueue:
                sync()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def no_grad(f):
    """f() under torch.no_grad(), as a model's inference calls it."""
    def call():
        with torch.no_grad():
            return f()
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--shape", default="2,64,2,2", help="input shape, comma-separated (C a multiple of 32)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--enqueue", action="store_true", help="time until the call returns, not until the GPU is done")
    parser.add_argument("--compiled", action="store_true",
                        help="compiled chains, Inductor against the fusion backend, in place of the eager calls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    torch.manual_seed(0)
    G = 32
    shape = tuple(int(v) for v in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    x = torch.randn(shape, device=device, dtype=dtype)
    if args.channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    if args.compiled:
        return compiled_chains(x, G, args, sync)
    w, b = torch.randn(shape[1], device=device, dtype=dtype), torch.randn(shape[1], device=device, dtype=dtype)
    dy = torch.randn_like(x)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    leaves = [xg, wg, bg]
    graphs = {
        "fused": fusednorm.group_norm(xg, G, wg, bg, activation="silu"),
        "eager fused": F.silu(F.group_norm(xg, G, wg, bg)),
        "plain": fusednorm.group_norm(xg, G, wg, bg),
        "eager plain": F.group_norm(xg, G, wg, bg),
    }
    _, mean, rstd = torch.ops.fusednorm.group_norm_forward(x, G, w, b, 1e-5)
    N, C, HxW = x.shape[0], x.shape[1], x.numel() // (x.shape[0] * x.shape[1])
    # ATen's CUDA kernel takes contiguous input only (F.group_norm makes it so).
    xa, dya = x.contiguous(), dy.contiguous()
    _, aten_mean, aten_rstd = torch.ops.aten.native_group_norm(xa, w, b, N, C, HxW, G, 1e-5)
    # The modules under no_grad, as a model's eager inference calls them (fusednorm.convert swaps
    # the first for the second; the activation folds in only where it provably may).
    gn = torch.nn.GroupNorm(G, shape[1], device=device, dtype=dtype)
    silu = torch.nn.SiLU()
    fgn, fgn_silu = fusednorm.nn.GroupNorm(G, shape[1], device=device, dtype=dtype), \
        fusednorm.nn.GroupNorm(G, shape[1], device=device, dtype=dtype, activation="silu")

    fns = {
        "fusednorm.nn.GroupNorm, no grad": no_grad(lambda: fgn(x)),
        "nn.GroupNorm, no grad": no_grad(lambda: gn(x)),
        "fusednorm.nn.GroupNorm(silu), no grad": no_grad(lambda: fgn_silu(x)),
        "nn.GroupNorm + nn.SiLU, no grad": no_grad(lambda: silu(gn(x))),
        "fusednorm GN+SiLU forward, grad": lambda: fusednorm.group_norm(xg, G, wg, bg, activation="silu"),
        "eager GN+SiLU forward, grad": lambda: F.silu(F.group_norm(xg, G, wg, bg)),
        "fusednorm GN forward, grad": lambda: fusednorm.group_norm(xg, G, wg, bg),
        "eager GN forward, grad": lambda: F.group_norm(xg, G, wg, bg),
        "fusednorm GN+SiLU backward": lambda: torch.autograd.grad(graphs["fused"], leaves, dy, retain_graph=True),
        "eager GN+SiLU backward": lambda: torch.autograd.grad(graphs["eager fused"], leaves, dy, retain_graph=True),
        "fusednorm GN backward": lambda: torch.autograd.grad(graphs["plain"], leaves, dy, retain_graph=True),
        "eager GN backward": lambda: torch.autograd.grad(graphs["eager plain"], leaves, dy, retain_graph=True),
        "op fused_group_norm_backward": lambda: torch.ops.fusednorm.fused_group_norm_backward(
            dy, x, mean, rstd, w, b, G, None, None, None, "silu", 0.01, None, [True] * 3 + [False] * 4),
        "op group_norm_backward": lambda: torch.ops.fusednorm.group_norm_backward(
            dy, x, mean, rstd, w, G, [True] * 3),
        "op aten native_group_norm_backward": lambda: torch.ops.aten.native_group_norm_backward(
            dya, xa, aten_mean, aten_rstd, w, N, C, HxW, G, [True] * 3),
    }
    layout = "channels_last" if args.channels_last else "contiguous"
    what = "host time to return" if args.enqueue else "host time + GPU"
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} thread(s), input {tuple(x.shape)} "
          f"{dtype} {layout}; {what}")
    for name, us in timed_in_turns(fns, args.reps, sync, args.enqueue).items():
        print(f"{name:38s} {us:8.1f} us")


def compiled_chains(x, G, args, sync):
    """--compiled: host time a call of two compiled norm chains, Inductor's against the fusion
    backend's."""
    C = x.shape[1]
    conv = torch.nn.Conv2d(C, C, 3, padding=1, device=x.device, dtype=x.dtype)
    if args.channels_last:
        conv = conv.to(memory_format=torch.channels_last)
    w, b = torch.randn(C, device=x.device, dtype=x.dtype), torch.randn(C, device=x.device, dtype=x.dtype)
    temb = torch.randn(x.shape[0], C, *([1] * (x.dim() - 2)), device=x.device, dtype=x.dtype)

    def prologue_chain(h):
        return F.silu(F.group_norm(conv(h) + temb, G, w, b))

    def plain_chain(h):
        return F.silu(F.group_norm(h, G, w, b))

    fns, rewritten = {}, {}
    for chain, f in (("conv + temb -> GN+SiLU", prologue_chain), ("GN+SiLU", plain_chain)):
        backend = fusednorm.fusion.backend()
        fns[f"{chain}, Inductor"] = torch.compile(f)
        fns[f"{chain}, fusion backend"] = torch.compile(f, backend=backend)
        fns[f"{chain}, eager"] = f
        with torch.no_grad():
            fns[f"{chain}, fusion backend"](x)
        rewritten[chain] = sum(backend.fusions)

    what = "host time to return" if args.enqueue else "host time + GPU"
    print(f"torch {torch.__version__}, {x.device}, {torch.get_num_threads()} thread(s), input {tuple(x.shape)} "
          f"{x.dtype} {'channels_last' if args.channels_last else 'contiguous'}; compiled chains, no grad; {what}; "
          f"chains the backend rewrote: {rewritten}")
    calls = {k: no_grad(lambda f=f: f(x)) for k, f in fns.items()}
    for name, us in timed_in_turns(calls, args.reps, sync, args.enqueue).items():
        print(f"{name:42s} {us:8.1f} us")


if __name__ == "__main__":
    main()
