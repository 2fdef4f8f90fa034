"""The clients' own output layers as arrays on a one-shot fusion's units (bayesfuse.inference.client_heads)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from bayesfuse.inference.client_heads import class_shares, one_shot_heads, trace_ratios
from bayesfuse.inference.spec import chain, dense


def mlp_spec(depth: int):
    """An MLP's spec, ``layers.i`` with hidden groups ``P1``..."""
    groups = [None, *(f"P{i + 1}" for i in range(depth)), None]
    parts = [dense(f"layers.{i}", groups[i], groups[i + 1]) for i in range(depth + 1)]
    return chain(*parts, output=(f"layers.{depth}.weight", f"layers.{depth}.bias"))


@dataclass
class _Summary:
    """What one_shot_heads reads of a ClientSummary."""

    precision: dict
    prior_precision: float
    class_counts: np.ndarray
    n_examples: int
    output_factors: dict | None


def _clients(widths=(3, 2), K=4, seed=0):
    gen = np.random.default_rng(seed)
    states, summaries = [], []
    for h in widths:
        states.append(
            {
                "layers.0.weight": gen.normal(size=(h, 5)),
                "layers.0.bias": gen.normal(size=h),
                "layers.1.weight": gen.normal(size=(K, h)),
                "layers.1.bias": gen.normal(size=K),
            }
        )
        a = gen.normal(size=(h + 1, h + 1))
        p = gen.dirichlet(np.ones(K))
        counts = gen.integers(0, 9, size=K)
        summaries.append(
            _Summary(
                precision={"layers.1.weight": gen.uniform(1, 2, (K, h)), "layers.1.bias": gen.uniform(1, 2, K)},
                prior_precision=float(gen.uniform(0.5, 2)),
                class_counts=counts,
                n_examples=int(counts.sum()),
                output_factors={"gram": a @ a.T, "curvature": np.diag(p) - np.outer(p, p)},
            )
        )
    return mlp_spec(1), states, summaries


def test_each_head_is_its_clients_output_layer_at_its_matched_units():
    spec, states, summaries = _clients()
    assignments = {"P1": [np.array([4, 0, 2]), np.array([1, 4])]}
    heads = one_shot_heads(spec, states, assignments, 5, summaries=summaries)
    assert heads["output"] == "layers.1" and heads["form"] == "kronecker"
    for j, (state, cols) in enumerate(zip(states, assignments["P1"])):
        np.testing.assert_array_equal(heads["weight"][j][:, cols], state["layers.1.weight"])
        others = np.setdiff1d(np.arange(5), cols)
        assert (heads["weight"][j][:, others] == 0).all()
        np.testing.assert_array_equal(heads["bias"][j], state["layers.1.bias"])
        lap = heads["laplace"]
        at = np.append(cols, 5)  # the bias is the last feature
        np.testing.assert_array_equal(lap["support"][j], np.isin(np.arange(6), at))
        np.testing.assert_array_equal(lap["gram"][j][np.ix_(at, at)], summaries[j].output_factors["gram"])
        gram = lap["gram"][j].copy()
        gram[np.ix_(at, at)] = 0
        assert (gram == 0).all()  # nothing outside the client's own units
        assert lap["prior_precision"][j] == summaries[j].prior_precision and lap["n"][j] == summaries[j].n_examples
    np.testing.assert_allclose(heads["shares"], class_shares(np.stack([s.class_counts for s in summaries])))


def test_without_factors_the_heads_are_diagonal_and_without_summaries_points():
    spec, states, summaries = _clients()
    assignments = {"P1": [np.array([4, 0, 2]), np.array([1, 4])]}
    summaries[1].output_factors = None  # one version 1 summary: every head diagonal
    heads = one_shot_heads(spec, states, assignments, 5, summaries=summaries)
    assert heads["form"] == "diagonal"
    P = heads["laplace"]["precision"]
    s = summaries[0]
    np.testing.assert_allclose(P[0][:, [4, 0, 2]], s.precision["layers.1.weight"] + s.prior_precision)
    np.testing.assert_allclose(P[0][:, 5], s.precision["layers.1.bias"] + s.prior_precision)
    assert np.isinf(P[0][:, [1, 3]]).all()
    points = one_shot_heads(spec, states, assignments, 5, class_counts=np.ones((2, 4)))
    assert points["form"] == "map" and points["laplace"] is None
    np.testing.assert_allclose(points["shares"], 0.5)


def test_trace_matched_heads_scale_each_curvature_to_the_summarys_ggn_trace():
    spec, states, summaries = _clients()
    assignments = {"P1": [np.array([4, 0, 2]), np.array([1, 4])]}
    matched = one_shot_heads(spec, states, assignments, 5, summaries=summaries, trace_match=True)
    plain = one_shot_heads(spec, states, assignments, 5, summaries=summaries)
    assert "scale" not in plain["laplace"] and matched["form"] == "kronecker"
    for j, s in enumerate(summaries):
        exact = s.precision["layers.1.weight"].sum() + s.precision["layers.1.bias"].sum()
        kfac = s.n_examples * np.trace(s.output_factors["gram"]) * np.trace(s.output_factors["curvature"])
        assert matched["laplace"]["scale"][j] == pytest.approx(exact / kfac, rel=1e-12)
    for key, value in plain["laplace"].items():  # nothing else moves
        np.testing.assert_array_equal(matched["laplace"][key], value)
    # with the EKFAC eigenvalues (version 3+) the exact trace is their sum (bfloat16 since version
    # 6, float32 before), not the GGN diagonal's (bfloat16 since version 5)
    s = summaries[0]
    kfac = s.n_examples * np.trace(s.output_factors["gram"]) * np.trace(s.output_factors["curvature"])
    g, k = len(s.output_factors["gram"]), len(s.output_factors["curvature"])
    s.output_factors = dict(s.output_factors, eigenvalues=np.full((g, k), 0.25))
    assert trace_ratios(summaries, "layers.1.weight", "layers.1.bias")[0] == pytest.approx(
        0.25 * g * k / kfac, rel=1e-12
    )
    # a head whose curvature is 0 either way keeps its own; diagonal heads are left as they are
    K = len(summaries[1].output_factors["curvature"])
    summaries[1].output_factors = dict(summaries[1].output_factors, curvature=np.zeros((K, K)))
    assert trace_ratios(summaries, "layers.1.weight", "layers.1.bias")[1] == 1.0
    summaries[1].output_factors = None
    diagonal = one_shot_heads(spec, states, assignments, 5, summaries=summaries, trace_match=True)
    assert diagonal["form"] == "diagonal" and set(diagonal["laplace"]) == {"precision"}
    with pytest.raises(ValueError, match="client 1's summary has no output factors"):
        trace_ratios(summaries, "layers.1.weight", "layers.1.bias")


def test_client_order_moves_the_heads_with_their_clients():
    spec, states, summaries = _clients(widths=(3, 2, 4))
    assignments = {"P1": [np.array([4, 0, 2]), np.array([1, 4]), np.array([0, 1, 2, 3])]}
    heads = one_shot_heads(spec, states, assignments, 5, summaries=summaries)
    order = [2, 0, 1]
    moved = one_shot_heads(
        spec,
        [states[j] for j in order],
        {"P1": [assignments["P1"][j] for j in order]},
        5,
        summaries=[summaries[j] for j in order],
    )
    for key in ("weight", "bias", "shares"):
        np.testing.assert_array_equal(moved[key], heads[key][order])
    for key, value in heads["laplace"].items():
        np.testing.assert_array_equal(moved["laplace"][key], value[order])


def test_refusals():
    spec, states, summaries = _clients()
    good = {"P1": [np.array([4, 0, 2]), np.array([1, 4])]}
    with pytest.raises(ValueError, match="do not fit 2 clients and 4 fused units"):
        one_shot_heads(spec, states, good, 4)
    summaries[0].output_factors = dict(summaries[0].output_factors, gram=np.eye(3))
    with pytest.raises(ValueError, match="client 0's output factors"):
        one_shot_heads(spec, states, good, 5, summaries=summaries)
    logistic = mlp_spec(0)
    with pytest.raises(ValueError, match="reads inputs"):
        one_shot_heads(logistic, [{"layers.0.weight": np.ones((4, 5)), "layers.0.bias": np.ones(4)}], {}, 5)
