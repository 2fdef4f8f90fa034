"""A point-estimate network with a Gaussian posterior over its output layer, and its predictive.

The fused network of :func:`bayesfuse.fuse` with client summaries is a posterior: every weight
has a precision (:mod:`bayesfuse.inference.summary_fusion`). Its output layer
``f = W a + b`` is linear in the features ``a(x)`` of the layer below, so with independent
Gaussians ``W_kg ~ N(m_kg, v_kg)``, ``b_k ~ N(m_k, v_k)`` each logit is Gaussian,

.. math::

    f_k(x) \\sim N\\big(\\bar f_k(x),\\; s_k^2(x)\\big), \\qquad
    s_k^2(x) = \\sum_g a_g(x)^2 v_{kg} + v_k,

and the predictive ``E[softmax(f)]`` is approximated by the probit rule
``softmax(f_bar_k / sqrt(1 + pi s_k^2 / 8))`` (MacKay 1992; the last-layer Laplace
approximation of Kristiadi et al., ICML 2020, eq. 7, here with the diagonal posterior), or
estimated by sampling the logits. The rest of the network stays at its posterior mean.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from bayesfuse._validation import as_input, check_inputs
from bayesfuse.nets.heads import logits_and_features

__all__ = ["LastLayerLaplace"]


def _copy(values, dtype: torch.dtype) -> torch.Tensor:
    """A tensor copy of ``values`` (a tensor or anything NumPy reads) in ``dtype``."""
    if isinstance(values, torch.Tensor):
        return values.detach().to(dtype).clone()
    return torch.tensor(np.asarray(values), dtype=dtype)


class LastLayerLaplace(nn.Module):
    """``network`` with a diagonal Gaussian posterior over its output layer.

    Parameters
    ----------
    network : nn.Module
        The network at its posterior mean (logits out).
    output : str
        Name of the output layer module (``"layers.1"``): a Linear whose input are the features.
    weight_var, bias_var : arrays
        Posterior variances of that layer's weight ``(K, G)`` and bias ``(K,)``.
    covariance : array (K, G+1, G+1), optional
        Instead of independent weights, per class ``k`` the covariance of its weights and bias
        (the bias last), as the refit of the second round gives
        (:func:`bayesfuse.inference.output_fusion.fuse_output_fits`):
        ``s_k^2(x) = a~^T Sigma_k a~`` with ``a~ = [a(x); 1]``. ``weight_var`` and ``bias_var`` are
        then its diagonal, and may be left ``None``.

    ``forward(x)`` returns the probit-scaled logits, so ``softmax(forward(x))`` (what
    :func:`bayesfuse.nets.predict.predict_proba` computes) is the probit predictive;
    :meth:`mean_logits` the logits at the mean; :meth:`predict` either predictive. A
    ``temperature`` buffer (1 unless a second round set it) divides the predictive logits.
    """

    weight_var: torch.Tensor
    bias_var: torch.Tensor
    temperature: torch.Tensor
    covariance: torch.Tensor | None

    def __init__(self, network: nn.Module, output: str, weight_var=None, bias_var=None, *, covariance=None) -> None:
        super().__init__()
        try:
            layer = network.get_submodule(output)
        except AttributeError:
            layer = None
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"the output layer {output!r} must be an nn.Linear, got {type(layer).__name__}")
        if covariance is not None:
            covariance = torch.as_tensor(np.asarray(covariance), dtype=layer.weight.dtype)
            shape = (layer.out_features, layer.in_features + 1, layer.in_features + 1)
            if covariance.shape != shape:
                raise ValueError(
                    f"covariance of shape {tuple(covariance.shape)} does not fit the output layer "
                    f"{tuple(layer.weight.shape)}: need {shape}"
                )
            if (
                not torch.isfinite(covariance).all()
                or (torch.linalg.eigvalsh(covariance.double()) < -1e-9 * (1 + covariance.abs().amax())).any()
            ):
                raise ValueError("covariance must be finite and positive semi-definite")
            diagonal = torch.diagonal(covariance, dim1=-2, dim2=-1)
            weight_var, bias_var = diagonal[:, :-1], diagonal[:, -1]
        elif weight_var is None or bias_var is None:
            raise ValueError("give weight_var and bias_var, or covariance")
        weight_var = _copy(weight_var, layer.weight.dtype)  # a copy: inputs may be read-only
        bias_var = _copy(bias_var, layer.weight.dtype)
        if weight_var.shape != layer.weight.shape or bias_var.shape != (layer.out_features,):
            raise ValueError(
                f"variances of shapes {tuple(weight_var.shape)} and {tuple(bias_var.shape)} do not fit "
                f"the output layer {tuple(layer.weight.shape)}"
            )
        if (
            not (torch.isfinite(weight_var).all() and torch.isfinite(bias_var).all())
            or (weight_var < 0).any()
            or (bias_var < 0).any()
        ):
            raise ValueError("posterior variances must be finite and non-negative")
        self.network = network
        self.output = output
        self.register_buffer("weight_var", weight_var)
        self.register_buffer("bias_var", bias_var)
        self.register_buffer("temperature", torch.ones((), dtype=layer.weight.dtype))
        self.register_buffer("covariance", covariance)

    def _logits_and_variance(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, features = logits_and_features(self.network, self.output, x)
        if self.covariance is not None:
            tilde = torch.cat([features, torch.ones_like(features[:, :1])], 1).to(self.covariance.dtype)
            variance = torch.einsum("kgh,nh->nkg", self.covariance, tilde).mul(tilde[:, None, :]).sum(-1)
            return logits, variance.clamp_min(0).to(logits.dtype)
        variance = (features**2) @ self.weight_var.T + self.bias_var
        return logits, variance

    def mean_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the network at the posterior mean."""
        return self.network(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, variance = self._logits_and_variance(x)
        return logits / torch.sqrt(1.0 + (math.pi / 8.0) * variance) / self.temperature

    @torch.no_grad()
    def predict(self, x, *, num_samples: int | None = None, seed: int = 0) -> np.ndarray:
        """Class probabilities: the probit predictive, or the mean over ``num_samples`` draws of the logits."""
        dtype = self.weight_var.dtype
        x = as_input(x, dtype)  # token ids stay integers
        check_inputs(x)
        was_training = self.training
        self.eval()
        try:
            if num_samples is None:
                return torch.softmax(self(x).double(), -1).numpy()
            if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
                raise ValueError(f"num_samples must be a positive integer or None, got {num_samples!r}")
            logits, variance = self._logits_and_variance(x)
            gen = torch.Generator().manual_seed(seed)
            eps = torch.randn((num_samples, *logits.shape), generator=gen, dtype=logits.dtype)
            draws = (logits.double() + eps.double() * variance.double().sqrt()) / float(self.temperature)
            return torch.softmax(draws, -1).mean(0).numpy()
        finally:
            self.train(was_training)
