"""fusednorm: fused GroupNorm and InstanceNorm operators for PyTorch.

The ops live in the ``torch.ops.fusednorm`` namespace; this package loads their native library,
registers their fake (meta) kernels, and offers F-style functions and nn modules.
"""

from ._version import __version__  # noqa: F401  (the one version source)
from . import _library

_library.load()

from . import _registrations  # noqa: E402,F401  (registers the fake kernels)
from . import nn  # noqa: E402
from .functional import add_group_norm, group_norm, instance_norm  # noqa: E402
from .convert import convert  # noqa: E402
from ._replication_pads import replication_pads  # noqa: E402  (eager F.pad(mode="replicate") on fusednorm's kernels)
from . import fusion  # noqa: E402,F401  (opt-in torch.compile backend; imports nothing heavy)
from . import distributed  # noqa: E402  (sharded norms; DTensor support once torch.distributed.tensor loads)

__all__ = ["add_group_norm", "convert", "distributed", "fusion", "group_norm", "instance_norm", "nn",
           "replication_pads"]
