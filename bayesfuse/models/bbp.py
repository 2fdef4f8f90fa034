"""The Beta-Bernoulli process model of neurons (PFNM eq. 1), stated in Pyro.

Generative story (Yurochkin et al., ICML 2019, section 3; NAFI eq. 1-2):

1. Global atoms ``theta_i ~ N(mu0, sigma0^2 I)``, i = 1, 2, ...
2. Atom weights from a Beta process with mass ``gamma0``, by stick-breaking
   (Teh, Gorur & Ghahramani 2007): ``nu_t ~ Beta(gamma0, 1)``, ``pi_i = prod_{t<=i} nu_t``,
   truncated at T sticks.
3. Client j selects atom i with probability ``pi_i``: ``z_ji ~ Bernoulli(pi_i)``.
4. Client j observes its selected atoms in a uniformly random order, each with noise:
   ``v_jl ~ N(theta_{a_j(l)}, sigma_j^2 I)``.

:func:`federation_model` is that story; :func:`simulate_federation` runs it under
``poutine.trace`` and returns the neurons with their ground truth. :func:`collapsed_model`
integrates the sticks out: the selection matrix then follows the Indian buffet process in its
exchangeable closed form (:class:`IBPSelection`), which is what :func:`log_joint` scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, cast

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from torch.distributions import constraints

__all__ = [
    "Federation",
    "IBPSelection",
    "UniformPermutation",
    "collapsed_model",
    "default_truncation",
    "federation_model",
    "log_joint",
    "simulate_federation",
]


class UniformPermutation(dist.TorchDistribution):
    """Uniform distribution over the permutations of ``0..n-1``; ``log_prob = -log n!``."""

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    has_enumerate_support = False

    def __init__(self, n: int, validate_args=None):
        self.n = int(n)
        super().__init__(torch.Size(), torch.Size([self.n]), validate_args=validate_args)

    def sample(self, sample_shape=torch.Size()):
        if sample_shape != torch.Size():
            return torch.stack([torch.randperm(self.n) for _ in range(int(np.prod(sample_shape)))]).reshape(
                *sample_shape, self.n
            )
        return torch.randperm(self.n)

    def log_prob(self, value):
        value = torch.as_tensor(value)
        ok = torch.equal(torch.sort(value, dim=-1).values, torch.arange(self.n).expand_as(value))
        return torch.tensor(-math.lgamma(self.n + 1) if ok else -math.inf, dtype=torch.float64)


class IBPSelection(dist.TorchDistribution):
    """Indian buffet process over a (J, K) binary matrix with labelled, unordered atoms.

    With every column non-empty and ``m_k`` the number of clients using atom k,

    .. math::

        \\log P(Z) = K \\log\\gamma_0 - \\log K! - \\gamma_0 H_J
            + \\sum_{k=1}^K \\log\\frac{(m_k - 1)!\\,(J - m_k)!}{J!},

    ``H_J = sum_{j<=J} 1/j``: the left-ordered-form probability of Griffiths & Ghahramani
    (2011, eq. 14) spread evenly over the ``K! / prod_h K_h!`` labellings of its columns. It is
    the law of the Beta-Bernoulli process of :func:`federation_model` with the sticks
    integrated out, its atoms relabelled at random. A matrix with an empty column has
    probability 0. ``sample`` runs the buffet: customer j takes dish k with probability
    ``m_k / j`` and ``Poisson(gamma0 / j)`` new dishes; columns are then shuffled.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.boolean, 2)

    def __init__(self, gamma0: float, n_clients: int, n_atoms: int | None = None, validate_args=None):
        self.gamma0 = float(gamma0)
        self.n_clients = int(n_clients)
        self.n_atoms = n_atoms
        shape = torch.Size([self.n_clients, n_atoms]) if n_atoms is not None else torch.Size([self.n_clients, 0])
        super().__init__(torch.Size(), shape, validate_args=validate_args)

    def sample(self, sample_shape=torch.Size()):
        counts: list[int] = []
        rows: list[list[int]] = []
        for j in range(1, self.n_clients + 1):
            taken = [k for k, m in enumerate(counts) if torch.rand(()) < m / j]
            n_new = int(torch.poisson(torch.tensor(self.gamma0 / j)))
            taken += list(range(len(counts), len(counts) + n_new))
            counts += [0] * n_new
            for k in taken:
                counts[k] += 1
            rows.append(taken)
        z = torch.zeros(self.n_clients, len(counts))
        for j, taken in enumerate(rows):
            z[j, taken] = 1.0
        return z[:, torch.randperm(len(counts))]

    def log_prob(self, value):
        z = torch.as_tensor(value, dtype=torch.float64)
        m = z.sum(0)
        if (m == 0).any():
            return torch.tensor(-math.inf, dtype=torch.float64)
        J, K = self.n_clients, z.shape[1]
        harmonic = sum(1.0 / j for j in range(1, J + 1))
        per_atom = torch.lgamma(m) + torch.lgamma(J - m + 1) - math.lgamma(J + 1)
        return K * math.log(self.gamma0) - math.lgamma(K + 1) - self.gamma0 * harmonic + per_atom.sum()


def _noise_scales(noise_var, n_clients: int) -> list[float]:
    v = np.broadcast_to(np.asarray(noise_var, dtype=np.float64), (n_clients,))
    if not np.isfinite(v).all() or (v <= 0).any():
        raise ValueError(f"noise_var must be positive and finite, got {noise_var}")
    return [float(np.sqrt(x)) for x in v]


def _check_prior(prior_var: float, gamma0: float) -> None:
    if not np.isfinite(prior_var) or prior_var <= 0:
        raise ValueError(f"prior_var must be positive, got {prior_var}")
    if not np.isfinite(gamma0) or gamma0 <= 0:
        raise ValueError(f"gamma0 must be positive, got {gamma0}")


def default_truncation(gamma0: float, tail: float = 1e-3) -> int:
    """Sticks T such that the expected mass beyond T per client, ``(1+gamma0) r^(T+1)``, is below ``tail``.

    ``r = gamma0 / (1 + gamma0)`` is the mean of each ``Beta(gamma0, 1)`` stick.
    """
    r = gamma0 / (1.0 + gamma0)
    return max(1, int(math.ceil(math.log(tail / (1.0 + gamma0)) / math.log(r))) - 1)


def _emit_neurons(atoms: torch.Tensor, selected: Sequence[torch.Tensor], scales: Sequence[float]) -> list[torch.Tensor]:
    """Step 4 for every client: a random order of its atoms, plus Gaussian noise."""
    neurons = []
    for j, sel in enumerate(selected):
        order = pyro.sample(f"order_{j}", UniformPermutation(len(sel)))
        mean = atoms[sel[order]]
        neurons.append(pyro.sample(f"neurons_{j}", dist.Normal(mean, scales[j]).to_event(2)))
    return neurons


def federation_model(
    n_clients: int,
    dim: int,
    *,
    gamma0: float = 1.0,
    prior_var: float = 1.0,
    noise_var: float | Sequence[float] = 0.01,
    prior_mean: float = 0.0,
    truncation: int | None = None,
) -> list[torch.Tensor]:
    """The generative model with truncated stick-breaking weights (module docstring, steps 1-4).

    Sites: ``nu`` (T,), ``atoms`` (T, D), ``z`` (J, T), ``order_j`` and ``neurons_j`` (L_j, D).
    """
    _check_prior(prior_var, gamma0)
    scales = _noise_scales(noise_var, n_clients)
    T = truncation or default_truncation(gamma0)
    f64 = torch.float64
    with pyro.plate("sticks", T):
        nu = pyro.sample("nu", dist.Beta(torch.tensor(gamma0, dtype=f64), torch.tensor(1.0, dtype=f64)))
        atoms = pyro.sample(
            "atoms",
            dist.Normal(torch.tensor(prior_mean, dtype=f64), math.sqrt(prior_var)).expand([T, dim]).to_event(1),
        )
    pi = torch.cumprod(nu, 0)
    with pyro.plate("clients", n_clients):
        z = pyro.sample("z", dist.Bernoulli(pi).to_event(1))
    selected = [torch.nonzero(z[j] > 0)[:, 0] for j in range(n_clients)]
    return _emit_neurons(atoms, selected, scales)


def collapsed_model(
    n_neurons: Sequence[int],
    dim: int,
    n_atoms: int,
    *,
    gamma0: float = 1.0,
    prior_var: float = 1.0,
    noise_var: float | Sequence[float] = 0.01,
    prior_mean: float | np.ndarray = 0.0,
    selection: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The same model with the sticks integrated out, for scoring (see :func:`log_joint`).

    Sites: ``atoms`` (K, D), ``selection`` (J, K) from :class:`IBPSelection`, then ``order_j``
    and ``neurons_j`` as in :func:`federation_model`. ``selection`` must be passed (or
    conditioned on) because the atoms' number K is fixed by the caller.
    """
    _check_prior(prior_var, gamma0)
    J = len(n_neurons)
    scales = _noise_scales(noise_var, J)
    mu0 = torch.as_tensor(np.broadcast_to(np.asarray(prior_mean, dtype=np.float64), (dim,)).copy())
    atoms = pyro.sample("atoms", dist.Normal(mu0, math.sqrt(prior_var)).expand([n_atoms, dim]).to_event(2))
    z = pyro.sample("selection", IBPSelection(gamma0, J, n_atoms), obs=selection)
    selected = [torch.nonzero(z[j] > 0)[:, 0] for j in range(J)]
    for j, sel in enumerate(selected):
        if len(sel) != n_neurons[j]:
            raise ValueError(f"client {j} selects {len(sel)} atoms but has {n_neurons[j]} neurons")
    return _emit_neurons(atoms, selected, scales)


@dataclass
class Federation:
    """A simulated federation with its ground truth.

    Attributes
    ----------
    layers : list of (L_j, D) arrays
        Each client's observed neurons.
    assignments : list of (L_j,) int arrays
        True atom of each local neuron (atoms numbered 0..K-1 over the atoms in use).
    atoms : (K, D) array
        The atoms in use.
    hyper : dict
    """

    layers: list[np.ndarray]
    assignments: list[np.ndarray]
    atoms: np.ndarray
    hyper: dict

    @property
    def n_atoms(self) -> int:
        return self.atoms.shape[0]


def simulate_federation(
    n_clients: int,
    dim: int,
    *,
    gamma0: float = 1.0,
    prior_var: float = 1.0,
    noise_var: float | Sequence[float] = 0.01,
    prior_mean: float = 0.0,
    seed: int = 0,
    truncation: int | None = None,
    max_tries: int = 100,
) -> Federation:
    """Draw a federation from :func:`federation_model` (run under ``poutine.trace``).

    Draws in which some client selects no atom are rejected (a client with no neurons is not
    a client); for ``gamma0 >= 2`` that almost never happens. The caller's torch RNG state is
    left untouched.

    Examples
    --------
    >>> fed = simulate_federation(3, 5, gamma0=4.0, seed=1)
    >>> len(fed.layers), fed.layers[0].shape[1]
    (3, 5)
    """
    if n_clients < 1 or dim < 1:
        raise ValueError("n_clients and dim must be positive")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(max_tries):
            trace = poutine.trace(federation_model).get_trace(
                n_clients,
                dim,
                gamma0=gamma0,
                prior_var=prior_var,
                noise_var=noise_var,
                prior_mean=prior_mean,
                truncation=truncation,
            )
            z = cast(torch.Tensor, trace.nodes["z"]["value"])  # a sample site's value
            if (z.sum(1) > 0).all():
                break
        else:
            raise RuntimeError(f"every draw in {max_tries} left a client without neurons; raise gamma0")
    atoms = cast(torch.Tensor, trace.nodes["atoms"]["value"]).numpy()
    used = torch.nonzero(z.sum(0) > 0)[:, 0].numpy()
    relabel = np.full(z.shape[1], -1)
    relabel[used] = np.arange(len(used))
    layers, assignments = [], []
    for j in range(n_clients):
        sel = torch.nonzero(z[j] > 0)[:, 0]
        order = cast(torch.Tensor, trace.nodes[f"order_{j}"]["value"])
        assignments.append(relabel[sel[order].numpy()])
        layers.append(cast(torch.Tensor, trace.nodes[f"neurons_{j}"]["value"]).numpy())
    hyper = dict(
        gamma0=gamma0,
        prior_var=prior_var,
        noise_var=noise_var,
        prior_mean=prior_mean,
        seed=seed,
        truncation=truncation or default_truncation(gamma0),
    )
    return Federation(layers, assignments, atoms[used], hyper)


def log_joint(
    layers: Sequence[np.ndarray],
    assignments: Sequence[np.ndarray],
    atoms: np.ndarray,
    *,
    gamma0: float = 1.0,
    prior_var: float = 1.0,
    noise_var: float | Sequence[float] = 0.01,
    prior_mean: float | np.ndarray = 0.0,
) -> float:
    """``log p(neurons, assignments, atoms)`` by conditioning :func:`collapsed_model` and summing its trace.

    The assignments are read as labelled atoms: ``selection[j, i] = 1`` iff some neuron of
    client j is assigned atom i, and ``order_j`` is the rank of each neuron's atom among the
    atoms client j selects. The value is

    .. math::

        \\sum_i \\log N(\\theta_i; \\mu_0, \\sigma_0^2 I) + \\log P_{\\mathrm{IBP}}(Z)
        - \\sum_j \\log L_j! + \\sum_{j,l} \\log N(v_{jl}; \\theta_{a_j(l)}, \\sigma_j^2 I).

    Summing over the K! labellings of the atoms gives the joint of the unlabelled partition
    that :func:`bayesfuse.inference.matching.log_marginal_posterior` scores (with atoms
    integrated out).
    """
    atoms_t = torch.as_tensor(np.asarray(atoms, dtype=np.float64))
    K, D = atoms_t.shape
    J = len(layers)
    if len(assignments) != J:
        raise ValueError(f"need one assignment array per client ({J}), got {len(assignments)}")
    z = torch.zeros(J, K, dtype=torch.float64)
    data = {"atoms": atoms_t}
    for j, (v, a) in enumerate(zip(layers, assignments)):
        a = np.asarray(a, dtype=np.int64)
        if a.shape != (len(v),) or len(np.unique(a)) != len(a) or a.min() < 0 or a.max() >= K:
            raise ValueError(f"client {j}: assignments must give each neuron a distinct atom in 0..{K - 1}")
        z[j, a] = 1.0
        data[f"order_{j}"] = torch.as_tensor(np.argsort(np.argsort(a)))  # rank of a[l] among sorted atoms
        data[f"neurons_{j}"] = torch.as_tensor(np.asarray(v, dtype=np.float64))
    conditioned = poutine.condition(collapsed_model, data=data)
    trace = poutine.trace(conditioned).get_trace(
        [len(v) for v in layers],
        D,
        K,
        gamma0=gamma0,
        prior_var=prior_var,
        noise_var=noise_var,
        prior_mean=prior_mean,
        selection=z,
    )
    return float(trace.log_prob_sum())


@dataclass
class DeepFederation:
    """A simulated federation of deep MLPs with its ground truth.

    Attributes
    ----------
    states : list of dict
        Client j's state_dict in :class:`~bayesfuse.nets.mlp.MLP` layout
        (``layers.{i}.weight`` of shape ``[out, in]``, ``layers.{i}.bias``), NumPy float64.
    assignments : list of list of (L_jn,) int arrays
        ``assignments[n][j]``: true atom of each of client j's units in hidden layer n.
    atoms : list of arrays
        ``atoms[n]``: (K_n, K_{n-1} + 1) incoming weights and bias of hidden layer n's atoms
        (K_0 the input size); the last entry is the (K, K_top + 1) output layer.
    """

    states: list[dict]
    assignments: list[list[np.ndarray]]
    atoms: list[np.ndarray]
    hyper: dict


def simulate_deep_federation(
    n_clients: int,
    in_features: int,
    n_hidden: int,
    n_classes: int,
    *,
    gamma0: float = 1.0,
    prior_var: float = 1.0,
    noise_var: float = 0.01,
    seed: int = 0,
) -> DeepFederation:
    """Deep MLPs whose every hidden layer is a BBP draw (PFNM supplement section 2's model).

    Hidden layer n's units follow :func:`federation_model`: the IBP (mass ``gamma0``) picks the
    atoms each client uses, in a uniformly random order. An atom of layer n holds one weight
    from every atom of layer n-1 (plus a bias), ``~ N(0, prior_var)``; client j's unit of atom
    i keeps the weights from the atoms it has below, in its own order, plus ``N(0, noise_var)``
    noise. The output layer (not permuted) holds one weight per atom of the top layer.
    """
    if n_hidden < 1:
        raise ValueError("n_hidden must be >= 1")
    rng = np.random.default_rng(seed)
    assignments: list[list[np.ndarray]] = []
    atoms: list[np.ndarray] = []
    prev_assign = [np.arange(in_features)] * n_clients
    prev_size = in_features
    sd = np.sqrt(prior_var)
    noise = np.sqrt(noise_var)
    states: list[dict] = [{} for _ in range(n_clients)]
    for n in range(n_hidden):
        structure = simulate_federation(n_clients, 1, gamma0=gamma0, seed=seed * 1009 + n)
        theta = rng.normal(0.0, sd, size=(structure.n_atoms, prev_size + 1))
        for j, a in enumerate(structure.assignments):
            w = theta[a][:, prev_assign[j]] + rng.normal(0.0, noise, size=(len(a), len(prev_assign[j])))
            b = theta[a, -1] + rng.normal(0.0, noise, size=len(a))
            states[j][f"layers.{n}.weight"], states[j][f"layers.{n}.bias"] = w, b
        assignments.append(structure.assignments)
        atoms.append(theta)
        prev_assign, prev_size = structure.assignments, structure.n_atoms
    theta = rng.normal(0.0, sd, size=(n_classes, prev_size + 1))
    for j in range(n_clients):
        states[j][f"layers.{n_hidden}.weight"] = theta[:, prev_assign[j]] + rng.normal(
            0.0, noise, size=(n_classes, len(prev_assign[j]))
        )
        states[j][f"layers.{n_hidden}.bias"] = theta[:, -1] + rng.normal(0.0, noise, size=n_classes)
    atoms.append(theta)
    hyper = dict(gamma0=gamma0, prior_var=prior_var, noise_var=noise_var, seed=seed)
    return DeepFederation(states, assignments, atoms, hyper)
