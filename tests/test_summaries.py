"""Client summaries: moments against direct computation, files, the checks that refuse bad ones."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesfuse.curvature import diag_ggn
from bayesfuse.inference.output_fusion import packed_upper
from bayesfuse.nets.arch import make_cnn
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.spec import spec_from_module
from bayesfuse.summaries import (
    ClientSummary,
    SummaryError,
    _output_factors,
    bfloat16_bits,
    bfloat16_rounded,
    check_summary,
    from_bfloat16_bits,
    gram_factor,
    load_summary,
    rounded_gram,
    save_summary,
    summarize,
    summary_arrays,
    summary_from_arrays,
    summary_path,
    temperature_nll,
    unit_moments,
)
from tests.helpers import randomise
from tests.nets import user_nets


@pytest.fixture
def client():
    model = randomise(MLP(6, [5, 4], 3), 0)
    gen = np.random.default_rng(1)
    x = gen.normal(size=(50, 6)).astype(np.float32)
    y = gen.integers(0, 3, size=50)
    return model, x, y


def test_moments_are_those_of_the_units(client):
    model, x, y = client
    s = summarize(model, x, y)
    with torch.no_grad():
        z1 = model.layers[0](torch.as_tensor(x)).double()
        z2 = model.layers[1](torch.relu(z1).float()).double()
    for group, z in (("P1", z1), ("P2", z2)):
        m = s.moments[group]
        np.testing.assert_allclose(m["pre_mean"], z.mean(0).numpy(), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(m["pre_var"], z.var(0, unbiased=False).numpy(), rtol=1e-5, atol=1e-9)
        a = torch.relu(z)
        np.testing.assert_allclose(m["act_mean"], a.mean(0).numpy(), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(m["act_var"], a.var(0, unbiased=False).numpy(), rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(s.class_counts, np.bincount(y, minlength=3))
    assert s.n_examples == 50


def test_precision_is_the_ggn_and_chunks_do_not_matter(client):
    model, x, y = client
    s = summarize(model, x, y, batch_size=7)
    g = diag_ggn(model, x)
    assert s.precision.keys() == g.keys()
    for k in g:
        # bfloat16 keeps 8 significant bits: a relative error of at most 2^-8 (the float32 model's
        # chunks summing in another order adds ~1e-7)
        np.testing.assert_allclose(s.precision[k], g[k], rtol=2**-8 + 1e-6, atol=1e-30)
        # and the values are bfloat16's: their upper 16 bits hold them exactly
        np.testing.assert_array_equal(from_bfloat16_bits(bfloat16_bits(s.precision[k])), s.precision[k])


def test_float32_precisions_are_the_ggn_in_a_version_4_summary(client):
    model, x, y = client
    s = summarize(model, x, y, precisions="float32")
    g = diag_ggn(model, x)
    assert s.version == 4 and s.nbytes == dataclasses.replace(s, version=5).nbytes + 2 * sum(p.size for p in g.values())
    for k in g:
        np.testing.assert_array_equal(s.precision[k], g[k].astype(np.float32))
    with pytest.raises(ValueError, match="precisions must be 'bfloat16' or 'float32', got 'float16'"):
        summarize(model, x, y, precisions="float16")


def test_bfloat16_bits_round_as_torch_does_and_keep_nan_and_shape():
    # every float32 bit pattern class: random patterns (normals, subnormals, inf, NaN payloads, both
    # signs) against torch's own float32 -> bfloat16 conversion, bit for bit on non-NaN values
    gen = np.random.default_rng(0)
    bits = gen.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 1, 0x007FFFFF, 0x3FFFFFFF, 0x3F808000, 0x3F818000, 0x7F7F7FFF,
                        0x7F7F8000, 0x7F800000, 0xFF800000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000],
                       dtype=np.uint32)  # fmt: skip
    f = np.concatenate([bits, special]).view(np.float32)
    ours = bfloat16_bits(f)
    theirs = torch.from_numpy(f.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(f)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    back = from_bfloat16_bits(ours)
    assert np.isnan(back[nan]).all()  # a NaN is never inf or zero
    # ties to even: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6; the relative error of normal values
    np.testing.assert_array_equal(
        from_bfloat16_bits(bfloat16_bits(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32))), [1.0, 1 + 2**-6]
    )
    normal = np.isfinite(back) & (np.abs(f) >= np.finfo(np.float32).tiny)
    assert np.abs(back[normal].astype(np.float64) / f[normal] - 1).max() <= 2**-8
    # shapes, 0-d included
    for shape in ((), (3,), (2, 3)):
        a = np.full(shape, 1.5, np.float32)
        assert bfloat16_bits(a).shape == shape and bfloat16_rounded(a).shape == shape


def test_a_version_5_summary_rounds_what_it_is_given_and_keeps_scalars(client, tmp_path):
    model, x, y = client
    s = summarize(model, x, y, precisions="float32")
    five = dataclasses.replace(s, version=5)  # built from unrounded precisions: rounded, as its file holds them
    for k, v in s.precision.items():
        np.testing.assert_array_equal(five.precision[k], bfloat16_rounded(v))
    save_summary(five, tmp_path / "five.summary.safetensors")
    back = load_summary(tmp_path / "five.summary.safetensors")
    for k in s.precision:
        np.testing.assert_array_equal(back.precision[k], five.precision[k])
    # a scalar parameter's precision keeps its shape (0-d) in memory and through the file
    scalar = dataclasses.replace(five, precision={"scale": np.float64(2.0)})
    assert scalar.precision["scale"].shape == () and scalar.precision["scale"] == 2.0
    save_summary(scalar, tmp_path / "scalar.summary.safetensors")
    assert load_summary(tmp_path / "scalar.summary.safetensors").precision["scale"].shape == ()


def test_conv_moments_are_per_channel():
    """Per channel, over examples and positions, before and after: the activation of the last
    convolution's channels is read where the dense layer after ``Flatten`` reads it, each
    channel's pooled maps one block of its input (it was per input feature)."""
    model = randomise(make_cnn(16, 3, channels=(2, 3), hidden=(4,)), 2)
    x = np.random.default_rng(3).normal(size=(8, 16)).astype(np.float32)
    s = summarize(model, x, np.arange(8) % 3)
    assert {k: len(v["pre_mean"]) for k, v in s.moments.items()} == {"P1": 2, "P2": 3, "P3": 4}
    assert {k: len(v["act_mean"]) for k, v in s.moments.items()} == {"P1": 2, "P2": 3, "P3": 4}
    dense = next(m for m in model if isinstance(m, nn.Linear))
    seen = []
    hook = dense.register_forward_hook(lambda m, i, o: seen.append(i[0].detach().double()))
    with torch.no_grad():
        model(torch.as_tensor(x))
    hook.remove()
    maps = seen[0].reshape(8, 3, -1)  # (N, channels, positions): flattened channel by channel
    np.testing.assert_allclose(s.moments["P2"]["act_mean"], maps.mean((0, 2)).numpy(), atol=1e-12)
    np.testing.assert_allclose(
        s.moments["P2"]["act_var"], maps.transpose(1, 2).reshape(-1, 3).var(0, unbiased=False).numpy(), atol=1e-12
    )


@pytest.mark.parametrize(
    "name", ["GroupedCNN", "DepthwiseCNN", "BiLSTM", "ProjectedLSTM", "StackedLSTM", "UpConvUNet", "InceptionMLP"]
)
def test_every_moment_has_its_groups_width(name):
    """Each unit's moments, one number per unit of its group: a convolution of groups makes its
    units in blocks (one per group), a bidirectional LSTM's output holds both directions' (it
    gave one number per channel or feature); a projected LSTM's cells are not in its output (no
    pre-activation moments for them)."""
    torch.manual_seed(0)
    model = getattr(user_nets, name)().eval()
    spec = spec_from_module(model)
    sizes = spec.sizes(model.state_dict())
    moments = unit_moments(model, np.random.default_rng(2).normal(size=(16, 64)).astype(np.float32), spec)
    assert moments
    for group, stats in moments.items():
        assert stats and {k: v.shape for k, v in stats.items()} == {k: (sizes[group],) for k in stats}, group


@pytest.mark.parametrize("name", ["DenseBlockCNN", "UpConvUNet"])
def test_moments_of_streams_side_by_side_and_of_transposed_convolutions(name):
    """A group read among streams concatenated on their units has the moments of its own stream
    (its piece of the reader's input), at its own width; a transposed convolution makes the units
    of its weight's axis 1, so its output holds them."""
    torch.manual_seed(0)
    model = randomise(getattr(user_nets, name)(), 1)
    spec = spec_from_module(model)
    x = np.random.default_rng(7).normal(size=(12, 64)).astype(np.float32)
    s = summarize(model, x, np.arange(12) % 10)
    state = model.state_dict()
    for group, m in s.moments.items():
        width = spec.sizes(state)[group]
        assert all(v.shape == (width,) for v in m.values()), (group, {k: v.shape for k, v in m.items()})
    seen = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(lambda mod, i, o, n=n: seen.update({n: (i[0], o)}))
        for n in {"DenseBlockCNN": ("head", "layers.1.conv2"), "UpConvUNet": ("dec",)}[name]
    ]
    with torch.no_grad():
        model(torch.as_tensor(x))
    for h in hooks:
        h.remove()
    if name == "DenseBlockCNN":  # the head reads [input mean (3), P2 (6), P4 (4)]: P4's are the last four
        group = spec.axes["layers.1.conv2.weight"][0].group
        act = seen["head"][0].double()[:, -4:]
        pre = seen["layers.1.conv2"][1].double().movedim(1, -1).reshape(-1, 4)
    else:  # dec reads [skip (6), up (7)]: up's units are its last seven channels
        group = spec.axes["up.weight"][1].group
        act = seen["dec"][0].double().movedim(1, -1).reshape(-1, 13)[:, 6:]
        with torch.no_grad():
            pre = (
                model.up(
                    F.relu(
                        model.bn1(
                            model.mid(
                                F.max_pool2d(F.relu(model.bn0(model.enc(torch.as_tensor(x).view(-1, 1, 8, 8)))), 2)
                            )
                        )
                    )
                )
                .double()
                .movedim(1, -1)
                .reshape(-1, 7)
            )
    np.testing.assert_allclose(s.moments[group]["act_mean"], act.mean(0).numpy(), atol=1e-12)
    np.testing.assert_allclose(s.moments[group]["act_var"], act.var(0, unbiased=False).numpy(), atol=1e-12)
    np.testing.assert_allclose(s.moments[group]["pre_mean"], pre.mean(0).numpy(), atol=1e-12)


def test_lstm_moments_are_over_every_step_and_its_activations_the_last_state():
    from bayesfuse.nets.arch import LSTMClassifier

    torch.manual_seed(0)
    model = LSTMClassifier(16, 3, hidden=5).eval()
    x = np.random.default_rng(4).normal(size=(8, 16)).astype(np.float32)
    s = summarize(model, x, np.arange(8) % 3)
    with torch.no_grad():
        steps, (h, _) = model.lstm(torch.as_tensor(x).reshape(8, model.steps, model.step_features))
    steps, last = steps.double().reshape(-1, 5).numpy(), h[-1].double().numpy()
    np.testing.assert_allclose(s.moments["H"]["pre_mean"], steps.mean(0), atol=1e-12)
    np.testing.assert_allclose(s.moments["H"]["pre_var"], steps.var(0), atol=1e-12)
    np.testing.assert_allclose(s.moments["H"]["act_mean"], last.mean(0), atol=1e-12)
    np.testing.assert_allclose(s.moments["H"]["act_var"], last.var(0), atol=1e-12)


def test_moments_of_dense_units_on_sequences_are_per_unit_over_every_step():
    """A Linear applied to (N, T, D) tokens or steps (a transformer's, an embedding before a GRU)
    has its units last: their moments are over examples and steps (they were per step before)."""
    from bayesfuse.nets.tracing import spec_from_module
    from tests.nets.user_nets import MyGRU

    torch.manual_seed(0)
    model = MyGRU().eval()
    x = np.random.default_rng(6).normal(size=(9, 64)).astype(np.float32)
    s = summarize(model, x, np.arange(9) % 10)
    group = spec_from_module(model).axes["embed.weight"][0].group
    with torch.no_grad():
        pre = model.embed(torch.as_tensor(x).view(-1, 8, 8)).double().reshape(-1, 10)
    np.testing.assert_allclose(s.moments[group]["pre_mean"], pre.mean(0).numpy(), atol=1e-12)
    np.testing.assert_allclose(s.moments[group]["act_var"], pre.relu().var(0, unbiased=False).numpy(), atol=1e-12)


def test_moments_of_a_grouped_transposed_convolutions_units_pool_every_group():
    """A transposed convolution of 4 groups makes 3 units, each once per group (channels ``4 x
    3``): a unit's moments are over its channel in every group."""
    torch.manual_seed(0)
    model = randomise(user_nets.GroupedUpConv(), 0)
    x = torch.randn(20, 64)
    s = summarize(model, x.numpy(), np.arange(20) % 10)
    group = spec_from_module(model).axes["up.weight"][1].group
    with torch.no_grad():
        out = model.up(torch.relu(model.enc(x.view(-1, 1, 8, 8)))).double().movedim(1, -1).reshape(-1, 3)
    np.testing.assert_allclose(s.moments[group]["pre_mean"], out.mean(0).numpy(), atol=1e-12)


def test_a_summary_leaves_a_network_holding_a_module_twice_as_it_was():
    """torch.func's calls would leave their wrappers in a module held under two names: the GGN
    runs on a copy, the network stays a network (copied, fused with its summary)."""
    import bayesfuse

    models = []
    for seed in range(2):
        torch.manual_seed(seed)
        models.append(user_nets.SharedModule().eval())
    x = torch.randn(20, 64)
    summaries = [summarize(m, x.numpy(), np.arange(20) % 10) for m in models]
    assert all(type(m.mix.weight) is nn.Parameter and m.block["mix"] is m.mix for m in models)
    copy.deepcopy(models[0])
    fused = bayesfuse.fuse(models, "pfnm", summaries=summaries)
    assert fused.model(x).shape == (20, 10)


def test_moments_of_units_split_into_pieces_of_different_widths_are_each_pieces():
    """``qkv(t).split([dk, dk, dv], -1)``: each piece is a group, made by a run of the
    projection's rows; its moments are those of that run of its output."""
    torch.manual_seed(0)
    model = user_nets.UnequalSplit().eval()
    x = torch.randn(20, 64)
    s = summarize(model, x.numpy(), np.arange(20) % 10)
    with torch.no_grad():
        out = model.qkv(model.embed(x.view(-1, 4, 16))).double().reshape(-1, 14)
    np.testing.assert_allclose(s.moments["P2"]["pre_mean"], out[:, :4].mean(0).numpy(), atol=1e-12)
    np.testing.assert_allclose(s.moments["P3"]["pre_mean"], out[:, 8:].mean(0).numpy(), atol=1e-12)


def test_moments_of_an_embeddings_units_are_those_of_its_vectors():
    """An embedding makes the units its weight's columns hold (it reads ids, not features): their
    moments are over the vectors it gives every token. Its output layer tied to it (the same
    tensor) has the precision under both names."""
    from bayesfuse.nets.tracing import spec_from_module

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.fc, self.head = nn.Embedding(6, 8), nn.Linear(8, 10), nn.Linear(10, 6)

        def forward(self, t):
            return self.head(torch.tanh(self.fc(self.emb(t).mean(1))))

    class TiedTokens(Tokens):
        def __init__(self) -> None:
            super().__init__()
            self.fc2 = nn.Linear(10, 8)
            self.head = nn.Linear(8, 6)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return self.head(self.fc2(torch.tanh(self.fc(self.emb(t).mean(1)))))

    torch.manual_seed(0)
    ids = torch.randint(0, 6, (20, 3))
    for model in (Tokens().eval(), TiedTokens().eval()):
        s = summarize(model, ids.numpy(), np.arange(20) % 6)
        group = spec_from_module(model, ids[:2]).axes["emb.weight"][1].group
        with torch.no_grad():
            vectors = model.emb(ids).double().reshape(-1, 8)
        np.testing.assert_allclose(s.moments[group]["pre_mean"], vectors.mean(0).numpy(), atol=1e-12)
    np.testing.assert_array_equal(s.precision["emb.weight"], s.precision["head.weight"])


def test_moments_of_units_one_lstm_makes_and_another_reads():
    from bayesfuse.inference.spec import chain, dense, lstm

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.LSTM(4, 6, batch_first=True), nn.LSTM(6, 5, batch_first=True)
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            out, _ = self.l2(self.l1(x.reshape(len(x), 4, 4))[0])
            return self.fc(out[:, -1])

    torch.manual_seed(0)
    model = Two().eval()
    spec = chain(lstm("l1", None, "A"), lstm("l2", "A", "B"), dense("fc", "B", None), output=("fc.weight", "fc.bias"))
    x = np.random.default_rng(5).normal(size=(8, 16)).astype(np.float32)
    s = summarize(model, x, np.arange(8) % 3, spec=spec)
    with torch.no_grad():
        a = model.l1(torch.as_tensor(x).reshape(8, 4, 4))[0].double().reshape(-1, 6).numpy()
    for stat in ("pre", "act"):  # l1's outputs at every step, which l2 reads
        np.testing.assert_allclose(s.moments["A"][f"{stat}_mean"], a.mean(0), atol=1e-12)
    assert len(s.moments["B"]["act_mean"]) == 5


def test_bad_inputs_are_refused_in_one_line(client):
    model, x, y = client[:3]
    with pytest.raises(ValueError, match="y must be a 1-D array of integer labels"):
        summarize(model, x, y[:, None])
    with pytest.raises(ValueError, match="x has NaN or infinite values"):
        summarize(model, np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x), y)
    broken = copy.deepcopy(model)
    with torch.no_grad():
        next(broken.parameters())[0, 0] = float("nan")
    with pytest.raises(ValueError, match="has NaN or infinite values; a summary of it would be too"):
        summarize(broken, x, y)
    model = copy.deepcopy(model).train()  # a network in training mode is left in it, refused or not
    for spec in (None, spec_from_module(model)):  # traced or given, the inputs are run once first
        with pytest.raises(ValueError, match=r"the network cannot run on x of shape \(50, 4\) \(RuntimeError: "):
            summarize(model, x[:, :4], y, spec=spec)
        assert model.training is True  # as it was


def test_size_is_the_model_plus_a_few_numbers_per_unit(client):
    model, x, y = client
    s = summarize(model, x, y)
    weights = sum(p.numel() for p in model.parameters())
    # the output layer's Gram (4 features and the bias) as its upper triangle, curvature and GGN
    # eigenvalues (5 x 3)
    gram, curvature, eigenvalues = (4 + 1) * (4 + 2) // 2, 3**2, (4 + 1) * 3
    # the precisions, the Gram's triangular factor and the eigenvalues as bfloat16 (version 6)
    assert s.version == 6
    assert s.nbytes == 2 * weights + 4 * 4 * (5 + 4) + 2 * (gram + eigenvalues) + 4 * curvature + 8 * 3
    five = dataclasses.replace(s, version=5)  # version 5: the Gram and eigenvalues as float32
    assert five.nbytes == s.nbytes + 2 * (gram + eigenvalues)
    assert dataclasses.replace(s, version=4).nbytes == five.nbytes + 2 * weights
    for version in (3, 4, 5, 6):  # what the file and the Flower record hold
        v = dataclasses.replace(s, version=version)
        assert v.nbytes == sum(a.nbytes for a in summary_arrays(v).values())


def test_output_factors_are_the_kfac_factors_and_exact_for_one_example(client):
    model, x, y = client
    s = summarize(model, x, y, batch_size=7, precisions="float32")  # unrounded (version 4)
    with torch.no_grad():
        a = torch.relu(model.layers[1](torch.relu(model.layers[0](torch.as_tensor(x))))).double()
        p = torch.softmax(model(torch.as_tensor(x)).double(), -1).numpy()
    a = np.hstack([a.numpy(), np.ones((len(x), 1))])
    np.testing.assert_allclose(s.output_factors["gram"], a.T @ a / len(x), rtol=1e-6, atol=1e-9)
    curvature = np.mean([np.diag(q) - np.outer(q, q) for q in p], axis=0)
    np.testing.assert_allclose(s.output_factors["curvature"], curvature, rtol=1e-6, atol=1e-9)
    # one example: n A (x) S is the output layer's GGN itself, so its diagonal is the summary's
    # precision (float32's)
    one = summarize(model, x[:1], y[:1], precisions="float32")
    kfac = np.kron(one.output_factors["gram"], one.output_factors["curvature"]).diagonal().reshape(5, 3)
    np.testing.assert_allclose(kfac[:-1].T, one.precision["layers.2.weight"], rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(kfac[-1], one.precision["layers.2.bias"], rtol=1e-5, atol=1e-12)


def test_output_eigenvalues_are_the_exact_ggn_in_the_kronecker_eigenbasis(client):
    # the GGN of the output layer's [W | b] written out from torch.func's Jacobian of the logits,
    # sum_n J_n^T (diag p_n - p_n p_n^T) J_n, read in the basis v_k u_i^T of the summary's factors
    model, x, y = client
    s = summarize(model, x, y, batch_size=7, precisions="float32")  # unrounded (version 4)
    with torch.no_grad():
        features = torch.relu(model.layers[1](torch.relu(model.layers[0](torch.as_tensor(x))))).double()
    out = model.layers[2]
    theta = torch.cat([out.weight, out.bias[:, None]], 1).detach().double()  # (K, G+1)

    def logits(t, a):
        return t[:, :-1] @ a + t[:, -1]

    ggn = torch.zeros(theta.numel(), theta.numel(), dtype=torch.float64)
    for a in features:
        jac = torch.func.jacrev(logits)(theta, a).reshape(3, -1)  # (K, K (G+1))
        p = torch.softmax(logits(theta, a), -1)
        ggn += jac.T @ (torch.diag(p) - torch.outer(p, p)) @ jac
    _, U = np.linalg.eigh(s.output_factors["gram"])
    _, V = np.linalg.eigh(s.output_factors["curvature"])
    expected = np.array(
        [
            [np.outer(V[:, k], U[:, i]).ravel() @ ggn.numpy() @ np.outer(V[:, k], U[:, i]).ravel() for k in range(3)]
            for i in range(5)
        ]
    )
    # (the summary reads the float32 network's logits: float32 round-off, relative 6e-8 each)
    np.testing.assert_allclose(s.output_factors["eigenvalues"], expected, rtol=1e-6, atol=1e-12)
    # the trace is the exact GGN's, the sum of the summary's (BackPACK-checked) GGN diagonal
    # (the GGN diagonal itself: the summary's is rounded to bfloat16)
    ggn_diagonal = diag_ggn(model, x)
    exact = ggn_diagonal["layers.2.weight"].sum() + ggn_diagonal["layers.2.bias"].sum()
    assert s.output_factors["eigenvalues"].sum() == pytest.approx(exact, rel=1e-5)


def test_summaries_with_eigenvalues_that_do_not_fit_are_refused(client):
    model, x, y = client
    s = summarize(model, x, y)
    factors = s.output_factors
    for eigenvalues, match in (
        (factors["eigenvalues"][:-1], r"output eigenvalues are \(4, 3\).*need \(5, 3\)"),
        (-factors["eigenvalues"] - 1.0, "eigenvalues must be finite and >= 0"),
        (np.full((5, 3), np.nan), "eigenvalues must be finite and >= 0"),
    ):
        bad = dataclasses.replace(s, output_factors={**factors, "eigenvalues": eigenvalues})
        with pytest.raises(SummaryError, match=match):
            check_summary(bad, model.state_dict(), "client 3")


def test_output_factors_only_for_an_output_layer_that_reads_units():
    x = np.random.default_rng(3).normal(size=(8, 16)).astype(np.float32)
    dense = summarize(randomise(make_cnn(16, 3, channels=(2,), hidden=(4,)), 2), x, np.arange(8) % 3)
    shapes = {k: np.shape(v) for k, v in dense.output_factors.items()}
    assert shapes == {"gram": (5, 5), "curvature": (3, 3), "eigenvalues": (5, 3)}
    positions = summarize(randomise(make_cnn(16, 3, channels=(2,), hidden=()), 2), x, np.arange(8) % 3)
    assert positions.output_factors is None


def test_file_round_trip_and_no_silent_overwrite(client, tmp_path):
    model, x, y = client
    s = summarize(model, x, y)
    path = summary_path(tmp_path / "model.pt")
    assert path.name == "model.summary.safetensors"
    save_summary(s, path)
    back = load_summary(path)
    assert back.fingerprint == s.fingerprint and back.n_examples == s.n_examples
    for k in s.precision:  # bfloat16 on disk, as summarize rounded them: read back exactly
        np.testing.assert_array_equal(back.precision[k], s.precision[k])
    for k in s.output_factors:
        np.testing.assert_allclose(back.output_factors[k], s.output_factors[k], rtol=1e-6, atol=1e-7)
    check_summary(back, model.state_dict(), "model.pt")
    old = summary_path(tmp_path / "old.pt")  # version 1 summaries, without the factors, are still read
    save_summary(dataclasses.replace(s, version=1, output_factors=None), old)
    assert load_summary(old).version == 1 and load_summary(old).output_factors is None
    two = summary_path(tmp_path / "two.pt")  # version 2, the factors without their eigenvalues
    kfac = {k: v for k, v in s.output_factors.items() if k != "eigenvalues"}
    save_summary(dataclasses.replace(s, version=2, output_factors=kfac), two)
    assert load_summary(two).version == 2 and set(load_summary(two).output_factors) == {"gram", "curvature"}
    # version 6 holds the upper triangle of the Gram's bfloat16 factor and the eigenvalues as
    # bfloat16: read back exactly, the factor too (saved again, the same arrays)
    from safetensors.numpy import load_file

    g = len(s.output_factors["gram"])
    stored = load_file(str(path))
    assert s.version == 6 and "output/gram" not in stored
    assert stored["output/gram_factor"].dtype == stored["output/eigenvalues"].dtype == np.uint16
    assert stored["output/gram_factor"].shape == (g * (g + 1) // 2,)
    for k in ("gram", "eigenvalues"):
        np.testing.assert_array_equal(back.output_factors[k], s.output_factors[k])
    np.testing.assert_array_equal(back.gram_factor, s.gram_factor)
    again = summary_path(tmp_path / "again.pt")
    save_summary(back, again)
    stored_again = load_file(str(again))
    assert stored_again.keys() == stored.keys()
    for k in stored:
        np.testing.assert_array_equal(stored_again[k], stored[k])
    # version 5 holds the Gram's upper triangle as float32, version 3 the whole: both read back to the same matrix
    five = summary_path(tmp_path / "five.pt")
    save_summary(dataclasses.replace(s, version=5), five)
    assert load_file(str(five))["output/gram"].shape == (g * (g + 1) // 2,)
    assert load_file(str(five))["output/gram"].dtype == np.float32
    three = summary_path(tmp_path / "three.pt")
    save_summary(dataclasses.replace(s, version=3), three)
    assert load_file(str(three))["output/gram"].shape == (g, g)
    np.testing.assert_array_equal(load_summary(three).output_factors["gram"], load_summary(five).output_factors["gram"])
    np.testing.assert_allclose(load_summary(five).output_factors["gram"], s.output_factors["gram"], rtol=1e-6)
    four = dataclasses.replace(s, version=4)
    assert (
        load_summary(three).version == 3
        and four.nbytes == dataclasses.replace(s, version=3).nbytes - 4 * g * (g - 1) // 2
    )
    # version 5 holds the precisions as bfloat16 bits, version 4 as float32: both read back to the same values
    assert {str(v.dtype) for k, v in load_file(str(path)).items() if k.startswith("precision/")} == {"uint16"}
    save_summary(four, summary_path(tmp_path / "four.pt"))
    for k in s.precision:
        assert load_file(str(summary_path(tmp_path / "four.pt")))[f"precision/{k}"].dtype == np.float32
        np.testing.assert_array_equal(load_summary(summary_path(tmp_path / "four.pt")).precision[k], s.precision[k])
    # a version 5 file whose precisions are float32 is refused, naming the file and the entry
    wide = summary_path(tmp_path / "wide.pt")
    save_summary(four, wide)
    wide.write_bytes(wide.read_bytes().replace(b'"version":"4"', b'"version":"5"'))
    with pytest.raises(
        SummaryError, match=r"wide.summary.safetensors: precision/.* must be bfloat16 bits \(uint16\), got float32"
    ):
        load_summary(wide)
    # and a version 4 file whose precisions are bfloat16 bits is refused, not read as integers
    narrow = summary_path(tmp_path / "narrow.pt")
    save_summary(s, narrow)
    narrow.write_bytes(narrow.read_bytes().replace(b'"version":"6"', b'"version":"4"'))
    with pytest.raises(
        SummaryError,
        match=r"narrow.summary.safetensors: precision/.* version 4 summary must be floating point, got uint16",
    ):
        load_summary(narrow)
    # a version 4 file whose Gram is no upper triangle is refused, naming the file
    odd = summary_path(tmp_path / "odd.pt")
    save_summary(dataclasses.replace(s, version=3), odd)
    odd.write_bytes(odd.read_bytes().replace(b'"version":"3"', b'"version":"4"'))
    with pytest.raises(SummaryError, match=r"odd.summary.safetensors: the output gram .* got shape \(5, 5\)"):
        load_summary(odd)
    # a version 6 file whose output factors are float32 is refused, naming the file and the entry
    relabelled = summary_path(tmp_path / "relabelled.pt")
    relabelled.write_bytes(five.read_bytes().replace(b'"version":"5"', b'"version":"6"'))
    with pytest.raises(SummaryError, match=r"relabelled.summary.safetensors: output/eigenvalues .* got float32"):
        load_summary(relabelled)
    arrays = summary_arrays(s)
    arrays["output/gram"] = arrays.pop("output/gram_factor")
    with pytest.raises(SummaryError, match="alice: a version 6\\+ summary holds its output Gram as output/gram_factor"):
        summary_from_arrays(arrays, "alice", version=6, n_examples=s.n_examples, prior_precision=1.0, fingerprint="")
    with pytest.raises(FileExistsError):
        save_summary(s, path)
    save_summary(s, path, overwrite=True)


def test_gram_factor_is_a_triangular_square_root_also_when_singular():
    rng = np.random.default_rng(0)
    for n in (50, 3):  # a definite Gram, and one of fewer examples than features (rank 3 of 6)
        a = np.hstack([rng.normal(size=(n, 5)), np.ones((n, 1))])
        a[:, 2] = 0.0  # a unit that never fired
        gram = a.T @ a / n
        R = gram_factor(gram)
        assert np.array_equal(R, np.triu(R)) and (np.diag(R) >= 0).all()
        np.testing.assert_allclose(R.T @ R, gram, rtol=0, atol=1e-12 * np.abs(gram).max())
        assert not R[:, 2].any() and not (R.T @ R)[2].any()  # the dead unit's row and column stay exactly 0
    # where the Gram is definite, its factor is its Cholesky factor (unique with a positive diagonal)
    a = np.hstack([rng.normal(size=(50, 5)), np.ones((50, 1))])
    np.testing.assert_allclose(gram_factor(a.T @ a), np.linalg.cholesky(a.T @ a).T, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="not positive semi-definite"):
        gram_factor(np.diag([1.0, -1.0]))


def test_the_rounded_gram_stays_positive_semi_definite_within_the_rounding_bound():
    # 20 examples of 60 ReLU features: a singular Gram, which rounding entry by entry makes indefinite
    rng = np.random.default_rng(1)
    a = np.hstack([np.maximum(rng.normal(size=(20, 60)), 0), np.ones((20, 1))])
    gram = a.T @ a / 20
    assert np.linalg.eigvalsh(bfloat16_rounded(gram))[0] < -1e-3
    R, rounded = rounded_gram(gram)
    np.testing.assert_array_equal(R, bfloat16_rounded(R))
    np.testing.assert_array_equal(rounded, R.T @ R)
    assert np.linalg.eigvalsh(rounded)[0] >= -1e-12 * np.abs(gram).max()
    # bfloat16 rounds each R_ki with a relative error of at most u = 2^-8, so entry ij of the Gram
    # moves by at most (2u + u^2) sum_k |R_ki| |R_kj| <= (2u + u^2) sqrt(gram_ii gram_jj) (Cauchy-Schwarz)
    u, d = 2.0**-8, np.sqrt(np.diag(gram))
    assert (np.abs(rounded - gram) <= (2 * u + u * u) * np.outer(d, d) + 1e-12).all()


def test_a_version_6_summary_keeps_the_gram_its_eigenvalues_were_measured_in(client):
    # three examples of four features: a singular Gram, whose factor a second factorisation
    # would not reproduce; the summary holds the very Gram (and factor) the eigenbasis came from
    model, x, y = client
    spec = spec_from_module(model)
    s = summarize(model, x[:3], y[:3])
    factors, factor = _output_factors(model, x[:3], spec, rounded=True)
    np.testing.assert_array_equal(s.output_factors["gram"], factors["gram"])
    np.testing.assert_array_equal(s.gram_factor, factor)
    # and that Gram is within the rounding bound of the features' own (float32 features: ~1e-7)
    with torch.no_grad():
        a = torch.relu(model.layers[1](torch.relu(model.layers[0](torch.as_tensor(x[:3]))))).double().numpy()
    a = np.hstack([a, np.ones((3, 1))])
    exact = a.T @ a / 3
    u, d = 2.0**-8, np.sqrt(np.diag(exact))
    assert (np.abs(s.output_factors["gram"] - exact) <= (2 * u + u * u) * np.outer(d, d) + 1e-6).all()


def test_a_version_6_summary_writes_the_factor_of_the_gram_it_holds(client, tmp_path):
    model, x, y = client
    s = summarize(model, x, y)
    # a factor given that is not bfloat16's is not kept: the summary rounds it as its file will
    exact = np.linalg.cholesky(s.output_factors["gram"] + np.eye(5)).T
    given = dataclasses.replace(s, output_factors={**s.output_factors, "gram": exact.T @ exact}, gram_factor=exact)
    np.testing.assert_array_equal(given.gram_factor, bfloat16_rounded(given.gram_factor))
    path = tmp_path / "given.summary.safetensors"
    save_summary(given, path)
    np.testing.assert_array_equal(load_summary(path).output_factors["gram"], given.output_factors["gram"])
    # output factors changed after the summary was made: the file holds the factor of the new Gram
    changed = copy.deepcopy(s)
    changed.output_factors["gram"] = changed.output_factors["gram"] * 4.0
    R = from_bfloat16_bits(summary_arrays(changed)["output/gram_factor"]).astype(np.float64)
    np.testing.assert_allclose(R, 2.0 * packed_upper(s.gram_factor))  # a power of 2: rounded alike
    changed.output_factors = None
    assert not any(k.startswith("output/") for k in summary_arrays(changed))
    # a Gram with no factor (not positive semi-definite) is refused, not written as float32
    indefinite = dataclasses.replace(s, output_factors={**s.output_factors, "gram": -np.eye(5)})
    assert indefinite.gram_factor is None
    with pytest.raises(
        SummaryError, match="summary: .* holds its output Gram as a triangular factor; this Gram has none"
    ):
        summary_arrays(indefinite)
    with pytest.raises(SummaryError, match=r"^bad\.summary\.safetensors: a version 6 summary"):
        save_summary(indefinite, tmp_path / "bad.summary.safetensors")
    assert not (tmp_path / "bad.summary.safetensors").exists()


def test_version_6_eigenvalues_are_the_ggn_in_the_rounded_grams_eigenbasis(client):
    # the server takes the eigenvectors of the Gram it reads, the rounded one: the client's
    # eigenvalues must be measured in that basis, sum_n (u_i^T a~_n)^2 v_k^T (diag p_n - p_n p_n^T) v_k
    model, x, y = client
    s = summarize(model, x, y)
    with torch.no_grad():
        a = torch.relu(model.layers[1](torch.relu(model.layers[0](torch.as_tensor(x))))).double().numpy()
        p = torch.softmax(model(torch.as_tensor(x)).double(), -1).numpy()
    a = np.hstack([a, np.ones((len(x), 1))])
    _, U = np.linalg.eigh(s.output_factors["gram"])
    _, V = np.linalg.eigh(s.output_factors["curvature"])
    spread = p @ V**2 - (p @ V) ** 2
    expected = ((a @ U) ** 2).T @ spread
    # bfloat16's relative 2^-8, and the float32 network's round-off
    np.testing.assert_allclose(s.output_factors["eigenvalues"], expected, rtol=2**-8 + 1e-6, atol=1e-12)
    exact = summarize(model, x, y, precisions="float32").output_factors["eigenvalues"]
    assert s.output_factors["eigenvalues"].sum() == pytest.approx(exact.sum(), rel=2**-8)  # the GGN's trace


def test_unknown_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="bayesfuse summarize"):
        load_summary(tmp_path / "none.summary.safetensors")
    bad = tmp_path / "bad.summary.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(SummaryError, match="bad.summary.safetensors"):
        load_summary(bad)


def test_bad_summaries_are_refused_naming_the_client(client):
    model, x, y = client
    s = summarize(model, x, y)
    state = model.state_dict()
    nan = {k: v.copy() for k, v in s.precision.items()}
    nan["layers.0.weight"][0, 0] = np.nan
    negative = {k: v.copy() for k, v in s.precision.items()}
    negative["layers.1.bias"][0] = -1.0
    shape = dict(s.precision, **{"layers.0.bias": np.zeros(4)})
    cases = {
        "NaN": dataclasses.replace(s, precision=nan),
        "negative": dataclasses.replace(s, precision=negative),
        "shape": dataclasses.replace(s, precision=shape),
        "version": dataclasses.replace(s, version=99),
        "another network": dataclasses.replace(s, fingerprint="0" * 16),
        "not symmetric": dataclasses.replace(s, output_factors=dict(s.output_factors, gram=np.triu(np.ones((5, 5))))),
        "fits no (3, 5)": dataclasses.replace(s, output_factors=dict(s.output_factors, gram=np.eye(6))),
        "for 3 classes": dataclasses.replace(s, output_factors=dict(s.output_factors, curvature=np.eye(4))),
    }
    for what, bad in cases.items():
        with pytest.raises(SummaryError, match="alice") as err:
            check_summary(bad, state, "alice")
        assert what in str(err.value), what
    other = MLP(6, [7, 4], 3).state_dict()
    with pytest.raises(SummaryError, match="another network"):
        check_summary(s, other, "alice")


def test_bad_data_is_refused(client):
    model, x, y = client
    with pytest.raises(ValueError, match="at least one example"):
        summarize(model, x[:0], y[:0])
    with pytest.raises(ValueError, match="labels"):
        summarize(model, x, y + 3)
    with pytest.raises(ValueError, match="prior_precision"):
        summarize(model, x, y, prior_precision=0.0)


def test_temperature_nll_is_the_scaled_cross_entropy(client):
    model, x, y = client
    t = np.array([0.5, 1.0, 3.0])
    got = temperature_nll(model, x, y, t)
    with torch.no_grad():
        logits = model(torch.as_tensor(x)).double()
    want = [float(torch.nn.functional.cross_entropy(logits / T, torch.as_tensor(y), reduction="sum")) for T in t]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    with pytest.raises(ValueError, match="positive"):
        temperature_nll(model, x, y, [1.0, -1.0])


def test_summary_is_a_dataclass_of_aggregates(client):
    model, x, y = client
    s = summarize(model, x, y)
    assert isinstance(s, ClientSummary)
    # nothing per example: every array is the size of a parameter, a unit count or the classes
    sizes = {np.size(v) for v in s.precision.values()} | {np.size(v) for m in s.moments.values() for v in m.values()}
    assert 50 not in sizes and max(sizes) == 6 * 5


def test_batchnorm_moments_are_torchs_batch_statistics_and_leave_the_module_as_it_was():
    from bayesfuse.summaries import batchnorm_moments

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4, 3), nn.BatchNorm1d(3)
    )
    model[1].running_mean.fill_(0.3)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = np.random.default_rng(0).normal(size=(40, 5)).astype(np.float32)
    got = batchnorm_moments(model, x, batch_size=64)  # one batch
    # independent: torch's own running statistics after one training-mode pass with momentum None
    # (batch mean; unbiased batch variance), dropout off as at test time
    reference = copy.deepcopy(model)
    for m in (reference[1], reference[5]):
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        reference(torch.as_tensor(x))
    assert sorted(got) == ["1", "5"]
    for name in ("1", "5"):
        n, mean, square = got[name]
        bn = reference.get_submodule(name)
        assert n == 40
        np.testing.assert_allclose(mean, bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose((square - mean**2) * n / (n - 1), bn.running_var.numpy(), rtol=1e-4, atol=1e-6)
    assert not model.training and all(not m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # batches of nearly equal size (none of one example); a network without batch norms has none
    assert batchnorm_moments(model, x[:3], batch_size=2)["1"][0] == 3
    assert batchnorm_moments(nn.Sequential(nn.Linear(5, 2)), x) == {}
    with pytest.raises(ValueError, match="at least 2 examples"):
        batchnorm_moments(model, x[:1])


@pytest.mark.parametrize("cls", [user_nets.StepGRU, user_nets.FlatCNN, user_nets.StepEncoder])
def test_the_clients_own_inputs_trace_a_network_that_does_not_say_its_input_shape(cls):
    from bayesfuse import fuse

    gen = np.random.default_rng(0)
    x = gen.normal(size=(40, 64)).astype(np.float32)
    y = np.arange(40) % 3
    torch.manual_seed(0)
    models = [randomise(cls(k=3), seed) for seed in range(2)]
    # no input shape to be had from the network alone: asked for, not guessed from its first Linear
    with pytest.raises(ValueError, match=r"give an example input \(example_input=\.\.\."):
        spec_from_module(models[0])
    summaries = [summarize(m, x, y) for m in models]
    assert all(s.moments for s in summaries)
    res = fuse(models, "pfnm", summaries=summaries, example_input=torch.as_tensor(x[:2]))
    assert res.hyper["summaries"]["used"] is True  # the summaries are of the networks fuse fuses


def test_a_network_of_token_ids_is_summarised_and_fused_on_its_ids():
    """Ids stay integers through every pass of the summary (curvature, moments, output factors)
    and through the fused posterior's predictive; a permuted copy fuses back to the network."""
    import bayesfuse
    from tests.nets.test_graph_spec import _permuted, _random

    model = _random(user_nets.BagOfWords, 0)
    rng = np.random.default_rng(0)
    ids, y = rng.integers(0, 40, size=(60, 12)), np.arange(60) % 10
    clients = [model, _permuted(model, 1)]
    summaries = [summarize(m, ids, y) for m in clients]
    assert summaries[0].class_counts.sum() == 60 and set(summaries[0].precision) == set(dict(model.named_parameters()))
    fused = bayesfuse.fuse(clients, "pfnm", summaries=summaries, prior_var=1e8, noise_var=1.0)
    p = bayesfuse.nets.predictive_proba(fused, ids)
    assert p.shape == (60, 10) and np.allclose(p.sum(1), 1)
    with torch.no_grad():
        assert float((fused.model.network(torch.as_tensor(ids)) - model(torch.as_tensor(ids))).abs().max()) < 1e-4
