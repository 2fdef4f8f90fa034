"""fuse(..., summaries=...) end to end on digits: what it uses, what it refuses, the second round."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bayesfuse import fuse, fuse_states, summarize
from bayesfuse.curvature import diag_ggn
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba
from bayesfuse.nets.state import numpy_state
from bayesfuse.summaries import SummaryError


@pytest.fixture(scope="module")
def federation(summarised_federation):
    return summarised_federation


def test_summaries_are_used_and_reported(federation):
    split, part, models, summaries = federation
    result = fuse(models, "pfnm", summaries=summaries)
    used = result.hyper["summaries"]
    assert used["used"] and used["examples"] == [int(n) for n in part.sizes]
    assert used["bytes"] == [s.nbytes for s in summaries]
    plain = fuse(models, "pfnm", class_counts=part.counts)
    assert "summaries" not in plain.hyper
    probs = predict_proba(result.model, split.test.x)
    assert np.isfinite(probs).all() and evaluate(probs, split.test.y)["accuracy"] > 0.5


def test_pseudo_count_smooths_the_clients_heads_as_setting_it_after_does(federation):
    from bayesfuse.nets.heads import ClientHeads
    from bayesfuse.nets.predict import predictive_proba

    split, part, models, summaries = federation
    default = fuse(models, "pfnm", summaries=summaries)
    plain = fuse(models, "pfnm", summaries=summaries, pseudo_count=0)
    assert isinstance(plain.model, ClientHeads) and plain.model.pseudo_count == 0 == plain.hyper["pseudo_count"]
    assert "smoothed" in default.hyper["predictive"] and "smoothed" not in plain.hyper["predictive"]
    default.model.pseudo_count = 0
    x = split.test.x[:50]
    np.testing.assert_allclose(predictive_proba(plain, x), predictive_proba(default, x), rtol=1e-12)


def test_one_client_fuses_to_itself(federation):
    split, part, models, summaries = federation
    with pytest.warns(UserWarning, match="only one model"):
        result = fuse(models[:1], "pfnm", summaries=summaries[:1])
    # one client: every fused unit has one member, so its precision-weighted mean is the member's
    # weights and its log pool (shares 1) the client's output layer; units come back permuted
    x = torch.as_tensor(split.test.x[:50])
    with torch.no_grad():
        np.testing.assert_allclose(result.model.network(x).numpy(), models[0](x).numpy(), rtol=1e-4, atol=1e-4)


def test_one_convnet_with_batch_norms_fuses_to_itself(federation):
    from bayesfuse.nets.arch import make_cnn
    from tests.helpers import randomise

    split, part, models, summaries = federation
    cnn = randomise(make_cnn(64, 10, channels=(3, 4), hidden=(6,)), 5)
    idx = part[0]
    summary = summarize(cnn, split.train.x[idx], split.train.y[idx])
    with pytest.warns(UserWarning) as caught:
        result = fuse([cnn], "pfnm", summaries=[summary])
    messages = [str(w.message) for w in caught]
    assert any("only one model" in m for m in messages)
    x = torch.as_tensor(split.test.x[:40])
    with torch.no_grad():  # batch norms folded into the convolutions before them: the same function
        np.testing.assert_allclose(result.model.network(x).numpy(), cnn(x).numpy(), rtol=1e-4, atol=1e-4)


def test_second_round_picks_a_temperature(federation):
    split, part, models, summaries = federation
    result = fuse(models, "pfnm", summaries=summaries, rounds=2, data=(split.train, part), second_round="temperature")
    r2 = result.hyper["second_round"]
    # six candidates: the shared head by either pool, and the clients' heads (the one-shot default)
    # with their Kronecker curvatures as sent, trace-matched and with the GGN's eigenvalues, and as
    # the diagonal posteriors of their GGN diagonals
    labels = {
        "precision",
        "counts",
        "client heads",
        "client heads, trace-matched",
        "client heads, EKFAC",
        "client heads, diagonal",
    }
    assert r2["kind"] == "temperature" and 1 / 16 <= r2["temperature"] <= 16 and r2["output_pool"] in labels
    assert r2["candidates"] == 6 * 65 and r2["bytes_up"] == 3 * r2["candidates"] * 8
    assert set(r2["nll"]) == labels
    body_pool = "precision" if r2["output_pool"].startswith("client heads") else r2["output_pool"]
    assert result.hyper["summaries"]["output"] == f"log pool, shares by {body_pool}"
    one_shot = fuse(models, "pfnm", summaries=summaries)

    # the chosen pair minimises the clients' summed NLL on their own data, so the training NLL of the
    # chosen model is at most the one-shot default's (a candidate at temperature 1 on the grid)
    def train_nll(model):
        return evaluate(predict_proba(model, split.train.x), split.train.y)["nll"]

    assert train_nll(result.model) <= train_nll(one_shot.model) + 1e-9
    with pytest.raises(ValueError, match="data="):
        fuse(models, "pfnm", summaries=summaries, rounds=2)
    with pytest.raises(ValueError, match="rounds must be"):
        fuse(models, "pfnm", rounds=4)
    with pytest.raises(ValueError, match="output_pool"):
        fuse(models, "pfnm", output_pool="counts")
    counts = fuse(models, "pfnm", summaries=summaries, output_pool="counts")
    assert counts.hyper["summaries"]["output"] == "log pool, shares by counts"


def test_temperature_round_scores_the_clients_heads(federation):
    from bayesfuse.nets.heads import ClientHeads
    from bayesfuse.nets.laplace import LastLayerLaplace

    split, part, models, summaries = federation
    data = (split.train, part)
    heads = fuse(models, "pfnm", summaries=summaries, rounds=2, data=data, second_round="temperature", head="clients")
    r2 = heads.hyper["second_round"]
    assert isinstance(heads.model, ClientHeads) and r2["candidates"] == 4 * 65
    assert set(r2["nll"]) == {
        "client heads",
        "client heads, trace-matched",
        "client heads, EKFAC",
        "client heads, diagonal",
    }
    assert r2["output_pool"] == min(r2["nll"], key=r2["nll"].get)
    assert heads.hyper["head"] == "clients" and float(heads.model.temperature) == r2["temperature"]
    # the chosen candidate is the one-shot default (the Kronecker heads' log pool), its curvature
    # trace-matched, with the GGN's eigenvalues or as sent, or the one-shot heads of the summaries
    # without their output factors (the diagonal posteriors), at the chosen temperature
    diagonal = r2["output_pool"] == "client heads, diagonal"
    plain = [dataclasses.replace(s, output_factors=None) for s in summaries]
    one_shot = fuse(models, "pfnm", summaries=plain if diagonal else summaries)
    assert (heads.model.form == "diagonal") == diagonal
    if r2["output_pool"] == "client heads, trace-matched":
        one_shot.model.register_buffer("scale", heads.model.scale.clone())
    if r2["output_pool"] == "client heads, EKFAC":
        one_shot.model.register_buffer("eigenvalues", heads.model.eigenvalues.clone())
    assert hasattr(heads.model, "scale") == (r2["output_pool"] == "client heads, trace-matched")
    assert hasattr(heads.model, "eigenvalues") == (r2["output_pool"] == "client heads, EKFAC")
    x = torch.as_tensor(split.test.x[:64])
    with torch.no_grad():
        expected = torch.log_softmax(one_shot.model(x) / r2["temperature"], -1)
        np.testing.assert_allclose(heads.model(x).numpy(), expected.numpy(), rtol=1e-10, atol=1e-10)
    # the clients' summed NLL of it at that temperature is what they reported for it
    nll = -sum(
        np.log(predict_proba(heads.model, split.train.x[idx])[np.arange(len(idx)), split.train.y[idx]]).sum()
        for idx in part
    )
    assert nll == pytest.approx(r2["nll"][r2["output_pool"]], rel=1e-6)
    # client order does not matter (bayesfuse.client_order): the reversed federation, the same model
    reverse = fuse(
        models[::-1],
        "pfnm",
        summaries=summaries[::-1],
        rounds=2,
        data=(split.train, list(part)[::-1]),
        second_round="temperature",
        head="clients",
    )
    assert np.array_equal(predict_proba(reverse.model, split.test.x), predict_proba(heads.model, split.test.x))
    shared = fuse(models, "pfnm", summaries=summaries, rounds=2, data=data, second_round="temperature", head="shared")
    r2 = shared.hyper["second_round"]
    assert isinstance(shared.model, LastLayerLaplace) and r2["candidates"] == 2 * 65
    assert set(r2["nll"]) == {"precision", "counts"}
    # the default scores all six, each as the runs above did, and keeps the least NLL's
    both = fuse(models, "pfnm", summaries=summaries, rounds=2, data=data, second_round="temperature")
    nll = both.hyper["second_round"]["nll"]
    assert nll == {**r2["nll"], **heads.hyper["second_round"]["nll"]}
    assert both.hyper["second_round"]["output_pool"] == min(nll, key=nll.get)
    assert isinstance(both.model, ClientHeads) == min(nll, key=nll.get).startswith("client heads")
    # what the server sends each client: every candidate's tensors, the heads' body (the precision
    # candidate's network) once, and not the heads' fixed draws; the trace-matched heads differ
    # from the others by their J scales alone, the EKFAC heads by their eigenvalues (J, G+1, K), the
    # diagonal heads by their inverse precisions (J, K, G+1)
    kronecker = fuse(models, "pfnm", summaries=summaries).model
    J = len(models)
    network = sum(t.numel() for t in kronecker.network.state_dict().values())
    own = sum(t.numel() for k, t in kronecker.state_dict().items() if not k.startswith("network."))
    draws = kronecker.draws.numel()
    eigenvalues = J * (kronecker.weight.shape[2] + 1) * kronecker.weight.shape[1]
    expected = network + own - draws + J + 2 * eigenvalues
    assert heads.hyper["second_round"]["bytes_down"] == J * 4 * expected
    with pytest.raises(ValueError, match="method must be one of pfnm, nafi"):
        fuse(models, "ot", summaries=summaries, rounds=2, data=data, second_round="temperature", head="clients")


def _chosen(federation, monkeypatch, choice: int, temperature: int):
    """The temperature round with the clients' replies made to prefer candidate ``choice`` (0
    precision, 1 counts, 2 the clients' heads, 3 the same trace-matched, 4 EKFAC, 5 diagonal) at grid index
    ``temperature``."""
    import bayesfuse.inference.summary_fusion as summary_fusion

    split, part, models, summaries = federation
    monkeypatch.setattr(summary_fusion, "best_candidate", lambda nll: (choice, temperature))
    return fuse(models, "pfnm", summaries=summaries, rounds=2, data=(split.train, part), second_round="temperature")


def test_a_shared_head_chosen_over_the_clients_heads_reports_itself(federation, monkeypatch):
    from bayesfuse.nets.laplace import LastLayerLaplace

    result = _chosen(federation, monkeypatch, 0, 32)
    r2 = result.hyper["second_round"]
    assert r2["output_pool"] == "precision" and r2["temperature"] == 1.0
    assert isinstance(result.model, LastLayerLaplace) and "LastLayerLaplace" in result.hyper["predictive"]
    assert "head" not in result.hyper and "pool" not in result.hyper  # nothing of the heads' candidate


def test_the_diagonal_heads_chosen_are_the_one_shot_heads_of_the_summaries_without_factors(federation, monkeypatch):
    from bayesfuse.nets.heads import ClientHeads

    split, part, models, summaries = federation
    result = _chosen(federation, monkeypatch, 5, 40)
    r2 = result.hyper["second_round"]
    assert r2["output_pool"] == "client heads, diagonal" and r2["temperature"] == 2.0
    assert isinstance(result.model, ClientHeads) and result.model.form == "diagonal"
    assert "diagonal Laplace posterior" in result.hyper["predictive"] and result.hyper["head"] == "clients"
    # the one-shot heads of the summaries without their output factors, at T = 2
    plain = fuse(models, "pfnm", summaries=[dataclasses.replace(s, output_factors=None) for s in summaries])
    x = torch.as_tensor(split.test.x[:64])
    with torch.no_grad():
        expected = torch.log_softmax(plain.model(x) / 2.0, -1)
        np.testing.assert_allclose(result.model(x).numpy(), expected.numpy(), rtol=1e-10, atol=1e-10)


def test_the_trace_matched_heads_chosen_report_themselves(federation, monkeypatch):
    from bayesfuse.inference.client_heads import trace_ratios
    from bayesfuse.nets.heads import ClientHeads

    result = _chosen(federation, monkeypatch, 3, 40)
    r2 = result.hyper["second_round"]
    assert r2["output_pool"] == "client heads, trace-matched" and r2["temperature"] == 2.0
    assert isinstance(result.model, ClientHeads) and float(result.model.temperature) == 2.0
    assert "scaled to the exact GGN's trace" in result.hyper["predictive"] and result.hyper["head"] == "clients"
    # each head's scale is its own client's ratio (heads are in the canonical client order: a head
    # is its client's by its bias, the client's own output bias)
    _, _, models, summaries = federation
    ratios = trace_ratios(summaries, "layers.1.weight", "layers.1.bias")
    for j, bias in enumerate(result.model.bias.numpy()):
        client = next(i for i, m in enumerate(models) if np.allclose(m.layers[1].bias.detach().numpy(), bias))
        assert float(result.model.scale[j]) == pytest.approx(ratios[client], rel=1e-12)


def test_the_ekfac_heads_chosen_report_themselves(federation, monkeypatch):
    from bayesfuse.nets.heads import ClientHeads

    result = _chosen(federation, monkeypatch, 4, 40)
    r2 = result.hyper["second_round"]
    assert r2["output_pool"] == "client heads, EKFAC" and r2["temperature"] == 2.0
    assert isinstance(result.model, ClientHeads) and float(result.model.temperature) == 2.0
    assert "(EKFAC)" in result.hyper["predictive"] and not hasattr(result.model, "scale")
    # each head's eigenvalues are its own client's rows, in order, at its supported features (where
    # it keeps its Gram's eigenpairs, ascending), summing to the exact GGN's trace (the client's GGN
    # diagonal of the output layer): a head is its client's by its output bias
    split, part, models, summaries = federation
    for j, bias in enumerate(result.model.bias.numpy()):
        client = next(i for i, m in enumerate(models) if np.allclose(m.layers[1].bias.detach().numpy(), bias))
        s = summaries[client]
        at = result.model.support[j].numpy() > 0
        np.testing.assert_array_equal(result.model.eigenvalues[j].numpy()[at], s.output_factors["eigenvalues"])
        assert not result.model.eigenvalues[j].numpy()[~at].any()
        # (the GGN diagonal itself: the summary's is rounded to bfloat16); the eigenvalues of a
        # version 6 summary are bfloat16 too: non-negative, each within 2^-8, so is their sum
        ggn = diag_ggn(models[client], split.train.x[part[client]])
        exact = ggn["layers.1.weight"].sum() + ggn["layers.1.bias"].sum()
        assert float(result.model.eigenvalues[j].sum()) == pytest.approx(exact, rel=2**-8)
    # version 2 summaries (no eigenvalues): the candidate is left out
    split, part, models, summaries = federation
    older = [
        dataclasses.replace(s, version=2, output_factors={k: s.output_factors[k] for k in ("gram", "curvature")})
        for s in summaries
    ]
    monkeypatch.undo()
    kfac = fuse(models, "pfnm", summaries=older, rounds=2, data=(split.train, part), second_round="temperature")
    assert (
        "client heads, EKFAC" not in kfac.hyper["second_round"]["nll"]
        and kfac.hyper["second_round"]["candidates"] == 5 * 65
    )


def test_diagonal_heads_have_no_trace_matched_candidate(federation):
    from dataclasses import replace as with_fields

    split, part, models, summaries = federation
    diagonal = [with_fields(s, output_factors=None) for s in summaries]
    result = fuse(models, "pfnm", summaries=diagonal, rounds=2, data=(split.train, part), second_round="temperature")
    r2 = result.hyper["second_round"]
    assert r2["candidates"] == 3 * 65 and set(r2["nll"]) == {"precision", "counts", "client heads"}


def test_second_round_refits_the_output_layer(federation):
    from bayesfuse.inference.output_fusion import evidence_precision, fuse_output_fits, prior_precision_from_weights
    from bayesfuse.nets.laplace import LastLayerLaplace
    from bayesfuse.summaries import output_fit

    split, part, models, summaries = federation
    result = fuse(models, "pfnm", rounds=2, data=(split.train, part))
    r2 = result.hyper["second_round"]
    assert r2["kind"] == "refit" and isinstance(result.model, LastLayerLaplace)
    # the clients fit with the data-free fan-in prior; the server chooses the product's by the evidence
    assert r2["fit_prior_precision"] == pytest.approx(
        prior_precision_from_weights(
            [m.layers[-1].weight.detach().numpy() for m in models], fan_in=result.model.network.layers[1].in_features
        )
    )
    lam0 = r2["fit_prior_precision"]  # exactly the server's: the clients' fits stop at a gradient tolerance
    assert r2["prior_precision_from"] == "evidence"
    # the server's output layer is the product of what the clients send, computed here again from
    # the one-shot fusion's hidden layers: the round changes the output layer only
    one_shot = fuse(models, "pfnm")
    fits = [
        output_fit(one_shot.model, "layers.1", split.train.x[idx], split.train.y[idx], lam0, n_clients=3)
        for idx in part
    ]
    lam = evidence_precision(fits, lam0)
    assert r2["prior_precision"] == pytest.approx(lam, rel=1e-6)
    mean, cov = fuse_output_fits(fits, lam0, posterior_precision=lam)
    layer = result.model.network.layers[1]
    np.testing.assert_allclose(layer.weight.detach().numpy(), mean[:-1].T, rtol=1e-6, atol=1e-8)
    joint = result.model.covariance.numpy()  # the whole of P^-1: its per-class blocks are fuse_output_fits'
    assert joint.shape == (mean.shape[0], mean.shape[1], mean.shape[0], mean.shape[1])
    blocks = np.stack([joint[:, c, :, c] for c in range(mean.shape[1])])
    np.testing.assert_allclose(blocks, cov, rtol=1e-6, atol=1e-10)
    np.testing.assert_array_equal(
        result.model.network.layers[0].weight.detach().numpy(), one_shot.model.layers[0].weight.detach().numpy()
    )
    assert r2["bytes_up"] == fits[0].nbytes

    # the refit is fitted to the clients' data: its training NLL is below the one-shot fusion's
    def train_nll(model):
        return evaluate(predict_proba(model, split.train.x), split.train.y)["nll"]

    assert train_nll(result.model) < train_nll(one_shot.model)
    given = fuse(models, "pfnm", rounds=2, data=(split.train, part), output_prior_precision=3.0)
    assert given.hyper["second_round"]["prior_precision"] == 3.0
    with pytest.raises(ValueError, match="second_round must be"):
        fuse(models, "pfnm", rounds=2, data=(split.train, part), second_round="newton")


def test_bad_summaries_are_refused_naming_the_client(federation):
    split, part, models, summaries = federation
    states = [numpy_state(m) for m in models]
    with pytest.raises(ValueError, match="does not read client summaries"):
        fuse(models, "fedavg", summaries=summaries)
    with pytest.raises(ValueError, match="2 summaries for 3 models"):
        fuse(models, "pfnm", summaries=summaries[:2])
    with pytest.raises(ValueError, match="no summary for client 1"):
        fuse_states(states, "pfnm", summaries=[summaries[0], None, summaries[2]])
    with pytest.raises(SummaryError, match="b.pt: the summary is of another network"):
        fuse_states(
            states, "pfnm", summaries=[summaries[0], summaries[0], summaries[2]], names=["a.pt", "b.pt", "c.pt"]
        )


def test_a_wide_output_layer_is_refitted_by_conjugate_gradients(federation, monkeypatch):
    # A fused layer too wide for the joint K-FAC precision is multiplied at the fits' prior by
    # conjugate gradients, with per-class covariance blocks, and the report says so: before, a
    # refit round on 600 fused units and 10 classes stopped with an error.
    from bayesfuse.inference import output_fusion
    from bayesfuse.nets.laplace import LastLayerLaplace

    split, part, models, _ = federation
    joint = fuse(models, "pfnm", rounds=2, data=(split.train, part), output_prior_precision=3.0)
    monkeypatch.setattr(output_fusion, "MAX_JOINT", 8)
    wide = fuse(models, "pfnm", rounds=2, data=(split.train, part), output_prior_precision=3.0)
    r2 = wide.hyper["second_round"]
    assert "conjugate gradients" in r2["product"] and "joint" in joint.hyper["second_round"]["product"]
    assert isinstance(wide.model, LastLayerLaplace)
    layer, want = wide.model.network.layers[1], joint.model.network.layers[1]
    np.testing.assert_allclose(layer.weight.detach().numpy(), want.weight.detach().numpy(), rtol=1e-5, atol=1e-7)
    p = predict_proba(wide.model, split.test.x)
    assert np.isfinite(p).all() and np.allclose(p.sum(1), 1.0, atol=1e-5)
    evidence = fuse(models, "pfnm", rounds=2, data=(split.train, part))
    assert evidence.hyper["second_round"]["prior_precision_from"].startswith("the fits'")
