"""torch.nn module calls as the functional calls they make, for the fusion backend's rules.

Dynamo on torch < 2.2 records a call of a torch.nn module (``self.conv(x)``, ``self.norm(x)``,
``self.act(x)``) as one ``call_module`` node; newer Dynamo traces into the module and records the
functional call its ``forward`` makes (``F.conv2d(x, weight, bias, ...)``). ``lower_module_calls``
rewrites the first form into the second for the modules the backend's rules read (convolutions,
group and instance norms, activations, dropouts), so that the rules see one form on every
supported torch: on torch 2.1 a convolution's bias became an input_bias, a norm of an
InstanceNorm module fused, a pad after an eval-mode Dropout module was taken, as on newer torch.

Only a module of one of those classes whose class keeps its ``forward`` (and what that calls;
the norms' and activations' tests are ``convert``'s), called with one positional argument, is
rewritten, into the call its ``forward`` makes with the module's attributes as they are now; an
attribute changed later goes unseen (Dynamo recompiles when a module's ``training`` changes, and a
frame holding a module call guards on that module). A module's parameters and buffers become
``get_attr`` nodes, one per attribute for the whole graph (a module called several times hands
each call the same nodes, as Mochi's per-chunk norms need), with the tensor itself as their
example value. An InstanceNorm module keeps its call unless its input is batched and has
``num_features`` channels (its own checks, warning and unbatched inputs stay with it).
"""

from typing import Any, Callable, Dict, Optional, Tuple

import torch.nn.functional as F
from torch import fx, nn

from ._fx_nodes import example_value
from .convert import _keeps, keeps_instance_norm_forward, module_activation

__all__ = ["lower_module_calls"]

_CONVS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
# The activations `convert.module_activation` names whose modules' forwards call F.<name>(x, inplace)
# (leaky_relu and the GELUs take other arguments, below).
_ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "mish": F.mish}
_DROPOUTS = {nn.Dropout: F.dropout, nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d, nn.Dropout3d: F.dropout3d}


def _call(module: nn.Module, x: fx.Node,
          attr: Callable[[str], Optional[fx.Node]]) -> Optional[Tuple[Callable, tuple, Dict[str, Any]]]:
    """(function, args, kwargs) of the call `module`'s forward makes on input `x`, or None."""
    cls = type(module)
    for base, conv in _CONVS.items():
        if isinstance(module, base) and _keeps(cls, base, ("forward", "_conv_forward")) \
                and module.padding_mode == "zeros":
            return conv, (x, attr("weight"), attr("bias"), module.stride, module.padding, module.dilation,
                          module.groups), {}
    if isinstance(module, nn.GroupNorm) and _keeps(cls, nn.GroupNorm, ("forward",)):
        return F.group_norm, (x, module.num_groups, attr("weight"), attr("bias"), module.eps), {}
    if keeps_instance_norm_forward(module):
        source = example_value(x)
        if source is None or module.momentum is None or source.dim() != module._get_no_batch_dim() + 1 \
                or source.shape[1] != module.num_features:
            return None
        return F.instance_norm, (x, attr("running_mean"), attr("running_var"), attr("weight"), attr("bias"),
                                 module.training or not module.track_running_stats, module.momentum, module.eps), {}
    activation = module_activation(module)
    if activation is not None:
        name, slope = activation
        if name == "leaky_relu":
            return F.leaky_relu, (x, slope, module.inplace), {}
        if name in ("gelu", "gelu_tanh"):
            return F.gelu, (x,), {"approximate": "tanh" if name == "gelu_tanh" else "none"}
        return _ACTIVATIONS[name], (x,), {"inplace": module.inplace}
    for base, dropout in _DROPOUTS.items():
        if isinstance(module, base) and _keeps(cls, base, ("forward",)):
            return dropout, (x, module.p, module.training, module.inplace), {}
    return None


def lower_module_calls(gm: fx.GraphModule) -> int:
    """Rewrites, in place, the call_module nodes of `gm` named in the module docstring into
    functional calls; returns how many."""
    graph = gm.graph
    attrs: Dict[str, fx.Node] = {}

    def attr_of(target: str) -> Callable[[str], Optional[fx.Node]]:
        module = gm.get_submodule(target)

        def attr(name: str) -> Optional[fx.Node]:
            value = getattr(module, name, None)
            if value is None:
                return None
            path = f"{target}.{name}"
            if path not in attrs:  # before every use: ahead of the first node after the inputs
                with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
                    attrs[path] = graph.get_attr(path)
                attrs[path].meta["example_value"] = value
            return attrs[path]

        return attr

    count = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            continue
        call = _call(gm.get_submodule(node.target), node.args[0], attr_of(node.target))
        if call is None:
            continue
        with graph.inserting_before(node):
            lowered = graph.call_function(*call)
        lowered.meta.update(node.meta)
        node.replace_all_uses_with(lowered)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count
