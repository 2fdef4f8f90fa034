"""Control flow on sizes, decided at the example input while a forward is traced
(bayesfuse.nets.decisions, through bayesfuse.nets.graph_spec).

A branch, ``assert`` or ``int()`` on a number read off tensors' sizes is taken at the example
input; the spec then describes the network down that branch, which each test checks by what a
spec promises: a copy permuted by it computes the same function, and fusing it back gives the
function again (max abs logit difference under 1e-4: float32 round-off on logits of order 1).
A branch that reads the units' width fixes it; one that reads a tensor's values is refused.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import bayesfuse
from bayesfuse.nets.decisions import Decider, decided, reads_sizes_only
from bayesfuse.nets.graph_spec import spec_from_graph
from bayesfuse.nets.tracing import UnsupportedLayerError
from tests.helpers import far_from_identity_norms, permuted_copy
from tests.nets.user_nets import NanoGPT, WrittenGPT


class AssertingGPT(NanoGPT):
    """nanoGPT's forward as written: ``assert t <= self.config.block_size`` before the embeddings."""

    def __init__(self) -> None:
        super().__init__(split_by="C")
        self.block_size = 6

    def forward(self, idx):
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        return super().forward(idx)


class TokenGrid(nn.Module):
    """Tokens folded back into a square grid by ``int(math.sqrt(T))`` (timm's Nest), a branch on
    the batch and one on the grid's side; a width the module holds cuts the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = nn.Linear(4, 12), nn.Conv2d(12, 12, 3, padding=1)
        self.qkv, self.head = nn.Linear(12, 36), nn.Linear(12, 10)
        self.width = 12

    def example_input(self):
        return torch.zeros(2, 16, 4)

    def forward(self, x):
        B, T, _ = x.shape
        side = int(math.sqrt(T))
        h = self.embed(x)
        if side > 2:  # a branch on the positions: taken at the example, the units are not read
            h = h.transpose(1, 2).reshape(B, -1, side, side)
            h = self.mix(torch.relu(h)).flatten(2).transpose(1, 2)
        q, k, v = self.qkv(h).view(B, T, 3, self.width).unbind(2)
        h = h + ((q @ k.transpose(1, 2)) * 0.3).softmax(-1) @ v
        return self.head(h.mean(1))


class WidthBranch(nn.Module):
    """A branch on the hidden layer's own width: at another width the forward would take the other."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 6), nn.Linear(6, 3)

    def example_input(self):
        return torch.zeros(2, 8)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if h.shape[-1] % 2 == 0:
            h = h * 2
        return self.head(h)


class ValueBranch(WidthBranch):
    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            h = -h
        return self.head(h)


class MaskBuilt(nn.Module):
    """A mask built by item assignment (``mask[a:b, c:d] = k``, as torchvision's Swin builds its
    shifted windows' mask) and added to attention scores; sizes read off the input."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.head = nn.Linear(4, 24), nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 6, 4)

    def forward(self, x):
        T = x.shape[1]
        mask = x.new_zeros((T, T))
        half = T // 2
        if half > 0:
            mask[:half, half:] = -1e4
            mask[half:, :half] = -1e4
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.head((((q @ k.transpose(1, 2)) * 0.3 + mask).softmax(-1) @ v).mean(1))


def _model(cls, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return far_from_identity_norms(cls()).eval()


def _fuses_back(model: nn.Module, x: torch.Tensor, method: str) -> float:
    spec = spec_from_graph(model)
    permuted = permuted_copy(model, spec, seed=1).eval()
    with torch.no_grad():
        assert float((permuted(x) - model(x)).abs().max()) < 1e-4  # the spec is a symmetry of the network
        fused = bayesfuse.fuse([model, permuted], method).model
        return float((fused(x) - model(x)).abs().max())


def test_nanogpt_asserting_its_sequence_length_fuses_by_every_method():
    """nanoGPT's ``assert t <= block_size`` reads the sequence's length, not the units: the trace
    takes it at the example, and every method fuses the network, PFNM at a wider stream."""
    model = _model(AssertingGPT, 0)
    x = torch.randint(0, 12, (8, 6))
    assert not spec_from_graph(model).fixed
    for method in ("pfnm", "ot"):
        assert _fuses_back(model, x, method) < 1e-4, method
    fused = bayesfuse.fuse([_model(AssertingGPT, s) for s in (1, 2, 3)], "pfnm")
    assert fused.sizes[0] > 16 and fused.model(x).shape == (8, 6, 12)


def test_int_of_a_size_and_a_branch_on_positions_are_taken_at_the_example():
    model = _model(TokenGrid, 0)
    x = torch.randn(5, 16, 4)
    spec = spec_from_graph(model)
    assert not spec.fixed and set(spec.widths) == {"width"}  # the held width still follows (a retrace replays)
    assert _fuses_back(model, x, "pfnm") < 1e-4
    fused = bayesfuse.fuse([_model(TokenGrid, s) for s in (1, 2, 3)], "pfnm").model
    assert fused.width == fused.head.in_features > 12 and fused(x).shape == (5, 10)


def test_a_branch_on_the_units_width_fixes_it():
    """PFNM then matches the units at that width, one to one, as OT keeps it."""
    model = _model(WidthBranch, 0)
    spec = spec_from_graph(model)
    assert "branches on" in spec.fixed["P1"]
    x = torch.randn(5, 8)
    for method in ("pfnm", "ot"):
        assert _fuses_back(model, x, method) < 1e-4, method
    fused = bayesfuse.fuse([_model(WidthBranch, s) for s in (1, 2, 3)], "pfnm")
    assert fused.sizes == [6] and "branches on" in fused.hyper["fixed"]["P1"]


def test_a_branch_on_a_tensors_values_is_refused_in_one_line():
    with pytest.raises(UnsupportedLayerError, match=r"a condition reads the values of fc") as err:
        spec_from_graph(_model(ValueBranch, 0))
    assert "\n" not in str(err.value)


def test_a_mask_built_by_item_assignment_traces():
    model = _model(MaskBuilt, 0)
    x = torch.randn(3, 6, 4)
    assert _fuses_back(model, x, "pfnm") < 1e-4


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        h[:, 0] = 0.0  # one unit silenced by its place
        return self.head(h)


def test_item_assignment_into_the_units_is_refused():
    with pytest.raises(UnsupportedLayerError, match="setitem on a permuted axis"):
        spec_from_graph(_Masked(), torch.zeros(2, 8))


def _graph(fn) -> fx.Graph:
    return fx.symbolic_trace(fn).graph


def test_the_decider_computes_sizes_and_refuses_values():
    """Unit level: a number computed from sizes gets its example value; one computed from a
    tensor's values names that tensor; a replay gives the recorded values back in order."""

    def f(x):
        return x.shape[1] * 2 + x.sum()

    graph = _graph(f)
    nodes = {n.name: n for n in graph.nodes}
    decider = Decider(nn.Module(), example=(torch.ones(3, 5),))
    assert decider.value(nodes["mul"], "a condition") == 10 and decider.made == [10]
    assert reads_sizes_only(nodes["mul"], decider.values) is None
    with pytest.raises(fx.proxy.TraceError, match="reads the values of x"):
        decider.value(nodes["add"], "a condition")
    again = Decider(nn.Module(), replay=[10])
    assert again.value(nodes["add"], "a condition") == 10
    with pytest.raises(fx.proxy.TraceError, match="did not meet"):
        again.value(nodes["add"], "a condition")
    assert decided(3) is None


#: _Net's layer of the branch not taken is not read: the tracer warns so
_UNREAD = pytest.mark.filterwarnings("ignore:_Net. other.weight, other.bias are not read")


class _Net(nn.Module):
    """A two-layer network whose forward each case below writes."""

    def __init__(self, forward) -> None:
        super().__init__()
        self.fc1, self.fc2, self.other = nn.Linear(8, 6), nn.Linear(6, 3), nn.Linear(8, 3)
        self.heads, self.hd = 2, 3
        self.body = forward

    def forward(self, x):
        return self.body(self, x)


def _masked_count(s, x):  # x[x > 0]'s size is computed from x's values
    h = torch.relu(s.fc1(x))
    return s.fc2(h) if x[x > 0].numel() > 16 else s.other(x)


def _written_into(s, x):  # t's values are written by add_ with data after it was made
    t = torch.zeros(x.shape[0])
    t.add_(x.sum())
    return s.fc2(torch.relu(s.fc1(x))) if t.max() > 5 else s.other(x)


def _written_with_sizes(s, x):  # t's values are written by add_ with a size: the branch holds for any input
    t = torch.zeros(x.shape[0])
    t.add_(10)
    return s.fc2(torch.relu(s.fc1(x))) if t.max() > 5 else s.other(x)


def _weight_read_first(s, x):  # a width read off a parameter before its layer runs
    if s.fc1.weight.shape[0] % 2 == 0:
        x = x * 2
    return s.fc2(torch.relu(s.fc1(x)))


def _dtype_checked(s, x):  # a tensor's dtype and rank are not its width
    h = torch.relu(s.fc1(x)).view(-1, s.heads, s.hd)
    if h.dtype == torch.float16 or h.dim() != 3:
        h = h.float()
    return s.fc2(h.flatten(1))


def _batch_asserted(s, x):  # the batch asserted after a reshape by held widths: the widths still follow
    q = torch.relu(s.fc1(x)).view(x.shape[0], s.heads, s.hd)
    assert q.shape[0] == x.shape[0]
    return s.fc2(q.softmax(-1).reshape(x.shape[0], -1))


def _numel_of_shape(s, x):
    h = torch.relu(s.fc1(x))
    return s.fc2(h * 2 if h.shape.numel() % 2 == 0 else h)


@pytest.mark.parametrize("body", [_masked_count, _written_into])
def test_a_branch_on_sizes_computed_from_values_is_refused(body):
    """A size computed from values (a mask's count), or a tensor written with data after it was
    made, is a branch on values: refused, not taken at the example."""
    with pytest.raises(UnsupportedLayerError, match="reads the values of"):
        spec_from_graph(_Net(body), torch.randn(4, 8))


def test_one_input_given_as_a_tuple_is_read_as_values():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 3)

        def forward(self, pair):
            return self.a(pair[0]) if pair[1].sum() > 0 else self.b(pair[0])

    with pytest.raises(UnsupportedLayerError, match="reads the values of pair"):
        spec_from_graph(Pair(), (torch.randn(2, 8), torch.randn(2, 8)))


@_UNREAD
def test_writes_into_a_tensor_are_made_before_a_branch_reads_it():
    """``t.add_(10)`` is made before ``t.max() > 5`` is computed: the trace takes the branch the
    forward takes (fc1, fc2), not the one of zeros (other)."""
    spec = spec_from_graph(_Net(_written_with_sizes), torch.randn(4, 8))
    assert spec.groups == ("P1",) and spec.axes["fc1.weight"][0].group == "P1"  # fc1 read: its branch taken


@pytest.mark.parametrize(
    ("body", "fixed", "widths"),
    [
        (_weight_read_first, {"P1"}, set()),  # read before fc1 runs: fixed as after it
        (_numel_of_shape, {"P1"}, set()),  # h.shape.numel(): the units' width among its factors
        (_dtype_checked, set(), {"hd"}),  # dtype and rank: nothing fixed, hd follows
        (_batch_asserted, set(), {"hd"}),  # the batch: nothing fixed, hd follows
    ],
)
@_UNREAD
def test_a_decision_fixes_the_widths_its_number_reads_and_only_those(body, fixed, widths):
    spec = spec_from_graph(_Net(body), torch.randn(4, 8))
    assert set(spec.fixed) == fixed and set(spec.widths) == widths


@pytest.mark.parametrize("flash", [True, False])
def test_nanogpt_as_written_fuses_by_pfnm(flash):
    """nanoGPT's model as written: its ``assert``, ``targets=None`` traced at its default (``if
    targets is not None:`` takes the branch the fused network is called on), ``(logits, loss)``
    returned, and its attention's scale a root of the heads' width (the kernel's default, or
    ``1.0 / math.sqrt(k.size(-1))``), which fixes the stream: PFNM holds it at 16 and grows the MLPs,
    the embedding stays tied to the output layer, and a permuted copy fuses back."""
    x = torch.randint(0, 12, (4, 8))
    model = _model(lambda: WrittenGPT(flash), 0)
    spec = spec_from_graph(model)
    assert set(spec.fixed) == {"P1"} and spec.tied == {"transformer.wte.weight": "lm_head.weight"}
    permuted = permuted_copy(model, spec, seed=1).eval()
    with torch.no_grad():
        assert float((permuted(x)[0] - model(x)[0]).abs().max()) < 1e-4
        for method in ("pfnm", "ot"):
            assert float((bayesfuse.fuse([model, permuted], method).model(x)[0] - model(x)[0]).abs().max()) < 1e-4
        fused = bayesfuse.fuse([_model(lambda: WrittenGPT(flash), s) for s in (1, 2, 3)], "pfnm")
        net = fused.model
        assert net.transformer.ln_f.weight.shape == (16,) and net.transformer.h[0].mlp.c_fc.out_features > 64
        assert net.transformer.wte.weight is net.lm_head.weight and net(x)[0].shape == (4, 1, 12)


def _sizes_iterated(s, x):  # HF's way: a mask's minimum by the input's dtype, sizes iterated and counted
    h = torch.relu(s.fc1(x))
    low = torch.finfo(h.dtype).min
    n = 1
    for d in h.shape[:-1]:
        n = n * d
    rows = [r for r in h.view(n, -1)]  # iterating over a tensor: its rows
    if len(h) != len(rows):
        h = h.clamp(min=low)
    return s.fc2(torch.stack(rows)).view(*h.shape[:-1], -1)


@_UNREAD
def test_dtypes_iteration_and_len_are_taken_at_the_example():
    """``torch.finfo(x.dtype)``, ``for d in x.shape[:-1]``, iterating over a tensor's rows and
    ``len(x)`` (as Hugging Face's models write their masks and shapes) are read at the example: a
    dtype has no width, and the sizes read are the batch's; the units still follow."""
    model = _model(lambda: _Net(_sizes_iterated), 0)
    x = torch.randn(4, 8)
    spec = spec_from_graph(model, x[:2])
    assert spec.groups == ("P1",) and not spec.fixed
    assert _fuses_back(model, x[:2], "pfnm") < 1e-4


class _PooledTo(nn.Module):
    """A forward with a tuple default (``out_size=(1, 1)``), which fx would unpack into placeholders."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 6, 3), nn.Linear(6, 3)

    def example_input(self):
        return torch.zeros(1, 3, 8, 8)

    def forward(self, x, out_size=(1, 1), scale=1.0):
        return self.fc(F.adaptive_avg_pool2d(torch.relu(self.conv(x)), out_size).flatten(1)) * scale


def test_only_plain_defaults_are_traced_at_their_value():
    """A plain default (``scale=1.0``) is traced at its value; a tuple default stays an argument,
    as before (fx cannot take it as a constant): the network traces and fuses back."""
    model = _model(_PooledTo, 0)
    x = torch.randn(2, 3, 8, 8)
    assert spec_from_graph(model).groups == ("P1",)
    assert _fuses_back(model, x, "pfnm") < 1e-4
