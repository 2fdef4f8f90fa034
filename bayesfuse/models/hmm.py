"""Hidden Markov models with Gaussian emissions, their states fused across clients
(Claici et al. 2020, section 5.2, Table 1).

Each client fits a Bayesian HMM with "sticky" transitions (a Dirichlet prior on each row of the
transition matrix with extra mass on staying, Fox et al. 2008) and Normal-Wishart posteriors of
each state's emission mean and precision, by mean-field VI. KL-fusion
(:func:`~bayesfuse.inference.klfusion.kl_fuse`, Normal-Wishart family, eq. 9) matches the
clients' states and averages their natural parameters (eq. 4); SPAHM (Yurochkin et al. 2019)
matches the states' posterior means alone (the BBP matching engine with the exact marginal
cost). Each client's decoded state sequence is then relabelled with the global states and
compared with the true labels by the Rand index and the adjusted mutual information.

* :func:`gaussian_hmm_model`, :func:`simulate_hmm_federation`: the HMM in Pyro, and clients whose
  sequences visit subsets of global states (ground truth for the tests);
* :func:`fit_local_hmm`: local VI by hmmlearn's ``VariationalGaussianHMM`` (optional dependency,
  ``pip install bayesfuse[apps]``);
* :func:`spahm_fuse`, :func:`relabel`, :func:`segmentation_scores`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bayesfuse._validation import finite_array
from bayesfuse.constraints import NON_NEGATIVE, POSITIVE_INT, Interval, check, validate_params
from bayesfuse.inference.expfam import NormalWishart
from bayesfuse.models.mixture import random_covariances

__all__ = [
    "HMMFederation",
    "LocalHMM",
    "gaussian_hmm_model",
    "simulate_hmm_federation",
    "fit_local_hmm",
    "spahm_fuse",
    "relabel",
    "segmentation_scores",
]


def gaussian_hmm_model(length: int, start, transition, means, covariances):
    """A Gaussian HMM's generative process in Pyro: ``z_1 ~ Cat(start)``,
    ``z_t | z_{t-1} ~ Cat(transition[z_{t-1}])``, ``x_t | z_t ~ N(means[z_t], covariances[z_t])``.
    Returns (states (T,), observations (T, D)) as tensors."""
    import pyro
    import pyro.distributions as dist
    import torch

    start, transition = torch.as_tensor(start, dtype=torch.float64), torch.as_tensor(transition, dtype=torch.float64)
    loc = torch.as_tensor(means, dtype=torch.float64)
    scale_tril = torch.linalg.cholesky(torch.as_tensor(covariances, dtype=torch.float64))
    states = []
    probs = start
    for t in pyro.markov(range(length)):
        z = pyro.sample(f"z_{t}", dist.Categorical(probs))
        states.append(z)
        probs = transition[z]
    z = torch.stack(states)
    with pyro.plate("time", length):  # the emissions are independent given the states
        x = pyro.sample("x", dist.MultivariateNormal(loc[z], scale_tril=scale_tril[z]))
    return z, x


@dataclass
class HMMFederation:
    """Clients' sequences from one set of Gaussian states.

    ``sequences[j]`` (T, D); ``states[j]`` (T,) the true global state of each step;
    ``means`` (K, D), ``covariances`` (K, D, D); ``client_states[j]`` the states client j visits.
    """

    sequences: list[np.ndarray]
    states: list[np.ndarray]
    means: np.ndarray
    covariances: np.ndarray
    client_states: list[np.ndarray]


def simulate_hmm_federation(
    n_clients: int = 3,
    n_states: int = 4,
    dim: int = 2,
    *,
    states_per_client: int | None = None,
    length: int = 300,
    stay: float = 0.95,
    separation: float = 3.0,
    scale: float = 0.5,
    seed: int = 0,
) -> HMMFederation:
    """Global states with means ``N(0, separation^2 I)`` and random covariances of axis scales
    ``scale * U(0.5, 1)``; client j visits a random subset of ``states_per_client`` (default all),
    staying in a state with probability ``stay`` and otherwise moving to another of its states
    uniformly, for ``length`` steps (:func:`gaussian_hmm_model`). The torch RNG is forked."""
    import torch

    m = n_states if states_per_client is None else states_per_client
    if not 1 <= m <= n_states:
        raise ValueError(f"states_per_client must lie in 1..{n_states}, got {m}")
    if not 0 <= stay <= 1:
        raise ValueError(f"stay must lie in [0, 1], got {stay}")
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, separation, size=(n_states, dim))
    covs = random_covariances(rng, n_states, dim, scale, low=0.5)
    sequences, states, subsets = [], [], []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(n_clients):
            sub = np.sort(rng.choice(n_states, m, replace=False))
            trans = np.full((m, m), (1 - stay) / max(m - 1, 1)) if m > 1 else np.ones((1, 1))
            if m > 1:
                np.fill_diagonal(trans, stay)
            z, x = gaussian_hmm_model(length, np.full(m, 1 / m), trans, means[sub], covs[sub])
            sequences.append(x.numpy())
            states.append(sub[z.numpy()])
            subsets.append(sub)
    return HMMFederation(sequences, states, means, covs, subsets)


@dataclass
class LocalHMM:
    """A client's fitted HMM: its used states' Normal-Wishart posteriors and its decoded sequence.

    ``labels[t]`` indexes ``states`` (the Viterbi path of the variational model, steps of dropped
    states given to the kept state whose posterior mean is nearest their observation).
    """

    states: NormalWishart
    labels: np.ndarray
    occupancy: np.ndarray


@validate_params(n_states=POSITIVE_INT, stickiness=NON_NEGATIVE, n_iter=POSITIVE_INT)
def fit_local_hmm(
    x: np.ndarray,
    n_states: int,
    *,
    stickiness: float = 50.0,
    min_share: float = 0.02,
    n_iter: int = 100,
    n_init: int = 1,
    seed: int = 0,
) -> LocalHMM:
    """Mean-field VI of a sticky Bayesian HMM with Normal-Wishart emission posteriors on ``x`` (T, D).

    hmmlearn's ``VariationalGaussianHMM`` (full covariances) keeps, per state, ``means_posterior_``
    (m), ``beta_posterior_`` (kappa), ``degrees_of_freedom_posterior_`` (nu) and
    ``scale_posterior_``, the inverse of the Wishart scale (its ``covars_`` are
    ``scale_posterior_ / nu``), so the :class:`NormalWishart` scale is ``W = scale_posterior_^{-1}``
    (Bishop 2006, eqs. 10.59-10.63). The transition prior is ``Dir(1 + stickiness e_k)`` on row k
    (the sticky HDP-HMM's ``kappa``, truncated to ``n_states``). States the Viterbi path uses for
    less than ``min_share`` of the steps are dropped (the truncation's spares); ``min_share`` lies in
    ``[0, 1 / n_states]``, so that the most used state, whose share is at least ``1 / n_states``, is
    kept. ``stickiness`` is non-negative. ``n_init`` fits
    from seeds ``seed, seed + 1, ...`` keep the one of largest variational lower bound.
    """
    try:
        from hmmlearn.vhmm import VariationalGaussianHMM
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "fit_local_hmm needs hmmlearn: pip install 'bayesfuse[apps]' (or pip install hmmlearn)"
        ) from err
    min_share = check(
        "min_share",
        Interval(float, 0.0, 1.0 / n_states, "both", why="1 / n_states: above it every state may fall short"),
        min_share,
    )
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2 * n_states or x.shape[1] < 1:
        raise ValueError(f"x must be (T, D) with T >= 2 * n_states and D >= 1, got shape {x.shape}")
    x = finite_array(x, "x")
    prior = np.ones((n_states, n_states)) + stickiness * np.eye(n_states)
    best, best_bound = None, -np.inf
    for i in range(max(1, n_init)):
        model = VariationalGaussianHMM(
            n_components=n_states,
            covariance_type="full",
            transmat_prior=prior,
            n_iter=n_iter,
            tol=1e-3,
            random_state=seed + i,
            implementation="scaling",
        )
        model.fit(x)
        bound = float(model.monitor_.history[-1])
        if bound > best_bound:
            best, best_bound = model, bound
    if best is None:  # every fit's lower bound was NaN or -inf
        raise FloatingPointError(
            f"none of the {max(1, n_init)} HMM fits has a finite lower bound; check the series for NaN or "
            "constant stretches"
        )
    path = best.predict(x)
    share = np.bincount(path, minlength=n_states) / len(x)
    keep = np.flatnonzero(share >= min_share)
    dof = np.asarray(best.dof_posterior_, dtype=np.float64)[keep]
    scale = np.linalg.inv(best.scale_posterior_[keep])
    states = NormalWishart(
        mean=best.means_posterior_[keep],
        kappa=best.beta_posterior_[keep],
        dof=dof,
        scale=0.5 * (scale + np.swapaxes(scale, 1, 2)),
    )
    index = np.full(n_states, -1)
    index[keep] = np.arange(len(keep))
    labels = index[path]
    lost = labels < 0
    if lost.any():
        d = ((x[lost, None, :] - states.mean[None]) ** 2).sum(-1)
        labels[lost] = d.argmin(1)
    return LocalHMM(states, labels, np.bincount(labels, minlength=len(keep)) / len(x))


def spahm_fuse(posteriors: Sequence[NormalWishart], *, seed: int = 0, **match_options):
    """SPAHM (Yurochkin et al. 2019): match the states by their posterior means alone.

    The BBP matching engine (:func:`~bayesfuse.inference.matching.match_neurons`) with the exact
    marginal cost (``cost="marginal"``) and its empirical-Bayes hyper-parameters; covariances and
    the posteriors' spreads are not used. Returns its ``MatchResult`` (``assignments``, ``mean``).
    """
    from bayesfuse.inference.matching import match_neurons

    return match_neurons([q.mean for q in posteriors], cost="marginal", seed=seed, **match_options)


def relabel(labels: Sequence[np.ndarray], assignments: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each client's decoded local states mapped to global states: ``assignments[j][labels[j]]``."""
    labels, assignments = list(labels), list(assignments)
    if len(labels) != len(assignments):
        raise ValueError(
            f"{len(labels)} label sequences but {len(assignments)} assignments; need one of each per client"
        )
    out = []
    for j, (z, a) in enumerate(zip(labels, assignments)):
        z, a = np.asarray(z), np.asarray(a)
        if z.size and not np.issubdtype(z.dtype, np.integer):
            raise TypeError(f"labels[{j}] must be integers, got dtype {z.dtype}")
        if z.size and (z.min() < 0 or z.max() >= len(a)):
            raise ValueError(
                f"labels[{j}] must lie in 0..{len(a) - 1} (the local states assignments[{j}] maps), "
                f"got range {z.min()}..{z.max()}"
            )
        out.append(a[z])
    return out


def segmentation_scores(truth: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> dict[str, float]:
    """Rand index and adjusted mutual information (Vinh et al. 2010) of the global labels of all
    clients' steps together against the true labels, as the paper's Table 1."""
    from sklearn.metrics import adjusted_mutual_info_score, rand_score

    truth, labels = list(truth), list(labels)
    if len(truth) != len(labels):
        raise ValueError(f"{len(truth)} true sequences but {len(labels)} label sequences; need one of each per client")
    if not truth:
        raise ValueError("truth and labels are empty; need at least one client's sequence")
    for j, (a, b) in enumerate(zip(truth, labels)):
        if np.shape(a) != np.shape(b):
            raise ValueError(
                f"truth[{j}] has shape {np.shape(a)} but labels[{j}] has {np.shape(b)}; need one label per step"
            )
    t, z = np.concatenate(truth), np.concatenate(labels)
    return {"rand": float(rand_score(t, z)), "ami": float(adjusted_mutual_info_score(t, z))}
