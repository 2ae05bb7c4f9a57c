"""The three benchmark problems fusednorm was born from, each as a `ModelNew` with the reference
`Model`'s constructor and forward signature, checked against the reference and taken through
compile / script / export / AOTInductor.

On a GPU the problems run at their real sizes; on a CPU at a reduced batch.
"""

import warnings

import torch
import torch.nn as nn

import fusednorm
from _harness import check_everywhere, device

# -- 1. GroupNorm(8, 64) on (112, 64, 512, 512) ----------------------------------------------------


class GroupNormModel(nn.Module):
    def __init__(self, num_features: int, num_groups: int):
        super().__init__()
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x)


class GroupNormModelNew(nn.Module):
    def __init__(self, num_features: int, num_groups: int):
        super().__init__()
        self.gn = fusednorm.nn.GroupNorm(num_groups=num_groups, num_channels=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x)


# -- 2. InstanceNorm2d(64) on (112, 64, 512, 512) ---------------------------------------------------


class InstanceNormModel(nn.Module):
    def __init__(self, num_features: int):
        super().__init__()
        self.inorm = nn.InstanceNorm2d(num_features=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(x)


class InstanceNormModelNew(nn.Module):
    def __init__(self, num_features: int):
        super().__init__()
        self.inorm = fusednorm.nn.InstanceNorm2d(num_features=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(x)


# -- 3. Linear(8192, 8192) -> per-row InstanceNorm -> (h + y) * y on (1024, 8192) ----------------


class LinearInstanceNormModel(nn.Module):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.bmm = nn.Linear(in_features, out_features)
        self.instance_norm = nn.InstanceNorm2d(out_features, eps=eps, momentum=momentum)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.bmm(x)
        x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
        return (x + y) * y


class LinearInstanceNormModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.bmm = nn.Linear(in_features, out_features)
        self.eps = eps
        # The reference's InstanceNorm2d(out_features) sees C = 1, H = 1, W = out_features: it
        # normalizes each row, has no parameters and never uses momentum. As a (N, C) tensor the
        # row is one group of group_norm, with no num_features warning.

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The whole norm-add-multiply tail is one fused pass: (normalize(h) + y) * y.
        return fusednorm.group_norm(self.bmm(x), 1, eps=self.eps, residual=y, multiplier=y)


# KernelBench-style inputs of each problem at its real size.
PROBLEMS = {
    "group_norm": dict(model=GroupNormModel, model_new=GroupNormModelNew,
                       get_init_inputs=lambda: [64, 8], get_inputs=lambda: [torch.rand(112, 64, 512, 512)]),
    "instance_norm": dict(model=InstanceNormModel, model_new=InstanceNormModelNew,
                          get_init_inputs=lambda: [64], get_inputs=lambda: [torch.rand(112, 64, 512, 512)]),
    "linear_instance_norm_add_mul": dict(
        model=LinearInstanceNormModel, model_new=LinearInstanceNormModelNew,
        get_init_inputs=lambda: [8192, 8192], get_inputs=lambda: [torch.rand(1024, 8192), torch.rand(1024, 8192)]),
}


def check_against_reference(ref_cls, new_cls, init_args, make_inputs, trials=3, atol=1e-4, rtol=1e-4):
    """ModelNew, given the reference's weights, matches the reference on fresh random inputs; it
    never warns (the reference Linear+InstanceNorm model warns about num_features on every call)."""
    for trial in range(trials):
        torch.manual_seed(trial)
        ref = ref_cls(*init_args).to(device())
        new = new_cls(*init_args).to(device())
        new.load_state_dict(ref.state_dict(), strict=False)
        inputs = make_inputs()
        with torch.no_grad():
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                got = new(*inputs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = ref(*inputs)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        del got, want, inputs
    print(f"  {new_cls.__name__} matches {ref_cls.__name__} over {trials} random trials")


def main():
    dev = device()
    full = dev == "cuda"
    b = 112 if full else 2
    hw = 512 if full else 64
    print(f"== GroupNorm problem ({b}, 64, {hw}, {hw}) on {dev}")
    check_against_reference(GroupNormModel, GroupNormModelNew, (64, 8), lambda: [torch.rand(b, 64, hw, hw, device=dev)])
    small = [torch.rand(2, 64, 16, 16, device=dev)]
    other = [torch.rand(3, 64, 12, 20, device=dev)]
    dims = {"x": {0: torch.export.Dim("batch"), 2: torch.export.Dim("h", min=2), 3: torch.export.Dim("w", min=2)}}
    check_everywhere(GroupNormModelNew(64, 8).to(dev), small, dims, other)

    print(f"== InstanceNorm problem ({b}, 64, {hw}, {hw}) on {dev}")
    check_against_reference(InstanceNormModel, InstanceNormModelNew, (64,), lambda: [torch.rand(b, 64, hw, hw, device=dev)])
    check_everywhere(InstanceNormModelNew(64).to(dev), small, dims, other)

    n = 1024 if full else 64
    print(f"== Linear + InstanceNorm + add + mul ({n}, 8192) on {dev}")
    check_against_reference(
        LinearInstanceNormModel, LinearInstanceNormModelNew, (8192, 8192),
        lambda: [torch.rand(n, 8192, device=dev), torch.rand(n, 8192, device=dev)],
    )
    small_model = LinearInstanceNormModelNew(256, 512).to(dev)
    dims = {"x": {0: torch.export.Dim("rows")}, "y": {0: torch.export.Dim("rows")}}
    check_everywhere(small_model, [torch.rand(8, 256, device=dev), torch.rand(8, 512, device=dev)], dims,
                     [torch.rand(5, 256, device=dev), torch.rand(5, 512, device=dev)])


if __name__ == "__main__":
    main()
