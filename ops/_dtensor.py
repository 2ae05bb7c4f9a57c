"""DTensor support: the kernel ops (group_norm_forward, group_norm_backward and their fused forms)
on DTensors of a 1-D device mesh, so that ``fusednorm.group_norm``, ``fusednorm.instance_norm``,
the composite ``torch.ops.fusednorm`` ops and fusednorm.nn modules take a DTensor and return one
with the input's placements.

How each placement runs (docs/distributed.md, 'DTensor'):
  Replicate(), Shard(0)   the kernels on the local tensor, no communication;
  Shard(1)                the kernels on the local channels, weight and bias sliced to match, when
                          every shard boundary falls on a group boundary; otherwise a RuntimeError
                          that says to redistribute;
  Shard(d), d >= 2        fusednorm.distributed's local moments, one all-gather merged with Chan's
                          formula, the local normalize with the global statistics; the backward
                          one all-gather of its two per-group sums. mean and rstd are Replicate();
                          parameter gradients Partial() (each rank's share);
  Partial()               redistributed to Replicate() first.

The ops are registered as DTensor custom op handlers (DTensor's op dispatcher table, where torch's
own convolution and loss-parallel handlers live) where the torch version has it; elsewhere
:func:`check_supported` raises a clear error. Nothing here imports DTensor at module import on a
torch without it (torch 2.1).
"""

import importlib.abc
import importlib.machinery
import math
import sys
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

# torch.distributed.tensor.DTensor once that module is imported (None before, and on a torch without
# it): fusednorm.functional tests `DTensor is not None` first, a constant under torch.compile.
DTensor: Any = None
_REGISTERED = False


_DTENSOR_MODULE = "torch.distributed.tensor"


def _import_dtensor():
    global DTensor
    if DTensor is None and torch.distributed.is_available():
        try:
            from torch.distributed import tensor
        except ImportError:
            return None
        # torch < 2.5 has the package (tensor parallelism) but keeps DTensor private.
        DTensor = getattr(tensor, "DTensor", None)
    return DTensor


def is_dtensor(t: Any) -> bool:
    if DTensor is None:
        # Without torch.distributed.tensor imported there is no DTensor to be.
        if _DTENSOR_MODULE not in sys.modules or not register():
            return False
    return isinstance(t, DTensor)


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the handlers right after torch.distributed.tensor is imported. Importing it takes
    seconds, so fusednorm does not; the handlers must still be in place before the first DTensor
    reaches a torch.ops.fusednorm op, which no fusednorm Python code may see first."""

    def find_spec(self, name, path, target=None):
        if name != _DTENSOR_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        register()


def install() -> None:
    """Registers now if torch.distributed.tensor is loaded, else once it is."""
    if not torch.distributed.is_available():
        return
    if _DTENSOR_MODULE in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def check_supported() -> None:
    if not _REGISTERED:
        raise NotImplementedError(
            f"fusednorm: DTensor inputs need a torch whose DTensor takes custom op handlers "
            f"(torch >= 2.5); this is torch {torch.__version__}")


# -- placements -------------------------------------------------------------------------------------


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Replicate, Shard, Partial


def _chunk_range(size: int, world: int, rank: int) -> Tuple[int, int]:
    # DTensor's Shard(d) splits as torch.chunk: chunks of ceil(size / world), the last ones smaller
    # or empty.
    step = -(-size // world) if world else size
    start = min(rank * step, size)
    return start, min(start + step, size)


class _Plan:
    """How a call on a DTensor input runs: 'local' (Replicate or Shard(0)), 'channels' (Shard(1) on
    group boundaries) or 'spatial' (Shard(d), d >= 2)."""

    def __init__(self, input, num_groups: int):
        Replicate, Shard, _ = _placements()
        mesh = input.device_mesh
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"fusednorm: DTensor inputs on a 1-D device mesh only, but got a {mesh.ndim}-D mesh {tuple(mesh.shape)}")
        self.mesh = mesh
        self.world = mesh.size(0)
        self.rank = mesh.get_local_rank(0)
        self.placement = input.placements[0]
        self.shape = tuple(input.shape)
        self.num_groups = num_groups
        self.local_groups = num_groups
        p = self.placement
        if p.is_replicate() or (p.is_shard() and p.dim % input.dim() == 0):
            self.mode = "local"
        elif p.is_shard() and p.dim % input.dim() == 1:
            self.mode = "channels"
            C = self.shape[1]
            per_group = C // num_groups if num_groups and C % num_groups == 0 else 0
            step = -(-C // self.world)
            if per_group == 0 or step % per_group != 0:
                raise RuntimeError(
                    f"fusednorm: a Shard(1) DTensor must split the channels on group boundaries, but {C} channels "
                    f"in {num_groups} groups over {self.world} ranks gives shards of {step} channels; redistribute "
                    "the input first (e.g. to Shard(2) or Replicate())")
            self.c0, self.c1 = _chunk_range(C, self.world, self.rank)
            self.local_groups = (self.c1 - self.c0) // per_group
        elif p.is_shard():
            self.mode = "spatial"
        else:
            raise NotImplementedError(f"fusednorm: unsupported DTensor placement {p}")

    # Placements of the operands and results, by kind.
    def like_input(self):
        return [self.placement]

    def per_sample_channel(self):
        # scale, shift (N, C), and mean / rstd (N, G).
        Replicate, Shard, _ = _placements()
        if self.mode == "spatial" or self.placement.is_replicate():
            return [Replicate()]
        return [Shard(0)] if self.mode == "local" else [Shard(1)]

    def parameter_grad(self):
        # weight / bias (C,) gradients.
        Replicate, Shard, Partial = _placements()
        if self.placement.is_replicate():
            return [Replicate()]
        return [Shard(0)] if self.mode == "channels" else [Partial()]

    def per_sample_channel_grad(self):
        _, _, Partial = _placements()
        return [Partial()] if self.mode == "spatial" else self.per_sample_channel()

    @property
    def group(self):
        return self.mesh.get_group(0)

    # Local tensors of the operands.
    def local(self, t: Optional[Tensor], placements) -> Optional[Tensor]:
        """This rank's tensor of t under `placements`: a DTensor is redistributed there; a plain
        tensor is taken as the whole (replicated) tensor and split as DTensor would."""
        if t is None:
            return None
        if is_dtensor(t):
            if tuple(t.placements) != tuple(placements):
                t = t.redistribute(self.mesh, placements)
            return t.to_local()
        p = placements[0]
        if p.is_shard():
            start, end = _chunk_range(t.shape[p.dim], self.world, self.rank)
            return t.narrow(p.dim, start, end - start)
        return t

    def local_parameter(self, t: Optional[Tensor]) -> Optional[Tensor]:
        Replicate, _, _ = _placements()
        t = self.local(t, [Replicate()])
        if t is not None and self.mode == "channels":
            t = t[self.c0:self.c1]
        return t

    def wrap(self, t: Tensor, placements, shape: Sequence[int], present: bool = True):
        """A DTensor of global `shape` from this rank's tensor; an output the op's mask turned off
        (an empty (0,) tensor) stays a replicated empty tensor."""
        Replicate, _, _ = _placements()
        if not present:
            placements, shape = [Replicate()], (0,)
        return DTensor.from_local(t, self.mesh, placements, run_check=False, shape=torch.Size(shape),
                                   stride=_contiguous_strides(shape))


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _wrap_like_input(plan: _Plan, t: Tensor, input) -> Any:
    return DTensor.from_local(t, plan.mesh, plan.like_input(), run_check=False, shape=input.shape,
                               stride=input.stride())


def _replicated_input(input):
    # A Partial() input is summed first (docs/distributed.md, 'DTensor').
    Replicate, _, _ = _placements()
    if input.placements[0].is_partial():
        return input.redistribute(input.device_mesh, [Replicate()])
    return input


def _whole_count(plan: _Plan, input_local: Tensor) -> Tensor:
    # Elements per (sample, group) of the whole tensor, from the global shape (no communication).
    spatial = math.prod(plan.shape[2:])
    per_group = plan.shape[1] // plan.num_groups
    return torch.full((input_local.shape[0], plan.num_groups), float(spatial * per_group), dtype=torch.float64,
                      device=input_local.device)


# -- handlers -----------------------------------------------------------------------------------------


def _add_input_bias(input, input_bias):
    """input + input_bias ((C,), (N, C) or (N, C, 1, ..., 1)) broadcast over the spatial dimensions."""
    return input + input_bias.reshape((-1, input.shape[1]) + (1,) * (input.dim() - 2))


def _forward(op, input, num_groups, weight, bias, eps, scale=None, shift=None, residual=None, activation="none",
             negative_slope=0.01, multiplier=None, input_bias=None, fused=False):
    from . import distributed as _dist  # here: distributed imports this module

    if input_bias is not None:
        # The prologue materialized by DTensor's own add, as the kernels that do not add it on
        # the fly are given it (docs/design.md, "Input bias").
        input = _add_input_bias(input, input_bias)
    input = _replicated_input(input)
    plan = _Plan(input, num_groups)
    x = input.to_local()
    w, b = plan.local_parameter(weight), plan.local_parameter(bias)
    s, t = plan.local(scale, plan.per_sample_channel()), plan.local(shift, plan.per_sample_channel())
    r, m = plan.local(residual, plan.like_input()), plan.local(multiplier, plan.like_input())
    if plan.mode == "spatial":
        out, mean, rstd, _ = _dist.sharded_forward(x, num_groups, eps, plan.group, w, b, s, t, r, activation,
                                                   negative_slope, m)
    elif fused:
        out, mean, rstd = op(x, plan.local_groups, w, b, eps, s, t, r, activation, negative_slope, m)
    else:
        out, mean, rstd = op(x, plan.local_groups, w, b, eps)
    stats_shape = (input.shape[0], num_groups)
    return (_wrap_like_input(plan, out, input), plan.wrap(mean, plan.per_sample_channel(), stats_shape),
            plan.wrap(rstd, plan.per_sample_channel(), stats_shape))


def _backward(op, grad_out, input, mean, rstd, weight, bias, num_groups, scale, shift, residual, activation,
              negative_slope, multiplier, output_mask, summed, fused):
    from . import distributed as _dist

    input = _replicated_input(input)
    plan = _Plan(input, num_groups)
    x = input.to_local()
    g = plan.local(grad_out, plan.like_input())
    mean_l, rstd_l = plan.local(mean, plan.per_sample_channel()), plan.local(rstd, plan.per_sample_channel())
    w, b = plan.local_parameter(weight), plan.local_parameter(bias)
    s, t = plan.local(scale, plan.per_sample_channel()), plan.local(shift, plan.per_sample_channel())
    r, m = plan.local(residual, plan.like_input()), plan.local(multiplier, plan.like_input())
    C, N = plan.shape[1], plan.shape[0]
    if plan.mode == "spatial":
        mask = list(output_mask)
        if not fused:
            # group_norm_backward has no bias argument but returns its gradient, in the weight's
            # dtype (float32 / float64 without weight).
            b = torch.zeros(x.shape[1], dtype=w.dtype if w is not None else _dist._compute_dtype(x.dtype),
                            device=x.device)
            mask = mask + [False] * (7 - len(mask))
        if summed and mask[5]:
            mask[6] = True
        grads = _dist.backward_local(g, x, mean_l, rstd_l, _whole_count(plan, x), num_groups, w, b, s, t, r,
                                     activation, negative_slope, m, output_mask=mask, group=plan.group)
        if summed and mask[5]:
            grads[5] = grads[5] + grads[6]
            grads[6] = None
        grads = [gr if gr is not None else x.new_empty((0,)) for gr in grads]
        for i in (3, 4):
            if grads[i].numel():
                grads[i] = grads[i].reshape(N, C)
        grads = grads[:7 if fused else 3]
    elif fused:
        grads = list(op(g, x, mean_l, rstd_l, w, b, plan.local_groups, s, t, r, activation, negative_slope, m,
                        output_mask, summed))
    else:
        grads = list(op(g, x, mean_l, rstd_l, w, plan.local_groups, output_mask))
    # Which outputs the op returns (the others are empty (0,) tensors), as its fake kernel says.
    present = list(output_mask) + [False] * (7 - len(output_mask))
    if fused and summed:
        present[5], present[6] = present[5] or present[6], False

    def like_input(i):
        return _wrap_like_input(plan, grads[i], input) if present[i] else plan.wrap(grads[i], None, (0,), False)

    out = [like_input(0), plan.wrap(grads[1], plan.parameter_grad(), (C,), present[1]),
           plan.wrap(grads[2], plan.parameter_grad(), (C,), present[2])]
    if fused:
        out += [plan.wrap(grads[3], plan.per_sample_channel_grad(), (N, C), present[3]),
                plan.wrap(grads[4], plan.per_sample_channel_grad(), (N, C), present[4]),
                like_input(5), like_input(6)]
    # A plain tensor beside DTensors is a replicated whole tensor (as under DTensor's
    # implicit_replication): its gradient is the whole gradient, a plain tensor on every rank. The
    # op is not given the bias when unfused; it goes as the weight does.
    operands = [input, weight, bias if fused else weight, scale, shift, residual, multiplier]
    for i in range(1, len(out)):
        if present[i] and operands[i] is not None and not is_dtensor(operands[i]):
            out[i] = out[i].full_tensor()
    return tuple(out)


def _group_norm_forward_handler(op_call, args, kwargs):
    return _forward(op_call, *args, **kwargs)


def _fused_group_norm_forward_handler(op_call, args, kwargs):
    return _forward(op_call, *args, **kwargs, fused=True)


def _add_group_norm_forward_handler(op_call, args, kwargs):
    # The residual-add prologue: the sum by DTensor's own add (it is an output too), then the fused
    # op's forward on it (docs/design.md, "Residual-add prologue").
    names = ("input", "other", "num_groups", "weight", "bias", "eps", "scale", "shift", "residual", "activation",
             "negative_slope", "multiplier", "input_bias")
    a = dict(zip(names, args))
    a.update(kwargs)
    total = a["input"] + a["other"]
    if a.get("input_bias") is not None:
        total = _add_input_bias(total, a["input_bias"])
    out, mean, rstd = _forward(torch.ops.fusednorm.fused_group_norm_forward.default, total, a["num_groups"],
                               a["weight"], a["bias"], a["eps"], a["scale"], a["shift"], a["residual"],
                               a["activation"], a["negative_slope"], a["multiplier"], fused=True)
    return out, total, mean, rstd


def _group_norm_backward_handler(op_call, args, kwargs):
    grad_out, input, mean, rstd, weight, num_groups, output_mask = args
    return _backward(op_call, grad_out, input, mean, rstd, weight, None, num_groups, None, None, None, "none", 0.01,
                     None, output_mask, False, fused=False)


def _fused_group_norm_backward_handler(op_call, args, kwargs):
    names = ("grad_out", "input", "mean", "rstd", "weight", "bias", "num_groups", "scale", "shift", "residual",
             "activation", "negative_slope", "multiplier", "output_mask", "sum_residual_multiplier_grads")
    a = dict(zip(names, args))
    a.update(kwargs)
    a.setdefault("sum_residual_multiplier_grads", False)
    return _backward(op_call, a["grad_out"], a["input"], a["mean"], a["rstd"], a["weight"], a["bias"],
                     a["num_groups"], a["scale"], a["shift"], a["residual"], a["activation"], a["negative_slope"],
                     a["multiplier"], a["output_mask"], a["sum_residual_multiplier_grads"], fused=True)


def register() -> bool:
    """Installs the handlers where this torch's DTensor has the table; returns whether it did."""
    global _REGISTERED
    if _REGISTERED:
        return True
    if _import_dtensor() is None:
        return False
    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    handlers = getattr(dispatcher, "_custom_op_handlers", None)
    if not isinstance(handlers, dict):
        return False
    ops = torch.ops.fusednorm
    handlers[ops.group_norm_forward.default] = _group_norm_forward_handler
    handlers[ops.fused_group_norm_forward.default] = _fused_group_norm_forward_handler
    handlers[ops.add_group_norm_forward.default] = _add_group_norm_forward_handler
    handlers[ops.group_norm_backward.default] = _group_norm_backward_handler
    handlers[ops.fused_group_norm_backward.default] = _fused_group_norm_backward_handler
    _REGISTERED = True
    return True


# -- the F-style functions on DTensors (routed here from fusednorm.functional) -------------------------------


def instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, **epilogue):
    """fusednorm.instance_norm of a DTensor: the kernel ops through the handlers above, the running
    statistics (plain tensors or replicated DTensors) updated from the whole batch's statistics
    on every rank."""
    from . import functional

    check_supported()
    Replicate, _, _ = _placements()
    if not use_input_stats:
        # The running statistics normalize each element: elementwise, run on the local tensor,
        # above autograd, so each operand's local tensor says how its gradient adds up.
        input = _replicated_input(input)
        plan = _Plan(input, input.shape[1])
        _, _, Partial = _placements()
        whole_is_local = plan.placement.is_replicate()

        def local(t, placements, partial_grad):
            if t is None:
                return None
            if not is_dtensor(t):
                # A plain tensor: replicated; from_local's backward sums its gradient over ranks.
                t = DTensor.from_local(t, plan.mesh, [_placements()[0]()], run_check=False)
            if tuple(t.placements) != tuple(placements):
                t = t.redistribute(plan.mesh, placements)
            grad_placements = [Partial()] if partial_grad and not whole_is_local else placements
            return t.to_local(grad_placements=grad_placements)

        def parameter(t):
            t = local(t, [Replicate()], True)
            return t[plan.c0:plan.c1] if t is not None and plan.mode == "channels" else t

        ep = dict(epilogue)
        for k in ("scale", "shift"):
            ep[k] = local(ep.get(k), plan.per_sample_channel(), plan.mode == "spatial")
        for k in ("residual", "multiplier"):
            ep[k] = local(ep.get(k), plan.like_input(), False)
        with torch.no_grad():
            rm, rv = parameter(running_mean), parameter(running_var)
        out = functional.instance_norm(input.to_local(), rm, rv, parameter(weight), parameter(bias), False, momentum,
                                       eps, **ep)
        return DTensor.from_local(out, plan.mesh, plan.like_input(), run_check=False, shape=input.shape,
                                   stride=input.stride())
    # Checks of the plain op (shape, spatial size) on the global shape.
    functional._verify_spatial_size(input.size())
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must either both be None or neither be None")
    C = input.shape[1]
    ep = {k: v for k, v in epilogue.items() if k in ("scale", "shift", "residual", "multiplier")}
    activation = epilogue.get("activation") or "none"
    negative_slope = epilogue.get("negative_slope", 0.01)
    ops = torch.ops.fusednorm
    if all(v is None for v in ep.values()) and activation == "none":
        out, mean, rstd = ops.group_norm_forward(input, C, weight, bias, eps)
    else:
        res = ep.get("residual")
        mul = ep.get("multiplier")
        out, mean, rstd = ops.fused_group_norm_forward(
            input, C, weight, bias, eps, ep.get("scale"), ep.get("shift"),
            functional._same_dtype(res, input.dtype), activation, negative_slope,
            functional._same_dtype(mul, input.dtype))
    if running_mean is not None and input.shape[0] > 0:
        with torch.no_grad():
            spatial = math.prod(input.shape[2:])
            batch_mean = mean.mean(0).full_tensor()
            var = rstd.pow(-2).sub(eps).mul(spatial).div(spatial - 1)
            batch_var = var.mean(0).full_tensor()
            for stat, value in ((running_mean, batch_mean), (running_var, batch_var)):
                local = stat.to_local() if is_dtensor(stat) else stat
                local.mul_(1 - momentum).add_(value.to(local.dtype), alpha=momentum)
    return out
