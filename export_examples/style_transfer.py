"""A style-transfer network (Johnson et al.): conv + InstanceNorm2d(affine) + ReLU blocks with
residual blocks, on fusednorm's InstanceNorm2d; checked against torch.nn.InstanceNorm2d and taken
through compile / script / export / AOTInductor."""

import torch
import torch.nn as nn

import fusednorm
from _harness import check_everywhere, device


def conv_norm_relu(cin, cout, stride, norm):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), norm(cout, affine=True), nn.ReLU())


class Residual(nn.Module):
    def __init__(self, c, norm):
        super().__init__()
        self.body = nn.Sequential(conv_norm_relu(c, c, 1, norm), nn.Conv2d(c, c, 3, 1, 1), norm(c, affine=True))

    def forward(self, x):
        return x + self.body(x)


class TransformerNet(nn.Module):
    def __init__(self, norm=fusednorm.nn.InstanceNorm2d):
        super().__init__()
        self.net = nn.Sequential(
            conv_norm_relu(3, 16, 1, norm), conv_norm_relu(16, 32, 2, norm),
            Residual(32, norm), Residual(32, norm),
            nn.Upsample(scale_factor=2.0), conv_norm_relu(32, 16, 1, norm), nn.Conv2d(16, 3, 3, 1, 1),
        )

    def forward(self, x):
        return self.net(x)


def main():
    dev = device()
    torch.manual_seed(0)
    ours = TransformerNet().to(dev).eval()
    ref = TransformerNet(norm=nn.InstanceNorm2d).to(dev).eval()
    ref.load_state_dict(ours.state_dict())
    x = torch.rand(2, 3, 32, 32, device=dev)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-4, rtol=1e-4)
    print(f"== style transfer network on {dev}: matches torch.nn.InstanceNorm2d")
    dims = {"x": {0: torch.export.Dim("batch"), 2: 2 * torch.export.Dim("h2", min=2), 3: 2 * torch.export.Dim("w2", min=2)}}
    check_everywhere(ours, [x], dims, [torch.rand(3, 3, 24, 40, device=dev)])


if __name__ == "__main__":
    main()
