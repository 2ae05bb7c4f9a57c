"""One GPU against two for a row-split GroupNorm + SiLU and for the patch-parallel VAE decode.

    python benchmarks/distributed_bench.py [--shape 1,128,4096,4096] [--groups 32] [--world 2]

1. GroupNorm(32) + SiLU of a bf16 (1, 128, 4096, 4096) activation: fusednorm.group_norm on the
   whole tensor on one GPU, then fusednorm.distributed.group_norm on row bands over `world` GPUs
   (NCCL). Per rank: time per call (forward, and forward + backward), peak memory, and the share of
   the call spent in its collective (the all-gather of the per-group moments, timed alone).
2. The diffusers AutoencoderKL decode at 2048 px with Stable Diffusion's VAE config
   (export_examples/patch_parallel_decode.py) on 1 and on `world` GPUs, when diffusers is present.

Needs `world` CUDA devices (NCCL); says so and exits 0 otherwise. No timing is asserted anywhere.
"""

import argparse
import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

import fusednorm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _time_ms(fn, reps: int) -> float:
    # Median of `reps` CUDA-event timings after two warm-up calls.
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _gn_case(rank: int, world: int, shape, groups: int, reps: int, backward: bool):
    device = torch.device(f"cuda:{rank}")
    N, C, H, W = shape
    rows = -(-H // world)
    a, b = min(rank * rows, H), min((rank + 1) * rows, H)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn((N, C, b - a, W), generator=g, device=device, dtype=torch.bfloat16).requires_grad_(backward)
    w = torch.ones(C, device=device, requires_grad=backward)
    bias = torch.zeros(C, device=device, requires_grad=backward)
    grad = torch.randn_like(x) if backward else None

    if world == 1:
        def call():
            return fusednorm.group_norm(x, groups, w, bias, activation="silu")
    else:
        def call():
            return fusednorm.distributed.group_norm(x, groups, w, bias, activation="silu", dim=2)

    def step():
        out = call()
        if backward:
            out.backward(grad)

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ms = _time_ms(step, reps)
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    comm_ms = 0.0
    if world > 1:
        moments = fusednorm.distributed.local_moments(x.detach(), groups)
        comm_ms = _time_ms(lambda: fusednorm.distributed._all_gather(moments, dist.group.WORLD), reps)
        if backward:
            comm_ms *= 2  # the backward's all-gather carries 2 x N x G numbers instead of 3: about the same
    return ms, peak, comm_ms


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    for backward in (False, True):
        ms, peak, comm = _gn_case(rank, world, args.shape, args.groups, args.reps, backward)
        kind = "fwd+bwd" if backward else "fwd"
        share = f"{100 * comm / ms:.1f}%" if world > 1 else "-"
        print(f"| GN+SiLU {kind} | {world} GPU | rank {rank} | {ms:.2f} ms | {peak:.2f} GiB | {comm:.3f} ms ({share}) |",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,128,4096,4096")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--decode-size", type=int, default=2048)
    args = parser.parse_args()
    args.shape = [int(s) for s in args.shape.split(",")]
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world or not dist.is_nccl_available():
        print(f"skipped: needs {args.world} CUDA devices and NCCL")
        return 0
    print("| case | GPUs | rank | time | peak memory | collective (share) |")
    print("|---|---|---|---|---|---|")
    for world in (1, args.world):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_worker, args=(world, port, args), nprocs=world, join=True)
    try:
        import diffusers  # noqa: F401
    except ImportError:
        print("decode: skipped: diffusers not installed")
        return 0
    example = os.path.join(ROOT, "export_examples", "patch_parallel_decode.py")
    for world in (1, args.world):
        print(f"== decode {args.decode_size} px on {world} GPU(s)", flush=True)
        cmd = [sys.executable, example, "--size", str(args.decode_size), "--channels", "128,256,512,512",
               "--groups", "32", "--world", str(world), "--repeats", "3", "--skip-reference"]
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
