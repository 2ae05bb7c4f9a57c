"""A 3-D segmentation block (as in MONAI's UNet / nnU-Net): conv3d + InstanceNorm3d(affine) +
LeakyReLU, twice, then a 1x1x1 head, on fusednorm's InstanceNorm3d with channels_last_3d
activations; checked against torch.nn.InstanceNorm3d and taken through compile / script / export /
AOTInductor."""

import torch
import torch.nn as nn

import fusednorm
from _harness import check_everywhere, device


class SegBlock(nn.Module):
    def __init__(self, cin=2, c=16, classes=3, norm=fusednorm.nn.InstanceNorm3d):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv3d(cin, c, 3, padding=1), norm(c, affine=True), nn.LeakyReLU(0.01),
            nn.Conv3d(c, c, 3, padding=1), norm(c, affine=True), nn.LeakyReLU(0.01),
            nn.Conv3d(c, classes, 1),
        )

    def forward(self, x):
        return self.body(x)


def main():
    dev = device()
    # cuDNN runs float32 convolutions in TF32 by default, and the channels_last_3d input and the
    # reference's contiguous one take different algorithms, whose TF32 roundings differ by ~1e-3
    # (seen on an H200): the comparison is of the norms, so the convolutions run in full float32.
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    # channels_last_3d activations come from the input alone (a convolution's output takes the
    # input's format); the weights stay contiguous, as torch.export.save warns ("No complete
    # tensor found in the group") about channels_last_3d ones.
    ours = SegBlock().to(dev).eval()
    ref = SegBlock(norm=nn.InstanceNorm3d).to(dev).eval()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 2, 12, 12, 12, device=dev).to(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        assert ours(x).is_contiguous(memory_format=torch.channels_last_3d)
        torch.testing.assert_close(ours(x), ref(x.contiguous()), atol=1e-4, rtol=1e-4)
    print(f"== 3-D segmentation block (channels_last_3d) on {dev}: matches torch.nn.InstanceNorm3d")
    dims = {"x": {0: torch.export.Dim("batch"), 2: torch.export.Dim("d", min=2)}}
    check_everywhere(ours, [x], dims, [torch.randn(3, 2, 8, 12, 12, device=dev).to(memory_format=torch.channels_last_3d)])


if __name__ == "__main__":
    main()
