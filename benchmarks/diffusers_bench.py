"""End-to-end timings of real diffusers models with fusednorm, for the adoption section of the README:
a Stable Diffusion (1.x) VAE decode at 512 px and a UNet step at batch 2 (64x64 latents), built
from their published configs with random weights, each as

    eager              the model as diffusers builds it
    eager + convert    fusednorm.convert(model): torch.nn norms swapped for fusednorm's
    compile            torch.compile(model)
    compile + fusion   torch.compile(model, backend=fusednorm.fusion.backend()): norms and their
                       epilogues fused into fusednorm's op, the rest compiled by Inductor

and checks that every variant's output matches eager. On a CPU it runs tiny configs and says so: a
smoke test of the four variants, since the real models take minutes a call there.
Needs diffusers; without it, says so and exits 0.

    python benchmarks/diffusers_bench.py [--out DIR] [--device cuda|cpu] [--no-compile]
"""

import argparse
import copy
import json
import os
import sys
import time

import torch

import fusednorm
from bench import timer  # the suite's timer: CUDA events after an L2 flush, medians

SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=32, layers_per_block=2,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
SD_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, cross_attention_dim=768,
    block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8, norm_num_groups=32,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
)
TINY_VAE = dict(SD_VAE, block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
                down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
TINY_UNET = dict(SD_UNET, sample_size=16, block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
                 cross_attention_dim=32, attention_head_dim=4,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


class VAEDecode(torch.nn.Module):
    """What a pipeline runs of the VAE: decode latents to an image (torch.compile compiles forward)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latents):
        return self.vae.decode(latents).sample


class UNetStep(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, context):
        return self.unet(sample, timestep, encoder_hidden_states=context).sample


def workloads(device, dtype):
    """(name, module, inputs) of each model at its real size on a GPU, tiny on a CPU."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    full = device == "cuda"
    torch.manual_seed(0)
    vae = AutoencoderKL(**(SD_VAE if full else TINY_VAE)).to(device, dtype).eval()
    latents = torch.randn(1, 4, 64 if full else 8, 64 if full else 8, device=device, dtype=dtype)
    yield "VAE decode", VAEDecode(vae), (latents,)

    unet = UNet2DConditionModel(**(SD_UNET if full else TINY_UNET)).to(device, dtype).eval()
    size = 64 if full else 16
    sample = torch.randn(2, 4, size, size, device=device, dtype=dtype)
    context = torch.randn(2, 77, 768 if full else 32, device=device, dtype=dtype)
    t = torch.tensor([500, 500], device=device)
    yield "UNet step", UNetStep(unet), (sample, t, context)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    try:
        import diffusers
    except ImportError:
        print("diffusers is not installed: no end-to-end diffusers timings")
        return
    device = args.device
    dtype = torch.float16 if device == "cuda" else torch.float32
    measure = timer(device)
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"diffusers {diffusers.__version__} models on {card}, torch {torch.__version__}, {dtype}")
    if device == "cpu":
        print("  on the CPU these are tiny configs (2 blocks of 32-64 channels, 8x8 latents), not SD's: "
              "the real models take minutes a call here. The rows check that convert and compile + "
              "fusion run and match eager; their times say nothing about SD-sized models.")
    rows = []
    with torch.no_grad():
        for name, model, inputs in workloads(device, dtype):
            converted = fusednorm.convert(copy.deepcopy(model))
            variants = {"eager": model, "eager + convert": converted}
            if not args.no_compile:
                torch._dynamo.reset()
                variants["compile"] = torch.compile(model)
                fusion = fusednorm.fusion.backend()
                variants["compile + fusion"] = torch.compile(model, backend=fusion)
            want = model(*inputs)
            row = {"workload": name, "ms": {}, "max_abs_diff": {}}
            for label, m in variants.items():
                got = m(*inputs)  # compiles on the first call
                row["max_abs_diff"][label] = float((got.float() - want.float()).abs().max())
                row["ms"][label] = measure(lambda: m(*inputs))
                print(f"  {name:10s} {label:17s} {row['ms'][label]:9.3f} ms  (max |diff| vs eager "
                      f"{row['max_abs_diff'][label]:.2e})", flush=True)
            if not args.no_compile:
                row["fusions"] = sum(fusion.fusions)
                print(f"  {name:10s} compile + fusion rewrote {row['fusions']} norm chains", flush=True)
            rows.append(row)
            del model, converted, variants
            if device == "cuda":
                torch.cuda.empty_cache()
    labels = list(rows[0]["ms"]) if rows else []
    table = ["| workload | " + " | ".join(f"{l} ms" for l in labels) + " |", "|---|" + "---|" * len(labels)]
    for r in rows:
        table.append(f"| {r['workload']} | " + " | ".join(f"{r['ms'][l]:.3f}" for l in labels) + " |")
    print("\n".join(table))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"diffusers_{device}.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "card": card, "torch": torch.__version__,
                   "diffusers": diffusers.__version__, "dtype": str(dtype), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
