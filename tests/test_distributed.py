"""fusednorm.distributed and DTensor inputs, on 2 and 3 CPU ranks (gloo), and on 2 GPUs (NCCL,
marked cuda).

Ranks are long-lived worker processes (one pool per world size and backend, started once per
module: starting a process and importing torch costs seconds), each running the task functions
below on its shard of tensors the test sends whole; the test compares the shards it gets back
with fusednorm on the whole tensor in one process. Every wait has a timeout, after which the pool
is killed and the test fails, so a rank stuck in a collective cannot hang the suite.
"""

import datetime
import io
import os
import queue
import socket
import traceback

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fusednorm
from reference import TOLERANCES, assert_close, to_layout

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch", allow_module_level=True)

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: F401

    HAS_DTENSOR = True
except ImportError:  # torch < 2.5
    HAS_DTENSOR = False

needs_dtensor = pytest.mark.skipif(not HAS_DTENSOR, reason="needs torch.distributed.tensor (torch >= 2.5)")

TIMEOUT_S = 90  # per task: far above the seconds one takes, far below a hang worth waiting for


# -- the pool of ranks ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, world, port, backend, tasks, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend, rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            # Serialized here, not by the queue's feeder thread, where an error would be lost.
            buf = io.BytesIO()
            torch.save(fn(rank, world, *args), buf)
            results.put((rank, True, buf.getvalue()))
        except BaseException:  # reported, not raised: the pool lives on for the next task
            results.put((rank, False, traceback.format_exc()))
    torch.distributed.destroy_process_group()


class RankPool:
    def __init__(self, world: int, backend: str = "gloo"):
        ctx = torch.multiprocessing.get_context("spawn")
        self.world = world
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, backend, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args):
        """fn(rank, world, *args) on every rank; returns the results by rank, or fails with the
        failing ranks' tracebacks."""
        for q in self.tasks:
            q.put((fn, args))
        got = {}
        try:
            for _ in range(self.world):
                rank, ok, payload = self.results.get(timeout=TIMEOUT_S)
                got[rank] = (ok, payload)
        except queue.Empty:
            self.close(kill=True)
            pytest.fail(f"ranks {sorted(set(range(self.world)) - set(got))} gave no result within {TIMEOUT_S} s")
        failed = {r: p for r, (ok, p) in got.items() if not ok}
        if failed:
            # A rank that raised may have left the others inside a collective: start afresh.
            self.close(kill=True)
            pytest.fail("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(failed.items())))
        return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        self.broken = True
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 3)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS = {}


def _pool(world: int, backend: str = "gloo") -> RankPool:
    key = (world, backend)
    if key not in _POOLS or _POOLS[key].broken:
        _POOLS[key] = RankPool(world, backend)
    return _POOLS[key]


def teardown_module(module):
    for p in _POOLS.values():
        if not p.broken:
            p.close()


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def pool(request):
    return _pool(request.param)


# -- tasks (run on every rank; module level, so that spawned ranks can unpickle them) ----------------------


def _bounds(sizes, rank):
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _device(rank, t):
    if t is None:
        return None
    return t.to(f"cuda:{rank}") if torch.distributed.get_backend() == "nccl" else t


def _task_sharded(rank, world, op, case, tensors, grad_out):
    """fusednorm.distributed.<op> on this rank's rows: (output, gradients by name) of the shard."""
    dim, sizes = case["dim"], case["sizes"]
    a, b = _bounds(sizes, rank)
    x = _device(rank, tensors["input"]).narrow(dim, a, b - a).detach().requires_grad_()
    leaves = {"input": x}
    kwargs = {}
    for name in ("weight", "bias", "scale", "shift"):
        if tensors.get(name) is not None:
            leaves[name] = kwargs[name] = _device(rank, tensors[name]).detach().requires_grad_()
    for name in ("residual", "multiplier"):
        if tensors.get(name) is not None:
            leaves[name] = kwargs[name] = (_device(rank, tensors[name]).narrow(dim, a, b - a).detach()
                                           .requires_grad_())
    if op == "group_norm":
        out = fusednorm.distributed.group_norm(x, case["num_groups"], eps=case["eps"], dim=dim,
                                               activation=case["activation"], **kwargs)
        extra = None
    else:
        rm = _device(rank, tensors["running_mean"]).clone()
        rv = _device(rank, tensors["running_var"]).clone()
        out = fusednorm.distributed.instance_norm(x, rm, rv, eps=case["eps"], momentum=0.3, dim=dim,
                                                  activation=case["activation"], **kwargs)
        extra = (rm.cpu(), rv.cpu())
    out.backward(_device(rank, grad_out).narrow(dim, a, b - a))
    return out.detach().cpu(), {k: v.grad.cpu() for k, v in leaves.items()}, extra


def _whole(op, case, tensors, grad_out):
    """The same call on the whole tensor in this process."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()
              if v is not None and not k.startswith("running")}
    kw = {k: v for k, v in leaves.items() if k != "input"}
    if op == "group_norm":
        out = fusednorm.group_norm(leaves["input"], case["num_groups"], eps=case["eps"],
                                   activation=case["activation"], **kw)
        extra = None
    else:
        rm, rv = tensors["running_mean"].clone(), tensors["running_var"].clone()
        out = fusednorm.instance_norm(leaves["input"], rm, rv, eps=case["eps"], momentum=0.3,
                                      activation=case["activation"], **kw)
        extra = (rm, rv)
    out.backward(grad_out)
    return out.detach(), {k: v.grad for k, v in leaves.items()}, extra


def _check_against_whole(results, op, case, tensors, grad_out, dtype):
    out, grads, extra = _whole(op, case, tensors, grad_out)
    dim = case["dim"]
    scale = 1.0 if dtype == torch.float64 else 4.0
    assert_close(torch.cat([r[0] for r in results], dim), out, dtype, msg="output")
    for name, g in grads.items():
        if name in ("input", "residual", "multiplier"):
            got = torch.cat([r[1][name] for r in results], dim)
        else:  # this rank's share: the shares add up to the whole gradient
            got = sum(r[1][name].double() for r in results)
        # Gradients are sums over many elements: scaled tolerance (float64: still 1e-9 relative).
        size = g.double().abs().max().item() if g.numel() else 0.0
        assert_close(got, g, dtype, scale=scale * max(1.0, size), msg=f"grad of {name}")
    if extra is not None:
        for r in results:
            for got, want, name in zip(r[2], extra, ("running_mean", "running_var")):
                assert_close(got, want, dtype, msg=name)


# -- cases ---------------------------------------------------------------------------------------------

_OPERANDS = ("weight", "bias", "scale", "shift", "residual", "multiplier")


@st.composite
def _cases(draw, world, op="group_norm"):
    N = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3)) if op == "group_norm" else 1
    C = G * draw(st.integers(1, 3))
    if op == "instance_norm":
        G = C
    spatial_rank = draw(st.integers(1, 2))
    dim = draw(st.integers(2, 1 + spatial_rank))
    shape = [N, C] + [draw(st.integers(1, 5)) for _ in range(spatial_rank)]
    # Split sizes along dim, uneven, some possibly empty; the whole tensor has > 1 element per group.
    shape[dim] = draw(st.integers(max(2, world - 1), 7))
    cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=world - 1, max_size=world - 1)))
    bounds = [0] + cuts + [shape[dim]]
    sizes = [bounds[i + 1] - bounds[i] for i in range(world)]
    present = {name: draw(st.booleans()) for name in _OPERANDS}
    return dict(shape=shape, num_groups=G, dim=dim, sizes=sizes, present=present,
                activation=draw(st.sampled_from([None, "silu", "swish", "gelu", "gelu_tanh", "leaky_relu", "mish"])),
                eps=draw(st.sampled_from([1e-5, 1e-3])),
                layout=draw(st.sampled_from(["contiguous", "channels_last"])), seed=draw(st.integers(0, 2**16)))


def _tensors(case, dtype, op="group_norm"):
    g = torch.Generator().manual_seed(case["seed"])
    shape = case["shape"]
    N, C = shape[:2]

    def rand(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    # An offset mean: the one-pass E[x^2] - E[x]^2 would lose digits here.
    x = to_layout((rand(*shape) * 2 + case.get("offset", 3.0)).to(dtype), case["layout"])
    t = {"input": x}
    p = case["present"]
    param_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    t["weight"] = (1 + 0.5 * rand(C)).to(param_dtype) if p["weight"] else None
    t["bias"] = rand(C).to(param_dtype) if p["bias"] else None
    t["scale"] = (0.3 * rand(N, C)).to(param_dtype) if p["scale"] else None
    t["shift"] = rand(N, C).to(param_dtype) if p["shift"] else None
    t["residual"] = rand(*shape).to(dtype) if p["residual"] else None
    t["multiplier"] = rand(*shape).to(dtype) if p["multiplier"] else None
    if op == "instance_norm":
        t["running_mean"] = rand(C).to(param_dtype)
        t["running_var"] = (1 + rand(C).abs()).to(param_dtype)
    return t, rand(*shape).to(dtype)


def _check_case(pool, op, case, dtype):
    tensors, grad_out = _tensors(case, dtype, op)
    results = pool.run(_task_sharded, op, case, tensors, grad_out)
    _check_against_whole(results, op, case, tensors, grad_out, dtype)


# -- plain shards with a process group ----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@settings(max_examples=8)
@given(data=st.data())
def test_group_norm_shards_match_whole_tensor_float64(world, data):
    # Forward and every gradient, uneven and empty shards, both layouts, the whole epilogue: to
    # float64 rounding (1e-10 absolute, 1e-8 relative, gradients scaled by their size).
    _check_case(_pool(world), "group_norm", data.draw(_cases(world)), torch.float64)


@pytest.mark.parametrize("world", [2, 3])
@settings(max_examples=4)
@given(data=st.data())
def test_instance_norm_shards_match_whole_tensor_with_running_stats(world, data):
    _check_case(_pool(world), "instance_norm", data.draw(_cases(world, "instance_norm")), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_norm_shards_reduced_precision(pool, dtype):
    case = dict(shape=[2, 8, 9, 5], num_groups=4, dim=2, sizes=_even_sizes(9, pool.world), activation="silu",
                eps=1e-5, layout="contiguous", seed=3, present=dict.fromkeys(_OPERANDS, True))
    _check_case(pool, "group_norm", case, dtype)


def test_group_norm_shards_gradients_of_offset_data(pool):
    # Values near 1e4 in float32: the saved mean is the whole tensor's rounded to float32 (off by
    # up to 5e-4), and the kernels centre their backward sums on each shard's own mean; the
    # sharded backward moves them to the saved one (docs/distributed.md, 'Local backward').
    case = dict(shape=[2, 8, 9, 5], num_groups=4, dim=2, sizes=_even_sizes(9, pool.world), activation="silu",
                eps=1e-5, layout="channels_last", seed=5, present=dict.fromkeys(_OPERANDS, True), offset=1e4)
    _check_case(pool, "group_norm", case, torch.float32)


def test_group_norm_shards_input_gradient_of_offset_data_whose_shards_differ(pool):
    # Near 1e5, with a gradient that follows x - 1e5 on the first rows and its negative on the
    # others: each shard's sum of g * (x - mean) is far from the whole tensor's, so the input
    # gradient's move from the shard's to the whole tensor's is large, and x - mean must keep
    # its digits there (taken as (x - c_hi) - c_lo).
    shape = [2, 8, 10, 5]
    case = dict(shape=shape, num_groups=4, dim=2, sizes=_even_sizes(10, pool.world), activation=None, eps=1e-5,
                layout="contiguous", seed=6, present=dict.fromkeys(_OPERANDS, False), offset=1e5)
    tensors, _ = _tensors(case, torch.float32)
    sign = torch.where(torch.arange(shape[2]) < shape[2] // 2, 1.0, -1.0).reshape(1, 1, -1, 1)
    grad_out = ((tensors["input"].double() - 1e5) * sign).float()
    results = pool.run(_task_sharded, "group_norm", case, tensors, grad_out)
    _check_against_whole(results, "group_norm", case, tensors, grad_out, torch.float32)


def test_group_norm_shards_of_an_empty_batch(pool):
    # N = 0: empty outputs and gradients, the statistics' shapes (0, G) throughout.
    case = dict(shape=[0, 4, 6, 3], num_groups=2, dim=2, sizes=_even_sizes(6, pool.world), activation="silu",
                eps=1e-5, layout="contiguous", seed=7, present=dict.fromkeys(_OPERANDS, True))
    _check_case(pool, "group_norm", case, torch.float64)


def _task_all_gathers(rank, world, x, wanted):
    # The all-gathers one sharded call makes: forward only, then forward and backward for the
    # gradients `wanted` ("input", "weight", "bias").
    a, b = _bounds(_even_sizes(x.shape[2], world), rank)
    calls = []
    original = torch.distributed.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch.distributed.all_gather = counting
    try:
        shard = x[:, :, a:b].clone().requires_grad_("input" in wanted)
        w = torch.ones(x.shape[1], dtype=x.dtype, requires_grad="weight" in wanted)
        bias = torch.zeros(x.shape[1], dtype=x.dtype, requires_grad="bias" in wanted)
        with torch.no_grad():
            fusednorm.distributed.group_norm(shard, 2, w, bias, activation="silu")
        forward = len(calls)
        y = fusednorm.distributed.group_norm(shard, 2, w, bias, activation="silu")
        leaves = [t for name, t in (("input", shard), ("weight", w), ("bias", bias)) if name in wanted]
        torch.autograd.grad(y.sum(), leaves)
    finally:
        torch.distributed.all_gather = original
    return forward, len(calls) - forward


@pytest.mark.parametrize("wanted, backward", [(("input",), 1), (("weight",), 1), (("bias",), 0),
                                              (("input", "weight", "bias"), 1)])
def test_sharded_norm_makes_one_all_gather_each_way(pool, wanted, backward):
    # docs/distributed.md, "Communication": one in the forward; one in the backward, none when
    # only the bias's gradient is asked.
    results = pool.run(_task_all_gathers, torch.randn(2, 4, 6, 3, dtype=torch.float64), wanted)
    assert all(r == (1, 1 + backward) for r in results), results


def _task_second_derivative(rank, world, x):
    a, b = _bounds(_even_sizes(x.shape[2], world), rank)
    shard = x[:, :, a:b].clone().requires_grad_()
    y = fusednorm.distributed.group_norm(shard, 2, activation="silu")
    (g,) = torch.autograd.grad(y.square().sum(), shard, create_graph=True)
    try:
        g.sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_sharded_second_derivative_raises(pool):
    # The all-gathers are not differentiable: a second derivative through them would be silently
    # wrong, so it raises.
    results = pool.run(_task_second_derivative, torch.randn(2, 4, 6, 3, dtype=torch.float64))
    assert all(r is not None and "differentiate twice" in r for r in results), results


def _even_sizes(n, world):
    step = -(-n // world)
    return [max(0, min(step, n - r * step)) for r in range(world)]


def _task_statistics_bitwise(rank, world, x):
    # Every rank merges the same gathered moments in the same order: bitwise equal statistics.
    a, b = _bounds(_even_sizes(x.shape[2], world), rank)
    mean, rstd, _ = fusednorm.distributed.global_statistics(x[:, :, a:b], 2, 1e-5, torch.distributed.group.WORLD)
    return mean, rstd


def test_statistics_bitwise_equal_on_every_rank_and_exact_for_offset_data(pool):
    # Values near 1e4 with unit spread: E[x^2] - E[x]^2 in float64 would keep ~8 digits of the
    # variance; the merged M2 keeps the variance to rounding.
    g = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(2, 4, 12, 3, generator=g, dtype=torch.float64)
    results = pool.run(_task_statistics_bitwise, x)
    for mean, rstd in results[1:]:
        assert torch.equal(mean, results[0][0]) and torch.equal(rstd, results[0][1])
    var = x.reshape(2, 2, -1).var(dim=-1, unbiased=False)
    torch.testing.assert_close(results[0][1], torch.rsqrt(var + 1e-5), rtol=1e-12, atol=0)


def test_sharded_checks_match_group_norm_errors():
    # Argument checks run before any communication, with fusednorm.group_norm's messages.
    x = torch.randn(2, 6, 4, 4)
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        fusednorm.distributed.group_norm(x, 4)
    with pytest.raises(RuntimeError, match="Expected weight to be a vector of size equal to the number of channels"):
        fusednorm.distributed.group_norm(x, 3, torch.ones(5))
    with pytest.raises(ValueError, match="Unknown activation 'tanh'"):
        fusednorm.distributed.group_norm(x, 3, activation="tanh")
    with pytest.raises(ValueError, match="dim=1"):
        fusednorm.distributed.group_norm(x, 3, dim=1)
    with pytest.raises(IndexError, match="Dimension out of range"):
        fusednorm.distributed.group_norm(x, 3, dim=4)
    with pytest.raises(RuntimeError, match=r"Expected residual of the input's shape \(2, 6, 4, 4\)"):
        fusednorm.distributed.group_norm(x, 3, residual=torch.randn(2, 6, 4, 3))
    # No channels: group_norm refuses them, as fusednorm.group_norm (and eager) does; instance_norm
    # takes them, as eager does, with no communication (no process group here).
    empty = torch.randn(2, 0, 4, 4)
    with pytest.raises(RuntimeError, match="Expected number of channels to be greater than 0, got 0"):
        fusednorm.distributed.group_norm(empty, 1)
    for stats in ((), (torch.zeros(0), torch.ones(0))):
        assert fusednorm.distributed.instance_norm(empty, *stats).shape == empty.shape == F.instance_norm(empty, *stats).shape


# -- DTensor -------------------------------------------------------------------------------------------


def _placement(spec):
    return Replicate() if spec == "replicate" else Shard(spec)


def _task_dtensor(rank, world, api, spec, case, tensors, grad_out):
    """fusednorm on DTensors of a 1-D mesh: (placements of the output, the whole output, the whole
    gradients), or the error's type and message."""
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    placement = [_placement(spec)]
    per_sample = [Shard(spec)] if spec in (0, 1) else [Replicate()]

    def dist(name, t):
        where = {"weight": [Replicate()], "bias": [Replicate()], "scale": per_sample, "shift": per_sample}
        return distribute_tensor(_device(rank, t), mesh, where.get(name, placement)).requires_grad_()

    leaves = {k: dist(k, v) for k, v in tensors.items() if v is not None and not k.startswith("running")}
    x = leaves["input"]
    kw = {k: v for k, v in leaves.items() if k != "input"}
    G = case["num_groups"]
    try:
        if api == "functional":
            out = fusednorm.group_norm(x, G, eps=case["eps"], activation=case["activation"], **kw)
        elif api == "op":
            out = torch.ops.fusednorm.group_norm(x, G, kw.get("weight"), kw.get("bias"), case["eps"],
                                                 activation=case["activation"], scale=kw.get("scale"),
                                                 shift=kw.get("shift"), residual=kw.get("residual"),
                                                 multiplier=kw.get("multiplier"))
        elif api == "instance_norm":
            rm = distribute_tensor(_device(rank, tensors["running_mean"]).clone(), mesh, [Replicate()])
            rv = distribute_tensor(_device(rank, tensors["running_var"]).clone(), mesh, [Replicate()])
            out = fusednorm.instance_norm(x, rm, rv, eps=case["eps"], momentum=0.3, activation=case["activation"],
                                          **kw)
        elif api == "instance_norm_eval":  # the running statistics normalize: elementwise, local
            out = fusednorm.instance_norm(x, _device(rank, tensors["running_mean"]), _device(rank, tensors["running_var"]),
                                          use_input_stats=False, eps=case["eps"], activation=case["activation"], **kw)
        else:  # "instance_norm_op": the composite op, without running statistics
            out = torch.ops.fusednorm.instance_norm(x, None, None, kw.get("weight"), kw.get("bias"), True, 0.1,
                                                    case["eps"])
    except Exception as e:  # noqa: BLE001  (the error is the result)
        return type(e).__name__, str(e)
    out.backward(distribute_tensor(_device(rank, grad_out), mesh, placement))
    extra = (rm.full_tensor().cpu(), rv.full_tensor().cpu()) if api == "instance_norm" else None
    return (tuple(out.placements), out.full_tensor().cpu(), {k: v.grad.full_tensor().cpu() for k, v in leaves.items()},
            extra)


def _dtensor_case(world, spec, epilogue):
    # Shard(1) on group boundaries: groups of 2 channels, 2 groups per rank.
    C = 4 * world
    shape = [2 * world - 1, C, 7, 5]  # uneven batch, rows and columns
    present = dict.fromkeys(_OPERANDS, epilogue)
    present["weight"] = present["bias"] = True
    return dict(shape=shape, num_groups=2 * world, dim=2, sizes=None, present=present,
                activation="gelu" if epilogue else None, eps=1e-5, layout="contiguous", seed=7)


@needs_dtensor
@pytest.mark.parametrize("api", ["functional", "op"])
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "epilogue"])
@pytest.mark.parametrize("spec", ["replicate", 0, 1, 2, 3])
def test_dtensor_group_norm_keeps_placement_and_values(pool, api, epilogue, spec):
    case = _dtensor_case(pool.world, spec, epilogue)
    tensors, grad_out = _tensors(case, torch.float64)
    results = pool.run(_task_dtensor, api, spec, case, tensors, grad_out)
    out, grads, _ = _whole("group_norm", case, tensors, grad_out)
    for placements, got_out, got_grads, _ in results:
        assert placements == (_placement(spec),)
        assert_close(got_out, out, torch.float64, msg="output")
        for name, g in grads.items():
            assert_close(got_grads[name], g, torch.float64, scale=max(1.0, g.abs().max().item()), msg=f"grad of {name}")


@needs_dtensor
@pytest.mark.parametrize("spec", ["replicate", 0, 1, 2])
def test_dtensor_instance_norm_with_running_stats(pool, spec):
    case = _dtensor_case(pool.world, spec, True)
    case["num_groups"] = case["shape"][1]
    tensors, grad_out = _tensors(case, torch.float64, "instance_norm")
    results = pool.run(_task_dtensor, "instance_norm", spec, case, tensors, grad_out)
    out, grads, (rm, rv) = _whole("instance_norm", case, tensors, grad_out)
    for placements, got_out, got_grads, (got_rm, got_rv) in results:
        assert placements == (_placement(spec),)
        assert_close(got_out, out, torch.float64, msg="output")
        for name, g in grads.items():
            assert_close(got_grads[name], g, torch.float64, scale=max(1.0, g.abs().max().item()), msg=f"grad of {name}")
        assert_close(got_rm, rm, torch.float64, msg="running_mean")
        assert_close(got_rv, rv, torch.float64, msg="running_var")


@needs_dtensor
@pytest.mark.parametrize("spec", [1, 2])
def test_dtensor_instance_norm_with_running_stats_in_eval(pool, spec):
    case = _dtensor_case(pool.world, spec, True)
    case["num_groups"] = case["shape"][1]
    tensors, grad_out = _tensors(case, torch.float64, "instance_norm")
    results = pool.run(_task_dtensor, "instance_norm_eval", spec, case, tensors, grad_out)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()
              if v is not None and not k.startswith("running")}
    out = fusednorm.instance_norm(leaves["input"], tensors["running_mean"], tensors["running_var"], use_input_stats=False,
                                  eps=case["eps"], activation=case["activation"],
                                  **{k: v for k, v in leaves.items() if k != "input"})
    out.backward(grad_out)
    for placements, got_out, got_grads, _ in results:
        assert placements == (_placement(spec),)
        assert_close(got_out, out, torch.float64, msg="output")
        for name, leaf in leaves.items():
            assert_close(got_grads[name], leaf.grad, torch.float64, scale=max(1.0, leaf.grad.abs().max().item()),
                         msg=f"grad of {name}")


@needs_dtensor
def test_dtensor_instance_norm_op_spatial(pool):
    case = _dtensor_case(pool.world, 3, False)
    case["num_groups"] = case["shape"][1]
    tensors, grad_out = _tensors(case, torch.float64)
    results = pool.run(_task_dtensor, "instance_norm_op", 3, case, tensors, grad_out)
    out, grads, _ = _whole("group_norm", case, tensors, grad_out)
    for placements, got_out, got_grads, _ in results:
        assert placements == (Shard(3),)
        assert_close(got_out, out, torch.float64, msg="output")
        assert_close(got_grads["input"], grads["input"], torch.float64, msg="grad of input")


def _task_dtensor_module(rank, world, spec, x, grad_out):
    # fusednorm.nn modules keep plain parameters: taken as replicated, their gradients whole.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    norm = fusednorm.nn.GroupNorm(2 * world, x.shape[1], activation="silu").double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, x.shape[1]))
        norm.bias.copy_(torch.linspace(-1, 1, x.shape[1]))
    xd = distribute_tensor(x, mesh, [_placement(spec)]).requires_grad_()
    out = norm(xd)
    out.backward(distribute_tensor(grad_out, mesh, [_placement(spec)]))
    return (tuple(out.placements), out.full_tensor(), xd.grad.full_tensor(), type(norm.weight.grad).__name__,
            norm.weight.grad, norm.bias.grad)


@needs_dtensor
@pytest.mark.parametrize("spec", ["replicate", 0, 1, 2])
def test_dtensor_through_module_with_plain_parameters(pool, spec):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4 * pool.world, 5, 3, generator=g, dtype=torch.float64) + 2
    grad_out = torch.randn(x.shape, generator=g, dtype=torch.float64)
    norm = fusednorm.nn.GroupNorm(2 * pool.world, x.shape[1], activation="silu").double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, x.shape[1]))
        norm.bias.copy_(torch.linspace(-1, 1, x.shape[1]))
    xr = x.clone().requires_grad_()
    out = norm(xr)
    out.backward(grad_out)
    for placements, got, got_dx, grad_type, dw, db in pool.run(_task_dtensor_module, spec, x, grad_out):
        assert placements == (_placement(spec),) and grad_type == "Tensor"
        assert_close(got, out, torch.float64)
        assert_close(got_dx, xr.grad, torch.float64, scale=10)
        assert_close(dw, norm.weight.grad, torch.float64, scale=10)
        assert_close(db, norm.bias.grad, torch.float64, scale=10)


@needs_dtensor
def test_dtensor_channel_shards_off_group_boundaries_raise(pool):
    # 6 channels in 3 groups of 2: shards of ceil(6 / world) = 3 (2 ranks) or 2 (3 ranks) channels.
    case = dict(shape=[2, 6, 4, 4], num_groups=3, dim=2, sizes=None, present=dict.fromkeys(_OPERANDS, False),
                activation=None, eps=1e-5, layout="contiguous", seed=1)
    tensors, grad_out = _tensors(case, torch.float64)
    results = pool.run(_task_dtensor, "functional", 1, case, tensors, grad_out)
    if pool.world == 2:
        for kind, message in results:
            assert kind == "RuntimeError" and "split the channels on group boundaries" in message, message
    else:
        for r in results:
            assert r[0] == (Shard(1),)


def _task_dtensor_input_bias(rank, world, spec, x, p, grad_out):
    """fusednorm.group_norm(x, input_bias=p) on DTensors, p replicated: (placements, output without and
    with a graph, the gradients of x and p)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dx = distribute_tensor(x, mesh, [_placement(spec)])
    dp = distribute_tensor(p, mesh, [Replicate()])
    with torch.no_grad():  # the op itself takes input_bias
        plain = fusednorm.group_norm(dx, 4, activation="silu", input_bias=dp)
    dx.requires_grad_()
    dp.requires_grad_()
    out = fusednorm.group_norm(dx, 4, activation="silu", input_bias=dp)  # autograd adds it first
    out.backward(distribute_tensor(grad_out, mesh, [_placement(spec)]))
    return (tuple(plain.placements), plain.full_tensor(), out.full_tensor(), dx.grad.full_tensor(),
            dp.grad.full_tensor())


@needs_dtensor
@pytest.mark.parametrize("p_shape", ["C", "NC"])
@pytest.mark.parametrize("spec", ["replicate", 0, 2])
def test_dtensor_input_bias(pool, spec, p_shape):
    torch.manual_seed(0)
    x = torch.randn(2 * pool.world, 8, 6, 5, dtype=torch.float64)
    p = torch.randn((8,) if p_shape == "C" else (2 * pool.world, 8), dtype=torch.float64)
    grad_out = torch.randn(x.shape, dtype=torch.float64)
    xr, pr = x.clone().requires_grad_(), p.clone().requires_grad_()
    want = F.silu(F.group_norm(xr + pr.reshape(-1, 8, 1, 1), 4))
    want.backward(grad_out)
    for placements, plain, out, gx, gp in pool.run(_task_dtensor_input_bias, spec, x, p, grad_out):
        assert placements == (_placement(spec),)
        assert_close(plain, want, torch.float64)
        assert_close(out, want, torch.float64)
        assert_close(gx, xr.grad, torch.float64, scale=10)
        assert_close(gp, pr.grad, torch.float64, scale=10)


def _task_dtensor_add_group_norm(rank, world, spec, x, other, p, grad_out):
    """torch.ops.fusednorm.add_group_norm(x, other, input_bias=p) on DTensors, p replicated:
    (placements, output and sum, the gradients of x, other and p)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dx, do = (distribute_tensor(t, mesh, [_placement(spec)]) for t in (x, other))
    dp = distribute_tensor(p, mesh, [Replicate()])
    with torch.no_grad():  # the op itself (its DTensor rule)
        plain, plain_total = torch.ops.fusednorm.add_group_norm(dx, do, 4, activation="silu", input_bias=dp)
    for t in (dx, do, dp):
        t.requires_grad_()
    out, total = torch.ops.fusednorm.add_group_norm(dx, do, 4, activation="silu", input_bias=dp)  # autograd's sum
    (out * total).backward(distribute_tensor(grad_out, mesh, [_placement(spec)]))
    return (tuple(plain.placements), tuple(out.placements), plain.full_tensor(), plain_total.full_tensor(),
            out.full_tensor(), total.full_tensor(), dx.grad.full_tensor(), do.grad.full_tensor(),
            dp.grad.full_tensor())


@needs_dtensor
@pytest.mark.parametrize("spec", ["replicate", 0, 2])
def test_dtensor_add_group_norm(pool, spec):
    torch.manual_seed(0)
    x, other = (torch.randn(2 * pool.world, 8, 6, 5, dtype=torch.float64) for _ in range(2))
    p = torch.randn(8, dtype=torch.float64)
    grad_out = torch.randn(x.shape, dtype=torch.float64)
    xr, orr, pr = (t.clone().requires_grad_() for t in (x, other, p))
    total = xr + orr + pr.reshape(-1, 8, 1, 1)
    want = F.silu(F.group_norm(total, 4))
    (want * total).backward(grad_out)
    for result in pool.run(_task_dtensor_add_group_norm, spec, x, other, p, grad_out):
        placements, placements_graph, plain, plain_total, out, got_total, gx, go, gp = result
        assert placements == placements_graph == (_placement(spec),)
        for got, expected in ((plain, want), (plain_total, total), (out, want), (got_total, total)):
            assert_close(got, expected, torch.float64)
        assert_close(gx, xr.grad, torch.float64, scale=10)
        assert_close(go, orr.grad, torch.float64, scale=10)
        assert_close(gp, pr.grad, torch.float64, scale=10)


# -- DDP and FSDP2 --------------------------------------------------------------------------------------


def _net(kind):
    """A small conv net with GroupNorm + SiLU and InstanceNorm2d (running stats) + ReLU, from
    fusednorm.nn ("fusednorm") or torch.nn ("torch"); the same parameters and buffers."""
    torch.manual_seed(0)
    if kind == "fusednorm":
        gn = fusednorm.nn.GroupNorm(4, 8, activation="silu")
        inorm = fusednorm.nn.InstanceNorm2d(8, affine=True, track_running_stats=True, activation="relu")
        layers = [torch.nn.Conv2d(3, 8, 3, padding=1), gn, torch.nn.Conv2d(8, 8, 3, padding=1), inorm,
                  torch.nn.Conv2d(8, 3, 1)]
    else:
        layers = [torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(4, 8), torch.nn.SiLU(),
                  torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
                  torch.nn.ReLU(), torch.nn.Conv2d(8, 3, 1)]
    return torch.nn.Sequential(*layers).double()


def _train(model, x, target, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, first_grads = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.full_tensor() if HAS_DTENSOR and isinstance(p.grad, DTensor) else p.grad.clone()
                           for p in model.parameters()]
        opt.step()
        losses.append(loss.detach())
    return losses, first_grads


def _task_ddp(rank, world, kind, x, target):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_net(kind))
    losses, grads = _train(model, x.chunk(world)[rank], target.chunk(world)[rank])
    # The mean of the ranks' losses is the whole batch's (equal shards).
    loss = torch.stack(losses)
    torch.distributed.all_reduce(loss)
    return loss / world, grads, {k: v.clone() for k, v in model.module.state_dict().items()}


def _batch(world):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(2 * world, 3, 6, 7, generator=g, dtype=torch.float64),
            torch.randn(2 * world, 3, 6, 7, generator=g, dtype=torch.float64))


def test_ddp_training_matches_one_process_and_torch_nn(pool):
    x, target = _batch(pool.world)
    whole_losses, whole_grads = _train(_net("fusednorm"), x, target)
    fused = pool.run(_task_ddp, "fusednorm", x, target)
    torch_nn = pool.run(_task_ddp, "torch", x, target)
    for (losses, grads, state), (_, _, torch_state) in zip(fused, torch_nn):
        torch.testing.assert_close(losses, torch.stack(whole_losses), rtol=1e-10, atol=1e-12)
        for g, want in zip(grads, whole_grads):
            torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12)
        # Parameters and running statistics as torch.nn's under DDP (it broadcasts rank 0's
        # buffers before each forward), in order (the torch.nn net has activation modules between).
        fused_values = list(state.values())
        torch_values = list(torch_state.values())
        assert len(fused_values) == len(torch_values)
        for got, want in zip(fused_values, torch_values):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    return fully_shard


def _task_fsdp(rank, world, x, target):
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard()
    model = _net("fusednorm")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses, grads = _train(model, x.chunk(world)[rank], target.chunk(world)[rank])
    loss = torch.stack(losses)
    torch.distributed.all_reduce(loss)
    return loss / world, grads


@needs_dtensor
@pytest.mark.skipif(_fully_shard() is None, reason="needs FSDP2's fully_shard")
def test_fsdp2_training_matches_one_process(pool):
    x, target = _batch(pool.world)
    whole_losses, whole_grads = _train(_net("fusednorm"), x, target)
    for losses, grads in pool.run(_task_fsdp, x, target):
        torch.testing.assert_close(losses, torch.stack(whole_losses), rtol=1e-10, atol=1e-12)
        for g, want in zip(grads, whole_grads):
            torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12)


# -- NCCL on two GPUs ------------------------------------------------------------------------------------


def _needs_two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _needs_two_gpus(), reason="needs 2 GPUs and NCCL")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_nccl_group_norm_shards_match_whole_tensor(dtype):
    pool = _pool(2, "nccl")
    case = dict(shape=[2, 32, 33, 17], num_groups=8, dim=2, sizes=[20, 13], activation="silu", eps=1e-5,
                layout="channels_last", seed=11, present=dict.fromkeys(_OPERANDS, True))
    _check_case(pool, "group_norm", case, dtype)


@pytest.mark.cuda
@needs_dtensor
@pytest.mark.skipif(not _needs_two_gpus(), reason="needs 2 GPUs and NCCL")
@pytest.mark.parametrize("spec", ["replicate", 0, 1, 2, 3])
def test_nccl_dtensor_group_norm(spec):
    pool = _pool(2, "nccl")
    case = _dtensor_case(2, spec, True)
    tensors, grad_out = _tensors(case, torch.float64)
    results = pool.run(_task_dtensor, "functional", spec, case, tensors, grad_out)
    out, grads, _ = _whole("group_norm", case, tensors, grad_out)
    for placements, got_out, got_grads, _ in results:
        assert placements == (_placement(spec),)
        assert_close(got_out, out, torch.float64, msg="output")
        for name, g in grads.items():
            assert_close(got_grads[name], g, torch.float64, scale=max(1.0, g.abs().max().item()), msg=f"grad of {name}")
