"""The fast ELBO estimator against closed forms, quadrature and Pyro's own Trace_ELBO."""

import math

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO
from scipy import integrate, stats

from bayesfuse.models.bnn import HorseshoeBNN
from bayesfuse.models.bnn_elbo import gaussian_kl, lognormal_halfcauchy_kl, negative_elbo
from tests.helpers import varied_bnn


def test_gaussian_kl_is_torchs_closed_form():
    g = torch.Generator().manual_seed(0)
    loc = torch.randn(5, 4, generator=g, dtype=torch.float64)
    log_scale = 0.5 * torch.randn(5, 4, generator=g, dtype=torch.float64)
    for prior in (1.0, 0.3):
        expected = torch.distributions.kl_divergence(
            torch.distributions.Normal(loc, log_scale.exp()),
            torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), prior),
        ).sum()
        assert gaussian_kl(loc, log_scale, prior).item() == pytest.approx(expected.item(), rel=1e-12)


# tolerance: the quadrature error bound stated in bayesfuse.models.bnn_elbo for each guide scale
@pytest.mark.parametrize(
    "mu, sigma, b, tol",
    [
        (0.0, 1.0, 1.0, 1e-10),
        (-3.0, 0.1, 0.1, 1e-10),
        (2.0, 0.5, 1.0, 1e-10),
        (-6.0, 2.0, 0.1, 2e-6),
        (0.0, 2.0, 1.0, 2e-6),
    ],
)
def test_lognormal_halfcauchy_kl_matches_quadrature(mu, sigma, b, tol):
    # KL(q || p) = integral of q(l) (log q(l) - log p(l)) dl over the log-scale u = log l, computed
    # by adaptive quadrature: an independent check of the entropy and the Gauss-Hermite term.
    q = stats.norm(mu, sigma)

    def integrand(u):
        log_q = q.logpdf(u) - u  # density of l = e^u at l
        log_p = math.log(2 / (math.pi * b)) - math.log1p(math.exp(2 * u) / b**2)
        return q.pdf(u) * (log_q - log_p)

    expected, _ = integrate.quad(integrand, mu - 14 * sigma, mu + 14 * sigma, epsabs=1e-14, limit=400)
    got = lognormal_halfcauchy_kl(
        torch.tensor([mu], dtype=torch.float64), torch.tensor([math.log(sigma)], dtype=torch.float64), b
    ).item()
    assert got == pytest.approx(expected, abs=tol)


def _trained_looking_bnn(hidden=4, prior="horseshoe"):
    """A small BNN with varied guide parameters (the initial guide is too uniform to test much)."""
    return varied_bnn(
        3, hidden, 3, seed=3, spread=0.5, scale_low=0.1, scale_span=0.5, global_scale=0.5, weight_scale=1.5, prior=prior
    )


@pytest.mark.parametrize("prior", ["horseshoe", "gaussian"])
@pytest.mark.parametrize("hidden", [4, (4, 5)], ids=["one-hidden-layer", "two-hidden-layers"])
def test_estimates_the_same_elbo_as_pyro(hidden, prior):
    # Both estimators are unbiased for the same ELBO; their means over R draws differ by less
    # than 4 standard errors of the difference (a false alarm about 1 in 16,000 at fixed seeds).
    # Under a Gaussian prior Pyro's model has no scale sites and the estimator no scale KL terms.
    bnn = _trained_looking_bnn(hidden, prior)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    R = 3000
    with torch.no_grad(), pyro.validation_enabled(False):
        torch.manual_seed(0)
        pyro_draws = np.array(
            [Trace_ELBO().differentiable_loss(bnn.model, bnn.guide, x, y, 40).item() for _ in range(R)]
        )
        local_draws = np.array([negative_elbo(bnn, x, y, 40, g).item() for _ in range(R)])
    se = math.sqrt(pyro_draws.var() / R + local_draws.var() / R)
    assert abs(pyro_draws.mean() - local_draws.mean()) < 4 * se


def test_vectorised_particles_are_refused_not_wrong():
    # the model draws one network at a time: with a particle dimension its logits were wrong
    # (Trace_ELBO's vectorised ELBO came out twice the sequential one) or failed deep in a reshape
    from pyro.infer import Predictive

    bnn = _trained_looking_bnn((4, 5))
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 3, (12,))
    vectorised = Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2)
    with pytest.raises(ValueError, match="draws one network at a time.*vectorize_particles=False"):
        vectorised.differentiable_loss(bnn.model, bnn.guide, x, y, 40)
    with pytest.raises(ValueError, match="draws one network at a time.*parallel=False"):
        Predictive(bnn.model, guide=bnn.guide, num_samples=5, parallel=True)(x)
    # one draw at a time, as before
    assert Predictive(bnn.model, guide=bnn.guide, num_samples=5)(x)["y"].shape == (5, 12)
    assert torch.isfinite(Trace_ELBO(num_particles=4).differentiable_loss(bnn.model, bnn.guide, x, y, 40))


@pytest.mark.parametrize("hidden", [4, (4, 2)])
def test_estimator_has_the_parameters_dtype_and_gradients(hidden):
    bnn = HorseshoeBNN(3, hidden, 3)
    bnn.loc.float(), bnn.log_scale.float()
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])
    loss = negative_elbo(bnn, x, y, 10)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bnn.parameters())
    gaussian = HorseshoeBNN(3, hidden, 3, prior="gaussian")
    negative_elbo(gaussian, x.double(), y, 10).backward()
    # a Gaussian prior's scales are fixed: only they get no gradient
    assert {name for name, p in gaussian.loc.items() if p.grad is None} == set(gaussian.fixed_sites())
