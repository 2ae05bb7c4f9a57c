"""The fusion backend's rewrite of concatenations that are replication pads (docs/design.md,
"Concatenations that are replication pads").

CogVideoX's causal 3-D convolutions pad time by concatenating copies of the first frame,
``torch.cat([x[:, :, :1]] * k + [x], dim=2)``: the values of ``F.pad(x, (0, 0, 0, 0, k, 0),
mode="replicate")``. Inductor computes a replication pad inside the kernel that produces x; a
concatenation it lays out by its inputs, which the layout pass asks for in channels_last_3d
(``_conv3d_layout``), so x is written and then copied. As a pad, the concatenation is one kernel
with x's producer again, or fusednorm's pad kernel after a fused op (``fusion._take_replication_pad``).
"""

import operator
from typing import Any

import torch.nn.functional as F
from torch import fx

from ._fx_nodes import concatenations, example_value

__all__ = ["replication_pad_concatenations"]

_FULL = slice(None, None, None)


def _first_slice_of(node: Any, source: fx.Node, dim: int) -> bool:
    """Whether `node` is ``source[:, ..., :1]`` with the ``:1`` (or ``0:1``) at `dim` (and only
    full slices after it)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and len(node.args) == 2 and not node.kwargs and node.args[0] is source):
        return False
    index = node.args[1]
    return isinstance(index, tuple) and len(index) > dim and all(i == _FULL for i in index[:dim] + index[dim + 1:]) \
        and isinstance(index[dim], slice) and index[dim].start in (None, 0) and index[dim].stop == 1 \
        and index[dim].step in (None, 1)


def replication_pad_concatenations(gm: fx.GraphModule) -> int:
    """Rewrites, in place, each ``torch.cat([x[..., :1, ...]] * k + [x], dim=d)`` of a
    Dynamo-captured graph ``gm`` (x of 3 to 5 dimensions, d one of its last three and not the
    first two, k >= 1) into ``F.pad(x, padding, mode="replicate")`` with k before x along d; the
    slices go with the concatenation where nothing else uses them. Returns how many it rewrote."""
    graph = gm.graph
    count = 0
    for cat, tensors, dim in concatenations(graph):
        if len(tensors) < 2 or type(dim) is not int:
            continue
        source, copies = tensors[-1], tensors[:-1]
        value = example_value(source)
        if value is None or not 3 <= value.dim() <= 5:  # (None too where source is not a node)
            continue
        rank = value.dim()
        dim = dim + rank if dim < 0 else dim
        if not 2 <= dim < rank or not all(_first_slice_of(c, source, dim) for c in copies):
            continue
        padding = [0] * (2 * (rank - 2))
        padding[2 * (rank - 1 - dim)] = len(copies)  # F.pad's pairs run from the last dimension
        with graph.inserting_before(cat):
            pad = graph.call_function(F.pad, (source, padding), {"mode": "replicate"})
        pad.meta.update(cat.meta)
        cat.replace_all_uses_with(pad)
        graph.erase_node(cat)
        for copy in set(copies):
            if not copy.users:
                graph.erase_node(copy)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count
