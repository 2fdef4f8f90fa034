"""A low-variance, fast estimator of the horseshoe BNN's ELBO (the same objective as Pyro's ``Trace_ELBO``).

For the model and mean-field guide of :class:`~bayesfuse.models.bnn.HorseshoeBNN`,

.. math::

    \\mathrm{ELBO} = \\sum_n E_q[\\log p(y_n \\mid x_n, \\theta)]
                    - \\sum_{\\text{sites}} \\mathrm{KL}(q \\,\\|\\, p),

and this module estimates each term with as little Monte Carlo noise as the model allows:

* **Gaussian sites** (``w1``, ``b1``, ``w2``, ``b2`` against their Normal priors): the KL in
  closed form, :math:`\\tfrac12\\sum(\\sigma^2/s^2 + \\mu^2/s^2 - 1 - \\log(\\sigma^2/s^2))`.
  Under a Gaussian prior (``prior="gaussian"``) these are all the KL terms: the scales are fixed.
* **Scale sites** (``lambda_k``, ``tau``: log-normal guides against half-Cauchy priors
  :math:`C^+(0, b)`): :math:`E_q[\\log q]` is minus the log-normal entropy,
  :math:`-(\\mu + \\tfrac12 + \\log(\\sigma\\sqrt{2\\pi}))`, and
  :math:`E_q[\\log p] = \\log\\frac{2}{\\pi b} - E[\\log(1 + e^{2u}/b^2)]`, :math:`u \\sim N(\\mu, \\sigma^2)`,
  by Gauss-Hermite quadrature with :data:`GH_NODES` nodes (the integrand is analytic; against
  adaptive quadrature the error is below 1e-10 for guide standard deviations up to 1 and below
  2e-6 up to 2, where a guide on a log-scale rarely goes).
* **Likelihood**, local reparameterisation (Kingma, Salimans & Welling 2015): given the unit
  scales :math:`s_k = \\tau\\lambda_k` (drawn once per minibatch), the pre-activation
  :math:`a_{nk} = \\tilde w_k^\\top x_n + \\tilde b_k` is Gaussian with mean
  :math:`\\mu_{w,k}^\\top x_n + \\mu_{b,k}` and variance :math:`(\\sigma^2_{w,k})^\\top x_n^2 + \\sigma^2_{b,k}`,
  and given :math:`h_n = \\mathrm{relu}(s \\odot a_n)` the logits are Gaussian with mean
  :math:`\\mu_{W_2} h_n + \\mu_{b_2}` and variance :math:`\\sigma^2_{W_2} h_n^2 + \\sigma^2_{b_2}`. Drawing
  these per example instead of one weight matrix per minibatch keeps each example's marginal
  (so the expectation of every :math:`\\log p(y_n \\mid \\cdot)` term is unchanged) and removes
  the correlation between examples, which is what makes minibatch gradients noisy. A deeper
  network repeats the hidden step layer by layer, each layer's input being the previous layer's
  drawn activations (so every draw is still one draw of the model's joint).

The estimate is unbiased for the same ELBO that Pyro's ``Trace_ELBO`` estimates on
``bnn.model`` / ``bnn.guide`` (tests/models/test_bnn_elbo.py checks both against each other and
against Pyro's log-probabilities), at a fraction of the cost: no traces, two matrix products per
layer, and the KL terms without sampling.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from bayesfuse.inference.bnn.sites import layer_sites

__all__ = ["GH_NODES", "gaussian_kl", "lognormal_halfcauchy_kl", "negative_elbo"]

#: Gauss-Hermite nodes for the expectations of the half-Cauchy log-density.
GH_NODES = 64
_GH_X, _GH_W = np.polynomial.hermite.hermgauss(GH_NODES)


@functools.lru_cache(maxsize=None)
def _gauss_hermite(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The quadrature's nodes and weights (normalised for ``E[f(z)]``, ``z ~ N(0, 1/2)``), once per dtype and device."""
    return (
        torch.as_tensor(_GH_X, dtype=dtype, device=device),
        torch.as_tensor(_GH_W / math.sqrt(math.pi), dtype=dtype, device=device),
    )


def gaussian_kl(
    loc: torch.Tensor, log_scale: torch.Tensor, prior_scale: float, var: torch.Tensor | None = None
) -> torch.Tensor:
    """``KL(N(loc, exp(log_scale)^2) || N(0, prior_scale^2))`` summed over all entries (closed form).

    ``var``, if given, is ``exp(2 log_scale)`` already computed.
    """
    var = torch.exp(2 * log_scale) if var is None else var
    n = loc.numel()
    return 0.5 * (
        (var.sum() + loc.square().sum()) / prior_scale**2 - n - 2 * log_scale.sum() + 2 * n * math.log(prior_scale)
    )


def lognormal_halfcauchy_kl(loc: torch.Tensor, log_scale: torch.Tensor, prior_scale: float) -> torch.Tensor:
    """``KL(LogNormal(loc, exp(log_scale)) || HalfCauchy(prior_scale))`` summed over entries.

    Exact up to Gauss-Hermite quadrature of ``E[log(1 + e^{2u} / b^2)]``, ``u ~ N(loc, sigma^2)``:
    ``KL = -(loc + 1/2 + log(sigma sqrt(2 pi))) - log(2 / (pi b)) + E[log(1 + e^{2u} / b^2)]``.
    """
    nodes, weights = _gauss_hermite(loc.dtype, loc.device)
    sigma = torch.exp(log_scale)
    u = loc.unsqueeze(-1) + math.sqrt(2.0) * sigma.unsqueeze(-1) * nodes  # (..., GH_NODES)
    e_log1p = (torch.nn.functional.softplus(2 * u - 2 * math.log(prior_scale)) * weights).sum(-1)
    neg_entropy = -(loc + 0.5 + log_scale + 0.5 * math.log(2 * math.pi))
    return (neg_entropy - math.log(2 / (math.pi * prior_scale)) + e_log1p).sum()


def negative_elbo(
    bnn,
    x: torch.Tensor,
    y: torch.Tensor,
    n_data: int,
    generator: torch.Generator | None = None,
    x_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-draw estimate of ``-ELBO`` for a minibatch ``(x, y)`` of a data set of ``n_data`` examples.

    The likelihood term is scaled by ``n_data / len(x)`` (as Pyro's subsampled plate does); the
    KL terms are computed once, without sampling (module docstring). ``x`` must have the
    parameters' dtype; ``x_sq`` is ``x ** 2`` when the caller has it already.
    """
    loc, log_scale = bnn.loc, bnn.log_scale
    dtype = loc["w1"].dtype

    def normal(shape):
        return torch.randn(shape, dtype=dtype, generator=generator)

    b_g, s_w = bnn.global_scale, bnn.weight_scale
    horseshoe = bnn.prior == "horseshoe"
    h, h_sq = x, x_sq
    kl: float | torch.Tensor = 0.0
    for layer, H in enumerate(bnn.hidden_sizes, 1):
        n = layer_sites(layer)
        if horseshoe:  # unit scales s_k = tau * lambda_k, one draw per minibatch (log-normal guides)
            log_s = (
                loc[n.log_tau]
                + torch.exp(log_scale[n.log_tau]) * normal(1)
                + loc[n.log_lam]
                + torch.exp(log_scale[n.log_lam]) * normal(H)
            )
        else:  # a Gaussian prior: the scales are fixed (HorseshoeBNN.fixed_sites), no KL term
            log_s = loc[n.log_tau] + loc[n.log_lam]
        # pre-activations, locally reparameterised given the layer's input h
        var_w, var_b = torch.exp(2 * log_scale[n.w]), torch.exp(2 * log_scale[n.b])
        mean_a = h @ loc[n.w].T + loc[n.b]
        var_a = (h.square() if h_sq is None else h_sq) @ var_w.T + var_b
        a = mean_a + var_a.sqrt() * normal(mean_a.shape)
        h, h_sq = torch.relu(a * torch.exp(log_s)), None
        kl = kl + gaussian_kl(loc[n.w], log_scale[n.w], 1.0, var_w) + gaussian_kl(loc[n.b], log_scale[n.b], 1.0, var_b)
        if horseshoe:
            kl = (
                kl
                + lognormal_halfcauchy_kl(loc[n.log_lam], log_scale[n.log_lam], 1.0)
                + lognormal_halfcauchy_kl(loc[n.log_tau], log_scale[n.log_tau], b_g)
            )
    # logits, locally reparameterised
    w, b = f"w{bnn.depth + 1}", f"b{bnn.depth + 1}"
    var_w, var_b = torch.exp(2 * log_scale[w]), torch.exp(2 * log_scale[b])
    mean_f = h @ loc[w].T + loc[b]
    var_f = h.square() @ var_w.T + var_b
    f = mean_f + var_f.sqrt() * normal(mean_f.shape)
    nll = torch.nn.functional.cross_entropy(f, y, reduction="sum") * (n_data / len(x))
    kl = kl + gaussian_kl(loc[w], log_scale[w], s_w, var_w) + gaussian_kl(loc[b], log_scale[b], s_w, var_b)
    return nll + kl
