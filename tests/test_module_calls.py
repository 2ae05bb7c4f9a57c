"""fusednorm._module_calls: the fusion backend's first step, which rewrites torch.nn module calls
(the form Dynamo records on torch < 2.2, and torch.fx.symbolic_trace's leaf modules) into the
functional calls their forwards make: the same values and running statistics, train and eval;
one get_attr node per parameter or buffer; the modules whose call stays (another padding mode, a
forward of their own, an unbatched or mismatched instance norm input) left as they are. On torch
2.1 the backend's tests (test_fusion, test_input_bias, ...) run through it too."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fusednorm._module_calls import lower_module_calls


class OwnForward(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x) * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.silu = nn.SiLU()
        self.proj = nn.Conv2d(8, 8, 1, bias=False)
        self.inorm = nn.InstanceNorm2d(8, affine=True, track_running_stats=True, momentum=0.3)
        self.leaky = nn.LeakyReLU(0.2)
        self.drop = nn.Dropout(0.3)
        self.gelu = nn.GELU(approximate="tanh")
        self.mish = nn.Mish()
        self.relu = nn.ReLU(inplace=True)
        self.drop2d = nn.Dropout2d(0.2)
        self.reflect = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")  # pads itself: kept
        self.own = OwnForward(2, 8)  # a forward of its own: kept
        self.unbatched = nn.InstanceNorm1d(4)  # an unbatched (C, L) input: kept
        self.mismatch = nn.InstanceNorm2d(3)  # 8 channels, not 3: its warning stays, kept

    def forward(self, x):
        h = self.silu(self.gn(self.conv(x)))
        h = self.leaky(self.inorm(self.proj(h)))
        h = self.mish(self.gelu(self.drop(h)))
        h = self.drop2d(self.relu(self.gn(h)))  # the same norm again: the same get_attr nodes
        h = self.own(self.reflect(h))
        return h, self.unbatched(h[0, :4].flatten(1)), self.mismatch(h)


def traced(module, x):
    """module's graph with symbolic_trace (leaf module calls), each node's value recorded as Dynamo
    records it (meta["example_value"]), on a copy of the module."""
    class Tracer(fx.Tracer):  # torch.nn's modules, and OwnForward, as calls
        def is_leaf_module(self, m, qualname):
            return isinstance(m, OwnForward) or super().is_leaf_module(m, qualname)

    gm = fx.GraphModule(module, Tracer().trace(module))

    class Record(fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            n.meta["example_value"] = value
            return value

    Record(fx.GraphModule(copy.deepcopy(module), gm.graph)).run(x)
    return gm


@pytest.mark.parametrize("training", [True, False])
def test_lowered_graph_computes_what_the_modules_do(training):
    torch.manual_seed(0)
    net = Net().train(training)
    x = torch.randn(2, 3, 6, 5)
    gm = traced(net, x)
    assert lower_module_calls(gm) == 12  # the group norm twice
    kept = sorted(n.target for n in gm.graph.nodes if n.op == "call_module")
    assert kept == ["mismatch", "own", "reflect", "unbatched"]
    attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(attrs) == len(set(attrs)) and "gn.weight" in attrs and "proj.bias" not in attrs
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {F.conv2d, F.group_norm, F.instance_norm, F.silu, F.leaky_relu, F.gelu, F.mish, F.relu,
            F.dropout, F.dropout2d} <= targets
    reference = copy.deepcopy(net)
    torch.manual_seed(1)  # the dropouts draw the same masks
    with pytest.warns(UserWarning, match="does not match num_features"):
        got = gm(x)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="does not match num_features"):
        want = reference(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # The instance norm's running statistics updated as the module updates them (train mode).
    torch.testing.assert_close(gm.inorm.running_mean, reference.inorm.running_mean)
    torch.testing.assert_close(gm.inorm.running_var, reference.inorm.running_var)


def test_a_graph_without_module_calls_is_left_alone():
    gm = fx.symbolic_trace(lambda x: F.silu(x) + 1)
    code = gm.code
    assert lower_module_calls(gm) == 0 and gm.code == code
