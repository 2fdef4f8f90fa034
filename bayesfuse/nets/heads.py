"""A fused network with the clients' own output layers: one fused body, a class-share pool of heads.

In one shot (:func:`bayesfuse.fuse` with ``head="clients"``, PFNM or NAFI) the heads are the
clients' own output layers: client j's weight from its hidden unit ``l`` becomes the head's
weight from the global unit its unit was matched to, 0 from the global units it has no unit in
(:mod:`bayesfuse.inference.client_heads`). Nothing more is sent than the weights; with client
summaries, each head is its client's Laplace posterior of that layer, Kronecker-factored as
below from the summary's factors, on the features of its matched units only.

After the refit round (:func:`bayesfuse.fuse` with ``rounds=2``) every client has fitted the
output layer on the fused network's features of its own data and sent the fit
(:func:`bayesfuse.summaries.output_fit`). The server multiplies the fits into one output layer
(:class:`~bayesfuse.nets.laplace.LastLayerLaplace`); with ``head="clients"`` it keeps them
instead, as the fused BNN's client heads do (:mod:`bayesfuse.models.bnn_heads`), and predicts
with the class-share pool of the heads' softmaxes:

.. math::

    \\text{linear:}\\quad p(y = k \\mid x) = \\frac{\\sum_j s_{jk}\\, p_j(k \\mid x)}
        {\\sum_{k'} \\sum_j s_{jk'}\\, p_j(k' \\mid x)}, \\qquad
    \\text{log:}\\quad p(y = k \\mid x) \\propto \\prod_j p_j(k \\mid x)^{s_{jk}},

with ``p_j(k | x) = softmax(W_j h(x) + b_j)_k`` on the fused features ``h(x)`` and ``s_jk = n_jk
/ sum_j n_jk`` client j's share of the examples of class k (``1 / J`` for a class no client saw).
The linear pool is a mixture, as an ensemble is: where the heads disagree (inputs unlike any
client's data) its predictive stays spread out, so its entropy tells such inputs apart about as
well as the ensemble's (see the README). The log pool is sharper and better calibrated in
distribution, and gives up most of that.

Each head is a posterior, not a point: the reply that carries ``W_hat_j`` also carries the
Kronecker factors of its Laplace precision (:mod:`bayesfuse.inference.output_fusion`),

.. math::

    H_j = n_j \\, \\bar A_j \\otimes \\bar S_j + \\lambda_j I ,

``lambda_j = lambda / J`` the prior share the client fitted with; with a ``scale`` the first term
is multiplied by ``scale_j`` (the trace-matched heads,
:func:`~bayesfuse.inference.client_heads.trace_ratios`). Given them (``laplace=``, which
:func:`bayesfuse.fuse` with ``head="clients"`` passes), ``p_j(k | x)`` is head j's Laplace
predictive, ``E[softmax(W^T a~)]`` under ``W ~ N(W_hat_j, H_j^{-1})``. The logits ``f = W^T a~`` are
Gaussian with mean ``W_hat_j^T a~`` and, in the eigenbases ``A_j = U diag(b) U^T``,
``S_j = V diag(c) V^T``, the covariance (Ritter, Botev & Barber 2018, eq. 7, for the output layer)

.. math::

    \\mathrm{Cov}(f) = V \\mathrm{diag}_k\\Big(\\sum_g \\frac{(U^T \\tilde a)_g^2}{n_j b_g c_k + \\lambda_j}\\Big) V^T

and the expectation is a mean over ``samples`` fixed standard normal draws (the same for every
input, so that a prediction does not depend on the batch it is in). Away from a client's data, in
directions of ``a~`` its Gram hardly covers, its head's logits spread, so the mixture's entropy rises
where the clients' heads could only guess: on Fashion-MNIST it tells font digits from the test set
better than the ensemble of the clients' own networks (see the quality guide). ``predictive =
"map"`` uses the fits' means alone.

Each head's predictive is smoothed by the number of examples ``n_j`` it was trained on (the
clients' class counts summed; without counts, not at all): the posterior mean of a class
distribution after ``n_j`` examples spread as ``p_j(. | x)`` under a symmetric Dirichlet prior of
``c`` pseudo-examples per class (:data:`PSEUDO_COUNT`, 1: Laplace's rule of succession),

.. math::

    \\tilde p_j(k \\mid x) = \\frac{n_j\\, p_j(k \\mid x) + c}{n_j + K c} ,

so that no head puts less than ``c / (n_j + K c)`` on a class: a head's evidence against a class
is worth at most what ``n_j`` examples can say. The mixture hardly changes. The geometric pool
does: it multiplies the heads, so one head that is confidently wrong (a probability of e^-100 on
the true class, which a softmax gives far from the head's data) vetoes the class for all; smoothed,
a head's veto costs at most ``s_jk log((n_j + K c) / c)`` nats. On Fashion-MNIST's one-hidden-layer
federations this takes the one-shot log pool's NLL from above the ensemble's to under it
(the quality guide). ``pseudo_count=0`` turns it off.

The heads cost the server nothing more: they are the replies of the refit round. They add
``J K (G + 1)`` numbers to the fused network (G the fused output layer's inputs), and with their
posteriors ``J ((G + 1)^2 + K^2 + 1)``; EKFAC heads ``J (G + 1) K`` more.
"""

from __future__ import annotations

import copy
import math
import numbers

import numpy as np
import torch
from torch import nn

from bayesfuse._validation import check_inputs, check_num_samples
from bayesfuse.inference.client_heads import class_shares, one_shot_heads
from bayesfuse.nets.state import OutputLogitsError, model_input, saved_temperature

__all__ = [
    "ClientHeads",
    "POOLS",
    "PREDICTIVES",
    "PSEUDO_COUNT",
    "checked_pseudo_count",
    "class_shares",
    "logits_and_features",
    "logit_variances",
]

#: How :class:`ClientHeads` pools its heads (module docstring).
POOLS = ("linear", "log")
#: What each head predicts: its Laplace predictive, or the softmax of its fit's mean.
PREDICTIVES = ("laplace", "map")
#: The Dirichlet pseudo-count per class that smooths each head's predictive against the examples
#: it was trained on (module docstring): 1, Laplace's rule of succession.
PSEUDO_COUNT = 1.0


def logits_and_features(network: nn.Module, output: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``network``'s output layer ``output`` on ``x`` and the features that layer
    reads, in one pass.

    Everything that predicts from the output layer's posterior (its Laplace predictive, the
    clients' heads, their curvature) takes the network's predictive to be the softmax of that
    layer's logits. A ``forward`` may do to them only what leaves that softmax as it is (a
    ``log_softmax``, a shift per input); one that does more (a scale, a bias, another layer) is
    refused with ``ValueError``: a posterior of the layer would not be the network's."""
    layer = network.get_submodule(output)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (features, logits) of each application
    hook = layer.register_forward_hook(lambda mod, inp, out: calls.append((inp[0], out)))
    try:
        returned = network(x)
    finally:
        hook.remove()
    if len(calls) != 1:
        raise ValueError(
            f"{type(network).__name__} applies its output layer {output!r} {len(calls)} times per batch: the output "
            "layer's posterior predicts from one application of it"
        )
    features, logits = calls[0]
    if not isinstance(returned, torch.Tensor) or returned.shape != logits.shape:
        shape = tuple(returned.shape) if isinstance(returned, torch.Tensor) else type(returned).__name__
        raise ValueError(
            f"{type(network).__name__} returns {shape} where its output layer {output!r} gives logits of shape "
            f"{tuple(logits.shape)}: the output layer's posterior predicts from those logits; return them"
        )
    if logits.numel() and logits.is_floating_point() and returned.is_floating_point():
        with torch.no_grad():  # a shift per input (log_softmax) leaves the softmax: returned - logits constant
            r, f = returned.double(), logits.double()
            shift = r - f
            spread = shift.amax(-1) - shift.amin(-1)
            eps = max(torch.finfo(returned.dtype).eps, torch.finfo(logits.dtype).eps)
            allowed = 8 * eps * (r.abs() + f.abs()).amax(-1)  # the rounding of a shift in these dtypes
            excess = float((spread - allowed).amax())
        if excess > 0:
            raise OutputLogitsError(
                f"{type(network).__name__}'s forward changes the logits of its output layer {output!r} after it (by "
                f"up to {float(spread.amax()):.2g} more for one class than another): the output layer's posterior "
                "predicts from that layer's logits; return them as they are (a log_softmax is fine)"
            )
    return logits, features


def _check_pool(pool: str) -> str:
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    return pool


def logit_variances(features: torch.Tensor, gram_vecs, gram_vals, curv_vals, n: float, prior: float) -> torch.Tensor:
    """``diag_k`` of the module docstring's ``V^T Cov(f) V``: (N, K) variances of one head's logits
    in the eigenbasis ``V`` of its curvature, for features ``a~`` (N, G+1) (bias column included)."""
    rotated = (features @ gram_vecs) ** 2  # (U^T a~)^2, (N, G+1)
    return rotated @ (1.0 / (n * gram_vals[:, None] * curv_vals[None, :] + prior))


#: Inputs a head's Monte Carlo predictive takes at a time (ClientHeads.head_log_probs).
_ROWS = 1024

#: How far below zero (relative to the largest) an eigenvalue of a Laplace factor may lie and still
#: count as round-off: float32 factors carry relative errors near 1e-7 per entry.
_PSD_TOL = 1e-5


def _supported_eigh(gram: torch.Tensor, support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors of each head's Gram, decomposed on its support alone: outside
    it the Gram is 0 and the eigenvectors are the unit vectors there (exact, and robust where a
    one-shot head reads few of many fused units: a large matrix mostly of zeros has eigenvalue 0
    many times over, which LAPACK's solver may fail to converge on)."""
    J, size, _ = gram.shape
    vals = torch.zeros(J, size, dtype=gram.dtype)
    vecs = torch.eye(size, dtype=gram.dtype).repeat(J, 1, 1)
    for j in range(J):
        at = torch.nonzero(support[j]).flatten()
        v, u = torch.linalg.eigh(gram[j][at][:, at])
        vals[j, at] = v
        vecs[j][at[:, None], at[None, :]] = u
    return vals, vecs


def unsmoothable(advice: str, name: str = "") -> ValueError:
    """The error for a pseudo-count given to heads that know no examples (nothing to smooth them
    by), naming ``name`` where given and ending with ``advice``, what would give them examples."""
    where = f"{name}: " if name else ""
    return ValueError(
        f"{where}pseudo_count smooths each head by its client's examples; these heads know none ({advice})"
    )


def checked_pseudo_count(value) -> float:
    """``value`` as a pseudo-count (:attr:`ClientHeads.pseudo_count`): a real number, finite and
    ``>= 0``, not a bool; else ``ValueError``."""
    try:
        ok = (
            not isinstance(value, (bool, np.bool_))
            and isinstance(value, numbers.Real)
            and math.isfinite(float(value))
            and float(value) >= 0
        )
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"pseudo_count must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_eigenbases(b: dict) -> None:
    """Refuse saved Kronecker heads whose eigenbases are not orthonormal (to round-off), or whose
    Gram's eigenvalues or EKFAC eigenvalues lie off their head's support: what
    :class:`ClientHeads` computes from factors always satisfies these."""
    for key in ("gram_vecs", "curv_vecs"):
        vecs = b[key].double()
        eye = torch.eye(vecs.shape[-1], dtype=torch.float64)
        if not bool(((vecs.transpose(1, 2) @ vecs - eye).abs() <= 1e-8).all()):
            raise ValueError(f"the saved heads' {key} are not orthonormal")
    off = b["support"] == 0
    if bool((b["gram_vals"][off] != 0).any()) or ("eigenvalues" in b and bool((b["eigenvalues"][off] != 0).any())):
        raise ValueError("the saved heads' eigenvalues lie off their support")


class ClientHeads(nn.Module):
    """The fused ``network`` whose output layer ``output`` is replaced, at prediction, by the class-share
    pool of the clients' heads (module docstring).

    Parameters
    ----------
    network : nn.Module
        The fused network; its output layer (``nn.Linear``) gives the features' width.
    output : str
        The name of the output layer in ``network``.
    weight : (J, K, G) array
        Each client's output weights on the fused features.
    bias : (J, K) array
        Each client's output biases.
    shares : (J, K) array
        Each client's share of each class, >= 0 and summing to 1 over the clients (:func:`class_shares`).
    pool : {"linear", "log"}
        The mixture of the heads' predictive distributions (default), or their geometric pool.
    laplace : dict, optional
        Each head's Laplace posterior (module docstring), in one of two forms. Kronecker-factored
        (the refit round's, and the one-shot heads' with summaries): ``gram`` (J, G+1, G+1), the
        mean of ``a~ a~^T`` over the client's examples; ``curvature`` (J, K, K), the mean softmax
        Hessian at its fit; ``n`` (J,), its number of examples; ``prior_precision``, the
        ``lambda_j`` it was fitted with (one number, or one per head); optionally ``support`` (J,
        G+1), 1 where a head reads a feature and 0 where it does not (a one-shot head's weights from
        global units its client has no unit in: 0, and no variance), all ones by default; optionally
        ``scale`` (J,), > 0, each head's curvature multiplied by it, ``H_j = scale_j n_j A_j (x) S_j +
        lambda_j I`` (the trace-matched heads, :func:`~bayesfuse.inference.client_heads.trace_ratios`),
        all ones by default; optionally ``eigenvalues`` (J, G+1, K) >= 0, the curvature's
        eigenvalues in the eigenbasis ``u_i (x) v_k`` of ``gram`` and ``curvature`` in place of
        ``n_j alpha_i sigma_k`` (EKFAC: :func:`~bayesfuse.inference.client_heads.ekfac_eigenvalues`;
        row ``i`` for the eigenpair of a head's Gram kept at its ``i``-th supported feature, 0 off
        its support), ``H_j = sum_ik (scale_j eigenvalues_jik + lambda_j) (u_i (x) v_k)(u_i (x)
        v_k)^T``. Diagonal
        (a version 1 client summary's): ``precision`` (J, K, G+1), each head weight's posterior
        precision, the bias last; ``inf`` where the head has no weight (a global unit the client has
        no unit in), so that it stays 0. Then ``Var(f_k) = sum_g a~_g^2 / P_kg``, the classes
        independent. Without it the heads are points.
    samples : int
        Draws of each head's logits for its Laplace predictive.
    examples : (J,) array, optional
        The number of examples each head was trained on (its client's class counts summed): each
        head's predictive is smoothed by them (module docstring). Without, it is not.
    pseudo_count : float
        ``c``, the Dirichlet pseudo-count per class of the smoothing (:data:`PSEUDO_COUNT`; 0:
        none); may be set.

    ``forward`` returns the pooled predictive's log-probabilities, so that
    :func:`~bayesfuse.nets.predict.predict_proba` (a softmax) gives its probabilities. The
    ``temperature`` buffer (1 unless the temperature round set it, :func:`bayesfuse.fuse` with
    ``second_round="temperature"``) divides them before they are normalised:
    ``p(y = k | x) = softmax(log pool(x) / T)_k``.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    shares: torch.Tensor
    temperature: torch.Tensor
    examples: torch.Tensor  # where the heads know their examples only
    _pseudo_count: float
    gram_vals: torch.Tensor  # with Kronecker-factored posteriors (laplace=) only, as the buffers below
    inv_precision: torch.Tensor  # with diagonal posteriors only
    gram_vecs: torch.Tensor
    support: torch.Tensor
    prior: torch.Tensor
    scale: torch.Tensor
    eigenvalues: torch.Tensor  # EKFAC heads only
    curv_vals: torch.Tensor
    curv_vecs: torch.Tensor
    n: torch.Tensor
    draws: torch.Tensor

    def __init__(
        self,
        network: nn.Module,
        output: str,
        weight,
        bias,
        shares,
        *,
        pool: str = "linear",
        laplace: dict | None = None,
        samples: int = 64,
        examples=None,
        pseudo_count: float = PSEUDO_COUNT,
    ) -> None:
        super().__init__()
        layer = network.get_submodule(output)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"the output layer {output!r} must be an nn.Linear, got {type(layer).__name__}")
        _check_pool(pool)
        dtype = torch.float64
        weight, bias, shares = (torch.as_tensor(np.array(a), dtype=dtype) for a in (weight, bias, shares))
        J = weight.shape[0] if weight.ndim == 3 else -1
        K, G = layer.out_features, layer.in_features
        if weight.shape != (J, K, G) or bias.shape != (J, K) or shares.shape != (J, K) or J < 1:
            raise ValueError(
                f"heads of shapes {tuple(weight.shape)}, {tuple(bias.shape)}, shares {tuple(shares.shape)} do not fit "
                f"the output layer {tuple(layer.weight.shape)}: need (J, {K}, {G}), (J, {K}) and (J, {K})"
            )
        if not all(torch.isfinite(a).all() for a in (weight, bias, shares)):
            raise ValueError("the heads' weights, biases and shares must be finite")
        if (shares < 0).any() or not torch.allclose(shares.sum(0), torch.ones(K, dtype=dtype), atol=1e-9):
            raise ValueError("shares must be >= 0 and sum to 1 over the clients for every class")
        self.network = network
        self.output = output
        self._pool = pool
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.register_buffer("shares", shares)
        self.register_buffer("temperature", torch.ones((), dtype=dtype))
        self.pseudo_count = pseudo_count
        if examples is not None:
            counts = torch.as_tensor(np.array(examples, dtype=np.float64))
            if counts.shape != (J,):
                raise ValueError(
                    f"examples must be {J} numbers (each head's examples), got shape {tuple(counts.shape)}"
                )
            if not bool((torch.isfinite(counts) & (counts >= 0)).all()):
                raise ValueError(f"each head's examples must be a finite number >= 0, got {counts.tolist()}")
            self.register_buffer("examples", counts)
        self._predictive = "map"
        if laplace is not None:
            self._set_laplace(laplace, samples)
            self._predictive = "laplace"

    def _set_laplace(self, laplace: dict, samples: int) -> None:
        J, K, G = self.weight.shape
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
            raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
        if "precision" in laplace:
            extra = set(laplace) - {"precision"}
            if extra:
                raise ValueError(f"a diagonal laplace takes precision alone; also got {sorted(extra)}")
            precision = torch.as_tensor(np.array(laplace["precision"], dtype=np.float64))
            if precision.shape != (J, K, G + 1):
                raise ValueError(
                    f"laplace precision of shape {tuple(precision.shape)} does not fit {J} heads of {K} classes on "
                    f"{G} features: need ({J}, {K}, {G + 1})"
                )
            if torch.isnan(precision).any() or (precision <= 0).any():
                raise ValueError("the laplace precisions must be positive (inf for a weight a head does not have)")
            self.register_buffer("inv_precision", 1.0 / precision)
            self._register_draws(J, K, samples)
            return
        missing = {"gram", "curvature", "n", "prior_precision"} - set(laplace)
        if missing:
            raise ValueError(f"laplace needs gram, curvature, n and prior_precision; missing {sorted(missing)}")
        extra = set(laplace) - {"gram", "curvature", "n", "prior_precision", "support", "scale", "eigenvalues"}
        if extra:
            raise ValueError(
                "a Kronecker laplace takes gram, curvature, n, prior_precision, support, scale and eigenvalues; "
                f"got {sorted(extra)}"
            )
        gram, curvature, n = (
            torch.as_tensor(np.array(laplace[k]), dtype=torch.float64) for k in ("gram", "curvature", "n")
        )
        prior = torch.as_tensor(np.array(laplace["prior_precision"], dtype=np.float64))
        prior = prior.expand(J).clone() if prior.ndim == 0 else prior
        support = torch.as_tensor(np.array(laplace.get("support", np.ones((J, G + 1))), dtype=np.float64))
        if gram.shape != (J, G + 1, G + 1) or curvature.shape != (J, K, K) or n.shape != (J,):
            raise ValueError(
                f"laplace factors of shapes gram {tuple(gram.shape)}, curvature {tuple(curvature.shape)}, n "
                f"{tuple(n.shape)} do not fit {J} heads of {K} classes on {G} features: need ({J}, {G + 1}, "
                f"{G + 1}), ({J}, {K}, {K}) and ({J},)"
            )
        if prior.shape != (J,) or support.shape != (J, G + 1):
            raise ValueError(
                f"laplace prior_precision of shape {tuple(prior.shape)} and support {tuple(support.shape)} do not "
                f"fit {J} heads on {G} features: need one number or ({J},), and ({J}, {G + 1})"
            )
        if not all(torch.isfinite(a).all() for a in (gram, curvature, n)) or not bool(
            (torch.isfinite(prior) & (prior > 0)).all()
        ):
            raise ValueError("the laplace factors must be finite and the prior precision > 0")
        if not bool(((support == 0) | (support == 1)).all()):
            raise ValueError("the laplace support must hold 0 and 1 only")
        if (n <= 0).any():
            raise ValueError("every head needs n > 0 examples")
        if bool(((gram != 0) & (support[:, :, None] * support[:, None, :] == 0)).any()):
            raise ValueError("the laplace gram has entries outside its head's support")
        # symmetrised, and negative eigenvalues tolerated down to round-off: factors sent in float32
        # (summaries, Flower records) move the softmax Hessian's exact zero eigenvalue by ~1e-8 of
        # its largest, either way; what is left below zero is clamped to 0
        gram_vals, gram_vecs = _supported_eigh((gram + gram.transpose(1, 2)) / 2, support > 0)
        curv_vals, curv_vecs = torch.linalg.eigh((curvature + curvature.transpose(1, 2)) / 2)
        if (gram_vals < -_PSD_TOL * gram_vals.abs().amax(-1, keepdim=True)).any() or (
            curv_vals < -_PSD_TOL * curv_vals.abs().amax(-1, keepdim=True).clamp_min(1e-300)
        ).any():
            raise ValueError("the laplace factors gram and curvature must be positive semi-definite")
        self.register_buffer("gram_vals", gram_vals.clamp_min(0.0))
        self.register_buffer("gram_vecs", gram_vecs)
        self.register_buffer("curv_vals", curv_vals.clamp_min(0.0))
        self.register_buffer("curv_vecs", curv_vecs.contiguous())  # as a saved copy holds it: the same round-off
        self.register_buffer("n", n)
        self.register_buffer("prior", prior)
        if "scale" in laplace:
            self._set_scale(laplace["scale"])
        self.register_buffer("support", support)
        if "eigenvalues" in laplace:
            self._set_eigenvalues(laplace["eigenvalues"])
        self._register_draws(J, K, samples)

    def _set_scale(self, scale) -> None:
        if hasattr(self, "eigenvalues"):
            raise ValueError("these heads have EKFAC eigenvalues, whose trace is the exact GGN's: no scale")
        J = self.n_heads
        values = torch.as_tensor(np.array(scale, dtype=np.float64))
        if values.shape != (J,) or not bool((torch.isfinite(values) & (values > 0)).all()):
            raise ValueError(f"laplace scale must be {J} finite numbers > 0, got shape {tuple(values.shape)}")
        self.register_buffer("scale", values)

    def _set_eigenvalues(self, eigenvalues) -> None:
        if hasattr(self, "scale"):
            raise ValueError("these heads' curvature is scaled; EKFAC eigenvalues replace K-FAC's unscaled")
        J, K, G = self.weight.shape
        values = torch.as_tensor(np.array(eigenvalues, dtype=np.float64))
        if values.shape != (J, G + 1, K):
            raise ValueError(f"laplace eigenvalues of shape {tuple(values.shape)} do not fit: need {(J, G + 1, K)}")
        if not bool((torch.isfinite(values) & (values >= 0)).all()):
            raise ValueError("the laplace eigenvalues must be finite and >= 0")
        if bool(((values != 0) & (self.support[:, :, None] == 0)).any()):
            raise ValueError("the laplace eigenvalues have entries outside their head's support")
        self.register_buffer("eigenvalues", values)

    def with_eigenvalues(self, eigenvalues) -> "ClientHeads":
        """These Kronecker-factored heads with the curvature's eigenvalues ``eigenvalues`` (J, G+1,
        K) in their factors' eigenbasis (``laplace["eigenvalues"]``, EKFAC:
        :func:`~bayesfuse.inference.client_heads.ekfac_eigenvalues`): a copy on the same
        ``network`` object, every other tensor copied bit for bit."""
        return self._twin("curvature eigenvalues are", ClientHeads._set_eigenvalues, eigenvalues)

    def with_scale(self, scale) -> "ClientHeads":
        """These Kronecker-factored heads, each one's curvature multiplied by ``scale`` (J,) > 0
        (``laplace["scale"]``, e.g. :func:`~bayesfuse.inference.client_heads.trace_ratios`): a
        copy on the same ``network`` object, every other tensor copied bit for bit."""
        return self._twin("a curvature scale is", ClientHeads._set_scale, scale)

    def with_diagonal(self, precision) -> "ClientHeads":
        """These heads' weights, biases, shares, pool and smoothing on the same ``network`` object, each head
        the diagonal Laplace posterior of ``precision`` (J, K, G+1; ``laplace["precision"]``,
        ``inf`` where a head has no weight; e.g. the third value of
        :func:`~bayesfuse.inference.client_heads.kronecker_variants`), at temperature 1, in eval mode."""
        samples = int(self.draws.shape[1]) if hasattr(self, "draws") else 64
        return ClientHeads(
            self.network,
            self.output,
            self.weight.numpy(),
            self.bias.numpy(),
            self.shares.numpy(),
            pool=self.pool,
            laplace={"precision": precision},
            samples=samples,
            examples=self.examples.numpy() if hasattr(self, "examples") else None,
            pseudo_count=self.pseudo_count,
        ).eval()

    def _twin(self, what: str, setter, value) -> "ClientHeads":
        """A copy of these Kronecker-factored heads on the same ``network``, ``setter(copy,
        value)`` applied (``what`` names the value in the refusal of other heads)."""
        if self.form != "kronecker":
            raise ValueError(f"{what} for Kronecker-factored heads; these are {self.form!r}")
        twin = copy.deepcopy(self, memo={id(self.network): self.network})
        setter(twin, value)
        return twin

    def _register_draws(self, J: int, K: int, samples: int) -> None:
        """The fixed standard normal draws of every head's logits (the same for every input)."""
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("draws", torch.randn(J, samples, K, generator=generator, dtype=torch.float64))

    @classmethod
    def from_fits(
        cls,
        network: nn.Module,
        output: str,
        fits,
        class_counts,
        *,
        pool: str = "linear",
        prior_precision: float | None = None,
        samples: int = 64,
    ) -> "ClientHeads":
        """The heads of the clients' refit replies (:class:`~bayesfuse.inference.output_fusion.OutputFit`,
        weights ``(G+1, K)`` with the bias as the last row), mixed by the shares of ``class_counts``
        (J, K), in the fits' order; in eval mode. With ``prior_precision``, the ``lambda_j`` the
        fits were made with (``lambda / J``), each head is its fit's Laplace posterior (the
        fits' Gram and curvature); without it, the fits' means. Each head's predictive is smoothed
        by its client's examples, ``class_counts`` summed (module docstring)."""
        weights = np.stack([f.weight for f in fits])
        laplace = (
            None
            if prior_precision is None
            else dict(
                gram=np.stack([f.gram for f in fits]),
                curvature=np.stack([f.curvature for f in fits]),
                n=np.array([f.n for f in fits], dtype=np.float64),
                prior_precision=prior_precision,
            )
        )
        return cls(
            network,
            output,
            weights[:, :-1].transpose(0, 2, 1),
            weights[:, -1],
            class_shares(class_counts),
            pool=pool,
            laplace=laplace,
            samples=samples,
            examples=np.asarray(class_counts, dtype=np.float64).sum(1),
        ).eval()

    @classmethod
    def from_clients(
        cls,
        network: nn.Module,
        spec,
        states,
        assignments,
        class_counts=None,
        summaries=None,
        *,
        pool: str = "linear",
        samples: int = 64,
        trace_match: bool = False,
        ekfac: bool = False,
    ) -> "ClientHeads":
        """One shot: the clients' own output layers as heads on the fused ``network`` (module docstring).

        Client j's output weight from its hidden unit ``l`` (its state_dict ``states[j]``) becomes
        its head's weight from the global unit ``assignments[g][j][l]`` its unit was matched to,
        ``g`` the group the output layer of ``spec`` reads, and 0 from the global units it has no
        unit in; its bias is its own. The heads are mixed by the shares of ``class_counts`` (J, K)
        (without: the summaries' counts, as :func:`bayesfuse.fuse_states` weights the fusion;
        uniform without either). With ``summaries`` (one :class:`~bayesfuse.summaries.ClientSummary` per
        client) each head is its client's Laplace posterior of its output layer (Daxberger et al. 2021):
        Kronecker-factored where the summaries carry the layer's factors, else diagonal
        (:mod:`bayesfuse.inference.client_heads`); a weight the head does not have gets no
        variance. Without, the heads are points. With ``trace_match`` each Kronecker-factored
        head's curvature is scaled to the exact GGN's trace
        (:func:`~bayesfuse.inference.client_heads.trace_ratios`); with ``ekfac`` its eigenvalues
        are the exact GGN's in the factors' eigenbasis (version 3 summaries,
        :func:`~bayesfuse.inference.client_heads.ekfac_eigenvalues`). In eval mode.
        """
        weight_key, _ = spec.output_layer(states[0])
        layer = network.get_submodule(weight_key.rpartition(".")[0])
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"the clients' own heads need an nn.Linear output layer, got {type(layer).__name__}")
        heads = one_shot_heads(
            spec, states, assignments, layer.in_features, class_counts, summaries, trace_match=trace_match, ekfac=ekfac
        )
        return cls.from_arrays(network, heads, pool=pool, samples=samples)

    @classmethod
    def from_arrays(cls, network: nn.Module, heads: dict, *, pool: str = "linear", samples: int = 64) -> "ClientHeads":
        """The heads :func:`~bayesfuse.inference.client_heads.one_shot_heads` computed (or a heads
        file holds, :func:`~bayesfuse.checkpoints.read_heads`) on ``network``, in eval mode; smoothed
        with ``heads["pseudo_count"]`` where given."""
        model = cls(
            network,
            heads["output"],
            heads["weight"],
            heads["bias"],
            heads["shares"],
            pool=pool,
            laplace=heads.get("laplace"),
            samples=samples,
            examples=heads.get("examples"),
        ).eval()
        if heads.get("pseudo_count") is not None:
            model.pseudo_count = heads["pseudo_count"]
        return model

    @classmethod
    def from_buffers(
        cls,
        network: nn.Module,
        output: str,
        buffers: dict,
        *,
        pool: str,
        pseudo_count: float,
        predictive: str,
        form: str | None = None,
    ) -> "ClientHeads":
        """Heads saved as their own tensors (:func:`~bayesfuse.checkpoints.module_heads_bytes`,
        :func:`bayesfuse.save`) back on ``network``, predicting exactly as the
        saved ones did (the same eigenbases, draws and temperature); in eval mode. Tensors of
        another shape, sign or kind than such heads hold, or of another ``form`` than the file says,
        are refused (``ValueError``)."""
        b = {k: torch.as_tensor(np.asarray(v)) for k, v in buffers.items()}
        missing = sorted({"weight", "bias", "shares", "temperature"} - set(b))
        if missing:
            raise ValueError(f"the saved heads are incomplete (missing {missing})")
        examples = b.pop("examples", None)
        model = cls(
            network,
            output,
            *(b.pop(k).numpy() for k in ("weight", "bias", "shares")),
            pool=pool,
            examples=None if examples is None else examples.numpy(),
            pseudo_count=pseudo_count,  # inert where the heads know no examples, as a fresh one's default
        )
        model.temperature.copy_(saved_temperature(b.pop("temperature"), "the saved heads"))
        J, K, G = model.weight.shape
        if "draws" in b:
            shapes: dict[str, tuple[int, ...]] = {
                "draws": (J, int(b["draws"].shape[1]) if b["draws"].dim() == 3 else -1, K)
            }
            if "inv_precision" in b:
                shapes["inv_precision"] = (J, K, G + 1)
            else:
                shapes.update(
                    gram_vals=(J, G + 1),
                    gram_vecs=(J, G + 1, G + 1),
                    curv_vals=(J, K),
                    curv_vecs=(J, K, K),
                    n=(J,),
                    prior=(J,),
                    support=(J, G + 1),
                )
                shapes.update({k: v for k, v in (("scale", (J,)), ("eigenvalues", (J, G + 1, K))) if k in b})
            wrong = sorted(set(b) ^ set(shapes)) or [k for k, shape in shapes.items() if tuple(b[k].shape) != shape]
            if wrong or shapes["draws"][1] < 1:
                raise ValueError(
                    f"the saved heads' posterior tensors {wrong or ['draws']} do not fit {J} heads of {K} classes"
                )
            if not all(bool(torch.isfinite(t).all()) for t in b.values()) or any(
                bool((b[k] < 0).any()) for k in ("inv_precision", "gram_vals", "curv_vals", "eigenvalues") if k in b
            ):
                raise ValueError(
                    "the saved heads' posterior tensors must be finite, their variances and eigenvalues >= 0"
                )
            if "n" in b and not (
                bool(((b["n"] > 0) & (b["prior"] > 0)).all())
                and bool(((b["support"] == 0) | (b["support"] == 1)).all())
                and bool((b.get("scale", torch.ones(1)) > 0).all())
                and not {"scale", "eigenvalues"} <= set(b)
            ):
                raise ValueError(
                    "the saved heads need n > 0 examples, a prior precision > 0 and a scale > 0 each, a support "
                    "of 0 and 1, and a scale or eigenvalues, not both"
                )
            if "n" in b:
                _check_eigenbases(b)
            for k, t in b.items():
                model.register_buffer(k, t.to(torch.float64))
            model._predictive = "laplace"
        elif b:
            raise ValueError(f"the saved heads hold unknown tensors {sorted(b)}")
        if form is not None and model.form != form:
            raise ValueError(f"the saved heads are {model.form!r}, not {form!r} as written")
        model.predictive = predictive
        return model.eval()

    @property
    def predictive(self) -> str:
        """``"laplace"`` (each head's Laplace predictive; the default where the heads have
        posteriors) or ``"map"`` (each head's mean); may be set."""
        return self._predictive

    @predictive.setter
    def predictive(self, value: str) -> None:
        if value not in PREDICTIVES:
            raise ValueError(f"predictive must be one of {PREDICTIVES}, got {value!r}")
        if value == "laplace" and not hasattr(self, "draws"):
            raise ValueError("these heads have no posteriors (laplace=None): only predictive='map'")
        self._predictive = value

    @property
    def form(self) -> str:
        """The heads' posteriors: ``"kronecker"``, ``"diagonal"`` or ``"map"`` (points)
        (:data:`~bayesfuse.inference.client_heads.HEAD_FORMS`)."""
        if hasattr(self, "inv_precision"):
            return "diagonal"
        return "kronecker" if hasattr(self, "gram_vals") else "map"

    @property
    def pool(self) -> str:
        """``"linear"`` (the mixture) or ``"log"`` (the geometric pool); may be set."""
        return self._pool

    @pool.setter
    def pool(self, value: str) -> None:
        self._pool = _check_pool(value)

    @property
    def pseudo_count(self) -> float:
        """``c``, the Dirichlet pseudo-count per class that smooths each head's predictive against
        its ``examples`` (module docstring; 0: none); may be set."""
        return self._pseudo_count

    @pseudo_count.setter
    def pseudo_count(self, value: float) -> None:
        self._pseudo_count = checked_pseudo_count(value)

    @property
    def n_heads(self) -> int:
        return int(self.shares.shape[0])

    def head_log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """(J, N, K): each head's log-probabilities on the fused features of ``x`` (its Laplace
        predictive, or its mean's softmax: :attr:`predictive`), smoothed by its examples where the
        heads know them (:attr:`pseudo_count`)."""
        return self._smoothed(self._head_log_probs(x))

    def _smoothed(self, log_p: torch.Tensor) -> torch.Tensor:
        """``log((n_j p + c) / (n_j + K c))`` of the heads' ``log p`` (J, N, K): the module docstring's smoothing."""
        if not hasattr(self, "examples") or self.pseudo_count == 0:
            return log_p
        K = log_p.shape[-1]
        # eps = K c / (n + K c), written so that no large c overflows; in (0, 1], 1 for a head of no examples
        eps = (1.0 / (1.0 + self.examples / (K * self.pseudo_count)))[:, None, None]
        return torch.logaddexp(torch.log1p(-eps) + log_p, torch.log(eps / K))

    def _head_log_probs(self, x: torch.Tensor) -> torch.Tensor:
        _, features = logits_and_features(self.network, self.output, x)
        if features.dim() != 2:
            raise ValueError(
                f"the output layer {self.output!r} reads features of shape {tuple(features.shape)}, not (n, G): "
                "give x as a batch of inputs (n, ...)"
            )
        features = features.to(self.weight.dtype)
        logits = torch.einsum("jkg,ng->jnk", self.weight, features) + self.bias[:, None, :]
        if self.predictive == "map":
            return torch.log_softmax(logits, -1)
        with_bias = torch.cat([features, features.new_ones(len(features), 1)], dim=1)
        out = torch.empty_like(logits)
        samples = self.draws.shape[1]
        for j in range(self.n_heads):
            variances, basis = self._logit_variances(j)
            # _ROWS inputs at a time: (samples, _ROWS, K) arrays stay in cache; no input's result
            # depends on the others' (to round-off: kernels group sums by the number of rows)
            for start in range(0, len(features), _ROWS):
                rows = slice(start, start + _ROWS)
                noise = self.draws[j][:, None, :] * variances(with_bias[rows]).sqrt()[None]
                if basis is not None:
                    noise = noise @ basis.T  # V (sqrt(d) * eps)
                log_p = torch.log_softmax(logits[j, rows][None] + noise, -1)
                out[j, rows] = torch.logsumexp(log_p, 0) - math.log(samples)  # log mean_s softmax
        return out

    def _logit_variances(self, j: int):
        """Head ``j``'s logit variances as a function of features ``a~`` (N, G+1), and the basis its
        draws are rotated by (None: the classes are independent).

        Diagonal: ``Var(f_k) = sum_g a~_g^2 / P_kg``. Kronecker: the variances in the eigenbasis
        ``V`` of its curvature, on the features the head reads alone: outside its support its
        eigenvectors are unit vectors on features it masks to 0 (:func:`_supported_eigh`), which
        add nothing."""
        if hasattr(self, "inv_precision"):
            inv_precision = self.inv_precision[j].T
            return (lambda a: a.square() @ inv_precision), None
        at = torch.nonzero(self.support[j]).flatten()
        vecs, vals, curv = self.gram_vecs[j][at][:, at], self.gram_vals[j][at], self.curv_vals[j]
        scale = float(self.scale[j]) if hasattr(self, "scale") else 1.0
        prior = float(self.prior[j])
        if hasattr(self, "eigenvalues"):  # EKFAC: the eigenvalues as measured
            inverse = 1.0 / (scale * self.eigenvalues[j][at] + prior)
            return (lambda a: ((a[:, at] @ vecs) ** 2) @ inverse), self.curv_vecs[j]
        n = float(self.n[j]) * scale
        return (lambda a: logit_variances(a[:, at], vecs, vals, curv, n, prior)), self.curv_vecs[j]

    @torch.no_grad()
    def predict(self, x, *, num_samples: int | None = None, seed: int = 0) -> np.ndarray:
        """Class probabilities (n, K) as float64.

        With ``num_samples`` None, the heads' own fixed draws (:meth:`forward`, the same every
        call); else each head's Laplace predictive is estimated by ``num_samples`` fresh standard
        normal draws made from ``seed`` (the same for every input, whatever the batch). Heads
        that predict by their means (``predictive="map"``) draw nothing.
        """
        x = model_input(x, self.network)
        check_inputs(x)
        kept = getattr(self, "draws", None)
        if num_samples is not None:
            n = check_num_samples(num_samples)
            if kept is not None:
                generator = torch.Generator().manual_seed(int(seed))
                self.draws = torch.randn(
                    kept.shape[0], n, kept.shape[2], generator=generator, dtype=kept.dtype, device=kept.device
                )
        was_training = self.training
        self.eval()
        try:
            return torch.softmax(self(x).double(), -1).cpu().numpy()
        finally:
            self.train(was_training)
            if kept is not None:
                self.draws = kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_p = self.head_log_probs(x)
        if self.pool == "linear":
            pooled = torch.logsumexp(log_p + torch.log(self.shares)[:, None, :], dim=0)  # log sum_j s_jk p_jk
        else:
            pooled = torch.einsum("jk,jnk->nk", self.shares, log_p)  # sum_j s_jk log p_jk
        return torch.log_softmax(pooled / self.temperature, -1)
