"""What the fusion backend's graph rewrites read of a Dynamo-captured FX graph: the example value
Dynamo records on a node, and the graph's concatenations with their operands."""

from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
from torch import fx

__all__ = ["CATS", "concatenations", "example_value"]

CATS = {torch.cat, torch.concat, getattr(torch, "concatenate", torch.cat)}


def example_value(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo recorded as `node`'s value (``node.meta["example_value"]``), or None
    (not a node, no record, or not a tensor)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def concatenations(graph: fx.Graph) -> Iterator[Tuple[fx.Node, Sequence[Any], Any]]:
    """(node, tensors, dim) of each ``torch.cat(tensors, dim)`` of `graph` (or torch.concat /
    torch.concatenate) whose tensors are a list or tuple, in graph order; a list taken first, so
    that the caller may rewrite or erase the nodes it is given."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in CATS or len(node.args) + len(node.kwargs) > 2:
            continue
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if isinstance(tensors, (list, tuple)):
            yield node, tensors, dim
