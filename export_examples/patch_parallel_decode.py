"""Patch-parallel VAE decode: a diffusers AutoencoderKL decoder (built from a config, random
weights, nothing downloaded) decodes one latent split by rows across ranks, and the result equals
the one-process decode.

Each rank holds a band of latent rows and decodes it into its band of image rows:
  - every GroupNorm becomes fusednorm.distributed.group_norm over the row split (the statistics of
    the whole image, one all-gather of per-group moments per norm; docs/distributed.md);
  - every 3x3 convolution gets its halo (the neighbours' boundary rows) by one all-gather of each
    rank's top and bottom rows, then convolves without padding in the row direction;
  - the mid block's self-attention sees every position: its input rows are gathered, attention
    runs on the whole (small, latent-resolution) tensor, and each rank keeps its rows;
  - nearest-neighbour upsampling and 1x1 convolutions are row-local.

Runs on 2 CPU processes with gloo when there are fewer than 2 GPUs, with NCCL on every GPU
otherwise, or under torchrun. Prints time and peak memory per rank. Exits 0 with a "skipped" line
when diffusers is not installed.

    python export_examples/patch_parallel_decode.py [--size PX] [--channels 128,256,512,512]
"""

import argparse
import datetime
import os
import resource
import socket
import sys
import time
from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fusednorm


def _chunk_sizes(n: int, world: int) -> List[int]:
    step = -(-n // world)
    return [max(0, min(step, n - r * step)) for r in range(world)]


class DistributedGroupNorm(nn.Module):
    """A torch.nn.GroupNorm over a tensor split by rows (dim 2) across the process group."""

    def __init__(self, norm: nn.GroupNorm):
        super().__init__()
        self.num_groups, self.eps, self.weight, self.bias = norm.num_groups, norm.eps, norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fusednorm.distributed.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, dim=2)


class HaloConv2d(nn.Module):
    """A stride-1 convolution of a tensor split by rows: the rows it needs from the neighbours
    (padding[0] of them each side) come by one all-gather; zero padding only at the image's edges."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        assert conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.padding_mode == "zeros"
        assert conv.padding[0] == (conv.kernel_size[0] - 1) // 2
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halo = self.conv.padding[0]
        if halo == 0:
            return self.conv(x)
        rank, world = dist.get_rank(), dist.get_world_size()
        edges = torch.cat([x[:, :, :halo], x[:, :, -halo:]], dim=2).contiguous()
        parts = [torch.empty_like(edges) for _ in range(world)]
        dist.all_gather(parts, edges)
        zeros = torch.zeros_like(edges[:, :, :halo])
        top = parts[rank - 1][:, :, halo:] if rank > 0 else zeros
        bottom = parts[rank + 1][:, :, :halo] if rank < world - 1 else zeros
        padded = torch.cat([top, x, bottom], dim=2)
        return F.conv2d(padded, self.conv.weight, self.conv.bias, padding=(0, self.conv.padding[1]))


class GatheredRows(nn.Module):
    """Runs a module that needs every position (self-attention) on the whole tensor, gathered from
    the row bands, and keeps this rank's band."""

    def __init__(self, module: nn.Module, sizes: List[int]):
        super().__init__()
        self.module, self.sizes = module, sizes

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rank, tallest = dist.get_rank(), max(self.sizes)
        padded = F.pad(x, (0, 0, 0, tallest - x.shape[2])).contiguous()
        parts = [torch.empty_like(padded) for _ in self.sizes]
        dist.all_gather(parts, padded)
        whole = torch.cat([p[:, :, :n] for p, n in zip(parts, self.sizes)], dim=2)
        out = self.module(whole, *args, **kwargs)
        start = sum(self.sizes[:rank])
        return out[:, :, start:start + self.sizes[rank]]


def make_patch_parallel(decoder: nn.Module, latent_rows: int) -> None:
    """Swaps the decoder's modules in place for their row-split forms."""
    sizes = _chunk_sizes(latent_rows, dist.get_world_size())
    for attn_holder in [decoder.mid_block]:
        attn_holder.attentions = nn.ModuleList(
            [GatheredRows(a, sizes) if a is not None else None for a in attn_holder.attentions])

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, GatheredRows):
                continue  # the attention runs on the whole tensor: its own GroupNorm stays
            if isinstance(child, nn.GroupNorm):
                setattr(module, name, DistributedGroupNorm(child))
            elif isinstance(child, nn.Conv2d) and child.kernel_size != (1, 1):
                setattr(module, name, HaloConv2d(child))
            else:
                swap(child)

    swap(decoder)


def build_vae(channels, groups: int):
    from diffusers import AutoencoderKL

    n = len(channels)
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=tuple(channels),
                         down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
                         layers_per_block=2 if n > 2 else 1, norm_num_groups=groups).eval()


def _peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"
    # ru_maxrss: KiB on Linux; the process's peak, libraries included.
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB"


def run(rank: int, world: int, args) -> None:
    backend = "nccl" if args.backend == "nccl" else "gloo"
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    dtype = torch.float32
    vae = build_vae(args.channels, args.groups).to(device)  # float32, as built
    factor = 2 ** (len(args.channels) - 1)
    rows = args.size // factor
    latent = torch.randn(1, 4, rows, rows, generator=torch.Generator().manual_seed(1)).to(device, dtype)

    whole = None
    if rank == 0 and not args.skip_reference:
        with torch.no_grad():
            whole = vae.decode(latent).sample

    make_patch_parallel(vae.decoder, rows)
    sizes = _chunk_sizes(rows, world)
    start = sum(sizes[:rank])
    local = latent[:, :, start:start + sizes[rank]]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    with torch.no_grad():
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            band = vae.decode(local).sample
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    print(f"rank {rank}/{world} ({backend}): latent rows {start}:{start + sizes[rank]}, image band "
          f"{tuple(band.shape)}, decode {min(times) * 1e3:.1f} ms, {_peak_memory(device)}", flush=True)

    bands = [torch.empty((1, 3, n * factor, rows * factor), device=device, dtype=dtype) for n in sizes]
    if world > 1:
        tallest = max(sizes) * factor
        padded = F.pad(band, (0, 0, 0, tallest - band.shape[2])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        bands = [p[:, :, :n * factor] for p, n in zip(parts, sizes)]
    else:
        bands = [band]
    if rank == 0 and whole is not None:
        image = torch.cat(bands, dim=2)
        err = (image - whole).abs().max().item()
        torch.testing.assert_close(image, whole, atol=2e-4, rtol=2e-4)
        print(f"patch-parallel decode on {world} ranks equals the one-process decode "
              f"(image {tuple(image.shape)}, max abs diff {err:.2e})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    run(rank, world, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=128, help="image height and width in pixels")
    parser.add_argument("--channels", default="32,64,64", help="block_out_channels (SD's VAE: 128,256,512,512)")
    parser.add_argument("--groups", type=int, default=16, help="norm_num_groups (SD's VAE: 32)")
    parser.add_argument("--world", type=int, default=0, help="ranks to spawn (default: GPUs if >= 2, else 2 CPU)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-reference", action="store_true", help="no one-process decode to compare with")
    args = parser.parse_args()
    args.channels = [int(c) for c in args.channels.split(",")]
    try:
        import diffusers  # noqa: F401
    except ImportError:
        print("skipped: diffusers not installed")
        return 0
    if not dist.is_available():
        print("skipped: torch.distributed not available")
        return 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.backend = "nccl" if gpus >= 2 and dist.is_nccl_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    world = args.world or (gpus if args.backend == "nccl" else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(world, port, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
