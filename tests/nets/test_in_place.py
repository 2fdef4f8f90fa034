"""Units the forward holds in place (bayesfuse.nets.graph_spec, PermutationSpec.in_place): a
rotary position embedding multiplies the queries and keys by ``cos`` and ``sin`` tables along
their features, which no permutation moves, so those features keep their order and width and
every method fuses them in place; the values, the stream and the MLPs are matched as before."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesfuse
from bayesfuse.inference.spec_io import spec_from_dict, spec_to_dict
from bayesfuse.nets.graph_spec import spec_from_graph
from tests.helpers import permuted_copy, randomise
from tests.nets.user_nets import BiEnds, RotaryLM


def _model(seed: int) -> RotaryLM:
    torch.manual_seed(seed)
    model = RotaryLM().eval()
    with torch.no_grad():  # norms away from 1, so a wrong permutation of their weights shows
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def test_rotary_queries_and_keys_stay_in_place_and_the_rest_is_matched():
    model = _model(0)
    spec = spec_from_graph(model)
    layer = "layers.0.attn."
    assert set(spec.in_place) == {f"layers.{i}.attn.{p}_proj" for i in (0, 1) for p in ("q", "k")}
    assert "numbers along their units that no permutation moves" in spec.in_place[layer + "q_proj"]
    # the queries' and keys' rows are no group's, their columns the stream's; the values' rows are permuted
    assert spec.axes[layer + "q_proj.weight"][0] is None and spec.axes[layer + "k_proj.weight"][0] is None
    assert spec.axes[layer + "q_proj.weight"][1] is not None and spec.axes[layer + "v_proj.weight"][0] is not None
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))).in_place == spec.in_place


def test_a_rotary_language_model_fuses_back_and_fuses():
    """A permuted copy (every group the spec lists permuted) computes the function and fuses back
    by each method; three independent ones fuse by PFNM with the stream and MLPs grown, the
    queries and keys at their width, and the report saying which units stayed in place."""
    x = torch.randint(0, 12, (3, 8))
    model = _model(0)
    spec = spec_from_graph(model)
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-5
        for method in ("pfnm", "nafi", "ot"):
            fused = bayesfuse.fuse([model, permuted], method)
            assert float((fused.model(x) - reference).abs().max()) < 1e-4, method
            assert set(fused.hyper["in_place"]) == set(spec.in_place)
        fused = bayesfuse.fuse([_model(s) for s in (1, 2, 3)], "pfnm")
        net = fused.model
        attention = net.layers[0]["attn"]
        assert attention.q_proj.out_features == attention.k_proj.out_features == 16
        assert net.norm.weight.shape[0] > 16 and net.layers[0]["mlp"].gate_proj.out_features > 32
        assert net(x).shape == (3, 8, 12)


def test_weights_applied_by_hand_are_layers():
    """``x @ self.w1 + self.b1`` (stored inputs first: its units on axis 1), ``F.linear(h, self.w2,
    self.b2)`` and ``h @ self.w3.T + self.b3`` (the output layer) are linear layers: a permuted copy
    fuses back by every method, and three independent networks fuse by PFNM to wider ones that run."""
    from tests.nets.user_nets import HandMLP

    def model(seed: int) -> HandMLP:
        torch.manual_seed(seed)
        return HandMLP().eval()

    net = model(0)
    spec = spec_from_graph(net)
    assert spec.axes["w1"][1] is not None and spec.axes["w1"][0] is None and "w1" in spec.transposed
    assert spec.axes["w2"][0] is not None and spec.axes["w2"][0].group == spec.axes["b2"][0].group
    assert spec.output == ("w3", "b3") and spec.axes["w3"][0] is None
    x = torch.randn(6, 8)
    permuted = permuted_copy(net, spec, seed=1)
    with torch.no_grad():
        assert float((permuted(x) - net(x)).abs().max()) < 1e-5
        for method in ("pfnm", "nafi", "ot", "fedavg"):
            if method == "fedavg":
                assert float((bayesfuse.fuse([net, net], method).model(x) - net(x)).abs().max()) < 1e-6
                continue
            assert float((bayesfuse.fuse([net, permuted], method).model(x) - net(x)).abs().max()) < 1e-4, method
        fused = bayesfuse.fuse([model(s) for s in (1, 2, 3)], "pfnm")
        assert fused.model.w1.shape[1] > 16 and fused.model.w2.shape == (fused.sizes[1], fused.sizes[0])
        assert fused.model(x).shape == (6, 3)


def test_an_output_weight_applied_as_stored_is_refused_in_one_line():
    from bayesfuse.nets.graph_spec import UnsupportedLayerError
    from tests.nets.user_nets import HandMLP

    with pytest.raises(UnsupportedLayerError, match=r"output layer 'w3' is a weight applied as it is stored"):
        spec_from_graph(HandMLP(last_as_stored=True))


class _SinusoidalLM(torch.nn.Module):
    """A sinusoidal position encoding computed in the forward, added to the embedded tokens: the
    stream is held in place, the MLP that writes into it too; the MLP's hidden units are matched."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(12, 16), torch.nn.Linear(16, 12)
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1] * 16.0).view(-1, 16)
        x = self.emb(idx) + torch.sin(pos / 7.0)
        return self.head(x + self.fc2(torch.relu(self.fc1(x))))


class _GainOfAParameter(torch.nn.Module):
    """``h * self.g.exp()`` where ``g`` also scales another stream's units, and a norm that scales
    by ``1 + self.n`` (Gemma's): functions of a parameter alone, number by number, read with the
    parameter's axes (both streams one permutation, ``g``'s); ``h * self.f1.weight[:, 0]`` (a
    column of a weight, in the order of that weight's units) is refused, never held in place."""

    def __init__(self, column: bool = False) -> None:
        super().__init__()
        self.f1, self.f2, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8), torch.nn.Linear(16, 3)
        self.g, self.n = torch.nn.Parameter(torch.rand(8) + 0.5), torch.nn.Parameter(torch.rand(8) - 0.5)
        self.column = column

    def forward(self, x):
        a = torch.relu(self.f1(x)) * self.g
        b = torch.relu(self.f2(x)) * (self.f1.weight[:, 0] if self.column else self.g.exp())
        return self.out(torch.cat([a, b * (1.0 + self.n)], -1))


def test_a_position_encoding_computed_in_the_forward_holds_the_stream_and_names_every_layer_on_it():
    torch.manual_seed(0)
    model = _SinusoidalLM().eval()
    spec = spec_from_graph(model, torch.zeros(2, 5, dtype=torch.long))
    assert set(spec.in_place) == {"emb", "fc2"} and spec.groups == ("P1",)  # the MLP's hidden units
    x = torch.randint(0, 12, (3, 5))
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        assert float((permuted(x) - model(x)).abs().max()) < 1e-5
        fused = bayesfuse.fuse([model, permuted], "pfnm", example_input=x[:1]).model
        assert float((fused(x) - model(x)).abs().max()) < 1e-4


def test_functions_of_a_parameter_alone_follow_it_and_other_operands_computed_from_one_are_refused():
    torch.manual_seed(0)
    model = _GainOfAParameter().eval()
    spec = spec_from_graph(model)
    assert not spec.in_place and spec.axes["f2.weight"][0] == spec.axes["f1.weight"][0] == spec.axes["n"][0]
    x = torch.randn(5, 4)
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        assert float((permuted(x) - model(x)).abs().max()) < 1e-5
        assert float((bayesfuse.fuse([model, permuted], "pfnm").model(x) - model(x)).abs().max()) < 1e-4
    from bayesfuse.nets.graph_spec import UnsupportedLayerError

    with pytest.raises(
        UnsupportedLayerError, match=r"an operand \(getitem\) .* computed from 'f1.weight', which a permutation moves"
    ):
        spec_from_graph(_GainOfAParameter(column=True))


class _FlippedGainFirst(torch.nn.Module):
    """``self.g.flip(0)`` meets one stream before ``g`` itself scales another: the flipped gain's
    order is ``g``'s, which the later use permutes, so the first use may not hold its stream in place."""

    def __init__(self) -> None:
        super().__init__()
        self.f1, self.f2, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8), torch.nn.Linear(16, 3)
        self.g = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        b = torch.relu(self.f2(x)) * self.g.flip(0)
        a = torch.relu(self.f1(x)) * self.g
        return self.out(torch.cat([a, b], -1))


def test_a_hold_in_place_is_checked_against_the_entries_permuted_later():
    from bayesfuse.nets.graph_spec import UnsupportedLayerError

    with pytest.raises(
        UnsupportedLayerError, match=r"an operand \(flip\) .* computed from 'g', which a permutation moves"
    ):
        spec_from_graph(_FlippedGainFirst())


class _ReadUnmoved(torch.nn.Module):
    """Numbers computed from an entry a permutation moves, read as if none moved them: a gain
    vector applied as a layer's input (``g @ w``), a weight read again through a function of it
    (``x @ w.abs().T`` beside ``x @ w.T``), an embedding written by hand (``E[ids]``) whose table
    is also the output layer (``@ E.T``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc, self.out, self.out2 = (
            how,
            torch.nn.Linear(8, 16),
            torch.nn.Linear(16, 3),
            torch.nn.Linear(16, 3),
        )
        self.g, self.w = torch.nn.Parameter(torch.rand(16) + 0.5), torch.nn.Parameter(torch.randn(16, 8))
        self.v = torch.nn.Parameter(torch.randn(16, 16))
        self.E = torch.nn.Parameter(torch.randn(20, 16))

    def forward(self, x):
        if self.how == "gain as input":
            return self.out(torch.relu(self.fc(x)) * self.g + self.g @ self.v)
        if self.how == "weight read again":
            return self.out(torch.relu(x @ self.w.T)) + self.out2(x @ self.w.abs().T)
        return torch.relu(self.fc(self.E[x.long().clamp(0, 19)][:, 0, :8])) @ self.E.T


@pytest.mark.parametrize(
    "how, operand, entry",
    [("gain as input", "", "v"), ("weight read again", "matmul_1", "w"), ("tied by hand", "getitem_1", "E")],
)
def test_numbers_computed_from_a_moved_entry_are_not_read_as_unmoved(how, operand, entry):
    from bayesfuse.nets.graph_spec import UnsupportedLayerError

    message = rf"an operand \({operand}\) .* computed from '{entry}', which a permutation moves, is read as numbers"
    if not operand:  # a parameter, no stream, applied a weight: no layer
        message = rf"a matrix product applies the network's own weight '{entry}'"
    with pytest.raises(UnsupportedLayerError, match=message):
        spec_from_graph(_ReadUnmoved(how), torch.zeros(2, 8))


class _FoldAndHand(torch.nn.Module):
    """A layer called as a module, its batch norm after it, and its weight applied by hand too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))) + torch.relu(x @ self.fc.weight.T))


def test_a_weight_applied_by_hand_is_a_call_of_its_module_and_takes_no_fold():
    from tests.helpers import far_from_identity_norms

    torch.manual_seed(0)
    model = far_from_identity_norms(_FoldAndHand()).eval()
    spec = spec_from_graph(model)
    assert spec.folds == {}  # the batch norm would be folded into a weight the hand use reads unfolded
    x = torch.randn(6, 8)
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        for method in ("pfnm", "ot", "nafi"):
            assert float((bayesfuse.fuse([model, permuted], method).model(x) - model(x)).abs().max()) < 1e-4, method


class _UnstoredBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.register_buffer("nb", torch.rand(16), persistent=False)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)) * self.nb.exp())


def test_units_held_by_a_buffer_the_state_dict_does_not_hold_are_named_in_place():
    spec = spec_from_graph(_UnstoredBuffer())
    assert spec.groups == () and set(spec.in_place) == {"fc"} and "buffer nb" in spec.in_place["fc"]


class _Checked(torch.nn.Module):
    """Cases of :meth:`~bayesfuse.nets.graph_spec._Walk.check_unmoved`: ``how`` names one."""

    def __init__(self, how: str) -> None:
        super().__init__()
        nn = torch.nn
        self.how = how
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc0, self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 5), nn.Linear(8, 5)
        self.g, self.p, self.ln = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8)), nn.LayerNorm(8)
        self.wide, self.w, self.fc4 = nn.Linear(12, 5), nn.Parameter(torch.randn(8, 6)), nn.Linear(6, 4)
        nn.init.normal_(self.ln.weight)
        self.alias = self.ln.weight  # one tensor under two names

    def forward(self, x):
        how = self.how
        if how == "a layer scale's view used twice":
            g = self.g.view(1, -1, 1, 1)
            return self.fc2(torch.relu(self.c2(torch.relu(self.c1(x) * g)) * g).mean((2, 3)))
        if how == "divided by a weight's norm":
            return self.fc2(torch.relu(self.fc1(x) / self.fc1.weight.norm()))
        if how == "a penalty returned beside the logits":
            return self.fc2(torch.relu(self.fc1(x))), self.fc1.weight.pow(2).sum()
        if how == "a flipped alias":
            return self.fc2(torch.relu(self.ln(self.fc1(x)))) + self.fc3(torch.relu(self.fc0(x)) * self.alias.flip(0))
        if how == "a parameter's function read by a layer":
            return self.fc2(torch.relu(self.fc0(x) + self.p)) + self.fc3(self.p.exp()[None])
        if how == "a parameter concatenated":
            return self.wide(torch.cat([torch.relu(self.fc0(x) + self.p), self.p[:4].expand(x.shape[0], -1)], 1))
        if how == "a weight's view read by a layer":
            wt = self.w.T
            return self.fc2(torch.relu(x @ wt)) + self.fc3(wt).sum(0)
        h = torch.cat([torch.relu(self.fc1(x)), torch.relu(self.fc4(x))], 1)  # a weight in pieces
        return self.wide(h) + self.fc2(self.wide.weight.abs().sum(0)[None, :8])


@pytest.mark.parametrize(
    "how, entry",
    [
        ("a layer scale's view used twice", None),
        ("divided by a weight's norm", None),  # the same whatever the order of its numbers
        ("a penalty returned beside the logits", None),
        ("a flipped alias", "alias"),
        ("a parameter's function read by a layer", "p"),
        ("a parameter concatenated", "p"),
        ("a weight's view read by a layer", "w"),
        ("a weight held in pieces", "wide.weight"),
    ],
)
def test_numbers_read_as_unmoved_are_checked_against_every_entry_they_read(how, entry):
    from bayesfuse.nets.graph_spec import UnsupportedLayerError

    torch.manual_seed(0)
    model = _Checked(how).eval()
    x = torch.randn(4, 3, 6, 6) if "scale" in how else torch.randn(4, 6)
    if entry is not None:
        with pytest.raises(UnsupportedLayerError, match=rf"computed from '{entry}', which a permutation moves"):
            spec_from_graph(model, x[:1])
        return
    spec = spec_from_graph(model, x[:1])
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        ours, theirs = permuted(x), model(x)
        if isinstance(ours, tuple):  # the logits, and a penalty: the same number
            (ours, penalty), (theirs, expected) = ours, theirs
            assert torch.allclose(penalty, expected)
        assert float((ours - theirs).abs().max()) < 1e-5


class _QkvBias(torch.nn.Module):
    """Attention whose ``qkv`` layer takes a bias put together in the forward, as BEiT and EVA
    write it: ``F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))``,
    ``k_bias`` a buffer of zeros (``stored``: in the state_dict, else not)."""

    def __init__(self, stored: bool) -> None:
        super().__init__()
        nn = torch.nn
        self.stem, self.qkv, self.proj, self.head = (
            nn.Linear(6, 8),
            nn.Linear(8, 24, bias=False),
            nn.Linear(8, 8),
            nn.Linear(8, 3),
        )
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.register_buffer("k_bias", torch.zeros(8), persistent=stored)

    def forward(self, x):
        h = self.stem(x)
        b, n, c = h.shape  # the attention's output reshaped to the stream's width, as EVA does
        qkv = torch.nn.functional.linear(h, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        q, k, v = qkv.reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.softmax(q @ k.transpose(-2, -1) * 0.5, -1) @ v
        return self.head((h + self.proj(a.transpose(1, 2).reshape(b, n, c))).mean(1))


@pytest.mark.parametrize("stored", [True, False])
def test_a_bias_put_together_in_the_forward_is_read_piece_by_piece(stored):
    """Each vector of the bias is a third of the ``qkv`` layer's rows, permuted with them; a zeros
    buffer the state_dict holds fixes their width, one it does not holds them in place."""
    torch.manual_seed(0)
    model = _QkvBias(stored).eval()
    spec = spec_from_graph(model, torch.zeros(2, 5, 6))
    rows = spec.axes["qkv.weight"][0]
    if stored:
        assert rows is not None and spec.axes["q_bias"][0] == spec.axes["v_bias"][0] == spec.axes["k_bias"][0]
        assert rows.outer == 3 * spec.axes["q_bias"][0].outer and rows.group in spec.fixed
    else:  # the attention's output, held in place, is reshaped to the stream's width: that width is fixed
        assert rows is None and spec.axes["q_bias"] == (None,) and "qkv" in spec.in_place
        assert spec.axes["stem.weight"][0].group in spec.fixed
    x = torch.randn(4, 5, 6)
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        assert float((permuted(x) - model(x)).abs().max()) < 1e-5
        for method in ("pfnm", "ot"):
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
            assert float((fused(x) - model(x)).abs().max()) < 1e-4, method
        clients = []
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            clients.append(_QkvBias(stored).eval())
        assert bayesfuse.fuse(clients, "pfnm", example_input=x[:1]).model(x).shape == (4, 3)  # runs


class _Picked(nn.Module):
    """A hidden layer's units picked by their places: reordered by an index buffer (``h[..., idx]``),
    one of them read as a gate (FocalNet's ``gates[:, l:l + 1]``), or a slice of them added to the
    rest (ReXNet adds its shortcut to its first channels)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.register_buffer("idx", torch.arange(15, -1, -1))

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.how == "reversed":
            h = h[..., self.idx]
        elif self.how == "a gate":
            h = h * torch.sigmoid(h[:, 2:3])
        else:  # "a slice added"
            h = h + torch.cat([h[:, 8:], h[:, :8]], 1)
        return self.out(F.relu(self.fc2(h)))


@pytest.mark.parametrize("how", ["reversed", "a gate", "a slice added"])
def test_units_picked_by_their_places_stay_in_place_and_the_rest_is_matched(how):
    """Units the forward picks by their places keep them (``spec.in_place`` names the layer and why),
    the next layer is matched as before, a permuted copy fuses back by every method, and three
    clients fuse by PFNM with the held layer at its width and the next one grown."""
    model, x = randomise(_Picked(how), 0), torch.randn(5, 8)
    spec = spec_from_graph(model, torch.zeros(2, 8))
    assert "its forward indexes into them" in spec.in_place["fc1"]
    assert spec.axes["fc1.weight"][0] is None and spec.axes["fc2.weight"][0] is not None
    permuted = permuted_copy(model, spec, seed=1)
    assert not torch.equal(permuted.fc2.weight, model.fc2.weight)
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-5
        for method in ("pfnm", "nafi", "ot"):
            assert float((bayesfuse.fuse([model, permuted], method).model(x) - reference).abs().max()) < 1e-4, method
        fused = bayesfuse.fuse([randomise(_Picked(how), seed) for seed in (1, 2, 3)], "pfnm").model
        assert fused.fc1.out_features == 16 and fused.fc2.out_features > 16 and fused(x).shape == (5, 3)


class _PartOfABlock(BiEnds):
    """Units of one direction and some of the other's: no block whole, so the GRU's units are
    picked by their places, and it is the network's one hidden layer."""

    def forward(self, x):
        out, _ = self.rnn(x.view(-1, 8, 8))
        return self.head(torch.cat([out[:, -1, :8], out[:, 0, 8:]], 1))


def test_networks_whose_every_unit_stays_in_place_are_averaged_not_matched():
    model = randomise(_PartOfABlock(), 0)
    assert set(spec_from_graph(model).in_place) >= {"rnn.weight_ih_l0", "rnn.weight_hh_l0"}
    with pytest.raises(
        ValueError, match=r"every hidden unit of the networks is held in place .* fuse them with 'fedavg'"
    ):
        bayesfuse.fuse([model, randomise(_PartOfABlock(), 1)], "pfnm")
    other = randomise(_PartOfABlock(), 1)
    averaged = bayesfuse.fuse([model, other], "fedavg").model
    for name, p in averaged.named_parameters():
        assert torch.allclose(p, (model.get_parameter(name) + other.get_parameter(name)) / 2, atol=1e-6), name


class _HeldNormed(nn.Module):
    """A convolution and its batch norm whose channels the forward picks by their places (one as a
    gate), before a convolution that is matched."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        return self.fc(F.relu(self.c2(h * h[:, :1])).mean((2, 3)))


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
def test_a_batch_norm_of_channels_held_in_place_is_folded_at_their_width(method):
    x = torch.randn(4, 3, 8, 8)
    model = randomise(_HeldNormed(), 0)
    spec = spec_from_graph(model, x[:1])
    assert {"c1", "bn"} <= set(spec.in_place) and spec.axes["c2.weight"][0] is not None
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        reference = model(x)
        assert (
            float((bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model(x) - reference).abs().max())
            < 1e-4
        )
        fused = bayesfuse.fuse([randomise(_HeldNormed(), s) for s in (1, 2, 3)], method, example_input=x[:1]).model
        assert fused.c1.out_channels == 8 and fused(x).shape == (4, 3)


class _GateReadLate(nn.Module):
    """One unit of ``fc1`` read as a gate, before or after ``fc2`` reads all of them."""

    def __init__(self, late: bool) -> None:
        super().__init__()
        self.late = late
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.late:
            y = F.relu(self.fc2(h))
            gate = h[:, 0:1]
        else:
            gate = h[:, 0:1]
            y = F.relu(self.fc2(h))
        return self.out(y * gate)


@pytest.mark.parametrize("late", [False, True])
def test_in_place_names_the_layers_whose_units_are_held_whatever_the_order(late):
    """``fc2`` reads the held units of ``fc1`` but its own are matched: it is not named, whether the
    walk met it before the hold or after."""
    spec = spec_from_graph(_GateReadLate(late), torch.zeros(1, 8))
    assert set(spec.in_place) == {"fc1"} and spec.axes["fc2.weight"][0] is not None
