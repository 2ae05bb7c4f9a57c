"""The fusion backend's rewrites of per-frame group norms (docs/design.md, "Group norms of frames").

Mochi's VAE normalizes each frame of a video (N, C, T, H, W) on its own, a few frames at a time
to save memory (``MochiChunkedGroupNorm3D``)::

    y = x.permute(0, 2, 1, 3, 4).flatten(0, 1)                       # (N * T, C, H, W)
    z = torch.cat([group_norm(c, G, w, b, eps) for c in y.split(k, dim=0)], dim=0)
    out = act(z.unflatten(0, (N, -1)).permute(0, 2, 1, 3, 4))       # then a pad, a convolution

A group norm normalizes each sample apart, so the concatenation is ``group_norm(y, G, w, b,
eps)``; and an activation computes the same values before the views as after them. Rewritten so,
the norm and its activation are one chain for the fusion rules (and the pad after the views one
for the pad rule), where the concatenation of separate norms ended every chain at the norm.

EasyAnimate's and Cosmos's VAEs normalize frames in one call, ``norm(x.permute(0, 2, 1, 3,
4).flatten(0, 1))``, and view the result back before their activation: the activation moves
before those views the same way, for every group norm of a graph.
"""

import operator
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import fx

from ._fx_nodes import argument, concatenations, example_value, is_view_of

__all__ = ["activations_before_views", "one_norm_of_frames"]

_GROUP_NORMS = {F.group_norm, torch.group_norm}


def _split_at_dim_0(node: Any) -> bool:
    """Whether `node` is ``y.split(k)`` / ``torch.split(y, k)`` along dimension 0."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method" and node.target == "split" or node.op == "call_function" and node.target is torch.split:
        return argument(node, 2, "dim", 0) == 0 and type(argument(node, 1, "split_size_or_sections", None)) is int
    return False


def _chunks_of_one_split(norms: List[fx.Node]) -> Optional[fx.Node]:
    """The split whose chunks, in order and each once, are the inputs of `norms`, each chunk used
    by its norm alone and every chunk of the split taken; None otherwise."""
    split = None
    for i, norm in enumerate(norms):
        chunk = norm.args[0] if norm.args else None
        if not (isinstance(chunk, fx.Node) and chunk.op == "call_function" and chunk.target is operator.getitem
                and len(chunk.args) == 2 and chunk.args[1] == i and len(chunk.users) == 1):
            return None
        if split is None:
            split = chunk.args[0]
        if chunk.args[0] is not split:
            return None
    if not _split_at_dim_0(split) or len(split.users) != len(norms):
        return None
    return split


def _is_group_norm(node: Any) -> bool:
    """Whether `node` calls F.group_norm / torch.group_norm (an ``nn.GroupNorm`` module's call, as
    Dynamo keeps it on torch < 2.2, is made that by the backend's first step: _module_calls)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _GROUP_NORMS


def _same_norm(a: fx.Node, b: fx.Node) -> bool:
    """Whether norms `a` and `b` take the same arguments but their input."""
    return a.op == b.op and a.target == b.target and len(a.args) == len(b.args) \
        and all(x is y or x == y for x, y in zip(a.args[1:], b.args[1:])) \
        and a.kwargs.keys() == b.kwargs.keys() \
        and all(a.kwargs[k] is b.kwargs[k] or a.kwargs[k] == b.kwargs[k] for k in a.kwargs)


def _move_activation_before_views(graph: fx.Graph, norm: fx.Node, activations: Any) -> bool:
    """With ``act(view(...view(norm)))`` (each node used by the next alone, act out of place),
    computes act on the norm's output and the views after it; returns whether it did."""
    cur, views = norm, []
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if not is_view_of(user, cur):
            break
        views.append(user)
        cur = user
    if not views or len(cur.users) != 1:
        return False
    act = next(iter(cur.users))
    if act.op != "call_function" or act.target not in activations or act.target.__name__.endswith("_") \
            or not act.args or act.args[0] is not cur or act.kwargs.get("inplace", False) \
            or any(isinstance(a, fx.Node) for a in list(act.args[1:]) + list(act.kwargs.values())):
        return False
    with graph.inserting_after(norm):
        moved = graph.call_function(act.target, (norm,) + tuple(act.args[1:]), dict(act.kwargs))
    moved.meta["example_value"] = norm.meta.get("example_value")
    views[0].replace_input_with(norm, moved)
    act.replace_all_uses_with(cur)
    graph.erase_node(act)
    return True


def one_norm_of_frames(gm: fx.GraphModule) -> int:
    """Rewrites, in place, each ``torch.cat([group_norm(c, ...) for c in y.split(k)], dim=0)`` of a
    Dynamo-captured graph ``gm`` (every chunk of the split, in order, normalized with the same
    arguments and used by nothing else) into ``group_norm(y, ...)``. Returns how many
    concatenations it rewrote."""
    graph = gm.graph
    count = 0
    for cat, norms, dim in concatenations(graph):
        if dim != 0 or not norms:
            continue
        if not all(_is_group_norm(n) and len(n.users) == 1 and _same_norm(n, norms[0]) for n in norms) \
                or len(set(norms)) != len(norms):
            continue
        split = _chunks_of_one_split(list(norms))
        value = example_value(cat)
        if split is None or value is None:
            continue
        # The norm runs where the concatenation was: only the chunks and their norms in between.
        between, node = set(norms) | {n.args[0] for n in norms}, split.next
        while node is not cat and node in between:
            node = node.next
        if node is not cat:
            continue
        first = norms[0]
        with graph.inserting_before(cat):
            norm = graph.create_node(first.op, first.target, (split.args[0],) + tuple(first.args[1:]),
                                     dict(first.kwargs))
        norm.meta.update(first.meta)
        norm.meta["example_value"] = value
        cat.replace_all_uses_with(norm)
        graph.erase_node(cat)
        for n in norms:
            chunk = n.args[0]
            graph.erase_node(n)
            graph.erase_node(chunk)
        graph.erase_node(split)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def activations_before_views(gm: fx.GraphModule, activations: Any) -> int:
    """Rewrites, in place, each ``act(view(...view(group_norm(...))))`` of a Dynamo-captured graph
    ``gm`` (each view used by the next alone, ``act`` among `activations`, out of place, its other
    arguments constants) into ``view(...view(act(group_norm(...))))``: the same values, the norm and
    its activation next to each other for the fusion rules. Returns how many it rewrote."""
    graph = gm.graph
    count = sum(_move_activation_before_views(graph, node, activations)
                for node in list(graph.nodes) if _is_group_norm(node))
    if count:
        graph.lint()
        gm.recompile()
    return count
