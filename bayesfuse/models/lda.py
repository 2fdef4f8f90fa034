"""Latent Dirichlet allocation fused across clients (Claici et al. 2020, section 5.3).

Each client fits LDA (Blei, Ng & Jordan 2003) to its own documents by mean-field variational
inference; its topics' posteriors are Dirichlets ``q(beta_k) = Dir(lambda_k)`` over the
vocabulary, the ``theta_l^j`` of section 3. KL-fusion (:func:`~bayesfuse.inference.klfusion.kl_fuse`,
Dirichlet family) matches and averages them: parametric with a fixed number of topics (eq. 3)
or non-parametric with the L2,2,1 regulariser (eq. 9). This module holds

* :func:`lda_model` and :func:`simulate_lda_federation`: LDA stated in Pyro, and clients that each
  write about a subset of global topics (ground truth for the tests);
* :func:`fit_local_lda`: local mean-field VI (scikit-learn's ``LatentDirichletAllocation``, whose
  ``components_`` are the variational ``lambda``);
* :func:`amps_fuse`: the AMPS baseline of Campbell & How (2014), as read in its docstring;
* :func:`split_documents`, :func:`fold_in`, :func:`completion_loglik`: the held-out
  document-completion log-likelihood of the paper's Figure 4;
* :func:`select_reg`: the regulariser ``lambda`` of eq. 9 chosen by the clients' own held-out words;
* :func:`top_words`, :func:`topic_sources`, :func:`topics_table`: the fused topics in words.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence, cast

import numpy as np
from scipy import sparse
from scipy.optimize import linear_sum_assignment
from scipy.special import digamma, gammaln

from bayesfuse.constraints import POSITIVE, POSITIVE_INT, OrNone, validate_params
from bayesfuse.inference.expfam import Dirichlet
from bayesfuse.inference.klfusion import KLFusionResult, kl_fuse

__all__ = [
    "LDAFederation",
    "lda_model",
    "simulate_lda_federation",
    "fit_local_lda",
    "AMPSResult",
    "amps_fuse",
    "split_documents",
    "fold_in",
    "completion_loglik",
    "RegSelection",
    "select_reg",
    "top_words",
    "topic_sources",
    "topics_table",
    "topic_means",
]


# ------------------------------------------------------------------------------ the model


def lda_model(n_docs: int, doc_length: int, topics, alpha: float = 0.1):
    """LDA's generative process in Pyro, for given topics (``topics``: (K, V) rows on the simplex).

    ``theta_d ~ Dir(alpha 1_K)``; the ``doc_length`` words of document d are drawn from
    ``Cat(theta_d^T beta)`` (the topic indicators summed out), so the counts are
    ``Multinomial(doc_length, theta_d^T beta)``. Returns the (n_docs, V) counts.
    """
    import pyro
    import pyro.distributions as dist
    import torch

    topics = torch.as_tensor(topics, dtype=torch.float64)
    with pyro.plate("docs", n_docs):
        theta = pyro.sample("doc_topics", dist.Dirichlet(torch.full((len(topics),), float(alpha), dtype=torch.float64)))
        return pyro.sample("counts", dist.Multinomial(doc_length, theta @ topics))


def _draw_topics(n_topics: int, n_words: int, beta: float):
    """``beta_k ~ Dir(beta 1_V)``, k = 1..K, in a Pyro plate."""
    import pyro
    import pyro.distributions as dist
    import torch

    with pyro.plate("topics", n_topics):
        return pyro.sample("topic_words", dist.Dirichlet(torch.full((n_words,), float(beta), dtype=torch.float64)))


@dataclass
class LDAFederation:
    """Clients' documents drawn from subsets of one set of topics.

    Attributes
    ----------
    clients : list of (n_j, V) float arrays
        Word counts of each client's documents.
    topics : (K, V) array
        The true global topics.
    client_topics : list of int arrays
        The global topics each client's documents use.
    alpha : float
        The documents' topic prior.
    """

    clients: list[np.ndarray]
    topics: np.ndarray
    client_topics: list[np.ndarray]
    alpha: float


def simulate_lda_federation(
    n_clients: int = 4,
    n_topics: int = 6,
    n_words: int = 60,
    *,
    topics_per_client: int | None = None,
    docs_per_client: int = 200,
    doc_length: int = 80,
    alpha: float = 0.2,
    beta: float = 0.05,
    seed: int = 0,
) -> LDAFederation:
    """Draw global topics ``beta_k ~ Dir(beta)``; client j writes ``docs_per_client`` documents
    (:func:`lda_model`) from a random subset of ``topics_per_client`` of them (default all).

    A small ``beta`` gives sparse, well separated topics. The torch RNG is forked, so the global
    random state is untouched; the same seed gives the same federation.
    """
    import torch

    m = n_topics if topics_per_client is None else topics_per_client
    if not 1 <= m <= n_topics:
        raise ValueError(f"topics_per_client must lie in 1..{n_topics}, got {m}")
    rng = np.random.default_rng(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        topics = _draw_topics(n_topics, n_words, beta).numpy()
        subsets = [np.sort(rng.choice(n_topics, m, replace=False)) for _ in range(n_clients)]
        clients = [lda_model(docs_per_client, doc_length, topics[s], alpha).numpy() for s in subsets]
    return LDAFederation(clients, topics, subsets, alpha)


# ----------------------------------------------------------------------- local inference


def _count_matrix(counts, name: str) -> sparse.csr_matrix:
    """``counts`` (documents by words, an array or a sparse matrix) as float64 CSR; a TypeError or a
    ValueError naming ``name`` for another type, another number of dimensions, NaN, infinite or
    negative counts."""
    expected = f"{name} must be a (n_docs, n_words) array or sparse matrix of word counts"
    if counts is None or isinstance(counts, (str, bytes)):
        raise TypeError(f"{expected}, got {type(counts).__name__}")
    if not sparse.issparse(counts):
        try:
            counts = np.asarray(counts, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{expected}, got {type(counts).__name__} of non-numbers") from None
    if counts.ndim != 2:
        raise ValueError(f"{expected}, got shape {counts.shape}")
    x = sparse.csr_matrix(counts, dtype=np.float64)
    if not np.isfinite(x.data).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    if x.data.size and x.data.min() < 0:
        raise ValueError(f"{name} must be non-negative word counts, got a minimum of {x.data.min():g}")
    return x


@validate_params(
    n_topics=POSITIVE_INT, doc_topic_prior=OrNone(POSITIVE), topic_word_prior=OrNone(POSITIVE), max_iter=POSITIVE_INT
)
def fit_local_lda(
    counts,
    n_topics: int,
    *,
    doc_topic_prior: float | None = None,
    topic_word_prior: float | None = None,
    max_iter: int = 50,
    n_init: int = 1,
    method: str = "sklearn",
    seed: int = 0,
) -> Dirichlet:
    """Mean-field VI for LDA on one client's documents; the topics' posteriors ``Dir(lambda_k)``.

    ``method="sklearn"``: scikit-learn's ``LatentDirichletAllocation`` (batch variational Bayes,
    Hoffman, Blei & Bach 2010), whose ``components_`` are ``lambda``: the topic-word prior plus the
    expected word counts of each topic, exactly the variational Dirichlet parameters KL-fusion
    takes (section 3). ``method="numpy"``: the same batch updates (``lambda_kw = eta + sum_d n_dw
    phi_dwk`` after each E-step, :func:`_e_step`) vectorised over all documents, several times
    faster on small corpora; each E-step runs up to 20 sweeps warm-started from the last ``gamma``.
    Priors default to scikit-learn's ``1 / n_topics``. The variational objective has local optima
    (two topics merged, another split); ``n_init`` fits from seeds ``seed, seed + 1, ...`` and keeps
    the one whose topics give the documents the largest completion-free fit (scikit-learn's
    ``score``, an evidence lower bound, for "sklearn"; the log-likelihood of the words under the
    posterior means for "numpy").
    """
    x = _count_matrix(counts, "counts")
    if min(x.shape) == 0:
        raise ValueError(f"counts must hold at least one document and one word, got shape {x.shape}")
    if x.sum() <= 0:
        raise ValueError(f"counts holds no words: all {x.shape[0]} documents are empty")
    alpha = 1.0 / n_topics if doc_topic_prior is None else float(doc_topic_prior)
    eta = 1.0 / n_topics if topic_word_prior is None else float(topic_word_prior)
    if method not in ("sklearn", "numpy"):
        raise ValueError(f"method must be 'sklearn' or 'numpy', got {method!r}")
    best, best_fit = None, -np.inf
    for i in range(max(1, n_init)):
        if method == "sklearn":
            from sklearn.decomposition import LatentDirichletAllocation

            lda = LatentDirichletAllocation(
                n_components=n_topics,
                doc_topic_prior=alpha,
                topic_word_prior=eta,
                learning_method="batch",
                max_iter=max_iter,
                random_state=seed + i,
            )
            lda.fit(x)
            lam = lda.components_.astype(np.float64)
            fit = lda.score(x) if n_init > 1 else 0.0
        else:
            lam, gamma = _batch_vb(x, n_topics, alpha, eta, max_iter, seed + i)
            fit = _words_loglik(x, gamma, lam) if n_init > 1 else 0.0
        if fit > best_fit:
            best, best_fit = lam, fit
    if best is None:  # every fit scored NaN or -inf
        raise FloatingPointError(
            f"none of the {max(1, n_init)} LDA fits has a finite score ({method}); check the counts for NaN, "
            "negative or empty documents"
        )
    return Dirichlet(concentration=best)


def _batch_vb(
    x: sparse.csr_matrix, k: int, alpha: float, eta: float, max_iter: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Batch mean-field VI for LDA: E-step (:func:`_e_step`), then ``lambda = eta + E[counts]``.

    Started like scikit-learn: ``lambda ~ Gamma(100, 1/100)`` entrywise, ``gamma = 1``.
    """
    rng = np.random.default_rng(seed)
    lam = rng.gamma(100.0, 0.01, size=(k, x.shape[1]))
    coo = x.tocoo()
    gamma = np.ones((x.shape[0], k))
    for _ in range(max_iter):
        elb = _exp_log_beta(lam)
        gamma, stats = _e_step(coo, elb, alpha, gamma, 20, 1e-3)
        new = eta + stats * elb
        change = float(np.abs(new - lam).mean())
        lam = new
        if change < 1e-3:
            break
    return lam, gamma


def _words_loglik(x: sparse.csr_matrix, gamma: np.ndarray, lam: np.ndarray) -> float:
    """``sum_{d,w} n_dw log sum_k E[theta_dk] E[beta_kw]``: how well the fit explains its own words."""
    coo = x.tocoo()
    theta = gamma / gamma.sum(1, keepdims=True)
    beta = lam / lam.sum(1, keepdims=True)
    return float((coo.data * np.log(np.einsum("nk,kn->n", theta[coo.row], beta[:, coo.col]))).sum())


# ----------------------------------------------------------------------- AMPS


@dataclass
class AMPSResult:
    """Outcome of :func:`amps_fuse`: the merged topics, each client's map local -> global,
    the objective ``J`` after each sweep, and timings (the ``LayerResult`` protocol)."""

    components: Dirichlet
    assignments: list[np.ndarray]
    objective: list[float]
    converged: bool
    seconds: float = 0.0

    @property
    def n_global(self) -> int:
        return len(self.components)


def _dirichlet_log_norm(alpha: np.ndarray) -> np.ndarray:
    """``A = sum_v lgamma(alpha_v) - lgamma(sum_v alpha_v)`` over the last axis."""
    return gammaln(alpha).sum(-1) - gammaln(alpha.sum(-1))


@validate_params(n_sweeps=POSITIVE_INT)
def amps_fuse(posteriors: Sequence[Dirichlet], prior: float, *, n_sweeps: int = 50) -> AMPSResult:
    """AMPS-style merge of topic posteriors (Campbell & How 2014), one global topic per local one.

    AMPS merges the clients' posteriors by the decentralised Bayes rule
    ``q(beta) ∝ p_0(beta)^{1-J} prod_j q_j(beta)``: for Dirichlets with prior ``Dir(beta_0)`` the
    merged topic g has ``lambda_g = sum_j lambda^j_{sigma_j(g)} - (J - 1) beta_0``, i.e. the prior
    plus all clients' expected counts. The symmetry (label switching) is resolved by the
    permutations ``sigma_j`` that maximise the merged posterior's normaliser
    ``J(sigma) = sum_g A(sum_j eta^j_{sigma_j(g)} - (J - 1) eta_0)`` (the log of the integral of
    the product of the aligned posteriors, up to terms that do not depend on ``sigma``). It is a
    sum over g, so with all clients but j fixed it is a linear assignment in ``sigma_j``: cost
    ``-A(rest_g + eta^j_l)``. Clients are added one at a time by that assignment, then swept in
    turn (coordinate ascent, the AMPS algorithm for the case where the objective separates) until
    no ``sigma_j`` changes. Needs equal numbers of topics, like the parametric KL-fusion (eq. 3),
    whose objective it resembles (section 5.3).
    """
    start = time.perf_counter()
    posteriors = list(posteriors)
    sizes = {len(q) for q in posteriors}
    if len(sizes) != 1:
        raise ValueError(f"AMPS needs equal numbers of topics, got {[len(q) for q in posteriors]}")
    if not prior > 0:
        raise ValueError(f"prior must be positive, got {prior}")
    lam = [q.concentration for q in posteriors]
    n_clients = len(lam)
    counts = [x - prior for x in lam]  # each client's expected counts (lambda minus the prior)
    sigma: list[np.ndarray | None] = [np.arange(len(lam[0]))] + [None] * (n_clients - 1)

    def assign(j: int) -> np.ndarray:
        rest = prior + sum(
            (counts[i][sigma[i]] for i in range(n_clients) if i != j and sigma[i] is not None), np.zeros_like(counts[j])
        )
        # merged topic g if client j's topic l joins it: rest_g + counts_l (its prior is in rest)
        cost = -_dirichlet_log_norm(rest[None, :, :] + counts[j][:, None, :])  # (L, G)
        rows, cols = linear_sum_assignment(cost)
        s = np.empty(len(rows), dtype=np.int64)
        s[cols] = rows  # sigma_j(g) = the local topic put in slot g
        return s

    for j in range(1, n_clients):
        sigma[j] = assign(j)
    placed = cast(list[np.ndarray], sigma)  # every client placed: sigma itself, no None left
    objective, converged = [], False
    for _ in range(n_sweeps):
        changed = False
        for j in range(n_clients):
            new = assign(j)
            changed |= not np.array_equal(new, placed[j])
            placed[j] = new
        merged = cast(np.ndarray, prior + sum(c[s] for c, s in zip(counts, placed)))
        objective.append(float(_dirichlet_log_norm(merged).sum()))
        if not changed:
            converged = True
            break
    assignments = [np.argsort(s) for s in placed]  # local l -> global g
    return AMPSResult(Dirichlet(concentration=merged), assignments, objective, converged, time.perf_counter() - start)


# ----------------------------------------------------------- held-out document completion


def split_documents(counts, share: float = 0.1, *, seed: int = 0) -> tuple[sparse.csr_matrix, sparse.csr_matrix]:
    """Split each document's word tokens at random: ``1 - share`` observed, ``share`` held out.

    Each token is held out independently with probability ``share`` (a binomial thinning of the
    counts), as in the paper's evaluation of "10% of the words in each test document given the
    remaining 90%". Returns (observed, held_out) counts with the input's shape.
    """
    if not 0 < share < 1:
        raise ValueError(f"share must lie in (0, 1), got {share}")
    x = sparse.csr_matrix(counts, dtype=np.float64)
    rng = np.random.default_rng(seed)
    held = x.copy()
    held.data = rng.binomial(x.data.astype(np.int64), share).astype(np.float64)
    observed = x - held
    observed.eliminate_zeros()
    held.eliminate_zeros()
    return observed.tocsr(), held.tocsr()


def topic_means(topics: Dirichlet) -> np.ndarray:
    """``E[beta_k] = lambda_k / sum_v lambda_kv``, shape (K, V)."""
    c = topics.concentration
    return c / c.sum(1, keepdims=True)


def _e_step(
    x: sparse.coo_matrix, exp_log_beta: np.ndarray, alpha: float, gamma: np.ndarray, max_iter: int, tol: float
) -> tuple[np.ndarray, np.ndarray]:
    """LDA's mean-field E-step for all documents at once, over the non-zero counts only.

    ``phi_dwk ∝ exp(E[log theta_dk]) exp(E[log beta_kw])`` and ``gamma_dk = alpha + sum_w n_dw
    phi_dwk`` (Blei et al. 2003, eqs. 6-7), iterated from ``gamma`` until its mean change is below
    ``tol``. Returns ``gamma`` (n_docs, K) and the expected topic-word counts
    ``sum_d n_dw phi_dwk`` divided by ``exp(E[log beta_kw])`` (K, V), which the M-step multiplies back.
    """
    eb = exp_log_beta[:, x.col].T  # (nnz, K)
    for _ in range(max_iter):
        exp_log_theta = np.exp(digamma(gamma) - digamma(gamma.sum(1, keepdims=True)))
        norm = np.einsum("nk,nk->n", exp_log_theta[x.row], eb) + 1e-300
        ratio = sparse.csr_matrix((x.data / norm, (x.row, x.col)), shape=x.shape)
        new = alpha + exp_log_theta * (ratio @ exp_log_beta.T)
        change = float(np.abs(new - gamma).mean())
        gamma = new
        if change < tol:
            break
    exp_log_theta = np.exp(digamma(gamma) - digamma(gamma.sum(1, keepdims=True)))
    norm = np.einsum("nk,nk->n", exp_log_theta[x.row], eb) + 1e-300
    ratio = sparse.csr_matrix((x.data / norm, (x.row, x.col)), shape=x.shape)
    return gamma, np.asarray((ratio.T @ exp_log_theta).T)


def _exp_log_beta(concentration: np.ndarray) -> np.ndarray:
    """``exp(E[log beta_kw])`` under ``Dir(lambda_k)``: ``exp(psi(lambda_kw) - psi(sum_v lambda_kv))``."""
    return np.exp(digamma(concentration) - digamma(concentration.sum(1, keepdims=True)))


def fold_in(
    observed, topics: Dirichlet, alpha: float | None = None, *, max_iter: int = 200, tol: float = 1e-6
) -> np.ndarray:
    """Variational posterior ``q(theta_d) = Dir(gamma_d)`` of each document given fixed topics.

    The mean-field E-step of LDA (Blei et al. 2003, eqs. 6-7; Hoffman et al. 2010) with the
    topics' posterior ``Dir(lambda_k)``: ``phi_dwk ∝ exp(E[log theta_dk] + E[log beta_kw])`` and
    ``gamma_dk = alpha + sum_w n_dw phi_dwk``, iterated until the mean change of ``gamma`` is below
    ``tol``; all documents at once, over the non-zero counts only. ``alpha`` defaults to 1 / K.
    Returns ``gamma``, shape (n_docs, K).
    """
    x = _count_matrix(observed, "observed").tocoo()
    k, n_words = topics.concentration.shape
    if x.shape[1] != n_words:
        raise ValueError(f"observed has {x.shape[1]} words (columns) but the topics have {n_words}")
    alpha = 1.0 / k if alpha is None else float(alpha)
    gamma = alpha + np.asarray(x.sum(1)).reshape(-1, 1) / k * np.ones((1, k))
    return _e_step(x, _exp_log_beta(topics.concentration), alpha, gamma, max_iter, tol)[0]


def completion_loglik(observed, held_out, topics: Dirichlet, alpha: float | None = None, **fold_in_options) -> float:
    """Held-out log-likelihood per word of document completion (section 5.3, Figure 4).

    ``theta_d`` is folded in from the observed words (:func:`fold_in`); each held-out word w of
    document d then has predictive probability ``p(w | d) = sum_k E[theta_dk] E[beta_kw]``
    (posterior means). Returns ``sum_{d,w} n'_dw log p(w | d) / sum_{d,w} n'_dw`` in nats over
    the held-out counts ``n'``.
    """
    obs, held = _count_matrix(observed, "observed"), _count_matrix(held_out, "held_out").tocoo()
    if obs.shape != held.shape:
        raise ValueError(
            f"observed and held_out must have the same shape (documents by words), got {obs.shape} and {held.shape}"
        )
    if obs.shape[1] != topics.concentration.shape[1]:
        raise ValueError(
            f"observed and held_out have {obs.shape[1]} words (columns) but the topics have "
            f"{topics.concentration.shape[1]}"
        )
    gamma = fold_in(obs, topics, alpha, **fold_in_options)
    theta = gamma / gamma.sum(1, keepdims=True)
    if held.sum() <= 0:
        raise ValueError("no held-out words")
    beta = topic_means(topics)
    p = np.einsum("nk,kn->n", theta[held.row], beta[:, held.col])
    return float((held.data * np.log(p)).sum() / held.data.sum())


# ------------------------------------------------------------------------ choosing lambda


@dataclass
class RegSelection:
    """Outcome of :func:`select_reg`: the chosen ``reg``, and for each candidate the fused
    result, its number of topics and the clients' total held-out log-likelihood per word."""

    reg: float
    regs: list[float]
    scores: list[float]
    n_topics: list[int]
    results: list[KLFusionResult] = field(repr=False)

    @property
    def best(self) -> KLFusionResult:
        return self.results[self.regs.index(self.reg)]


def select_reg(
    posteriors: Sequence[Dirichlet],
    validation: Sequence,
    regs: Sequence[float],
    *,
    alpha: float | None = None,
    share: float = 0.1,
    seed: int = 0,
    **fuse_options,
) -> RegSelection:
    """Choose ``lambda`` of eq. 9 by the clients' own held-out documents, no test data.

    The server fuses at each candidate ``reg`` (:func:`kl_fuse`, heterogeneous) and sends the
    candidates back; client j scores each by the document-completion log-likelihood of its own
    validation documents (documents it kept out of its local fit, split by
    :func:`split_documents`), and returns one number per candidate: the sum of its held-out words'
    log-likelihoods. The chosen ``reg`` maximises the total per word over all clients; ties go to
    the larger ``reg`` (fewer topics). No document leaves a client.
    """
    posteriors, validation, regs = list(posteriors), list(validation), [float(r) for r in regs]
    if len(posteriors) != len(validation):
        raise ValueError(
            f"{len(posteriors)} posteriors but {len(validation)} validation sets; each client needs its own "
            "validation documents"
        )
    if not regs:
        raise ValueError("regs is empty; give at least one candidate reg")
    results, scores, sizes = [], [], []
    splits = [split_documents(v, share, seed=seed + j) for j, v in enumerate(validation)]
    for reg in regs:
        res = kl_fuse(posteriors, mode="heterogeneous", reg=reg, **fuse_options)
        total, words = 0.0, 0.0
        for obs, held in splits:
            n = float(held.sum())
            total += completion_loglik(obs, held, cast(Dirichlet, res.components), alpha) * n  # Dirichlets in, out
            words += n
        results.append(res)
        scores.append(total / words)
        sizes.append(res.n_global)
    best = max(range(len(regs)), key=lambda i: (round(scores[i], 6), regs[i]))
    return RegSelection(regs[best], regs, scores, sizes, results)


# --------------------------------------------------------------------------- in words


def top_words(topics: Dirichlet, vocabulary: Sequence[str], n: int = 8) -> list[list[str]]:
    """The ``n`` words of largest posterior mean in each topic."""
    words = np.asarray(vocabulary)
    order = np.argsort(-topics.concentration, axis=1, kind="stable")[:, :n]
    return [words[o].tolist() for o in order]


def topic_sources(
    assignments: Sequence[np.ndarray], n_global: int, names: Sequence[str] | None = None
) -> list[list[str]]:
    """For each global topic, the clients with a local topic assigned to it (``names[j]`` or j)."""
    names = [str(j) for j in range(len(assignments))] if names is None else list(names)
    out: list[list[str]] = [[] for _ in range(n_global)]
    for j, a in enumerate(assignments):
        for g in np.unique(a):
            out[int(g)].append(names[j])
    return out


def topics_table(
    topics: Dirichlet,
    vocabulary: Sequence[str],
    assignments: Sequence[np.ndarray] | None = None,
    names: Sequence[str] | None = None,
    *,
    n_words: int = 8,
) -> str:
    """Plain-text table: one row per topic, its top words and (given ``assignments``) its sources,
    ordered by the number of sources."""
    words = top_words(topics, vocabulary, n_words)
    sources = topic_sources(assignments, len(topics), names) if assignments is not None else [[] for _ in words]
    order = sorted(range(len(words)), key=lambda g: (-len(sources[g]), g))
    rows = [f"{'topic':>5}  {'top words':<{9 * n_words}}  sources"]
    for g in order:
        src = f"{len(sources[g])}: {', '.join(sources[g])}" if assignments is not None else ""
        rows.append(f"{g:>5}  {' '.join(words[g]):<{9 * n_words}}  {src}")
    return "\n".join(rows)
