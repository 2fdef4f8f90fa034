"""Fused BNNs with the clients' own output layers (bayesfuse.models.bnn_heads)."""

import numpy as np
import pytest
import torch

from bayesfuse import fuse
from bayesfuse.core import fuse_states
from bayesfuse.fuse_files import fuse_files
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.loading import load
from bayesfuse.models.bnn import HorseshoeBNN
from bayesfuse.models.bnn_fusion import HEAD_KEYS, client_heads
from bayesfuse.models.bnn_heads import HeadMixtureBNN, bnn_from_state
from bayesfuse.models.bnn_posterior import DeepBNNPosterior, HiddenLayer
from tests.helpers import varied_bnn

pytestmark = pytest.mark.filterwarnings("ignore:KL-fusion did not converge")

X = np.random.default_rng(0).normal(size=(40, 6))
COUNTS = np.array([[30.0, 0.0, 10.0], [10.0, 20.0, 0.0]])


def _posterior(seed: int, hidden, spread: float = 0.3) -> DeepBNNPosterior:
    bnn = varied_bnn(6, hidden, 3, seed=seed, spread=spread, scale_low=0.05, scale_span=0.3, global_scale=0.3)
    return DeepBNNPosterior.from_state(bnn.state_dict())


def _logits(post: DeepBNNPosterior, x: np.ndarray) -> np.ndarray:
    """The network at its guide's means (each unit's scale exp(E[log tau + log lambda]))."""
    h = x
    for layer in post.layers:
        w, b = layer.incoming.loc[:, :-1], layer.incoming.loc[:, -1]
        h = np.maximum(np.exp(layer.log_lam.loc[:, 0] + layer.log_tau.loc[0, 0]) * (h @ w.T + b), 0.0)
    return h @ post.out_weights.loc + post.out_bias.loc[0]


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _disjoint_clients() -> list[DeepBNNPosterior]:
    """Two clients whose units no fusion merges: b's first layer sits far from a's (as in
    test_bnn_fusion's class-share test), so the fused layers hold each client's units side by side."""
    a, b = _posterior(4, (3, 2)), _posterior(5, (4, 3))
    first = b.layers[0]
    far = HiddenLayer(
        incoming=DiagNormal(loc=first.incoming.loc + 8.0, var=first.incoming.var),
        log_lam=first.log_lam,
        log_tau=first.log_tau,
    )
    b = DeepBNNPosterior(
        (far, b.layers[1]), b.out_weights, b.out_bias, b.in_features, b.n_classes, b.global_scale, b.weight_scale
    )
    return [a, b]


def _at_means(state: dict) -> dict:
    """``state`` with every standard deviation ~0, so that a prediction is the network at its means."""
    out = dict(state)
    for k in state:
        if k.startswith("log_scale."):
            out[k] = np.full_like(np.asarray(state[k]), -40.0)
        elif k in ("heads.scale_w", "heads.scale_b"):
            out[k] = np.zeros_like(np.asarray(state[k]))
    return out


@pytest.mark.parametrize("counts", [None, COUNTS])
def test_heads_on_side_by_side_units_predict_the_class_share_mixture_of_the_clients(counts):
    # No unit merges: head j reads client j's units through the fused layers (weight 0 on the
    # other client's), so it computes client j's network; the predictive is then
    # sum_j s_jk softmax_j / normaliser with s the class shares (1/J without counts).
    posts = _disjoint_clients()
    fused = fuse_states(
        [p.to_state() for p in posts], "kl", class_counts=counts, reg=1e-6, prune_kl=0.0, head="clients"
    )
    assert fused.sizes == [7, 5] and fused.hyper["head"] == "clients"
    model = HeadMixtureBNN.from_state_dict(_at_means(fused.state))
    assert model.n_heads == 2
    shares = np.full((2, 3), 0.5) if counts is None else counts / counts.sum(0)
    mixture = sum(shares[j] * _softmax(_logits(p, X)) for j, p in enumerate(posts))
    want = mixture / mixture.sum(1, keepdims=True)
    np.testing.assert_allclose(model.predict(X, num_samples=3), want, rtol=1e-9, atol=1e-12)
    # the shared head is the one softmax of the class-share averaged logits (a different rule)
    shared = HorseshoeBNN.from_state_dict({k: v for k, v in _at_means(fused.state).items() if k not in HEAD_KEYS})
    averaged = _softmax(sum(shares[j] * _logits(p, X) for j, p in enumerate(posts)))
    np.testing.assert_allclose(shared.predict(X, num_samples=3), averaged, rtol=1e-9, atol=1e-12)
    assert np.abs(want - averaged).max() > 1e-3
    # the geometric pool: softmax_k(sum_j s_jk log softmax_j), with 0 log 0 = 0 where s_jk = 0
    with np.errstate(divide="ignore"):
        scores = sum(
            np.where(shares[j] > 0, shares[j] * np.log(_softmax(_logits(p, X))), 0.0) for j, p in enumerate(posts)
        )
    geometric = model.predict(X, num_samples=3, pool="log")
    np.testing.assert_allclose(geometric, _softmax(scores), rtol=1e-9, atol=1e-12)
    assert np.abs(geometric - want).max() > 1e-6  # the rules differ far beyond the 1e-9 tolerance


def test_the_log_pool_takes_each_heads_monte_carlo_predictive_before_the_log():
    # With the heads' and body's standard deviations as fused (no longer ~0), pool="log" is the
    # geometric pool of each head's own predictive: the linear pool with one-hot shares gives
    # head j's predictive from the same draws (same seed), and pooling those by hand must agree.
    # Pooling each draw's softmax before averaging would give a sharper, different answer.
    fused = fuse_states(
        [p.to_state() for p in _disjoint_clients()], "kl", class_counts=COUNTS, reg=1e-6, prune_kl=0.0, head="clients"
    )
    model = HeadMixtureBNN.from_state_dict(fused.state)
    shares = model.heads.shares.clone()
    per_head = []
    for j in range(model.n_heads):
        model.heads.shares.copy_(torch.nn.functional.one_hot(torch.full((3,), j), model.n_heads).T.double())
        per_head.append(model.predict(X, num_samples=50, seed=3))
    model.heads.shares.copy_(shares)
    s = shares.numpy()
    with np.errstate(divide="ignore"):
        scores = sum(np.where(s[j] > 0, s[j] * np.log(q), 0.0) for j, q in enumerate(per_head))
    np.testing.assert_allclose(
        model.predict(X, num_samples=50, seed=3, pool="log"), _softmax(scores), rtol=1e-9, atol=1e-12
    )
    per_draw = model._predict(X, 50, 3, 4096, lambda x, d: _per_draw_log_pool(model, x, d))
    assert np.abs(per_draw - _softmax(scores)).max() > 1e-6  # far beyond the 1e-9 tolerance


def _per_draw_log_pool(model: HeadMixtureBNN, x: torch.Tensor, draws) -> torch.Tensor:
    from bayesfuse.models.bnn import _forward_hidden

    hidden = _forward_hidden(x, draws, model.depth)
    logits = torch.einsum("snh,sjkh->sjnk", hidden, draws["heads.w"]) + draws["heads.b"].unsqueeze(2)
    score = (model.heads.shares[None, :, None, :] * torch.log_softmax(logits, -1)).sum(1)
    return torch.softmax(score, -1).mean(0)


def test_the_log_pool_is_computed_in_log_space():
    # Heads whose logits are their biases, 1000s apart: a floor on probabilities would turn the
    # log-probabilities below -708 into ties. Exactly: score = (1/2)(log_softmax_1 + log_softmax_2)
    # = (-500, -400, -2000) + const, so class 1 takes all the mass (e^-100 is left to class 0).
    fused = fuse_states([p.to_state() for p in _disjoint_clients()], "kl", reg=1e-6, prune_kl=0.0, head="clients")
    state = dict(fused.state)
    for k in ("heads.loc_w", "heads.scale_w", "heads.scale_b"):
        state[k] = np.zeros_like(np.asarray(state[k]))
    state["heads.loc_b"] = np.array([[-1000.0, 0.0, -2000.0], [0.0, -800.0, -2000.0]])
    probs = HeadMixtureBNN.from_state_dict(state).predict(X, num_samples=4, pool="log")
    np.testing.assert_allclose(probs, np.broadcast_to([np.exp(-100.0), 1.0, 0.0], probs.shape), rtol=1e-12, atol=1e-300)


def test_an_unknown_pool_is_refused():
    fused = fuse_states([p.to_state() for p in _disjoint_clients()], "kl", reg=1e-6, prune_kl=0.0, head="clients")
    with pytest.raises(ValueError, match="pool must be one of 'linear', 'log', got 'mean'"):
        HeadMixtureBNN.from_state_dict(fused.state).predict(X, pool="mean")


def _kept(post: DeepBNNPosterior, kept) -> DeepBNNPosterior:
    """``post`` with only the units ``kept`` (one index array per hidden layer): the network pruning leaves."""
    layers, below = [], None
    for layer, keep in zip(post.layers, kept):
        layer = layer.units(np.asarray(keep))
        if below is not None:
            cols = np.append(below, layer.incoming.loc.shape[1] - 1)
            layer = HiddenLayer(
                incoming=DiagNormal(loc=layer.incoming.loc[:, cols], var=layer.incoming.var[:, cols]),
                log_lam=layer.log_lam,
                log_tau=layer.log_tau,
            )
        layers.append(layer)
        below = np.asarray(keep)
    return DeepBNNPosterior(
        tuple(layers),
        post.out_weights[np.asarray(kept[-1])],
        post.out_bias,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )


def _switch_off(post: DeepBNNPosterior, unit: int) -> DeepBNNPosterior:
    """``post`` with unit ``unit`` of every hidden layer at the prior (incoming weights N(0, 1)): pruned."""
    layers = []
    for layer in post.layers:
        loc, var = layer.incoming.loc.copy(), layer.incoming.var.copy()
        loc[unit], var[unit] = 0.0, 1.0
        layers.append(HiddenLayer(incoming=DiagNormal(loc=loc, var=var), log_lam=layer.log_lam, log_tau=layer.log_tau))
    return DeepBNNPosterior(
        tuple(layers),
        post.out_weights,
        post.out_bias,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )


@pytest.mark.parametrize(
    "method, unit_form, depth",
    [
        ("kl", "effective", 1),
        ("kl", "effective", 2),
        ("kl", "raw", 1),
        ("pfnm", "raw", 1),
    ],
)
def test_pruned_clients_heads_compute_each_clients_kept_units(method, unit_form, depth):
    # Pruning on (some units of every client dropped), units unmerged: head j must compute client j's
    # network restricted to its kept units, whatever the method and unit form. In the raw form the
    # fused tau is the clients' barycenter, so this needs the heads' rescaling by s_member / s_fused
    # (one hidden layer: the layers below carry the raw form's own mismatch).
    posts = _disjoint_clients()
    if depth == 1:
        posts = [
            DeepBNNPosterior(
                p.layers[:1],
                DiagNormal(
                    loc=np.random.default_rng(j).normal(size=(p.layers[0].width, 3)),
                    var=np.full((p.layers[0].width, 3), 0.01),
                ),
                p.out_bias,
                p.in_features,
                p.n_classes,
                p.global_scale,
                p.weight_scale,
            )
            for j, p in enumerate(posts)
        ]
    posts = [_switch_off(p, unit=j) for j, p in enumerate(posts)]
    hyper = dict(reg=1e-6) if method == "kl" else dict(noise_var=1e-4, prior_var=1e8)  # matching: no pull to the prior
    fused = fuse_states(
        [p.to_state() for p in posts],
        method,
        class_counts=COUNTS,
        prune_kl=1.0,
        unit_form=unit_form,
        head="clients",
        **hyper,
    )
    kept = fused.hyper["kept_units"] if depth > 1 else [fused.hyper["kept_units"]]
    assert fused.sizes == [sum(len(k) for k in layer) for layer in kept]  # nothing merged
    for layer, post_layers in zip(kept, zip(*[p.layers for p in posts])):
        widths = [len(k) for k in layer]
        assert all(0 < w < pl.width for w, pl in zip(widths, post_layers)), widths  # every client lost some units
    model = HeadMixtureBNN.from_state_dict(_at_means(fused.state))
    shares = COUNTS / COUNTS.sum(0)
    nets = [_kept(p, [layer[j] for layer in kept]) for j, p in enumerate(posts)]
    mixture = sum(shares[j] * _softmax(_logits(n, X)) for j, n in enumerate(nets))
    rtol = 1e-9 if method == "kl" else 1e-6  # matching: the prior's pull, 1e-4 / 1e8 of a unit
    np.testing.assert_allclose(
        model.predict(X, num_samples=2), mixture / mixture.sum(1, keepdims=True), rtol=rtol, atol=1e-9
    )


def test_client_heads_place_each_clients_outgoing_weights_at_its_global_units():
    heads = client_heads(
        [np.array([2, 0]), np.array([1, 2, 3])],
        [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])],
        [np.full((2, 2), 0.25), np.full((3, 2), 4.0)],
        [np.array([[0.1, 0.2]]), np.array([[0.3, 0.4]])],
        [np.full((1, 2), 1.0)] * 2,
        4,
    )
    np.testing.assert_array_equal(heads["heads.loc_w"][0], [[3.0, 0.0, 1.0, 0.0], [4.0, 0.0, 2.0, 0.0]])
    np.testing.assert_array_equal(heads["heads.loc_w"][1], [[0.0, 5.0, 7.0, 9.0], [0.0, 6.0, 8.0, 10.0]])
    np.testing.assert_array_equal(heads["heads.scale_w"][0], [[0.5, 0.0, 0.5, 0.0]] * 2)  # 0 where no unit
    np.testing.assert_array_equal(heads["heads.loc_b"], [[0.1, 0.2], [0.3, 0.4]])
    # two units of one client in one global unit: their outputs add up
    both = client_heads(
        [np.array([0, 0])], [np.array([[1.0], [2.0]])], [np.array([[1.0], [3.0]])], [np.zeros(1)], [np.ones(1)], 1
    )
    assert both["heads.loc_w"][0, 0, 0] == 3.0 and both["heads.scale_w"][0, 0, 0] == 2.0


def test_fuse_builds_a_head_mixture_that_files_and_load_keep(tmp_path):
    bnns = [HorseshoeBNN.from_state_dict(p.to_state()) for p in _disjoint_clients()]
    res = fuse(bnns, "kl", class_counts=COUNTS, reg=1e-6, prune_kl=0.0, head="clients")
    assert isinstance(res.model, HeadMixtureBNN) and res.hyper["head"] == "clients"
    assert type(fuse(bnns, "kl", reg=1e-6).model) is HorseshoeBNN  # the default: one shared head
    paths = []
    for j, bnn in enumerate(bnns):
        paths.append(tmp_path / f"client{j}.pt")
        torch.save(bnn.state_dict(), paths[-1])
    fuse_files(
        paths,
        "kl",
        tmp_path / "fused.pt",
        hyper=dict(reg=1e-6, prune_kl=0.0, head="clients"),
        class_counts={p.name: row.tolist() for p, row in zip(paths, COUNTS)},
    )
    loaded = load(tmp_path / "fused.pt")
    assert isinstance(loaded, HeadMixtureBNN)
    np.testing.assert_array_equal(loaded.predict(X, 5, seed=1), res.model.predict(X, 5, seed=1))
    with pytest.raises(TypeError, match="HeadMixtureBNN is a fused model"):
        fuse([res.model, res.model], "kl")


def _head_state() -> dict:
    bnns = [HorseshoeBNN.from_state_dict(p.to_state()) for p in _disjoint_clients()]
    return {k: v.numpy() for k, v in fuse(bnns, "kl", reg=1e-6, head="clients").model.state_dict().items()}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("heads.shares"), "missing heads.shares"),
        (lambda s: s.update({"heads.loc_b": s["heads.loc_b"][:, :2]}), r"heads.loc_b must be \(2, 3\)"),
        (lambda s: s.update({"heads.loc_w": s["heads.loc_w"][:, :, :-1]}), r"heads.loc_w must be \(heads, 3, "),
        (lambda s: s.update({"heads.scale_w": -s["heads.scale_w"] - 1.0}), "standard deviations must be >= 0"),
        (lambda s: s.update({"heads.shares": s["heads.shares"] * 2}), "sum to 1 over the heads"),
        (lambda s: s.update({"heads.loc_b": np.full_like(s["heads.loc_b"], np.nan)}), "NaN or infinite"),
    ],
)
def test_a_bad_head_state_is_refused(change, message):
    state = _head_state()
    assert isinstance(bnn_from_state(state), HeadMixtureBNN)
    change(state)
    with pytest.raises(ValueError, match=message):
        bnn_from_state(state, "fused.pt")


def test_an_unknown_head_is_refused():
    bnns = [HorseshoeBNN.from_state_dict(p.to_state()) for p in _disjoint_clients()]
    with pytest.raises(ValueError, match="head must be one of 'shared', 'clients'"):
        fuse(bnns, "kl", head="mixture")


def test_a_head_mixture_is_no_input_to_fusion_or_arviz_export(tmp_path):
    from bayesfuse.analysis import bnn_to_arviz

    state = _head_state()
    with pytest.raises(TypeError, match="HeadMixtureBNN is a fused model"):
        fuse_states([state, state], "kl")
    path = tmp_path / "heads.pt"
    torch.save({k: torch.as_tensor(v) for k, v in state.items()}, path)
    client = _disjoint_clients()[0].to_state()  # a plain client: only heads.pt can be named
    torch.save({k: torch.as_tensor(np.asarray(v)) for k, v in client.items()}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="heads.pt is a fused BNN with one head per client"):
        fuse_files([path, tmp_path / "other.pt"], "kl", tmp_path / "out.pt")
    with pytest.raises(TypeError, match="mixture of its clients' heads"):
        bnn_to_arviz(bnn_from_state(state), X, np.zeros(len(X), dtype=int))
    broken = dict(state)
    del broken["heads.shares"]
    torch.save({k: torch.as_tensor(v) for k, v in broken.items()}, path)
    with pytest.raises(ValueError, match="missing heads.shares"):
        load(path)
