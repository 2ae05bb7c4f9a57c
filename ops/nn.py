"""Drop-in replacements for torch.nn.GroupNorm and torch.nn.InstanceNorm1d/2d/3d.

Each subclasses its torch.nn counterpart, so constructor arguments, input checks, exceptions,
warnings, train/eval behaviour, state_dict keys and checkpoint loading are PyTorch's own; only the
computation goes through fusednorm's ops.
"""

import torch
from torch import Tensor

from . import functional as F

__all__ = ["GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"]


class GroupNorm(torch.nn.GroupNorm):
    __doc__ = torch.nn.GroupNorm.__doc__

    def forward(self, input: Tensor) -> Tensor:
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


# torch.nn's _InstanceNorm.forward does the checks and the no-batch-dim handling and then calls
# _apply_instance_norm, the only method these classes replace.


class InstanceNorm1d(torch.nn.InstanceNorm1d):
    __doc__ = torch.nn.InstanceNorm1d.__doc__

    def _apply_instance_norm(self, input: Tensor) -> Tensor:
        return F.instance_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            self.momentum if self.momentum is not None else 0.0,
            self.eps,
        )


class InstanceNorm2d(torch.nn.InstanceNorm2d):
    __doc__ = torch.nn.InstanceNorm2d.__doc__
    _apply_instance_norm = InstanceNorm1d._apply_instance_norm


class InstanceNorm3d(torch.nn.InstanceNorm3d):
    __doc__ = torch.nn.InstanceNorm3d.__doc__
    _apply_instance_norm = InstanceNorm1d._apply_instance_norm
