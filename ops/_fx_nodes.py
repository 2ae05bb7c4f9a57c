"""What the fusion backend's graph rewrites read of a Dynamo-captured FX graph: the example value
Dynamo records on a node, a call's argument, views, and the graph's concatenations with their
operands."""

from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
from torch import fx

__all__ = ["VIEWS", "argument", "concatenations", "example_value", "is_view_of"]

_CATS = {torch.cat, torch.concat, getattr(torch, "concatenate", torch.cat)}
# Tensor methods that view their input keeping each element once: an elementwise op without
# operands computes the same values before them as after them.
VIEWS = {"permute", "unflatten", "flatten", "view", "reshape", "transpose"}


def example_value(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo recorded as `node`'s value (``node.meta["example_value"]``), or None
    (not a node, no record, or not a tensor)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def argument(node: fx.Node, index: int, name: str, default: Any) -> Any:
    """The call's argument at position `index`, or else the keyword `name`, or else `default`."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def is_view_of(node: fx.Node, source: fx.Node) -> bool:
    """Whether `node` is ``source.<view>(...)``, a method of VIEWS called on `source`."""
    return node.op == "call_method" and node.target in VIEWS and bool(node.args) and node.args[0] is source


def concatenations(graph: fx.Graph) -> Iterator[Tuple[fx.Node, Sequence[Any], Any]]:
    """(node, tensors, dim) of each ``torch.cat(tensors, dim)`` of `graph` (or torch.concat /
    torch.concatenate) whose tensors are a list or tuple, in graph order; a list taken first, so
    that the caller may rewrite or erase the nodes it is given."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CATS or len(node.args) + len(node.kwargs) > 2:
            continue
        tensors, dim = argument(node, 0, "tensors", None), argument(node, 1, "dim", 0)
        if isinstance(tensors, (list, tuple)):
            yield node, tensors, dim
