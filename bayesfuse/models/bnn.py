"""Bayesian MLP with a node-wise horseshoe prior (or a Gaussian one), in Pyro, with a mean-field Gaussian guide.

Model (Ghosh, Yao & Doshi-Velez, JMLR 2019, section 3; one hidden layer of H units):

.. math::

    \\tau \\sim C^+(0, b_g), \\quad \\lambda_k \\sim C^+(0, 1), \\quad
    \\tilde w_k \\sim N(0, I), \\quad \\tilde b_k \\sim N(0, 1), \\quad
    W_2 \\sim N(0, s^2), \\; b_2 \\sim N(0, s^2),

    h_k(x) = \\mathrm{relu}\\big(\\tau \\lambda_k (\\tilde w_k^\\top x + \\tilde b_k)\\big), \\qquad
    y \\mid x \\sim \\mathrm{Categorical}(\\mathrm{softmax}(W_2 h(x) + b_2)).

Deeper networks (``hidden=(H1, H2, ...)``) repeat the hidden layer: layer l has its own global
scale ``tau_l ~ C+(0, b_g)``, unit scales ``lambda_{l,k} ~ C+(0, 1)`` and standard normal
``w~_l``, ``b~_l``, and feeds ``h_{l-1}`` (``h_0 = x``) to ``h_l = relu(tau_l lambda_l (w~_l h_{l-1} + b~_l))``
(the node-wise horseshoe of Ghosh et al. on every hidden layer).

The non-centred form (incoming weights ``tau * lambda_k * w~_k``) lets the unit scale
``tau * lambda_k`` switch a whole unit off. The guide is mean-field: Gaussian on ``w~``, ``b~``,
``W_2``, ``b_2`` and on ``log tau``, ``log lambda`` (log-normal scales), i.e. Gaussian in the
unconstrained space where the guide's parameters live. Guide parameters are ordinary
``nn.Parameter``s of the module (nothing goes through Pyro's global parameter store), so many
networks can be trained in one process.

With ``prior="gaussian"`` the scales are fixed instead, ``tau_l = s_h`` (``global_scale``) and
``lambda_{l,k} = 1``, so that every hidden weight and bias has the Gaussian prior

.. math::

    w_{l,kd} = s_h \\tilde w_{l,kd} \\sim N(0, s_h^2), \\qquad b_{l,k} \\sim N(0, s_h^2),

the mean-field Gaussian BNN of Blundell et al. (2015) with one prior scale, in the same
coordinates: its state_dict has the same sites, the scale sites held at ``log s_h`` and 0 (their
guide's standard deviations unused), and ``prior_scales`` says which prior it is
(:class:`~bayesfuse.inference.bnn.sites.Prior`), so a saved network comes back with its prior
and fusing networks of different priors is refused.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, cast

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from torch import nn
from tqdm.auto import tqdm

from bayesfuse._runtime import progress, torch_threads
from bayesfuse._validation import check_inputs, check_num_samples
from bayesfuse.inference.bnn.sites import (
    DEFAULT_GLOBAL_SCALE,
    PRIORS,
    Prior,
    deep_site_shapes,
    is_bnn_state,
    layer_sites,
    read_prior,
    state_sizes,
    unit_group,
)
from bayesfuse.models.bnn_elbo import negative_elbo

__all__ = ["HorseshoeBNN", "BNNConfig", "ESTIMATORS", "PRIORS", "train_bnn"]


#: ELBO estimators :func:`train_bnn` can follow: ``"local"``
#: (:func:`bayesfuse.models.bnn_elbo.negative_elbo`: closed-form KLs, local reparameterisation,
#: float32) and ``"pyro"`` (Pyro's ``Trace_ELBO`` on :meth:`HorseshoeBNN.model` and
#: :meth:`HorseshoeBNN.guide`, float64). Both estimate the same ELBO.
ESTIMATORS = ("local", "pyro")


@dataclass(frozen=True)
class BNNConfig:
    """Training settings of :func:`train_bnn`.

    ``estimator`` is one of :data:`ESTIMATORS`; ``num_particles`` applies to ``"pyro"``.
    """

    epochs: int = 30
    batch_size: int = 128
    lr: float = 0.01
    num_particles: int = 1
    seed: int = 0
    num_threads: int | None = 1
    estimator: str = "local"

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}; got {self.estimator!r}")
        if self.epochs < 0 or self.batch_size < 1 or not (self.lr > 0) or self.num_particles < 1:
            raise ValueError("need epochs >= 0, batch_size >= 1, lr > 0 and num_particles >= 1")


class HorseshoeBNN(nn.Module):
    """Horseshoe (or Gaussian-prior) BNN (module docstring) holding its mean-field guide.

    Parameters
    ----------
    in_features, n_classes : int
    hidden : int or sequence of int
        Units of the hidden layer, or of each hidden layer (bottom first).
    global_scale : float, optional
        The horseshoe's ``b_g``, scale of the half-Cauchy prior on ``tau`` (default 0.1); with
        ``prior="gaussian"``, ``s_h``, the prior standard deviation of the hidden weights and
        biases (default 1).
    weight_scale : float
        ``s``, prior standard deviation of the output layer.
    init_scale : float
        Initial standard deviation of the guide's Gaussians.
    prior : {"horseshoe", "gaussian"}
        The prior of the hidden layers (:data:`~bayesfuse.inference.bnn.sites.PRIORS`).

    Attributes
    ----------
    loc, log_scale : nn.ParameterDict
        Guide means and log standard deviations per site
        (:func:`~bayesfuse.inference.bnn.sites.deep_site_shapes`); one hidden layer: ``w1`` (H, D),
        ``b1`` (H,), ``log_lam`` (H,), ``log_tau`` (1,), ``w2`` (K, H), ``b2`` (K,).
    hidden : int or tuple of int
        As given: an int for one hidden layer, a tuple for several.
    hidden_sizes : tuple of int
        The units of each hidden layer; ``depth`` is their number.
    """

    prior_scales: torch.Tensor
    # set by train_bnn
    elbo_history: list[float]
    epoch_seconds: list[float]
    train_seconds: float
    examples_per_second: float

    def __init__(
        self,
        in_features: int,
        hidden: int | tuple[int, ...],
        n_classes: int,
        *,
        global_scale: float | None = None,
        weight_scale: float = 1.0,
        init_scale: float = 1e-2,
        prior: str = "horseshoe",
    ):
        super().__init__()
        sizes = (cast(int, hidden),) if np.ndim(hidden) == 0 else tuple(cast(tuple[int, ...], hidden))
        if len(sizes) == 0 or min(in_features, n_classes, *sizes) < 1:
            raise ValueError("in_features, n_classes and every hidden size must be positive")
        if prior not in PRIORS:
            raise ValueError(f"prior must be one of {', '.join(map(repr, PRIORS))}, got {prior!r}")
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(
                f"init_scale (the guide's initial standard deviation) must be positive, got {init_scale!r}"
            )
        spec = Prior(prior, DEFAULT_GLOBAL_SCALE[prior] if global_scale is None else global_scale, weight_scale)
        global_scale = spec.global_scale
        self.hidden_sizes = tuple(int(h) for h in sizes)
        self.depth = len(self.hidden_sizes)
        self.in_features, self.n_classes = int(in_features), int(n_classes)
        self.hidden = self.hidden_sizes[0] if self.depth == 1 else self.hidden_sizes
        # The prior and its scales travel with the state_dict, so a saved network rebuilds exactly.
        self.register_buffer("prior_scales", torch.as_tensor(spec.to_array()))
        shapes = self.site_shapes()
        self.loc = nn.ParameterDict({k: nn.Parameter(torch.zeros(s, dtype=torch.float64)) for k, s in shapes.items()})
        self.log_scale = nn.ParameterDict(
            {k: nn.Parameter(torch.full(s, math.log(init_scale), dtype=torch.float64)) for k, s in shapes.items()}
        )
        with torch.no_grad():
            fan_in = (self.in_features,) + self.hidden_sizes
            for layer in range(1, self.depth + 2):  # hidden layers, then the output layer
                self.loc[f"w{layer}"].normal_(0.0, 1.0 / math.sqrt(fan_in[layer - 1]))
            for layer in range(1, self.depth + 1):
                self.loc[layer_sites(layer).log_tau].fill_(math.log(global_scale))
                self.loc[layer_sites(layer).log_lam].fill_(0.0)
        for site in self.fixed_sites():  # not trained: a Gaussian prior's scales are constants
            self.loc[site].requires_grad_(False)
            self.log_scale[site].requires_grad_(False)

    @property
    def prior(self) -> str:
        """The prior of the hidden layers: ``"horseshoe"`` or ``"gaussian"``."""
        return PRIORS[int(self.prior_scales[2])] if len(self.prior_scales) == 3 else "horseshoe"

    @property
    def prior_spec(self) -> Prior:
        """The prior with its scales (:class:`~bayesfuse.inference.bnn.sites.Prior`); ``str()`` of it names both."""
        return Prior(self.prior, self.global_scale, self.weight_scale)

    def fixed_sites(self) -> tuple[str, ...]:
        """The guide's sites held at their means: the scale sites ``log_tau<l>``, ``log_lam<l>`` of a
        Gaussian prior (none for the horseshoe)."""
        if self.prior == "horseshoe":
            return ()
        return tuple(
            name
            for layer in range(1, self.depth + 1)
            for name in (layer_sites(layer).log_tau, layer_sites(layer).log_lam)
        )

    @property
    def global_scale(self) -> float:
        return float(self.prior_scales[0])

    @property
    def weight_scale(self) -> float:
        return float(self.prior_scales[1])

    def site_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each guide site (:func:`~bayesfuse.inference.bnn.sites.deep_site_shapes`), in the guide's order."""
        return deep_site_shapes(self.hidden_sizes, self.in_features, self.n_classes)

    # ------------------------------------------------------------------ state_dicts
    @staticmethod
    def is_state_dict(state: Mapping[str, object]) -> bool:
        """Whether ``state`` has exactly the keys of a HorseshoeBNN state_dict."""
        return is_bnn_state(state)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object], name: str = "state_dict") -> HorseshoeBNN:
        """The network whose state_dict is ``state`` (torch tensors or NumPy arrays).

        Sizes come from the weights (:func:`~bayesfuse.inference.bnn.sites.state_sizes`), the
        prior and its scales from ``prior_scales``. Raises ``ValueError`` naming ``name`` when ``state``
        is not a consistent HorseshoeBNN state_dict.
        """
        hidden, D, K = state_sizes(state, name)
        H = hidden[0] if len(hidden) == 1 else hidden
        prior = read_prior(state["prior_scales"], name)
        try:
            bnn = cls(D, H, K, global_scale=prior.global_scale, weight_scale=prior.weight_scale, prior=prior.kind)
            bnn.load_state_dict(
                {k: torch.as_tensor(np.asarray(v)) if not torch.is_tensor(v) else v for k, v in state.items()}
            )
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"{name}: not a consistent HorseshoeBNN state_dict ({str(err).splitlines()[0]})") from None
        return bnn

    # ------------------------------------------------------------------ Pyro model and guide
    def model(self, x: torch.Tensor, y: torch.Tensor | None = None, n_data: int | None = None):
        D, K = self.in_features, self.n_classes
        f64: dict[str, Any] = dict(dtype=torch.float64)
        params, width = {}, D
        horseshoe = self.prior == "horseshoe"
        for layer, H in enumerate(self.hidden_sizes, 1):
            names, tag = layer_sites(layer), _tag(layer)
            if horseshoe:
                params[names.log_tau] = pyro.sample(
                    f"tau{tag}", dist.HalfCauchy(torch.tensor(self.global_scale, **f64)).expand([1]).to_event(1)
                ).log()
            else:  # fixed scales (fixed_sites)
                params[names.log_tau] = self.loc[names.log_tau].detach().double()
                params[names.log_lam] = self.loc[names.log_lam].detach().double()
            with pyro.plate(f"units{tag}", H):
                if horseshoe:
                    params[names.log_lam] = pyro.sample(f"lam{tag}", dist.HalfCauchy(torch.tensor(1.0, **f64))).log()
                params[names.w] = pyro.sample(
                    names.w, dist.Normal(torch.tensor(0.0, **f64), 1.0).expand([width]).to_event(1)
                )
                params[names.b] = pyro.sample(names.b, dist.Normal(torch.tensor(0.0, **f64), 1.0))
            width = H
        out = self.depth + 1
        params[f"w{out}"] = pyro.sample(
            f"w{out}", dist.Normal(torch.tensor(0.0, **f64), self.weight_scale).expand([K, width]).to_event(2)
        )
        params[f"b{out}"] = pyro.sample(
            f"b{out}", dist.Normal(torch.tensor(0.0, **f64), self.weight_scale).expand([K]).to_event(1)
        )
        if params[f"w{out}"].numel() != K * width:  # a vectorised particle dimension: this model has none
            raise ValueError(
                f"HorseshoeBNN.model draws one network at a time; got output weights of shape "
                f"{tuple(params[f'w{out}'].shape)} (vectorize_particles or a parallel Predictive?): use "
                "Trace_ELBO(num_particles=..., vectorize_particles=False) or Predictive(..., parallel=False)"
            )
        logits = forward_logits(x, params, self.depth)
        with pyro.plate("data", n_data or len(x), subsample=torch.arange(len(x))):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y)

    def guide(self, x: torch.Tensor, y: torch.Tensor | None = None, n_data: int | None = None):
        q = self._q
        horseshoe = self.prior == "horseshoe"
        for layer, H in enumerate(self.hidden_sizes, 1):
            names, tag = layer_sites(layer), _tag(layer)
            if horseshoe:
                pyro.sample(f"tau{tag}", dist.LogNormal(*q(names.log_tau)).to_event(1))
            with pyro.plate(f"units{tag}", H):
                if horseshoe:
                    pyro.sample(f"lam{tag}", dist.LogNormal(*q(names.log_lam)))
                pyro.sample(names.w, dist.Normal(*q(names.w)).to_event(1))
                pyro.sample(names.b, dist.Normal(*q(names.b)))
        out = self.depth + 1
        pyro.sample(f"w{out}", dist.Normal(*q(f"w{out}")).to_event(2))
        pyro.sample(f"b{out}", dist.Normal(*q(f"b{out}")).to_event(1))

    def _q(self, site: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loc[site], self.log_scale[site].exp()

    # ------------------------------------------------------------------ prediction
    @torch.no_grad()
    def sample_params(self, num_samples: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Draws from the guide, each site with a leading sample dimension (the :meth:`fixed_sites` at their means)."""
        out = {}
        fixed = self.fixed_sites()
        for site in self.site_shapes():
            loc, scale = self._q(site)
            if site in fixed:
                out[site] = loc.expand(num_samples, *loc.shape).clone()
                continue
            eps = torch.randn((num_samples, *loc.shape), dtype=loc.dtype, generator=generator)
            out[site] = loc + scale * eps
        return out

    @torch.no_grad()
    def predict(self, x, num_samples: int = 100, *, seed: int = 0, batch_size: int = 4096) -> np.ndarray:
        """Monte Carlo predictive ``(1/S) sum_s softmax(f(x; theta_s))``, theta_s from the guide.

        Returns float64 probabilities of shape (n, K). The same seed gives the same draws.
        """
        return self._predict(x, num_samples, seed, batch_size, self._predictive)

    def _predict(self, x, num_samples: int, seed: int, batch_size: int, predictive) -> np.ndarray:
        """:meth:`predict` with the per-chunk rule ``predictive(x_chunk, draws) -> (n, K)``."""
        x = torch.as_tensor(np.asarray(x), dtype=torch.float64)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be (n, {self.in_features}), got {tuple(x.shape)}")
        check_inputs(x)
        num_samples = check_num_samples(num_samples)
        draws = self._draws(num_samples, torch.Generator().manual_seed(seed))
        step = self._rows_per_chunk(batch_size)
        return torch.cat([predictive(x[i : i + step], draws) for i in range(0, len(x), step)]).numpy()

    def _draws(self, num_samples: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """What :meth:`predict` draws once for all inputs: the guide's sites."""
        return self.sample_params(num_samples, generator)

    def _rows_per_chunk(self, batch_size: int) -> int:
        return batch_size

    def _predictive(self, x: torch.Tensor, draws: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(n, K) predictive of the rows ``x`` over ``draws``: the mean softmax."""
        return torch.softmax(forward_logits(x, draws, self.depth), -1).mean(0)  # (S, n, K) -> (n, K)

    @torch.no_grad()
    def unit_moments(self, x, *, batch_size: int = 4096) -> dict[str, dict[str, np.ndarray]]:
        """Mean and variance over the rows of ``x`` of every hidden unit's pre-activation
        ``tau lambda_k (w~_k^T h + b~_k)`` and activation ``h_k = relu(.)``, at the guide's means.

        Keyed by the hidden layers' groups (``"units"``, ``"units2"``, ...), each a dict of
        ``pre_mean``, ``pre_var``, ``act_mean``, ``act_var`` arrays of shape (H_l,), float64: the
        moments :func:`bayesfuse.summarize` sends for a BNN (aggregates over ``x``, nothing per row).
        """
        x = torch.as_tensor(np.asarray(x), dtype=torch.float64)
        if x.ndim != 2 or x.shape[1] != self.in_features or len(x) == 0:
            raise ValueError(f"x must be (n, {self.in_features}) with n > 0, got {tuple(x.shape)}")
        means = {site: loc.detach().double() for site, loc in self.loc.items()}
        sums = [[torch.zeros(h, dtype=torch.float64) for _ in range(4)] for h in self.hidden_sizes]
        for start in range(0, len(x), batch_size):
            h = x[start : start + batch_size]
            for layer, acc in enumerate(sums, 1):
                names = layer_sites(layer)
                scale = torch.exp(means[names.log_tau] + means[names.log_lam])
                pre = (h @ means[names.w].T + means[names.b]) * scale
                h = torch.relu(pre)
                for i, t in enumerate((pre, pre.square(), h, h.square())):
                    acc[i] += t.sum(0)
        out = {}
        for layer, (s1, s2, a1, a2) in enumerate(sums, 1):
            pre_mean, act_mean = (s1 / len(x)).numpy(), (a1 / len(x)).numpy()
            out[unit_group(layer)] = {
                "pre_mean": pre_mean,
                "pre_var": np.maximum((s2 / len(x)).numpy() - pre_mean**2, 0.0),
                "act_mean": act_mean,
                "act_var": np.maximum((a2 / len(x)).numpy() - act_mean**2, 0.0),
            }
        return out

    def unit_scales(self, layer: int = 1) -> np.ndarray:
        """Posterior median of each unit's scale ``tau * lambda_k`` in hidden layer ``layer`` (log-normal:
        exp of the loc)."""
        if not 1 <= layer <= self.depth:
            raise ValueError(f"layer must be in 1..{self.depth}, got {layer}")
        names = layer_sites(layer)
        with torch.no_grad():
            return torch.exp(self.loc[names.log_tau] + self.loc[names.log_lam]).numpy()


def _tag(layer: int) -> str:
    """The suffix of hidden layer ``layer``'s Pyro sites (``tau``, ``lam``, ``units``): none for the first."""
    return "" if layer == 1 else str(layer)


def forward_hidden(x, params: Mapping[str, torch.Tensor], depth: int):
    """The top hidden layer's outputs ``h_L(x)`` for the sites' values ``params`` (log-scales for
    ``tau``, ``lambda``), each with an optional leading sample dimension."""
    h = x
    for layer in range(1, depth + 1):
        names = layer_sites(layer)
        scale = torch.exp(params[names.log_tau] + params[names.log_lam])  # (..., H)
        pre = torch.matmul(h, params[names.w].transpose(-1, -2)) + params[names.b].unsqueeze(-2)  # (..., n, H)
        h = torch.relu(pre * scale.unsqueeze(-2))
    return h


def forward_logits(x, params: Mapping[str, torch.Tensor], depth: int):
    """Logits for the sites' values ``params`` (as :func:`forward_hidden`)."""
    h = forward_hidden(x, params, depth)
    w, b = params[f"w{depth + 1}"], params[f"b{depth + 1}"]
    return torch.matmul(h, w.transpose(-1, -2)) + b.unsqueeze(-2)


#: The former private name, which the tests import.
_forward_hidden = forward_hidden


def train_bnn(
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    hidden: int | tuple[int, ...] = 150,
    config: BNNConfig | None = None,
    *,
    verbose: bool | None = None,
    name: str = "bnn",
    prior: str = "horseshoe",
    **model_kwargs,
) -> HorseshoeBNN:
    """Fit a :class:`HorseshoeBNN` by SVI (ELBO, Adam, minibatches with the likelihood rescaled).

    ``prior`` is the prior of the hidden layers, ``"horseshoe"`` or ``"gaussian"`` (module
    docstring); ``model_kwargs`` (``global_scale``, ``weight_scale``, ``init_scale``) go to
    :class:`HorseshoeBNN`. The prior is recorded in the network's state_dict (``prior_scales``).

    With ``config.estimator="local"`` (the default) each step uses
    :func:`~bayesfuse.models.bnn_elbo.negative_elbo` in float32 (about 3x the examples per
    second of Pyro's ``Trace_ELBO``, with less gradient noise; ``benchmarks/bench_bnn_fusion.py
    --speed``); ``"pyro"`` runs Pyro's ``Trace_ELBO`` on the model and guide in float64. The
    returned network is float64 either way.

    Returns the network with ``elbo_history`` (mean negative ELBO per example, per epoch),
    ``epoch_seconds`` (the wall time of each epoch), ``train_seconds`` and ``examples_per_second``
    (over the whole call). Raises ``FloatingPointError`` if the ELBO
    becomes NaN.
    """
    config = config or BNNConfig()
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    if x.ndim != 2 or len(x) == 0 or y.shape != (len(x),):
        raise ValueError(f"need x (n, d) with n > 0 and y (n,), got {x.shape} and {y.shape}")
    if not np.isfinite(x).all():
        raise ValueError("training inputs contain NaN or infinite values")
    if isinstance(n_classes, bool) or not isinstance(n_classes, (int, np.integer)) or n_classes < 1:
        raise ValueError(f"n_classes must be a positive integer, got {n_classes!r}")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= n_classes:
        raise ValueError(f"labels must be integers in 0..{n_classes - 1}")
    start = time.perf_counter()
    local = config.estimator == "local"
    dtype = torch.float32 if local else torch.float64
    xt, yt = torch.from_numpy(x).to(dtype), torch.from_numpy(y.astype(np.int64))
    x_sq = xt.square() if local else None
    with torch_threads(config.num_threads), pyro.validation_enabled(False):
        torch.manual_seed(config.seed)
        bnn = HorseshoeBNN(x.shape[1], hidden, n_classes, prior=prior, **model_kwargs)
        bnn.loc.to(dtype), bnn.log_scale.to(dtype)  # the guide's parameters; prior_scales stays float64
        opt = torch.optim.Adam([p for p in bnn.parameters() if p.requires_grad], lr=config.lr, fused=True)
        gen = torch.Generator().manual_seed(config.seed)
        if local:
            assert x_sq is not None  # computed for the local estimator

            def loss_fn(idx):
                return negative_elbo(bnn, xt[idx], yt[idx], len(xt), gen, x_sq[idx])
        else:
            pyro_loss = Trace_ELBO(num_particles=config.num_particles, vectorize_particles=False).differentiable_loss

            def loss_fn(idx):
                return pyro_loss(bnn.model, bnn.guide, xt[idx], yt[idx], len(xt))

        history, epoch_seconds = [], []
        bar = tqdm(range(config.epochs), desc=name, unit="epoch", disable=not progress(verbose), leave=False)
        for epoch in bar:
            epoch_start = time.perf_counter()
            order = torch.randperm(len(xt), generator=gen)
            total = 0.0
            for i in range(0, len(xt), config.batch_size):
                idx = order[i : i + config.batch_size]
                loss = loss_fn(idx)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"{name}: the ELBO became {loss.item()} at epoch {epoch + 1}; "
                        f"lower the learning rate (now {config.lr})"
                    )
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item() * len(idx) / len(xt)
            history.append(total / len(xt))
            epoch_seconds.append(time.perf_counter() - epoch_start)
            bar.set_postfix(neg_elbo=f"{history[-1]:.4f}")
    bnn.loc.double(), bnn.log_scale.double()
    bnn.elbo_history, bnn.epoch_seconds = history, epoch_seconds
    bnn.train_seconds = time.perf_counter() - start
    bnn.examples_per_second = len(xt) * config.epochs / bnn.train_seconds if bnn.train_seconds > 0 else float("inf")
    return bnn
