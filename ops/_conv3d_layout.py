"""The fusion backend's layout pass: 3-D convolutions in channels_last_3d (docs/design.md, "3-D
convolutions in channels_last_3d").

Inductor's layout optimization turns 2-D convolutions channels-last and leaves 3-D ones in the
layout of their operands, so a video VAE written in NCDHW runs every convolution through cuDNN's
NDHWC kernels with a transpose of the activations in and out of each (20 ms of the HunyuanVideo
decode's 120 on an H200). :func:`channels_last_3d_convolutions` asks Inductor for channels_last_3d
weights (``prims.inductor_force_stride_order``, Inductor's own stride constraint), which makes cuDNN
pick channels_last_3d for the convolution and Inductor lay out the kernels around it so; fusednorm's
ops keep their input's layout. Inductor lays a concatenation out by its inputs, which a pointwise
producer leaves contiguous, so the pass asks for channels_last_3d inputs of 5-D concatenations too
(the video VAEs' upsamplers concatenate their first frame with the others before a convolution),
and for the video whose frames a fusednorm op normalizes (Mochi's per-frame norms), and drops the
``.contiguous()`` calls that would turn a tensor back into NCDHW before ops that take any layout.
"""

import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx

from ._fx_nodes import concatenations, example_value

__all__ = ["channels_last_3d_convolutions"]

_CONV3D = {F.conv3d, torch.conv3d}
# cuDNN's channels_last_3d convolutions measured against its NCDHW ones: half and bfloat16.
_DTYPES = (torch.float16, torch.bfloat16)
# Where cuDNN runs the convolutions (tests add "cpu" to run the pass on small graphs).
_DEVICE_TYPES = ("cuda",)
# Ops that compute the same values whatever their input's strides, under Inductor (which
# decomposes interpolate into indexing): a `.contiguous()` whose users are all among them (or
# fusednorm's ops) is dropped from a channels_last_3d graph.
_ANY_LAYOUT = {F.interpolate, F.pad, torch._C._nn.pad, F.conv3d, torch.conv3d, F.group_norm, torch.group_norm, F.silu,
               operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
               torch.div}


def _force_stride_order() -> Optional[Callable[..., Any]]:
    """``prims.inductor_force_stride_order.default``, or None on a torch without it."""
    try:
        import torch._inductor.inductor_prims  # noqa: F401 (registers the prim)
    except ImportError:
        return None
    packet = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return getattr(packet, "default", None)


def _candidate(value: Optional[torch.Tensor]) -> bool:
    """A 5-D tensor of a static shape, of a dtype and on a device the pass is for."""
    return value is not None and value.dim() == 5 and value.dtype in _DTYPES \
        and value.device.type in _DEVICE_TYPES and all(type(s) is int for s in value.shape)


def _dense(value: torch.Tensor) -> bool:
    """Whether `value`'s elements fill its storage span once each (no overlap, no gaps)."""
    expected = 1
    dims = sorted(((size, stride) for size, stride in zip(value.shape, value.stride()) if size != 1),
                  key=lambda dim: dim[1])
    for size, stride in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _channels_last_3d_strides(value: torch.Tensor) -> List[int]:
    n, c, d, h, w = value.shape
    del n
    return [c * d * h * w, 1, c * h * w, c * w, c]


def channels_last_3d_convolutions(gm: fx.GraphModule) -> int:
    """Rewrites, in place, a Dynamo-captured inference graph ``gm`` so that Inductor runs its 3-D
    convolutions (``F.conv3d`` / ``torch.conv3d`` of half or bfloat16 CUDA tensors of static
    shapes) in channels_last_3d: each weight not already channels_last_3d in the example values,
    each 5-D input of a concatenation, and each video whose frames a fusednorm op takes, goes
    through ``prims.inductor_force_stride_order`` (no copy when the tensor has those strides, as
    a buffer Inductor has not laid out yet has); a ``.contiguous()`` whose users take any layout
    is dropped; the graph's outputs keep the strides eager gives them. Returns how many
    convolutions now run in channels_last_3d (those whose weights the model had in
    channels_last_3d included); 0 leaves the graph as it was. The prim has no backward: the
    caller runs the pass only on graphs that need none. A no-op on a torch without the prim."""
    force = _force_stride_order()
    if force is None:
        return 0
    graph = gm.graph
    convs = [node for node in graph.nodes if node.op == "call_function" and node.target in _CONV3D]
    weights = []
    for conv in convs:
        weight = conv.args[1] if len(conv.args) > 1 else conv.kwargs.get("weight")
        value = example_value(weight)
        if _candidate(value):
            weights.append((conv, weight, value))
    if not weights:
        return 0
    for conv, weight, value in weights:
        if value.is_contiguous(memory_format=torch.channels_last_3d):
            continue  # (the model's own weights, converted by the user)
        with graph.inserting_before(conv):
            forced = graph.call_function(force, (weight, _channels_last_3d_strides(value)))
        conv.replace_input_with(weight, forced)
    for cat, tensors, _ in concatenations(graph):
        if not _candidate(example_value(cat)):
            continue
        inputs = []
        for item in tensors:
            value = example_value(item)
            if _candidate(value):
                with graph.inserting_before(cat):
                    item = graph.call_function(force, (item, _channels_last_3d_strides(value)))
            inputs.append(item)
        if cat.args:
            cat.args = (type(tensors)(inputs),) + tuple(cat.args[1:])
        else:
            cat.kwargs = {**cat.kwargs, "tensors": type(tensors)(inputs)}
    for permute, video in _normalized_frames(graph):
        with graph.inserting_before(permute):
            forced = graph.call_function(force, (video, _channels_last_3d_strides(example_value(video))))
        permute.replace_input_with(video, forced)
    _drop_contiguous(graph)
    _outputs_in_eager_strides(graph, force)
    graph.lint()
    gm.recompile()
    return len(weights)


def _is_fusednorm_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.name.startswith("fusednorm::")


def _normalized_frames(graph: fx.Graph) -> List[Tuple[fx.Node, fx.Node]]:
    """(permute, video) of each fusednorm op whose input is the frames of a 5-D tensor the pass
    is for, ``video.permute(0, 2, 1, 3, 4).flatten(0, 1)`` (the per-frame norms of Mochi's VAE,
    one norm since ``one_norm_of_frames``) or ``video.transpose(1, 2).flatten(0, 1)``
    (``fusednorm.nn.FrameGroupNorm``'s, in a model ``convert`` converted). The pass asks for
    `video` in channels_last_3d: its frames are then channels-last, and so are the op's output
    and the video it is viewed back into, which the pad and the convolution after it take as they
    are, where frames of an NCDHW video would give a video dense in no layout (docs/design.md,
    "3-D convolutions in channels_last_3d")."""
    found = []
    for node in graph.nodes:
        if not _is_fusednorm_op(node) or not node.args:
            continue
        frames = node.args[0]
        if not (isinstance(frames, fx.Node) and frames.op == "call_method" and frames.target == "flatten"
                and tuple(frames.args[1:]) == (0, 1) and not frames.kwargs):
            continue
        permute = frames.args[0]
        if not (isinstance(permute, fx.Node) and permute.op == "call_method" and not permute.kwargs and (
                permute.target == "permute" and tuple(permute.args[1:]) in ((0, 2, 1, 3, 4), ((0, 2, 1, 3, 4),))
                or permute.target == "transpose" and tuple(permute.args[1:]) in ((1, 2), (2, 1)))):
            continue
        video = permute.args[0]
        value = example_value(video)
        if isinstance(video, fx.Node) and _candidate(value) \
                and not value.is_contiguous(memory_format=torch.channels_last_3d):
            found.append((permute, video))
    return found


def _takes_any_layout(user: fx.Node) -> bool:
    if user.op != "call_function":
        return False
    return user.target in _ANY_LAYOUT or _is_fusednorm_op(user)  # (fusednorm's ops take both layouts)


def _drop_contiguous(graph: fx.Graph) -> None:
    """Drops each ``x.contiguous()`` of a 5-D tensor the pass is for whose users all take any
    layout: in a graph whose convolutions run in channels_last_3d it would transpose x back into
    NCDHW (HunyuanVideo's resnets and upsamplers call it on their input)."""
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target != "contiguous" or len(node.args) != 1 \
                or node.kwargs.get("memory_format", torch.contiguous_format) is not torch.contiguous_format \
                or set(node.kwargs) - {"memory_format"} or not _candidate(example_value(node.args[0])) \
                or not node.users or not all(_takes_any_layout(user) for user in node.users):
            continue
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


def _outputs_in_eager_strides(graph: fx.Graph, force: Callable[..., Any]) -> None:
    """Each dense output of 4 or more dimensions computed in the graph keeps the strides eager
    gave it (Inductor gives an output the strides of the graph it compiles, where they follow the
    convolutions' layout): a copy where they differ, nothing where they do not."""
    output = next(node for node in graph.nodes if node.op == "output")
    forced: Dict[fx.Node, fx.Node] = {}

    def keep(node: fx.Node) -> fx.Node:
        value = example_value(node)
        if node.op == "placeholder" or value is None or value.dim() < 4 \
                or value.device.type not in _DEVICE_TYPES or not all(type(s) is int for s in value.shape) \
                or not _dense(value):
            return node
        if node not in forced:
            with graph.inserting_before(output):
                forced[node] = graph.call_function(force, (node, list(value.stride())))
        return forced[node]

    output.args = fx.node.map_arg(output.args, keep)
