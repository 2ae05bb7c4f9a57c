"""F-style functions with the signatures, defaults and argument checks of torch.nn.functional.

Scriptable with torch.jit.script; they call the ops in torch.ops.fusednorm.
"""

from typing import List, Optional

import torch
from torch import Tensor


def _verify_batch_size(size: List[int]) -> None:
    # As torch.nn.functional._verify_batch_size.
    size_prods = size[0]
    for i in range(len(size) - 2):
        size_prods *= size[i + 2]
    if size_prods == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")


def _verify_spatial_size(size: List[int]) -> None:
    # As torch.nn.functional._verify_spatial_size.
    size_prods = 1
    for i in range(2, len(size)):
        size_prods *= size[i]
    if size_prods == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {size}")


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tensor:
    """Group normalization, as :func:`torch.nn.functional.group_norm`.

    Statistics over (C / num_groups) channels x all spatial positions per sample and group, biased
    variance, optional per-channel ``weight`` and ``bias``. Any rank >= 2; contiguous,
    channels_last and channels_last_3d inputs keep their memory format.
    """
    if input.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input.dim()}")
    if num_groups <= 0:
        raise RuntimeError(f"Expected num_groups to be positive, but got num_groups={num_groups}")
    _verify_batch_size([input.size(0) * input.size(1) // num_groups, num_groups] + list(input.size()[2:]))
    return torch.ops.fusednorm.group_norm(input, num_groups, weight, bias, eps)


def instance_norm(
    input: Tensor,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Instance normalization, as :func:`torch.nn.functional.instance_norm`.

    With ``use_input_stats`` each (sample, channel) is normalized by its own statistics and the
    running statistics, when given, are updated in place:
    ``running = (1 - momentum) * running + momentum * batch_mean(statistic)``, the variance unbiased.
    Without it, the running statistics normalize the input.
    """
    if use_input_stats:
        _verify_spatial_size(input.size())
    return torch.ops.fusednorm.instance_norm(
        input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
    )
