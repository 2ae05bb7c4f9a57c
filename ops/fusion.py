"""Opt-in ``torch.compile`` fusion: PyTorch's own group_norm / instance_norm followed by
elementwise epilogues become one fusednorm op, with no change to the model code::

    model = torch.compile(model, backend=fusednorm.fusion.backend())          # then Inductor
    model = torch.compile(model, backend=fusednorm.fusion.backend("aot_eager"))
    model = torch.compile(model, backend=fusednorm.fusion.backend(mode="reduce-overhead"))  # CUDA graphs

The backend rewrites each graph Dynamo captures (:func:`fuse_graph`) and hands it to the inner
backend. With Inductor as the inner backend, ``mode`` and ``options`` are what ``torch.compile``'s
own arguments of those names are (``backend(mode="reduce-overhead")``: Inductor with CUDA graphs;
see :func:`backend`). A chain is rewritten when it starts at ``F.group_norm`` / ``torch.group_norm`` /
``F.instance_norm`` / ``torch.instance_norm`` (what ``nn.GroupNorm`` / ``nn.InstanceNorm*d``
calls become; where Dynamo keeps torch.nn modules as module calls, torch < 2.2, the backend first
rewrites those into the functional calls their forwards make: ``fusednorm._module_calls``) and
continues through, in this order, each step optional::

    z * (1 + scale)    scale of shape (N, C, 1, ..., 1), the ``1 + scale`` written out
    z + shift          shift of shape (N, C, 1, ..., 1)
    z + residual       residual of z's shape
    act(z)             F.silu, F.relu / torch.relu / Tensor.relu (in place or not), F.gelu
                       (approximate 'none' or 'tanh'), F.leaky_relu, F.mish, or their nn modules
    z * multiplier     multiplier of z's shape

into ``torch.ops.fusednorm.group_norm`` / ``instance_norm`` with those epilogue arguments. A step
is taken only when the value it consumes has no other user, appears once among its operands
(and is the one modified, for an in-place op), and when the norm's input, every operand and
every intermediate have the same dtype (no promotion, hence no autocast-dependent rewrite) and
the shapes above, read from the fake tensors Dynamo records (``node.meta["example_value"]``;
a node without one is not fused). Steps out of this order end the chain: reordering would change
the rounding. A norm with no step after it is left as it is (``_bare_norm_left``).

Per-frame group norms run in chunks (Mochi's VAE: ``torch.cat([F.group_norm(c, ...) for c in
y.split(k)])``, y a video's frames as a batch) become one norm of y first; then an activation after
views of any group norm (the frames permuted back: Mochi's, EasyAnimate's, Cosmos's) moves before
the views, so that the chain above reaches it (docs/design.md, "Group norms of frames").

Before Inductor (the default inner backend), a chain is also left as it is when the norm's input
is an elementwise op (add, sub, mul, div) that nothing else uses, on less than 8 MiB
(``INDUCTOR_PROLOGUE_MAX_BYTES``): Inductor computes that op inside its own norm kernels, where
the fused op would have it written to memory and read back. In the SD1.5 UNet these are the
``conv(h) + temb`` adds before each ResnetBlock's second norm; measured on an H200 with CUDA
graphs, fusing them cost 5% at batch 2 and leaving them all cost 1.5% at batch 8, whose larger ones the
rule fuses (docs/design.md, "Compile-time fusion").

Likewise a chain whose last value goes to an elementwise op alone (a spatial norm's
``group_norm(f) * y + b``, the add out of the epilogue's order, in the decoders of Kandinsky's
KVAE), on tensors of at most 4 dimensions: Inductor computes that op inside its own norm's output
kernel, where after the fused op it would be a pass of its own. A video's chain (CogVideoX's
spatial norms) is fused all the same: its norms read the channels_last_3d tensors of the layout
pass below, on which Inductor's norm kernels are far slower than the fused op
(docs/design.md, "Compile-time fusion").

Before the norm, a group norm also takes over the bias of the convolution that feeds it
(``F.conv1d/2d/3d``, ``torch.conv1d/2d/3d``) and an embedding of shape (N, C, 1, ..., 1) added to
that convolution's output (the UNet's ``conv1(h) + temb``), when each is used only by the next and
has the norm's dtype: the convolution runs without its bias and the fused op gets
``input_bias = bias [+ embedding]`` (docs/design.md, "Input bias"). The Inductor rule above is
applied first; a norm with such a prologue and no step after it is fused too.

A group norm whose input is a residual add, ``a + b`` or ``(a + b) / 1`` (a ResnetBlock's output
at ``output_scale_factor=1``) with a and b of its shape and dtype and at least one of them a
convolution with a bias used only by the add, becomes ``torch.ops.fusednorm.add_group_norm(a, b,
..., input_bias=the biases)``, whose second output (the sum) replaces the add's other uses; only
when those come after the chain, and only where the CUDA planner gives the call the channels-last
sweep, the one path that computes the sum on the fly (docs/design.md, "Residual-add prologue").

After a fused op on CUDA tensors, ``F.pad(z, padding, mode="replicate")`` (non-negative padding of
1-3 dimensions; z the op's output, an eval-mode dropout of it, or a view of it) becomes
``torch.ops.fusednorm.replication_pad``: the causal convolutions of the video VAEs pad a norm's
output so, and Inductor, which folds the pad into its own norm kernel, runs it alone and slowly
after an opaque op. The op's kernels take contiguous and channels-last inputs and keep the format
(docs/design.md, "Replication pad").

With Inductor, the backend first rewrites ``torch.cat([x[:, :, :1]] * k + [x], dim=2)`` (the
causal time padding of CogVideoX's convolutions; any dimension but the first two) into the
``F.pad(x, ..., mode="replicate")`` it equals, which Inductor computes inside x's kernel, or which
the rule above gives fusednorm's pad kernel (docs/design.md, "Concatenations that are replication
pads").

With Inductor, on a graph that needs no backward, the backend also runs the 3-D convolutions of
half / bfloat16 CUDA tensors in channels_last_3d, with 5-D concatenations laid out so too and
the ``.contiguous()`` calls that would undo it dropped where no user needs them
(``backend(conv3d_channels_last=False)`` turns this off; docs/design.md, "3-D convolutions in
channels_last_3d"): Inductor does so for 2-D convolutions alone, and cuDNN transposes an NCDHW
convolution's operands in and out of NDHWC.

The fused op runs where the chain ends, so a step is also refused when a node between the norm and
it reads the running statistics the norm updates (it would see them before the update), or when
a node between it and the previous one may mutate a tensor or change grad mode / autocast (in-place ops, ``out=``,
``inplace=True``, setitem, running-statistics updates, context-manager calls), and an operand
that is itself modified in place anywhere in the graph is not taken. Not fused: ``sigmoid(z) * z``
written out, per-channel operands that only broadcast over N (shape (1, C, 1, 1)), scalars, and
fusednorm's own ops. Known limit: the fused op saves its operands for backward; an operand
modified in place through a view after the fused op makes backward raise (a version-counter
error, never a wrong gradient) where the unfused code would not have saved it.
"""

import inspect
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx

from ._cat_pads import replication_pad_concatenations
from ._conv3d_layout import channels_last_3d_convolutions
from ._frame_norms import activations_before_views, one_norm_of_frames
from ._fx_nodes import argument, example_value, is_view_of
from ._module_calls import lower_module_calls

__all__ = ["backend", "dynamo_backend", "fuse_graph", "FusionBackend", "INDUCTOR_PROLOGUE_MAX_BYTES"]

_SCALE, _SHIFT, _RESIDUAL, _ACT, _MULTIPLIER = range(5)

_GN = ("input", "num_groups", "weight", "bias", "eps", "cudnn_enabled")
_NORMS = {  # target -> (fused op name, positional parameter names)
    F.group_norm: ("group_norm", _GN[:5]),
    torch.group_norm: ("group_norm", _GN),
    F.instance_norm: ("instance_norm", ("input", "running_mean", "running_var", "weight", "bias",
                                        "use_input_stats", "momentum", "eps")),
    torch.instance_norm: ("instance_norm", ("input", "weight", "bias", "running_mean", "running_var",
                                            "use_input_stats", "momentum", "eps", "cudnn_enabled")),
}
_OP_PARAMS = {  # the fused ops' positional parameters
    "group_norm": _GN[:5],
    "instance_norm": ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps"),
}
_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5, "running_mean": None, "running_var": None,
             "use_input_stats": True, "momentum": 0.1}
_ACTIVATIONS = {F.silu: "silu", F.relu: "relu", torch.relu: "relu", torch.relu_: "relu",
                F.mish: "mish", F.gelu: "gelu", F.leaky_relu: "leaky_relu", F.leaky_relu_: "leaky_relu"}
_BINARY = {operator.add: ("add", False), torch.add: ("add", False), operator.iadd: ("add", True),
           operator.mul: ("mul", False), torch.mul: ("mul", False), operator.imul: ("mul", True)}
_BINARY_METHODS = {"add": ("add", False), "add_": ("add", True), "mul": ("mul", False), "mul_": ("mul", True)}
_MUTATING = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
             operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
             operator.irshift, operator.imatmul}
_MUTATING_METHODS = {f"__{f.__name__}__" for f in _MUTATING}  # __setitem__, __iadd__, ...
_RUNNING_STATS = {F.batch_norm, F.instance_norm, torch.batch_norm, torch.instance_norm}  # update buffers
_ELEMENTWISE = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul, torch.div}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div"}
_PADS = {F.pad, torch._C._nn.pad}
_PAD_PARAMS = inspect.signature(lambda input, pad, mode="constant", value=None: None).parameters
_DROPOUT_PARAMS = {F.dropout: inspect.signature(F.dropout).parameters,
                   torch.dropout: inspect.signature(lambda input, p, train: None).parameters}
_CONVS = {F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d}
# A chain whose input Inductor would compute inside its own norm kernels is left to it below this
# size (docs/design.md, "Compile-time fusion"): at 8 MiB and over, the fused op wins
# even though the input is then written and read back.
INDUCTOR_PROLOGUE_MAX_BYTES = 8 * 2**20


def _eq(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:  # symbolic sizes: only what is known without adding a guard
        from torch.fx.experimental.symbolic_shapes import statically_known_true
    except ImportError:  # torch < 2.2: the same expression (sympy compares structurally)
        expr = [x.node.expr if isinstance(x, torch.SymInt) else x for x in (a, b)]
        return bool(expr[0] == expr[1])
    return statically_known_true(a == b)


def _is_like(t: Optional[torch.Tensor], ref: torch.Tensor) -> bool:
    return t is not None and t.dtype == ref.dtype and t.device == ref.device and t.dim() == ref.dim()


def _is_full(t: Optional[torch.Tensor], ref: torch.Tensor) -> bool:
    """t has ref's shape, dtype and device."""
    return _is_like(t, ref) and all(_eq(a, b) for a, b in zip(t.shape, ref.shape))


def _is_per_channel(t: Optional[torch.Tensor], ref: torch.Tensor) -> bool:
    """t has shape (N, C, 1, ..., 1) for ref of shape (N, C, *), and ref's dtype and device."""
    return _is_like(t, ref) and ref.dim() >= 3 and _eq(t.shape[0], ref.shape[0]) \
        and _eq(t.shape[1], ref.shape[1]) and all(_eq(s, 1) for s in t.shape[2:])


def _norm(node: fx.Node) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(fused op name, its arguments) when `node` computes a plain group/instance norm."""
    if node.op == "call_function" and node.target in _NORMS:
        op, names = _NORMS[node.target]
        args = {name: argument(node, i, name, _DEFAULTS.get(name)) for i, name in enumerate(names)}
        args.pop("cudnn_enabled", None)
        return op, args
    return None


def _activation(node: fx.Node) -> Optional[Tuple[fx.Node, Dict[str, Any]]]:
    """(input, epilogue arguments) when `node` applies a supported activation."""
    name, slope = None, 0.01
    if node.op == "call_function" and node.target in _ACTIVATIONS:
        name = _ACTIVATIONS[node.target]
        if name == "gelu":
            approximate = argument(node, 1, "approximate", "none")
            name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
        elif name == "leaky_relu":
            slope = argument(node, 1, "negative_slope", 0.01)
            name = name if isinstance(slope, (int, float)) and not isinstance(slope, bool) else None
    elif node.op == "call_method" and node.target in ("relu", "relu_") and len(node.args) == 1:
        name = "relu"
    if name is None:
        return None
    return argument(node, 0, "input", None), {"activation": name, "negative_slope": float(slope)}


def _binary(node: fx.Node) -> Optional[Tuple[str, bool, Any, Any]]:
    """(kind, in_place, a, b) for a two-operand add / mul without alpha."""
    if node.op == "call_function" and node.target in _BINARY:
        kind, in_place = _BINARY[node.target]
    elif node.op == "call_method" and node.target in _BINARY_METHODS:
        kind, in_place = _BINARY_METHODS[node.target]
    else:
        return None
    if len(node.args) != 2 or node.kwargs:
        return None
    return (kind, in_place) + tuple(node.args)


def _one_plus(node: Any, ref: torch.Tensor) -> Optional[fx.Node]:
    """s when `node` computes 1 + s (or s + 1) out of place, s a per-channel operand."""
    if not isinstance(node, fx.Node) or not _is_per_channel(example_value(node), ref):
        return None
    binary = _binary(node)
    if binary is None or binary[:2] != ("add", False):
        return None
    for one, s in (binary[2:], binary[3:1:-1]):
        if type(one) in (int, float) and one == 1 and _is_per_channel(example_value(s), ref):
            return s
    return None


def _step(gm: fx.GraphModule, node: fx.Node, cur: fx.Node, ref: torch.Tensor):
    """(stage, epilogue arguments, the `1 + scale` node or nothing) when `node` continues the chain
    from `cur`."""
    out = example_value(node)
    if not _is_full(out, ref):
        return None
    activation = _activation(node)
    if activation is not None:
        return (_ACT, activation[1], []) if activation[0] is cur else None
    binary = _binary(node)
    if binary is None:
        return None
    kind, in_place, a, b = binary
    if (a is cur) == (b is cur) or (in_place and a is not cur):
        return None
    other = b if a is cur else a
    if kind == "add" and _is_per_channel(example_value(other), ref):
        return _SHIFT, {"shift": other}, []
    if kind == "add" and _is_full(example_value(other), ref):
        return _RESIDUAL, {"residual": other}, []
    scale = _one_plus(other, ref) if kind == "mul" else None
    if scale is not None:
        return _SCALE, {"scale": scale}, [other]
    if kind == "mul" and _is_full(example_value(other), ref):
        return _MULTIPLIER, {"multiplier": other}, []
    return None


def _may_mutate(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` may change a tensor, or a global state (grad mode, autocast), that a
    computation moved from before it to after it would read. Errs on the side of True."""
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return node.is_impure() or bool(getattr(module, "inplace", False)) or any(True for _ in module.buffers())
    if node.is_impure() or node.target in _MUTATING or node.target in _RUNNING_STATS or "out" in node.kwargs:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if (name.endswith("_") and not name.startswith("__")) or name in _MUTATING_METHODS \
            or name.startswith(("_set", "set_", "_enter", "_exit")):
        return True
    try:
        parameters = list(inspect.signature(node.target).parameters) if callable(node.target) else []
    except (TypeError, ValueError):  # builtins without a signature
        parameters = []
    return "inplace" in parameters and bool(argument(node, parameters.index("inplace"), "inplace", False))


def _mutated(gm: fx.GraphModule, node: Any) -> bool:
    """Whether some node modifies `node` itself in place. Such a tensor is not taken as an
    operand: the fused op saves its operands for backward, which the modification would void."""
    return isinstance(node, fx.Node) and any(
        user.op in ("call_function", "call_method") and len(user.args) > 0 and user.args[0] is node
        and user.target not in _RUNNING_STATS and _may_mutate(gm, user) for user in node.users)


def _untouched_between(gm: fx.GraphModule, start: fx.Node, end: fx.Node) -> bool:
    """Whether no node after `start` and before `end` (which follows it) may mutate."""
    node = start.next
    while node is not end and not _may_mutate(gm, node):
        node = node.next
    return node is end


def _running_stats_readers(gm: fx.GraphModule, norm: fx.Node, args: Dict[str, Any]) -> List[fx.Node]:
    """The nodes other than `norm` that read (or view) the running statistics `norm` updates in
    place; none when it updates none."""
    if args.get("use_input_stats", True) is False:
        return []
    stats = [args.get(name) for name in ("running_mean", "running_var")]
    sources = [s for s in stats if isinstance(s, fx.Node)]
    # Another get_attr of the same buffer is the same tensor.
    targets = {s.target for s in sources if s.op == "get_attr"}
    sources += [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in targets and n not in sources]
    readers: List[fx.Node] = []
    pending = list(sources)
    while pending:  # users, and users of users: views of a buffer read it too
        for user in pending.pop().users:
            if user is not norm and user not in readers:
                readers.append(user)
                pending.append(user)
    return readers


def _hint(n: Any) -> Optional[int]:
    """An int, or a symbolic size's hint, read without adding a guard; None without one."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _numel_hint(t: torch.Tensor) -> Optional[int]:
    """t.numel(), read without adding a guard (_hint)."""
    return _hint(t.numel())


def _is_elementwise(node: fx.Node) -> bool:
    """Whether `node` is an out-of-place add, sub, mul or div (function or method)."""
    return (node.op == "call_function" and node.target in _ELEMENTWISE) \
        or (node.op == "call_method" and node.target in _ELEMENTWISE_METHODS)


def _inductor_prologue(node: Any, source: torch.Tensor) -> bool:
    """Whether the norm's input `node` is an out-of-place elementwise op with no other user, on
    fewer than INDUCTOR_PROLOGUE_MAX_BYTES: Inductor computes such an op inside its own norm
    kernels, and would have to write it out and read it back for the fused op."""
    if not isinstance(node, fx.Node) or len(node.users) != 1 or not _is_elementwise(node):
        return False
    numel = _numel_hint(source)
    return numel is not None and numel * source.element_size() < INDUCTOR_PROLOGUE_MAX_BYTES


def _inductor_epilogue(end: fx.Node) -> bool:
    """Whether the chain's last value `end` goes to an out-of-place elementwise op alone (a spatial
    norm's ``group_norm(f) * y + b``, its add out of the epilogue's order): Inductor computes that
    op inside its own norm's output kernel, where after the fused op it would be a pass of its own,
    reading the op's output back (docs/design.md, "Compile-time fusion")."""
    return len(end.users) == 1 and _is_elementwise(next(iter(end.users)))


def _bare_norm_left(node: fx.Node) -> bool:
    """Whether a norm with no epilogue step, no prologue and no residual add is left as it is:
    always. The op would save no pass over memory, only put fusednorm's kernels in place of
    Inductor's (or eager's) norm, and Inductor writes the views after it (a transformer's
    ``permute(...).reshape(...)`` into tokens) in its norm's output kernel. The video UNets'
    attention norms are such norms (docs/design.md, "Compile-time fusion");
    ``tools/fusion_rule_ab.py _bare_norm_left`` times the other choice."""
    return True


def _conv_bias(gm: fx.GraphModule, node: Any, ref: torch.Tensor) -> Optional[Tuple[fx.Node, Optional[fx.Node]]]:
    """(conv, its bias node or None) when `node` is a convolution (F.conv1d/2d/3d, torch.conv1d/2d/3d)
    that nothing else uses, whose bias, if any, is a vector of ref's dtype not modified in place."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CONVS
            and len(node.users) == 1):
        return None
    bias = argument(node, 2, "bias", None)
    if bias is None:
        return node, None
    value = example_value(bias)
    if value is None or value.dtype != ref.dtype or value.device != ref.device or value.dim() != 1 \
            or not _eq(value.shape[0], ref.shape[1]) or _mutated(gm, bias):
        return None
    return node, bias


def _prologue(gm: fx.GraphModule, node: Any, ref: torch.Tensor) -> Optional[Dict[str, Any]]:
    """The input_bias the group norm of input `node` can take over (docs/design.md, "Input bias"):
    `node` is conv(h, w, b), or conv(h, w, b) + e with e of shape (N, C, 1, ..., 1) (a timestep
    embedding), each used only by the next. Returns {"conv", "bias", "embedding", "add"} (absent
    ones None), or None when there is nothing to take (no bias and no embedding)."""
    add, embedding, found = None, None, None
    binary = _binary(node) if isinstance(node, fx.Node) else None
    if binary is not None and binary[:2] == ("add", False) and len(node.users) == 1:
        a, b = binary[2:]
        for c, e in ((a, b), (b, a)):
            if isinstance(e, fx.Node) and _is_per_channel(example_value(e), ref) and not _mutated(gm, e):
                found = _conv_bias(gm, c, ref)
                if found is not None:
                    add, embedding = node, e
                    break
    if found is None:
        found = _conv_bias(gm, node, ref)
    if found is None or (found[1] is None and embedding is None):
        return None
    return {"conv": found[0], "bias": found[1], "embedding": embedding, "add": add}


def _drop_conv_bias(conv: fx.Node) -> None:
    """Calls the convolution `conv` without its bias (the fused op takes it over)."""
    if len(conv.args) > 2:
        conv.update_arg(2, None)
    else:
        conv.update_kwarg("bias", None)


def _take_prologue(gm: fx.GraphModule, prologue: Dict[str, Any], rank: int) -> Tuple[fx.Node, fx.Node]:
    """Removes the bias from the convolution and the embedding's add; returns (the convolution,
    the input_bias node), inserted before the convolution's old user."""
    graph = gm.graph
    conv, bias, embedding, add = (prologue[k] for k in ("conv", "bias", "embedding", "add"))
    if bias is not None:
        _drop_conv_bias(conv)
    if embedding is None:
        return conv, bias
    if bias is None:
        input_bias = embedding
    else:
        with graph.inserting_before(add):
            column = graph.call_method("view", (bias, -1) + (1,) * (rank - 2))
            input_bias = graph.call_function(operator.add, (embedding, column))
    add.replace_all_uses_with(conv)
    graph.erase_node(add)
    return conv, input_bias


def _residual_add(gm: fx.GraphModule, node: Any, ref: torch.Tensor) -> Optional[Dict[str, Any]]:
    """The residual-add prologue the group norm of input `node` can take over (docs/design.md,
    "Residual-add prologue"): `node` is a + b, or (a + b) / 1 (diffusers' ``/ output_scale_factor``
    at its default), a and b of ref's shape and dtype, at least one of them a convolution with a
    bias that only the add uses (a resnet's ``conv2(h) + shortcut``). The sum may have other users
    (the next block's shortcut): they get the fused op's second output. Returns {"add", "div",
    "operands", "convs"} (div None without one; convs: the (conv, bias) pairs whose bias the op
    takes over), or None."""
    div = None
    if isinstance(node, fx.Node) and len(node.args) == 2 and not node.kwargs and (
            (node.op == "call_function" and node.target in (operator.truediv, torch.div))
            or (node.op == "call_method" and node.target == "div")):
        one = node.args[1]
        if type(one) in (int, float) and one == 1 and isinstance(node.args[0], fx.Node) \
                and len(node.args[0].users) == 1:
            div, node = node, node.args[0]
    binary = _binary(node) if isinstance(node, fx.Node) else None
    if binary is None or binary[:2] != ("add", False):
        return None
    operands = binary[2:]
    if not all(isinstance(t, fx.Node) and _is_full(example_value(t), ref) and not _mutated(gm, t) for t in operands) \
            or operands[0] is operands[1]:
        return None
    convs = [c for c in (_conv_bias(gm, t, ref) for t in operands) if c is not None and c[1] is not None]
    if not convs:
        return None
    return {"add": node, "div": div, "operands": operands, "convs": convs}


def _residual_add_pays(ref: torch.Tensor, num_groups: Any, epilogue: Dict[str, Any], inductor: bool) -> bool:
    """Whether the op computes the residual-add prologue's sum on the fly for this call: the CUDA
    planner gives it the channels-last sweep (the one path that does; the others would have the sum
    written by an add of their own, no better than Inductor's). Inductor lays a convolution's
    output out channels-last, so under it the plan is that of a channels-last input."""
    if ref.device.type != "cuda" or not isinstance(num_groups, int):
        return False
    shape = [_hint(size) for size in ref.shape]
    if None in shape:
        return False
    from . import kernel_paths

    channels_last = inductor or (ref.dim() >= 3 and ref.movedim(1, -1).is_contiguous() and not ref.is_contiguous())
    operands = [name for name in ("scale", "shift", "residual", "multiplier") if name in epilogue]
    try:
        plan = kernel_paths.plan(shape, num_groups, ref.dtype, channels_last=channels_last,
                                 activation=epilogue.get("activation"), operands=operands, device=ref.device,
                                 affine=False)
    except (RuntimeError, ValueError):
        return False
    return plan.startswith("path=cols_sweep")


def _take_residual_add(gm: fx.GraphModule, found: Dict[str, Any], before: fx.Node) -> Optional[fx.Node]:
    """Removes the biases of the residual add's convolutions; returns the input_bias node (their
    sum, inserted before `before`), or None without bias."""
    biases = []
    for conv, bias in found["convs"]:
        _drop_conv_bias(conv)
        biases.append(bias)
    input_bias = biases[0]
    if len(biases) > 1:
        with gm.graph.inserting_before(before):
            input_bias = gm.graph.call_function(operator.add, (biases[0], biases[1]))
    return input_bias


def _identity_dropout(node: fx.Node) -> bool:
    """Whether `node` is a dropout that returns its input (``training=False``, as nn.Dropout in
    eval mode calls it), not in place."""
    if node.op != "call_function" or node.target not in _DROPOUT_PARAMS:
        return False
    try:
        bound = inspect.Signature(list(_DROPOUT_PARAMS[node.target].values())).bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    return bound.arguments.get("train", bound.arguments.get("training")) is False \
        and not bound.arguments.get("inplace", False)


def _replication_pad_pays(value: torch.Tensor) -> bool:
    """Whether the CUDA kernel takes a replication pad of `value` (docs/design.md, "Replication
    pad"): on the CPU the op is ATen's pad, where Inductor's own pad kernel is as good."""
    return value.device.type == "cuda"


def _take_replication_pad(gm: fx.GraphModule, output: fx.Node) -> bool:
    """Replaces ``F.pad(output, padding, mode="replicate")`` (through dropouts that return their
    input, as in a causal convolution after ``norm -> act -> nn.Dropout``, and views) with
    ``fusednorm.replication_pad``: after a fused op, Inductor can no longer fold the pad into the
    norm's output kernel, and the pad it runs alone is slower than a copy, in either layout: the
    op's kernels take contiguous and channels-last inputs and keep the format (docs/design.md,
    "Replication pad"). Returns whether it did."""
    cur = output
    # (Views: a per-frame norm's output, unflattened and permuted back to (N, C, T, H, W).)
    while len(cur.users) == 1 and (_identity_dropout(next(iter(cur.users))) or is_view_of(next(iter(cur.users)), cur)):
        cur = next(iter(cur.users))
    if len(cur.users) != 1:
        return False
    pad = next(iter(cur.users))
    if pad.op != "call_function" or pad.target not in _PADS:
        return False
    try:
        bound = inspect.Signature(list(_PAD_PARAMS.values())).bind(*pad.args, **pad.kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    args = bound.arguments
    padding, value = args["pad"], example_value(cur)
    if args["mode"] != "replicate" or args["value"] is not None or value is None or args["input"] is not cur \
            or not isinstance(padding, (tuple, list)) or len(padding) not in (2, 4, 6) \
            or not all(type(p) is int and p >= 0 for p in padding) or value.dim() != len(padding) // 2 + 2 \
            or not _replication_pad_pays(value):
        return False
    with gm.graph.inserting_before(pad):
        fast = gm.graph.call_function(torch.ops.fusednorm.replication_pad.default, (cur, list(padding)))
    fast.meta.update(pad.meta)
    pad.replace_all_uses_with(fast)
    gm.graph.erase_node(pad)
    return True


def _fuse(gm: fx.GraphModule, node: fx.Node, leave_to_inductor: bool = False) -> bool:
    norm = _norm(node)
    ref = example_value(node)
    if norm is None or ref is None or not ref.is_floating_point():
        return False
    op, args = norm
    source = example_value(args["input"])
    if source is None or source.dtype != ref.dtype:
        return False
    if leave_to_inductor and _inductor_prologue(args["input"], source):
        return False
    prologue = _prologue(gm, args["input"], ref) if op == "group_norm" and ref.dim() >= 3 else None
    # The running-statistics update moves with the norm to where the chain ends: a read of the
    # statistics in between would see them before the update (the module docstring).
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    stat_reads = [position[r] for r in _running_stats_readers(gm, node, args)]
    stage, epilogue, chain, dying = -1, {}, [], []
    cur = node
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        step = _step(gm, user, cur, ref)
        if step is None or step[0] <= stage or any(_mutated(gm, t) for t in step[1].values()):
            break
        # The fused op runs where the chain ends: nothing in between may change what it reads.
        if not all(_untouched_between(gm, start, user) for start in [cur] + step[2]):
            break
        if any(position[node] < p <= position[user] for p in stat_reads):
            break
        stage, cur = step[0], user
        epilogue.update(step[1])
        chain.append(cur)
        dying += step[2]
    # (Not for videos: after the layout pass their norms read channels_last_3d tensors, where
    # Inductor's own norm kernels are far slower than the fused op; the module docstring.)
    if leave_to_inductor and ref.dim() <= 4 and _inductor_epilogue(cur):
        return False
    added = None
    if op == "group_norm" and ref.dim() >= 3 and prologue is None:
        added = _residual_add(gm, args["input"], ref)
        # The add moves to where the chain ends: the sum's other users must come after it, and
        # nothing between the add and the norm may change its operands.
        if added is not None and not (
                all(position[u] > position[cur] for u in args["input"].users if u is not node)
                and _untouched_between(gm, added["add"], node)
                and _residual_add_pays(ref, args["num_groups"], epilogue, leave_to_inductor)):
            added = None
    if not chain and prologue is None and added is None and _bare_norm_left(node):
        return False

    graph = gm.graph
    total = args["input"]  # with a residual add: the sum (the add, or the division by one)
    if prologue is not None:
        args["input"], epilogue["input_bias"] = _take_prologue(gm, prologue, ref.dim())
    if added is not None:
        input_bias = _take_residual_add(gm, added, cur)
        if input_bias is not None:
            epilogue["input_bias"] = input_bias
    params = tuple(args[name] for name in _OP_PARAMS[op])
    with graph.inserting_before(cur):
        if added is None:
            fused = output = graph.call_function(getattr(torch.ops.fusednorm, op).default, params, epilogue)
        else:  # add_group_norm(a, b, ...): (output, the sum)
            fused = graph.call_function(torch.ops.fusednorm.add_group_norm.default,
                                        tuple(added["operands"]) + params[1:], epilogue)
            output = graph.call_function(operator.getitem, (fused, 0))
            result = graph.call_function(operator.getitem, (fused, 1))
    fused.meta.update(node.meta)
    output.meta["example_value"] = cur.meta["example_value"]
    if added is not None:
        result.meta["example_value"] = total.meta["example_value"]
        fused.meta["example_value"] = (output.meta["example_value"], result.meta["example_value"])
    cur.replace_all_uses_with(output)
    for dead in reversed([node] + chain):
        graph.erase_node(dead)
    if added is not None:  # the sum's other users read the op's; the add (and division) go
        total.replace_all_uses_with(result)
        for dead in (added["div"], added["add"]):
            if dead is not None:
                graph.erase_node(dead)
    for dead in dying:
        if not dead.users:
            graph.erase_node(dead)
    _take_replication_pad(gm, output)
    return True


def fuse_graph(gm: fx.GraphModule, leave_to_inductor: bool = False) -> int:
    """Rewrite, in place, every norm-plus-epilogue chain of a Dynamo-captured ``gm`` into one
    fusednorm op (see the module docstring); returns how many were rewritten. With
    ``leave_to_inductor``, a chain whose input is an elementwise op that only the norm uses, on
    less than ``INDUCTOR_PROLOGUE_MAX_BYTES`` (8 MiB), is left as it is: Inductor, compiling the
    graph next, computes that op inside its own norm kernels."""
    # torch.nn module calls (older Dynamo's form) as the functional calls newer Dynamo records.
    lower_module_calls(gm)
    # Per-frame norms (docs/design.md, "Group norms of frames"): chunks made one norm, and an
    # activation after views of a norm moved before them, for the rules below.
    one_norm_of_frames(gm)
    activations_before_views(gm, _ACTIVATIONS)
    count = 0
    for node in list(gm.graph.nodes):
        if _fuse(gm, node, leave_to_inductor):  # (nodes erased by an earlier fusion are never norms)
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _inductor_config_patches(mode: Optional[str], options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The Inductor config patches that ``torch.compile(mode=mode, options=options)`` would apply:
    the mode's (``torch._inductor.list_mode_options``), then the options over them, their names
    with ``-`` read as ``_`` as torch.compile reads them. Raises ValueError for an unknown mode or
    option name (torch.compile raises RuntimeError: this is the constructor's argument check)."""
    from torch._inductor import config, list_mode_options  # both in torch >= 2.1

    patches: Dict[str, Any] = {}
    if mode is not None and mode != "default":
        modes = list_mode_options()
        if mode not in modes:
            raise ValueError(f"unknown Inductor mode {mode!r}; known: {', '.join(modes)}")
        patches.update(modes[mode])
    for key, value in (options or {}).items():
        patches[key.replace("-", "_")] = value
    known = config.get_config_copy()
    unknown = [key for key in patches if key not in known]
    if unknown:
        raise ValueError(f"unknown Inductor option(s) {unknown}: see torch._inductor.list_options()")
    return patches


class FusionBackend:
    """A Dynamo backend: :func:`fuse_graph`, then the inner backend (with ``leave_to_inductor``
    when that is Inductor, named ``"inductor"``; then also the replication pads written as
    concatenations rewritten first, and the layout pass after, on graphs that need no backward).
    ``fusions`` lists the number
    of chains rewritten in each graph compiled so far (graphs whose compilation raised, as Dynamo's
    own restarts do, are not listed), ``channels_last_3d_convolutions`` the number of 3-D
    convolutions each runs in channels_last_3d (``conv3d_channels_last``: see :func:`backend`).
    ``mode`` / ``options`` (only with ``inner="inductor"``): see :func:`backend`;
    ``config_patches`` holds the Inductor config patches they make (None without them)."""

    def __init__(self, inner: Any = "inductor", *, mode: Optional[str] = None,
                 options: Optional[Dict[str, Any]] = None, conv3d_channels_last: bool = True):
        self.inner = inner
        self.leave_to_inductor = isinstance(inner, str) and inner == "inductor"
        self.conv3d_channels_last = conv3d_channels_last
        self.fusions: List[int] = []
        self.channels_last_3d_convolutions: List[int] = []
        self.config_patches: Optional[Dict[str, Any]] = None
        if mode is not None or options is not None:
            if not (isinstance(inner, str) and inner == "inductor"):
                raise ValueError(f"mode and options are Inductor's: they need inner='inductor', not {inner!r}")
            self.config_patches = _inductor_config_patches(mode, options)

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable:
        if self.leave_to_inductor:  # (before the fusions: a pad after a fused op becomes its kernel's)
            replication_pad_concatenations(gm)
        count = fuse_graph(gm, leave_to_inductor=self.leave_to_inductor)
        convs = 0
        if self.leave_to_inductor and self.conv3d_channels_last and not (
                torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)):
            convs = channels_last_3d_convolutions(gm)  # (its prim has no backward: inference graphs only)
        if self.config_patches is not None:  # Inductor with torch.compile's mode / options
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=dict(self.config_patches))
        else:
            inner = self.inner
            if isinstance(inner, str):
                from torch._dynamo.backends.registry import lookup_backend

                inner = lookup_backend(inner)
            compiled = inner(gm, example_inputs)
        self.fusions.append(count)  # only for graphs compiled (Dynamo may restart an analysis)
        self.channels_last_3d_convolutions.append(convs)
        return compiled

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: with CUDA graphs, drops Inductor's CUDA graph trees
        (their memory pools), as torch.compile's own Inductor backend does."""
        if self.config_patches and self.config_patches.get("triton.cudagraphs"):
            try:
                from torch._inductor.cudagraph_trees import reset_cudagraph_trees
            except ImportError:  # a torch without CUDA graph trees
                return
            reset_cudagraph_trees()


def backend(inner: Any = "inductor", *, mode: Optional[str] = None,
            options: Optional[Dict[str, Any]] = None, conv3d_channels_last: bool = True) -> FusionBackend:
    """A backend for ``torch.compile(model, backend=fusednorm.fusion.backend())``: fuses norm
    epilogues into fusednorm ops, then compiles with ``inner`` (a registered backend name such as
    ``"inductor"`` or ``"aot_eager"``, or a backend callable).

    ``mode`` and ``options`` mirror ``torch.compile``'s arguments of those names for the Inductor
    inner backend, which ``torch.compile`` does not pass to a custom backend: ``mode`` is one of
    ``torch._inductor.list_mode_options()`` (``"default"``, ``"reduce-overhead"`` for CUDA graphs,
    ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``, ...), ``options`` a dict of Inductor
    config settings (``torch._inductor.list_options()``; ``{"triton.cudagraphs": True}`` is the
    same as ``mode="reduce-overhead"``). Given either, each fused graph is compiled by
    ``torch._inductor.compile_fx.compile_fx(gm, example_inputs, config_patches=...)`` with the
    mode's settings and the options over them (torch.compile refuses both at once; here options
    win). They need ``inner="inductor"`` (ValueError otherwise, and for an unknown mode or option).
    With CUDA graphs the usual rules of ``mode="reduce-overhead"`` hold: a call's outputs are
    overwritten by a later call (clone what you keep; ``torch.compiler.cudagraph_mark_step_begin()``
    before a call where Inductor cannot tell a new iteration begins).

    ``conv3d_channels_last`` (with Inductor, on graphs that need no backward: compiled under
    ``torch.no_grad()`` / ``torch.inference_mode()`` or with no input requiring grad): the graph's
    3-D convolutions of half / bfloat16 CUDA tensors run in channels_last_3d, as Inductor runs 2-D
    ones channels-last, whatever layout the model and its input have; its 5-D concatenations
    follow (and ``.contiguous()`` calls before ops that take any layout are dropped). Numerically
    the same convolutions; the HunyuanVideo decode takes ~1.2x less time
    (docs/design.md, "3-D convolutions in channels_last_3d"). False leaves the layouts to Inductor."""
    return FusionBackend(inner, mode=mode, options=options, conv3d_channels_last=conv3d_channels_last)


def dynamo_backend(gm: fx.GraphModule, example_inputs: List[Any], *, mode: Optional[str] = None,
                   options: Optional[Dict[str, Any]] = None) -> Callable:
    """The backend registered under the name ``"fusednorm"`` (the ``torch_dynamo_backends`` entry
    point in pyproject.toml), so that ``torch.compile(model, backend="fusednorm")`` works once
    fusednorm is installed: the same as :func:`backend` ``()``, fusion then Inductor.
    ``torch.compile`` hands its ``mode`` / ``options`` to a named backend, and they go to
    :func:`backend`: ``torch.compile(model, backend="fusednorm", mode="reduce-overhead")``."""
    return FusionBackend(mode=mode, options=options)(gm, example_inputs)
