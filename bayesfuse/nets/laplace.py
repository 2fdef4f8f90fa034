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
approximation of Kristiadi et al., ICML 2020, eq. 7, here with the diagonal posterior).

The refit round's posterior couples the classes: its covariance ``Sigma`` over all the layer's
weights and biases (``(G+1) K`` of them) makes the logits jointly Gaussian with covariance
``S(x) = (I_K (x) a~)^T Sigma (I_K (x) a~)``, ``a~ = [a(x); 1]``. Much of that variance lies along
the all-ones direction of the logits, which the softmax ignores; the per-class rule above would
read it as uncertainty. The softmax of ``f`` is that of the centred logits ``C f``,
``C = I - 1 1^T / K``, so ``E[softmax(f)] = E[softmax(C f)]`` exactly, with
``C f ~ N(C f_bar, C S C)``; the probit rule is applied to those,

.. math::

    p(x) \\approx \\mathrm{softmax}\\Big(\\frac{(C \\bar f)_k}{\\sqrt{1 + \\pi (C S C)_{kk} / 8}}\\Big).

Either predictive can also be estimated by sampling: draws of the
output layer's weights from their posterior (so the draws do not depend on the other inputs of
a batch). The rest of the network stays at its posterior mean.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch
from torch import nn

from bayesfuse._validation import as_input, check_inputs, check_num_samples
from bayesfuse.nets.heads import logits_and_features
from bayesfuse.nets.state import saved_temperature

__all__ = ["LastLayerLaplace"]


def _copy(values, dtype: torch.dtype) -> torch.Tensor:
    """A tensor copy of ``values`` (a tensor or anything NumPy reads) in ``dtype``."""
    if isinstance(values, torch.Tensor):
        return values.detach().to(dtype).clone()
    return torch.tensor(np.asarray(values), dtype=dtype)


class LastLayerLaplace(nn.Module):
    """``network`` with a Gaussian posterior over its output layer.

    Parameters
    ----------
    network : nn.Module
        The network at its posterior mean (logits out).
    output : str
        Name of the output layer module (``"layers.1"``): a Linear whose input are the features.
    weight_var, bias_var : arrays
        Posterior variances of that layer's weight ``(K, G)`` and bias ``(K,)``.
    covariance : array, optional
        Instead of independent weights, either per class ``k`` the covariance ``(K, G+1, G+1)`` of
        its weights and bias (the bias last): ``s_k^2(x) = a~^T Sigma_k a~`` with ``a~ = [a(x); 1]``;
        or the joint covariance ``(G+1, K, G+1, K)`` of every weight and bias (index ``(g, k)``
        as the ``(G+1, K)`` weights with the bias as the last row), as the refit of the second
        round gives (:func:`bayesfuse.inference.output_fusion.output_posterior`): the probit
        predictive is then taken on the centred logits (module docstring). ``weight_var`` and ``bias_var`` are
        the covariance's diagonal, and may be left ``None``.

    ``forward(x)`` returns logits whose softmax (what :func:`bayesfuse.nets.predict.predict_proba`
    computes) is the probit predictive; :meth:`mean_logits` the logits at the mean;
    :meth:`predict` either predictive. A ``temperature`` buffer (1 unless a second round set it)
    divides the predictive logits.
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
        root = None
        if covariance is not None:
            covariance = _copy(covariance, layer.weight.dtype)
            g, k = layer.in_features + 1, layer.out_features
            if covariance.shape not in ((k, g, g), (g, k, g, k)):
                raise ValueError(
                    f"covariance of shape {tuple(covariance.shape)} does not fit the output layer "
                    f"{tuple(layer.weight.shape)}: need {(k, g, g)} (per class) or {(g, k, g, k)} (joint)"
                )
            matrices = covariance if covariance.dim() == 3 else covariance.reshape(1, g * k, g * k)
            # semi-definite to round-off: a Cholesky factor exists once 1e-9 (1 + max |entry|) is added to the
            # diagonal (a factorisation, not an eigendecomposition: seconds less at d = MAX_JOINT)
            if not torch.isfinite(matrices).all():
                raise ValueError("covariance must be finite and positive semi-definite")
            root, info = torch.linalg.cholesky_ex(matrices.double())  # kept for the sampled predictive
            if bool(info.any()):
                root = None
                shifted = matrices.double() + 1e-9 * (1 + float(matrices.abs().amax())) * torch.eye(matrices.shape[-1])
                if bool(torch.linalg.cholesky_ex(shifted)[1].any()):
                    raise ValueError("covariance must be finite and positive semi-definite")
            diagonal = torch.diagonal(matrices, dim1=-2, dim2=-1)
            diagonal = diagonal if covariance.dim() == 3 else diagonal.reshape(g, k).T  # (K, G+1)
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
        if covariance is not None and root is not None:
            c = covariance
            self._root_cache = (_key(c), root if c.dim() == 3 else root[0])

    @classmethod
    def from_buffers(cls, network: nn.Module, output: str, buffers: dict) -> "LastLayerLaplace":
        """A posterior saved as its own tensors (:func:`~bayesfuse.checkpoints.module_posterior_bytes`,
        :func:`bayesfuse.save`) back on ``network``: the same variances,
        covariance and temperature, so that it predicts exactly as the saved one did."""
        b = {k: torch.as_tensor(np.asarray(v)) for k, v in buffers.items()}
        extra = sorted(set(b) - {"weight_var", "bias_var", "temperature", "covariance"})
        missing = sorted({"weight_var", "bias_var", "temperature"} - set(b))
        if extra or missing:
            raise ValueError(f"the saved posterior holds {sorted(b)}: missing {missing}, unknown {extra}")
        model = cls(network, output, b["weight_var"], b["bias_var"], covariance=b.get("covariance"))
        temperature = saved_temperature(b["temperature"], "the saved posterior")
        if "covariance" in b and not (
            torch.equal(model.weight_var, b["weight_var"].to(model.weight_var.dtype))
            and torch.equal(model.bias_var, b["bias_var"].to(model.bias_var.dtype))
        ):
            raise ValueError("the saved posterior's variances are not its covariance's diagonal")
        model.temperature.copy_(temperature)
        return model.eval()

    @property
    def joint(self) -> bool:
        """Whether the covariance couples the classes (the refit round's joint posterior)."""
        return self.covariance is not None and self.covariance.dim() == 4

    def _features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits at the mean and ``a~ = [a(x); 1]``, in the covariance's dtype."""
        logits, features = logits_and_features(self.network, self.output, x)
        return logits, torch.cat([features, torch.ones_like(features[:, :1])], 1).to(self.weight_var.dtype)

    def _logits_and_variance(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits at the mean and each logit's variance ``s_k^2(x)`` (N, K)."""
        if self.covariance is None:
            logits, features = logits_and_features(self.network, self.output, x)
            return logits, (features**2) @ self.weight_var.T + self.bias_var
        if self.joint:
            logits, covariance = self._logits_and_covariance(x)
            return logits, torch.diagonal(covariance, dim1=-2, dim2=-1).to(logits.dtype)
        logits, tilde = self._features(x)
        variance = torch.einsum("kgh,nh->nkg", self.covariance, tilde).mul(tilde[:, None, :]).sum(-1)
        return logits, variance.clamp_min(0).to(logits.dtype)

    def _logits_and_covariance(self, x: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits at the mean and their joint covariance ``S(x)`` (N, K, K), by the joint covariance."""
        assert self.covariance is not None
        logits, tilde = self._features(x)
        g, k = self.covariance.shape[:2]
        flat = self.covariance.reshape(g, k * g * k)
        parts = []
        for start in range(0, len(tilde), chunk):  # (n, K, G+1, K) at a time
            t = tilde[start : start + chunk]
            half = (t @ flat).reshape(len(t), k, g, k)
            parts.append(torch.einsum("nkhl,nh->nkl", half, t))
        covariance = torch.cat(parts) if parts else tilde.new_zeros((0, k, k))
        return logits, 0.5 * (covariance + covariance.transpose(1, 2))

    def mean_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the network at the posterior mean."""
        return self.network(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.joint:
            logits, variance = self._logits_and_variance(x)
            return logits / torch.sqrt(1.0 + (math.pi / 8.0) * variance) / self.temperature
        # the probit rule on the centred logits C f ~ N(C f_bar, C S C) (module docstring)
        logits, s = self._logits_and_covariance(x)
        k = s.shape[-1]
        centre = torch.eye(k, dtype=s.dtype, device=s.device) - 1.0 / k
        mean = logits.to(s.dtype) @ centre
        variance = torch.diagonal(centre @ s @ centre, dim1=-2, dim2=-1).clamp_min(0)
        return (mean / torch.sqrt(1.0 + (math.pi / 8.0) * variance) / self.temperature.to(s.dtype)).to(logits.dtype)

    def _weight_draws(self, num_samples: int, seed: int) -> torch.Tensor:
        """``num_samples`` draws (S, G+1, K) of the output layer's weights (the bias as the last row)."""
        layer = cast(nn.Linear, self.network.get_submodule(self.output))
        mean = torch.cat([layer.weight.T, layer.bias[None]]).detach().double().cpu()
        g, k = mean.shape
        gen = torch.Generator().manual_seed(seed)
        if self.covariance is None:
            spread = torch.cat([self.weight_var.T, self.bias_var[None]]).double().cpu().sqrt()
            return mean + torch.randn((num_samples, g, k), generator=gen, dtype=torch.float64) * spread
        if self.joint:
            root = self._covariance_root()
            eps = torch.randn((num_samples, g * k), generator=gen, dtype=torch.float64)
            return mean + (eps @ root.T).reshape(num_samples, g, k)
        roots = self._covariance_root()  # (K, G+1, G+1)
        eps = torch.randn((num_samples, k, g), generator=gen, dtype=torch.float64)
        return mean + torch.einsum("kgh,skh->sgk", roots, eps)

    def _covariance_root(self) -> torch.Tensor:
        """The covariance's root (:func:`_root`, float64 on the host), factorised once per covariance."""
        assert self.covariance is not None
        c = self.covariance
        key = _key(c)
        cached = getattr(self, "_root_cache", None)
        if cached is None or cached[0] != key:
            matrix = c.double().cpu()
            matrix = matrix if c.dim() == 3 else matrix.reshape(c.shape[0] * c.shape[1], -1)
            self._root_cache = (key, _root(matrix))
        return self._root_cache[1]

    @torch.no_grad()
    def predict(self, x, *, num_samples: int | None = None, seed: int = 0, chunk: int = 1024) -> np.ndarray:
        """Class probabilities: the probit predictive, or the mean over ``num_samples`` draws of the
        output layer's weights from their posterior (the same draws for every input, whatever
        the batch: an input's prediction does not depend on the others)."""
        dtype = self.weight_var.dtype
        x = as_input(x, self.network, dtype)  # token ids stay integers
        check_inputs(x)
        if num_samples is not None:
            num_samples = check_num_samples(num_samples)
        was_training = self.training
        self.eval()
        try:
            if num_samples is None:
                return torch.softmax(self(x).double(), -1).numpy()
            draws = self._weight_draws(num_samples, seed)
            _, tilde = self._features(x)
            tilde, out = tilde.double().cpu(), []
            for start in range(0, len(tilde), chunk):
                f = torch.einsum("ng,sgk->snk", tilde[start : start + chunk], draws) / float(self.temperature)
                out.append(torch.softmax(f, -1).mean(0))
            return torch.cat(out).numpy()
        finally:
            self.train(was_training)


def _key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's values for a cache: its storage, in-place version, dtype and device."""
    return (t.data_ptr(), t._version, t.dtype, t.device)


def _root(covariance: torch.Tensor) -> torch.Tensor:
    """A matrix root ``R`` with ``R R^T = covariance`` (batched): its Cholesky factor, or where the
    covariance is only semi-definite (a direction of no variance), ``V diag(sqrt(lambda))`` of its
    eigendecomposition, negative round-off clipped."""
    root, info = torch.linalg.cholesky_ex(covariance)
    if not bool(info.any()):
        return root
    values, vectors = torch.linalg.eigh(covariance)
    return vectors * values.clamp_min(0).sqrt()[..., None, :]
