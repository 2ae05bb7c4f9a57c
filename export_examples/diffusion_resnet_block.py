"""A diffusion-style ResNet block (GroupNorm(32) + SiLU, conv, timestep scale/shift, GroupNorm +
SiLU, conv, skip), as in Stable Diffusion's UNet. fusednorm fuses each norm with what follows it:
GroupNorm + SiLU in one pass, GroupNorm + timestep scale/shift (AdaGN) + SiLU in another. Checked
against the same block on torch.nn.GroupNorm (same state_dict) and taken through compile / script /
export / AOTInductor."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusednorm
from _harness import check_everywhere, device


class ResnetBlock(nn.Module):
    """The reference, as diffusers writes it: each elementwise step is its own pass over memory."""

    def __init__(self, channels: int, temb_channels: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.time_emb = nn.Linear(temb_channels, 2 * channels)
        self.norm2 = nn.GroupNorm(32, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.time_emb(F.silu(temb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(F.silu(h))
        return x + h


class FusedResnetBlock(nn.Module):
    """The same block and parameters with fusednorm: two fused calls replace five passes."""

    def __init__(self, channels: int, temb_channels: int):
        super().__init__()
        self.norm1 = fusednorm.nn.GroupNorm(32, channels, activation="silu")
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.time_emb = nn.Linear(temb_channels, 2 * channels)
        self.norm2 = fusednorm.nn.GroupNorm(32, channels, activation="silu")
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.norm1(x))  # GroupNorm + SiLU
        scale, shift = self.time_emb(F.silu(temb)).chunk(2, dim=1)  # (N, C) each
        h = self.conv2(self.norm2(h, scale=scale, shift=shift))  # GroupNorm + scale/shift + SiLU
        return x + h


def main():
    dev = device()
    torch.manual_seed(0)
    ours = FusedResnetBlock(64, 128).to(dev).eval()
    ref = ResnetBlock(64, 128).to(dev).eval()
    ref.load_state_dict(ours.state_dict())
    x, temb = torch.randn(2, 64, 16, 16, device=dev), torch.randn(2, 128, device=dev)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, temb), ref(x, temb), atol=1e-4, rtol=1e-4)
    print(f"== diffusion ResNet block on {dev}: fused GroupNorm+SiLU and GroupNorm+AdaGN+SiLU match the torch.nn block")
    dims = {"x": {0: torch.export.Dim("batch"), 2: torch.export.Dim("h", min=2), 3: torch.export.Dim("w", min=2)},
            "temb": {0: torch.export.Dim("batch")}}
    # dims share the name "batch", so both inputs' batch sizes are one symbol.
    dims["temb"][0] = dims["x"][0]
    check_everywhere(ours, [x, temb], dims, [torch.randn(3, 64, 8, 12, device=dev), torch.randn(3, 128, device=dev)])


if __name__ == "__main__":
    main()
