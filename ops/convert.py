"""``fusednorm.convert``: swap a model's torch.nn normalization layers for fusednorm's.

What is converted
    Every ``torch.nn.GroupNorm`` and ``torch.nn.InstanceNorm1d/2d/3d`` (the class itself, or a
    subclass that keeps torch's ``forward``) becomes ``fusednorm.nn.GroupNorm`` /
    ``fusednorm.nn.InstanceNorm1d/2d/3d``. timm's ``GroupNormAct`` / ``GroupNorm1Act`` (which
    override ``forward`` as group_norm -> ``self.drop`` -> ``self.act``) are converted too when
    ``drop`` is an ``nn.Identity`` and ``act`` is a supported activation (or ``nn.Identity``), the
    activation becoming the module's fused ``activation``. diffusers' ``MochiChunkedGroupNorm3D``
    (a video's frames group-normalized 8 at a time, then concatenated) becomes
    ``fusednorm.nn.FrameGroupNorm`` (all frames in one call), keeping its ``norm_layer``, when
    that is a ``torch.nn.GroupNorm`` with torch's ``forward`` and no forward or backward hooks
    (they would see one call instead of one a chunk). diffusers' ``AdaGroupNorm`` (a group norm
    modulated by a time embedding, ``* (1 + scale) + shift``) becomes
    ``fusednorm.nn.AdaGroupNorm``, keeping its ``linear`` and ``act``. Anything else that overrides
    ``forward`` is left alone, and so are fusednorm's own modules and parametrized modules
    (``torch.nn.utils.parametrize``).

    Not a norm, but where the video VAEs spend their time around them: diffusers' causal 3-D
    convolutions, which pad their input with ``F.pad(..., mode="replicate")`` in their own
    ``forward`` (``HunyuanVideoCausalConv3d``, ``HunyuanVideo15CausalConv3d``,
    ``HunyuanImageRefinerCausalConv3d``, ``CogVideoXCausalConv3d``, which Mochi's VAE runs in
    ``pad_mode "replicate"``, EasyAnimate's ``EasyAnimateCausalConv3d``, and the KVAE video VAE's
    ``KVAECausalConv3d`` and ``KVAECachedCausalConv3d``), and their subclasses, get a subclass of
    their own class (``<class>WithReplicationPads``) whose ``forward`` runs theirs inside
    :func:`fusednorm.replication_pads` (eager mode only; under ``torch.compile`` it is their
    ``forward`` as it is): the same values, bit for bit, with the pads on fusednorm's kernels.
    ``torch.nn.Conv1d/2d/3d`` of ``padding_mode="replicate"`` (and subclasses keeping torch's
    ``_conv_forward``) get such a subclass too, whose ``_conv_forward`` pads on fusednorm's kernels
    in eager mode and convolves as torch's does (``torch.jit.script`` scripts it as torch's class).
    ``isinstance`` checks against their class still hold (Mochi's framewise decoding switches
    their ``pad_mode`` so), and such a module pickles and deep-copies as converted.

    The new module takes over the old one's attributes: the same Parameter and buffer objects
    (optimizers and tied weights keep working), device, dtype, train/eval mode, hook dicts (forward,
    pre-forward, backward, state_dict and load_state_dict hooks; handles taken before the
    conversion still remove them) and so the same ``state_dict`` keys. A module registered at
    several places stays one shared module.

What is skipped
    ``filter_fn(name, module) -> bool``, when given, is asked about every module that would be
    converted (``name`` is its qualified name in ``model``, ``""`` for ``model`` itself, as
    ``named_modules`` gives it); a module it rejects is left as it is and nothing is folded into
    it (a ``MochiChunkedGroupNorm3D`` is converted when it and its ``norm_layer`` are both
    accepted). A module registered under several names is converted only when ``filter_fn``
    accepts every one of them (it stays one shared module either way). fusednorm modules already
    in the model are asked too, before an activation is folded into them.

What is logged
    One INFO record on the ``fusednorm`` logger: how many modules of each class were replaced,
    which activation modules were folded into which norms, and how many ``filter_fn`` rejected;
    one DEBUG record per replaced module.

What is folded (the activation becomes the norm's fused ``activation``, its module an ``nn.Identity``)
    Only where the activation provably runs on the norm's output and on nothing else:

    * an ``nn.Sequential`` (with ``Sequential.forward``) holding the norm at position i and the
      activation at i + 1, when each of the two module objects is registered exactly once in the
      model, the norm has no forward or backward hooks (they would see the activated output)
      and the activation has no hooks;
    * timm's ``GroupNormAct`` / ``GroupNorm1Act`` (converted as said above, when their ``act``
      and ``drop`` carry no hooks);
    * an activation called in its parent's own ``forward`` only as ``self.act(self.norm(...))``
      or as ``v = self.act(v)`` right after ``v = self.norm(...)`` on every path into it (or after
      it and statements viewing ``v`` alone, ``v = v.unflatten(...).permute(...)``), where
      each of those norms is called only so (diffusers' ``ResnetBlock2D`` in autoencoders, where
      ``nonlinearity`` follows ``norm1`` and ``norm2``, its ``ResnetBlockCondNorm2D``, whose
      ``norm1`` and ``norm2`` are ``AdaGroupNorm`` modules, HunyuanVideo's resnet block,
      EasyAnimate's, whose norms see frames viewed as a batch and viewed back), with the
      same module conditions as above. The proof reads the forward's source
      (``fusednorm._forward_folds`` has the exact rules); branches on the module's configuration
      (an attribute holding None, a bool, an int or a str, or a child compared with None; never
      ``training``) are taken as they are at conversion, and then a forward pre-hook raises
      ``RuntimeError`` if such an attribute changes (a Python hook, which ``torch.jit.script``
      cannot compile: to script such a model, keep those norms out with ``filter_fn``). Anything
      else, e.g. the UNet's ``ResnetBlock2D``, which also calls ``nonlinearity`` on the time
      embedding, is left alone.

    ("Registered once" is what can be checked: a model whose ``forward`` also calls such a
    Sequential's activation or norm directly, bypassing the Sequential, or another module's
    activation or norm from outside it, is not supported.)

    Supported activations: ``nn.SiLU``, ``nn.ReLU`` (in place or not), ``nn.GELU`` (approximate
    ``'none'`` or ``'tanh'``), ``nn.LeakyReLU``, ``nn.Mish``, and timm's ``GELU`` / ``GELUTanh``.
    What these rules leave, :mod:`fusednorm.fusion` may still fuse at ``torch.compile`` time,
    from the actual data flow.
"""

import copy
import logging
from collections import Counter
from typing import Callable, Dict, List, Optional, Set, Tuple

from torch import nn
from torch.nn.utils import parametrize

from . import nn as fnn
from ._forward_folds import FoldAssumptions, forward_folds
from ._replication_pads import ReplicationPadsClass, padded_conv_class, padded_forward_class, pads_in_conv_forward

__all__ = ["convert", "module_activation"]

_logger = logging.getLogger("fusednorm")

_INSTANCE_NORMS = (
    (nn.InstanceNorm3d, fnn.InstanceNorm3d),
    (nn.InstanceNorm2d, fnn.InstanceNorm2d),
    (nn.InstanceNorm1d, fnn.InstanceNorm1d),
)
_FUSED = (fnn.GroupNorm, fnn.InstanceNorm1d, fnn.InstanceNorm2d, fnn.InstanceNorm3d, fnn.FrameGroupNorm,
          fnn.AdaGroupNorm)
# diffusers' causal 3-D convolutions, which pad their input by replication in their own forward
# (HunyuanVideo's and its successors', CogVideoX's in Mochi's pad_mode "replicate", EasyAnimate's,
# Kandinsky's KVAE video): convert gives them a class whose forward runs inside replication_pads()
# (docs/design.md, "Replication pads in eager mode").
_DIFFUSERS_PAD_CONVS = ("HunyuanVideoCausalConv3d", "HunyuanVideo15CausalConv3d", "HunyuanImageRefinerCausalConv3d",
                        "CogVideoXCausalConv3d", "EasyAnimateCausalConv3d", "KVAECausalConv3d",
                        "KVAECachedCausalConv3d")


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_OUTPUT_HOOKS = ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks")  # see the module's output


def _has_hooks(module: nn.Module, kinds: Tuple[str, ...] = _HOOKS) -> bool:
    return any(getattr(module, kind, None) for kind in kinds)


def _keeps(cls: type, base: type, names: Tuple[str, ...]) -> bool:
    """Whether cls inherits base's methods `names` unchanged."""
    return all(getattr(cls, name) is getattr(base, name) for name in names)


def module_activation(module: nn.Module) -> Optional[Tuple[str, float]]:
    """(activation, negative_slope) of fusednorm's epilogue computing what ``module`` computes,
    or None when it is not one of the supported activation modules (or overrides its forward)."""
    cls = type(module)
    slope = 0.01
    if isinstance(module, nn.SiLU) and _keeps(cls, nn.SiLU, ("forward",)):
        return "silu", slope
    if isinstance(module, nn.ReLU) and _keeps(cls, nn.ReLU, ("forward",)):
        return "relu", slope
    if isinstance(module, nn.Mish) and _keeps(cls, nn.Mish, ("forward",)):
        return "mish", slope
    if isinstance(module, nn.LeakyReLU) and _keeps(cls, nn.LeakyReLU, ("forward",)):
        return "leaky_relu", float(module.negative_slope)
    if isinstance(module, nn.GELU) and _keeps(cls, nn.GELU, ("forward",)):
        approximate = getattr(module, "approximate", "none")
        if approximate in ("none", "tanh"):
            return ("gelu" if approximate == "none" else "gelu_tanh"), slope
        return None
    # timm's GELU / GELUTanh modules: F.gelu(x) / F.gelu(x, approximate='tanh').
    if cls.__module__ == "timm.layers.activations" and cls.__name__ in ("GELU", "GELUTanh"):
        return ("gelu" if cls.__name__ == "GELU" else "gelu_tanh"), slope
    return None


def _is_timm_group_norm_act(module: nn.Module) -> bool:
    cls = type(module)
    return (
        isinstance(module, nn.GroupNorm)
        and cls.__name__ in ("GroupNormAct", "GroupNorm1Act")
        and cls.__module__.startswith("timm.")
    )


def _diffusers_base(module: nn.Module, names) -> Optional[type]:
    """The class of `module`'s MRO defined in diffusers under one of `names`, if any."""
    return next((b for b in type(module).__mro__ if b.__name__ in names and b.__module__.startswith("diffusers.")),
                None)


def _mochi_frame_norm(module: nn.Module) -> bool:
    """Whether `module` is diffusers' MochiChunkedGroupNorm3D (or a subclass keeping its forward)
    whose norm_layer FrameGroupNorm can take over: a torch.nn.GroupNorm computing torch's group
    norm, without the hooks that one call instead of one a chunk would change."""
    base = _diffusers_base(module, ("MochiChunkedGroupNorm3D",))
    if base is None or not _keeps(type(module), base, ("forward",)):
        return False
    norm = module._modules.get("norm_layer")
    if not isinstance(norm, nn.GroupNorm) or parametrize.is_parametrized(norm) or _has_hooks(norm):
        return False
    return _keeps(type(norm), nn.GroupNorm, ("forward",)) or type(norm) is fnn.GroupNorm and norm.activation is None


def _pad_conv_class(module: nn.Module) -> Optional[type]:
    """The class `module` takes when it pads by replication: one of diffusers' causal convolutions
    of _DIFFUSERS_PAD_CONVS (or of a subclass), its own class made to run its forward inside
    replication_pads(); a torch.nn.Conv1d/2d/3d (or a subclass keeping torch's _conv_forward) of
    padding_mode "replicate", its own class made to pad on fusednorm's op. None otherwise (and
    for a module that already pads so)."""
    if isinstance(module, ReplicationPadsClass):
        return None
    if _diffusers_base(module, _DIFFUSERS_PAD_CONVS) is not None:
        return padded_forward_class(type(module))
    return padded_conv_class(type(module)) if pads_in_conv_forward(module) else None


def _target_class(module: nn.Module) -> Optional[type]:
    """The fusednorm class `module` converts to, or None if it is not converted."""
    if isinstance(module, _FUSED) or parametrize.is_parametrized(module):
        return None  # a parametrized module's class is made for it (its weight is a property)
    if _mochi_frame_norm(module):
        return fnn.FrameGroupNorm
    ada = _diffusers_base(module, ("AdaGroupNorm",))
    if ada is not None:
        return fnn.AdaGroupNorm if _keeps(type(module), ada, ("forward",)) else None
    pad_conv = _pad_conv_class(module)
    if pad_conv is not None:
        return pad_conv
    cls = type(module)
    if isinstance(module, nn.GroupNorm):
        if _keeps(cls, nn.GroupNorm, ("forward",)):
            return fnn.GroupNorm
        if _is_timm_group_norm_act(module):
            act = module._modules.get("act")
            drop = module._modules.get("drop")
            act_ok = type(act) is nn.Identity or (act is not None and module_activation(act) is not None)
            if type(drop) is nn.Identity and act_ok and not _has_hooks(act) and not _has_hooks(drop):
                return fnn.GroupNorm
        return None
    for torch_cls, fused_cls in _INSTANCE_NORMS:
        if isinstance(module, torch_cls):
            return fused_cls if keeps_instance_norm_forward(module) else None
    return None


def keeps_instance_norm_forward(module: nn.Module) -> bool:
    """Whether `module` is a ``torch.nn.InstanceNorm1d/2d/3d`` whose class keeps torch's
    ``forward`` and the three methods it calls (fusednorm's forward calls them too): what
    ``convert`` replaces, and what the fusion backend reads as ``F.instance_norm``."""
    for torch_cls, _ in _INSTANCE_NORMS:
        if isinstance(module, torch_cls):
            methods = ("forward", "_check_input_dim", "_get_no_batch_dim", "_apply_instance_norm")
            return _keeps(type(module), torch_cls, tuple(m for m in methods if hasattr(torch_cls, m)))
    return False


def _converted(module: nn.Module, cls: type) -> nn.Module:
    """A `cls` instance holding `module`'s state: its attribute dict, including the very
    _parameters / _buffers / hook dicts (so existing hook handles still work)."""
    new = cls.__new__(cls)
    state = dict(module.__dict__)
    if issubclass(cls, ReplicationPadsClass):
        new.__dict__.update(state)
        return new
    activation, slope = None, 0.01
    if _is_timm_group_norm_act(module):
        modules = dict(state["_modules"])
        act = modules.pop("act")
        modules.pop("drop")
        state["_modules"] = type(state["_modules"])(modules)
        state.pop("_fast_norm", None)
        if type(act) is not nn.Identity:
            activation, slope = module_activation(act)
    new.__dict__.update(state)
    new.activation = activation
    new.negative_slope = slope
    return new


def _fold_sequentials(model: nn.Module, rejected: Set[int]) -> List[Tuple[str, str, str]]:
    """Folds activations into the norms before them (the module docstring's rules), except into
    norms whose id is in ``rejected``; returns (activation's name, its class, norm's name) of each
    fold."""
    counts = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    folds = []
    for seq_name, seq in model.named_modules():
        if not (isinstance(seq, nn.Sequential) and _keeps(type(seq), nn.Sequential, ("forward",))):
            continue
        names = list(seq._modules)
        for name, next_name in zip(names, names[1:]):
            norm, act = seq._modules[name], seq._modules[next_name]
            if type(norm) not in _FUSED or norm.activation is not None or act is None:
                continue
            if id(norm) in rejected:
                continue
            folded = module_activation(act)
            if folded is None or counts[id(norm)] != 1 or counts[id(act)] != 1:
                continue
            if _has_hooks(norm, _OUTPUT_HOOKS) or _has_hooks(act):
                continue
            norm.activation, norm.negative_slope = folded
            seq._modules[next_name] = nn.Identity().train(act.training)
            prefix = seq_name + "." if seq_name else ""
            folds.append((prefix + next_name, type(act).__name__, prefix + name))
    return folds


def _fold_forwards(model: nn.Module, rejected: Set[int]) -> List[Tuple[str, str, str]]:
    """Folds activations called in their parent's own ``forward`` into the norms whose outputs
    they take (the module docstring's second rule; the proof is ``_forward_folds``'s), except into
    norms whose id is in ``rejected``; returns (activation's name, its class, norm's name) of each
    fold."""
    counts = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    folds = []
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, (nn.Sequential, nn.ModuleList, nn.ModuleDict) + _FUSED):
            continue
        children = parent._modules
        norms = {name for name, m in children.items()
                 if type(m) in _FUSED and m.activation is None and id(m) not in rejected and counts[id(m)] == 1
                 and not _has_hooks(m, _OUTPUT_HOOKS)}
        acts = {name: module_activation(m) for name, m in children.items()
                if m is not None and counts[id(m)] == 1 and not _has_hooks(m)}
        acts = {name: folded for name, folded in acts.items() if folded is not None}
        if not norms or not acts:
            continue
        proven = forward_folds(parent, norms, set(acts))
        prefix = parent_name + "." if parent_name else ""
        for fold in proven:
            act = children[fold.activation]
            activation, slope = acts[fold.activation]
            for norm_name in fold.norms:
                children[norm_name].activation, children[norm_name].negative_slope = activation, slope
                folds.append((prefix + fold.activation, type(act).__name__, prefix + norm_name))
            children[fold.activation] = nn.Identity().train(act.training)
        facts = [fact for fold in proven for fact in fold.facts]
        if facts:
            what = ", ".join(f"{fold.activation!r} into {', '.join(map(repr, fold.norms))}" for fold in proven)
            parent.register_forward_pre_hook(FoldAssumptions(facts, what))
    return folds


def _class_label(module: nn.Module) -> str:
    """fusednorm.nn.<class> for fusednorm's modules, the class's name for the others (a causal
    convolution's class with replication pads)."""
    cls = type(module)
    return f"fusednorm.nn.{cls.__name__}" if cls.__module__ == fnn.__name__ else cls.__name__


def _log_summary(replaced: Dict[str, Tuple[nn.Module, nn.Module]], folds: List[Tuple[str, str, str]],
                 rejected_count: int) -> None:
    by_class = Counter(f"{type(old).__name__} -> {_class_label(new)}" for old, new in replaced.values())
    parts = [f"replaced {len(replaced)} module(s)"
             + (": " + ", ".join(f"{n} {what}" for what, n in sorted(by_class.items())) if by_class else "")]
    # timm's GroupNormAct brings its own activation along.
    inner = [(name, new.activation) for name, (old, new) in replaced.items()
             if _is_timm_group_norm_act(old) and new.activation is not None]
    folded = [f"'{act}' ({cls}) into '{norm}'" for act, cls, norm in folds]
    folded += [f"{activation} of '{name}' ({type(replaced[name][0]).__name__})" for name, activation in inner]
    parts.append(f"folded {len(folded)} activation(s)" + (": " + ", ".join(folded) if folded else ""))
    if rejected_count:
        parts.append(f"left {rejected_count} module(s) alone as filter_fn asked")
    _logger.info("fusednorm.convert: %s", "; ".join(parts))
    for name, (old, new) in replaced.items():
        _logger.debug("fusednorm.convert: '%s': %s -> %s%s", name, type(old).__name__, _class_label(new),
                      f" (activation={new.activation!r})" if getattr(new, "activation", None) else "")


def convert(model: nn.Module, *, inplace: bool = True,
            filter_fn: Optional[Callable[[str, nn.Module], bool]] = None) -> nn.Module:
    """Replace the torch.nn GroupNorm / InstanceNorm layers of ``model`` with fusednorm's, folding
    activations that provably only follow them (and run the replication pads of diffusers' causal
    convolutions on fusednorm's kernels); see the module docstring for the exact rules.

    Args:
        model: any ``nn.Module`` (it may itself be a norm layer).
        inplace: convert ``model`` itself (default), or a deep copy of it, leaving ``model`` as is.
        filter_fn: ``filter_fn(name, module) -> bool`` chooses which norm layers (and causal
            convolutions) are converted (and may receive a folded activation): ``name`` is the
            module's qualified name in ``model`` (``""`` for ``model`` itself). Default: all of
            them.

    Returns:
        The converted model (``model`` itself when ``inplace``, unless ``model`` is itself a norm
        layer, which is returned converted).

    A summary of what was replaced and folded is logged at INFO on the ``fusednorm`` logger
    (``logging.getLogger("fusednorm").setLevel(logging.INFO)`` with a handler shows it).

    Example::

        model = fusednorm.convert(model, filter_fn=lambda name, m: not name.startswith("decoder."))
    """
    if not inplace:
        model = copy.deepcopy(model)
    # Names are asked before anything changes: a module registered several times is converted only
    # if every one of its names is accepted.
    rejected: Set[int] = set()
    names: Dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)
        if filter_fn is not None and (isinstance(module, _FUSED) or _target_class(module) is not None):
            if not filter_fn(name, module):
                rejected.add(id(module))
    memo: Dict[int, Optional[nn.Module]] = {}
    originals: Dict[int, nn.Module] = {}

    def replacement(module: nn.Module) -> Optional[nn.Module]:
        if id(module) not in memo:
            originals[id(module)] = module
            cls = None if id(module) in rejected else _target_class(module)
            if cls is fnn.FrameGroupNorm:
                # Its norm_layer holds the parameters alone (FrameGroupNorm calls fusednorm's
                # function): kept as it is, unless filter_fn rejected it, and then so is this.
                norm = module._modules["norm_layer"]
                cls = None if id(norm) in rejected else cls
                memo.setdefault(id(norm), None)
            memo[id(module)] = None if cls is None else _converted(module, cls)
        return memo[id(module)]

    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and replacement(child) is not None:
                parent._modules[name] = memo[id(child)]
    root = replacement(model)
    replaced = {names[key]: (originals[key], new) for key, new in memo.items() if new is not None}
    if root is not None:
        model = root
    folds = _fold_sequentials(model, rejected)  # rejected modules are still in the model, unchanged
    folds += _fold_forwards(model, rejected)
    _log_summary(replaced, folds, len(rejected))
    return model
