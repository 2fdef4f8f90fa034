"""Fused topic models on data simulated from the Pyro LDA model (KL-fusion paper, section 5.3)."""

import numpy as np
import pytest
from scipy import sparse
from scipy.optimize import linear_sum_assignment

from bayesfuse.inference.expfam import Dirichlet
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.models.lda import (
    amps_fuse,
    completion_loglik,
    fit_local_lda,
    fold_in,
    select_reg,
    simulate_lda_federation,
    split_documents,
    topic_means,
    topic_sources,
    topics_table,
)

N_WORDS, DOCS, LENGTH = 60, 150, 80


@pytest.fixture(scope="module")
def federation():
    """4 clients, each writing about 3 of 6 sparse topics (Dir(0.05) over 60 words)."""
    fed = simulate_lda_federation(4, 6, N_WORDS, topics_per_client=3, docs_per_client=DOCS, doc_length=LENGTH, seed=0)
    posts = [fit_local_lda(c, 3, method="numpy", max_iter=100, n_init=5, seed=0) for c in fed.clients]
    return fed, posts


def l1_to_truth(topics: Dirichlet, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hungarian match of estimated to true topics by L1 distance of the means; (true index, distance)."""
    d = np.abs(topic_means(topics)[:, None, :] - truth[None]).sum(-1)
    rows, cols = linear_sum_assignment(d)
    return cols[np.argsort(rows)], d[rows, cols][np.argsort(rows)]


# Tolerance on the L1 distance between an estimated topic mean and the true topic. A topic of a
# client is estimated from about DOCS * LENGTH / 3 = 4,000 tokens; the sampling error of a
# frequency p from n tokens has sd sqrt(p (1 - p) / n), so the L1 error is about
# sum_w sqrt(p_w / n) <= sqrt(V / n) = sqrt(60 / 4000) = 0.12 (Cauchy-Schwarz); fused topics pool
# 2 clients' tokens on average, so sqrt(1/2) of that. Distinct Dir(0.05) topics are >= 1.5 apart.
LOCAL_TOL = 0.12
FUSED_TOL = 0.12


def test_simulation_is_seeded_and_shaped(federation):
    fed, _ = federation
    assert fed.topics.shape == (6, N_WORDS) and np.allclose(fed.topics.sum(1), 1)
    assert all(c.shape == (DOCS, N_WORDS) and (c.sum(1) == LENGTH).all() for c in fed.clients)
    again = simulate_lda_federation(4, 6, N_WORDS, topics_per_client=3, docs_per_client=DOCS, doc_length=LENGTH, seed=0)
    np.testing.assert_array_equal(again.clients[3], fed.clients[3])
    with pytest.raises(ValueError, match="topics_per_client"):
        simulate_lda_federation(2, 3, 10, topics_per_client=4)


def test_local_fits_recover_their_topics(federation):
    fed, posts = federation
    for q, truth in zip(posts, fed.client_topics):
        match, dist = l1_to_truth(q, fed.topics)
        assert set(match) == set(truth)
        assert dist.max() < LOCAL_TOL


def test_sklearn_and_numpy_local_fits_agree(federation):
    fed, posts = federation
    q = fit_local_lda(fed.clients[1], 3, method="sklearn", max_iter=30, n_init=2, seed=0)
    match, dist = l1_to_truth(q, fed.topics)
    assert set(match) == set(fed.client_topics[1]) and dist.max() < LOCAL_TOL


def test_kl_fusion_recovers_the_global_topics(federation):
    fed, posts = federation
    present = np.unique(np.concatenate(fed.client_topics))  # topics some client writes about (5 of 6 here)
    res = kl_fuse(posts, reg=0.3)
    assert res.n_global == len(present)
    match, dist = l1_to_truth(res.components, fed.topics)
    assert sorted(match) == present.tolist() and dist.max() < FUSED_TOL
    # each fused topic's sources are exactly the clients that wrote about it
    sources = topic_sources(res.assignments, res.n_global)
    for g, k in enumerate(match):
        assert sources[g] == [str(j) for j, s in enumerate(fed.client_topics) if k in s]


def test_one_client_fuses_to_itself(federation):
    _, posts = federation
    res = kl_fuse(posts[:1], reg=0.3)
    assert res.n_global == 3
    order = np.argsort(res.assignments[0])
    np.testing.assert_allclose(res.components.concentration[res.assignments[0]], posts[0].concentration, rtol=1e-10)
    assert sorted(order) == [0, 1, 2]
    amps = amps_fuse(posts[:1], prior=1 / 3)
    np.testing.assert_allclose(amps.components.concentration[amps.assignments[0]], posts[0].concentration)


def test_permuting_a_client_changes_nothing(federation):
    _, posts = federation
    ref = kl_fuse(posts, reg=0.3)
    perm = np.array([2, 0, 1])
    shuffled = [*posts[:2], posts[2][perm], posts[3]]
    res = kl_fuse(shuffled, reg=0.3)

    def canon(r):
        return r.components.concentration[np.lexsort(r.components.concentration.T[:5])]

    np.testing.assert_allclose(canon(res), canon(ref), rtol=1e-8)
    np.testing.assert_array_equal(res.assignments[2], ref.assignments[2][perm])


def test_parametric_and_amps_on_a_homogeneous_federation():
    # all clients share the same 3 topics: eq. 3 and AMPS should both align them one to one
    fed = simulate_lda_federation(3, 3, N_WORDS, docs_per_client=DOCS, doc_length=LENGTH, seed=4)
    posts = [fit_local_lda(c, 3, method="numpy", max_iter=100, n_init=3, seed=0) for c in fed.clients]
    param = kl_fuse(posts, mode="homogeneous")
    amps = amps_fuse(posts, prior=1 / 3)
    for r in (param, amps):
        match, dist = l1_to_truth(r.components, fed.topics)
        assert sorted(match) == [0, 1, 2] and dist.max() < FUSED_TOL
        # every global topic takes one local topic of every client
        assert all(sorted(a) == [0, 1, 2] for a in r.assignments)
    # AMPS' merged posterior is the prior plus all clients' counts: its concentration sums to the
    # total tokens plus V times the prior; KL-fusion's is their average (eq. 4)
    total = sum(c.sum() for c in fed.clients)
    assert amps.components.concentration.sum() == pytest.approx(total + 3 * N_WORDS / 3, rel=1e-6)


def test_completion_loglik_two_ways(federation):
    """Our vectorised fold-in and log-likelihood against scikit-learn's own E-step
    (``transform`` with the topics' Dirichlets set) and a plain loop over documents."""
    from scipy.special import digamma
    from sklearn.decomposition import LatentDirichletAllocation

    fed, posts = federation
    q = posts[0]
    obs, held = split_documents(fed.clients[0][:40], 0.1, seed=1)
    alpha = 1 / 3
    gamma = fold_in(obs, q, alpha, tol=1e-10, max_iter=2000)
    lda = LatentDirichletAllocation(
        n_components=3, doc_topic_prior=alpha, max_doc_update_iter=2000, mean_change_tol=1e-10
    )
    lda.components_ = q.concentration
    c = q.concentration
    lda.exp_dirichlet_component_ = np.exp(digamma(c) - digamma(c.sum(1, keepdims=True)))
    lda.doc_topic_prior_ = alpha
    lda.n_features_in_ = N_WORDS
    lda.n_batch_iter_, lda.n_iter_ = 1, 1
    theta_sklearn = lda.transform(obs)
    theta = gamma / gamma.sum(1, keepdims=True)
    # both iterate the same fixed point to a change of 1e-10 per entry
    np.testing.assert_allclose(theta, theta_sklearn, atol=1e-6)
    beta = topic_means(q)
    h = held.toarray()
    loop = sum(h[d, w] * np.log(theta_sklearn[d] @ beta[:, w]) for d in range(len(h)) for w in np.flatnonzero(h[d]))
    ours = completion_loglik(obs, held, q, alpha, tol=1e-10, max_iter=2000)
    assert ours == pytest.approx(loop / h.sum(), abs=1e-6)


def test_split_documents_keeps_every_token():
    x = sparse.csr_matrix(np.random.default_rng(0).poisson(3.0, size=(50, 30)).astype(float))
    obs, held = split_documents(x, 0.1, seed=0)
    np.testing.assert_array_equal((obs + held).toarray(), x.toarray())
    # a binomial(n, 0.1) share: 4,500 tokens give a share within 4 sd = 4 sqrt(0.09 / 4500) = 0.018
    assert held.sum() / x.sum() == pytest.approx(0.1, abs=0.018)
    with pytest.raises(ValueError, match="share"):
        split_documents(x, 1.0)


def test_select_reg_by_clients_validation(federation):
    fed, posts = federation
    validation = [
        c[:30]
        for c in simulate_lda_federation(
            4, 6, N_WORDS, topics_per_client=3, docs_per_client=30, doc_length=LENGTH, seed=0
        ).clients
    ]
    sel = select_reg(posts, validation, [0.3, 3.0, 30.0])
    assert sel.n_topics[0] == 5 and sel.n_topics[-1] < 5  # a huge reg merges distinct topics
    assert sel.reg == 0.3 and sel.scores[0] > sel.scores[-1]
    assert sel.best is sel.results[0]


def test_topics_table_names_words_and_sources():
    q = Dirichlet(concentration=np.array([[5.0, 1.0, 0.1], [0.1, 1.0, 5.0]]))
    table = topics_table(q, ["apple", "pear", "plum"], [np.array([0, 1]), np.array([1])], ["A", "B"], n_words=2)
    lines = table.splitlines()
    assert "plum pear" in lines[1] and "2: A, B" in lines[1]
    assert "apple pear" in lines[2] and "1: A" in lines[2]
    with pytest.raises(ValueError, match="equal numbers"):
        amps_fuse([q, q[:1]], prior=0.1)


@pytest.mark.parametrize("n_sweeps", [0, -1])
def test_amps_needs_a_sweep(n_sweeps):
    posts = [Dirichlet(np.full((2, 3), 1.0 + j)) for j in range(2)]
    with pytest.raises(ValueError, match="n_sweeps must be a positive integer"):
        amps_fuse(posts, prior=0.5, n_sweeps=n_sweeps)


def test_fits_that_all_score_nan_are_refused_in_one_line(monkeypatch):
    import bayesfuse.models.lda as lda

    monkeypatch.setattr(lda, "_words_loglik", lambda *a: float("nan"))
    counts = np.random.default_rng(0).poisson(1.0, size=(20, 30))
    with pytest.raises(FloatingPointError, match="none of the 3 LDA fits has a finite score"):
        lda.fit_local_lda(counts, 2, n_init=3, method="numpy", max_iter=2)


@pytest.mark.parametrize(
    "counts, options, error, match",
    [
        (
            np.array([[1.0, -3.0], [2.0, 0.0]]),
            {},
            ValueError,
            "counts must be non-negative word counts, got a minimum of -3",
        ),
        (
            np.zeros((0, 30)),
            {},
            ValueError,
            r"counts must hold at least one document and one word, got shape \(0, 30\)",
        ),
        (np.zeros((4, 30)), {}, ValueError, "counts holds no words"),
        (np.array([[1.0, np.nan]]), {}, ValueError, "counts contains NaN"),
        (np.ones(5), {}, ValueError, r"counts must be a \(n_docs, n_words\) array .*got shape \(5,\)"),
        (None, {}, TypeError, r"counts must be a \(n_docs, n_words\) array .*got NoneType"),
        (np.ones((5, 4)), {"n_topics": 0}, ValueError, "n_topics must be a positive integer, got 0"),
        (np.ones((5, 4)), {"n_topics": -2}, ValueError, "n_topics must be a positive integer, got -2"),
        (
            np.ones((5, 4)),
            {"topic_word_prior": -1.0},
            ValueError,
            "topic_word_prior must be positive or None, got -1.0",
        ),
        (np.ones((5, 4)), {"doc_topic_prior": -1.0}, ValueError, "doc_topic_prior must be positive or None, got -1.0"),
        (np.ones((5, 4)), {"max_iter": 0}, ValueError, "max_iter must be a positive integer, got 0"),
    ],
)
@pytest.mark.parametrize("method", ["numpy", "sklearn"])
def test_fit_local_lda_refuses_bad_input_in_one_line(counts, options, error, match, method):
    options = {"n_topics": 2, **options}
    with pytest.raises(error, match=match):
        fit_local_lda(counts, method=method, **options)


def test_fit_local_lda_takes_sparse_counts():
    x = np.random.default_rng(0).poisson(1.0, size=(20, 10)).astype(float)
    a = fit_local_lda(sparse.csr_matrix(x), 2, method="numpy", max_iter=3)
    b = fit_local_lda(x, 2, method="numpy", max_iter=3)
    np.testing.assert_allclose(a.concentration, b.concentration)


def test_select_reg_needs_one_validation_set_per_posterior(federation):
    fed, posts = federation
    with pytest.raises(ValueError, match="4 posteriors but 1 validation sets"):
        select_reg(posts, fed.clients[:1], [0.3])
    with pytest.raises(ValueError, match="regs is empty"):
        select_reg(posts, fed.clients, [])


def test_completion_loglik_names_mismatched_shapes(federation):
    fed, posts = federation
    obs, held = split_documents(fed.clients[0][:40], 0.1, seed=1)
    with pytest.raises(ValueError, match=r"observed and held_out have 20 words \(columns\) but the topics have 60"):
        completion_loglik(obs[:, :20], held[:, :20], posts[0])
    with pytest.raises(ValueError, match=r"observed and held_out must have the same shape .*\(10, 60\) and \(40, 60\)"):
        completion_loglik(obs[:10], held, posts[0])
    with pytest.raises(ValueError, match=r"observed has 20 words \(columns\) but the topics have 60"):
        fold_in(obs[:, :20], posts[0])
