"""The cost of giving a client's neurons to atoms: gain terms, :func:`assignment_cost` and its
blocks, and the float32 screen for the pairs worth a look (:func:`negative_pairs`)."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from bayesfuse.constraints import KEYS, Options, validate_params
from bayesfuse.inference._backend import backend_of, ieee_float32, is_tensor, namespace, to_host
from bayesfuse.inference.matching.checks import widen
from bayesfuse.inference.matching.model import Groups, Prior

Cost = Literal["pfnm", "marginal"]


def gain_terms(h, lam, v, p, groups: Groups, with_kl: bool, hh=None, vv=None):
    """Per (atom, neuron): ``Delta`` (G, L), ``sum_d log(1 + p_d/lam_id)`` (G, 1|L), KL (G, L) or None.

    ``lam`` is (G, B) and ``p`` (1, B) (one precision row for the client's neurons) or (L, B)
    (per neuron), in the coordinate groups ``groups`` (:class:`Groups`). With one precision
    row, ``a_ib = 1 / (lambda_ib + p_b)`` and the group sums ``HH_ib = sum_{d in b} h_id^2``,
    ``VV_lb = sum_{d in b} v_ld^2``, the quadratic gain of the module docstring is

    .. math::

        \\Delta_{il} = \\sum_b \\Big[a_{ib} (HH_{ib} + p_b^2 VV_{lb}) - \\frac{HH_{ib}}{\\lambda_{ib}}\\Big]
            + 2 \\sum_d a_{i b(d)} p_{b(d)} h_{id} v_{ld},

    one (G, D) x (D, L) product (none more than that for the atoms' other terms, which are
    (G, B) arrays); the KL of :func:`assignment_cost` likewise, with ``mu_i = h_i / lambda_i``.
    ``hh``, ``vv``: the atoms' ``HH`` (G, B) and the neurons' ``VV`` (L, B), if known. Every
    array is of one backend (NumPy, or torch tensors of one device and dtype), and so is the result.
    """
    xp = namespace(v)
    sizes = groups.sizes if xp is np else v.new_tensor(groups.sizes)
    if groups.n == 1:  # isotropic: one GEMM serves every term
        D = float(groups.sizes[0])
        lam_i, pp = lam[:, :1], p[:, 0][None, :]  # (G, 1), (1, 1|L)
        hv = h @ v.T
        hh = groups.sum_sq(h) if hh is None else hh
        vv = (groups.sum_sq(v) if vv is None else vv).T
        a = 1.0 / (lam_i + pp)
        delta = a * (hh + 2 * pp * hv + pp * pp * vv) - hh / lam_i
        log_ratio = D * xp.log1p(pp / lam_i)
        kl = None
        if with_kl:
            sq = vv - 2 * hv / lam_i + hh / lam_i**2  # ||v - mu_i||^2
            kl = 0.5 * D * (pp / lam_i - xp.log1p(pp / lam_i)) + 0.5 * pp * pp * a * sq
        return delta, log_ratio, kl
    if p.shape[0] > 1:
        return gain_terms_per_neuron(h, groups.expand(lam), v, groups.expand(p), with_kl)
    pb = p[0]
    a = 1.0 / (lam + pb)  # (G, B)
    ap = a * pb
    hh = groups.sum_sq(h) if hh is None else hh
    vv = groups.sum_sq(v) if vv is None else vv  # (L, B)
    delta = _scaled_product(h, 2 * ap, groups, v)
    delta += (ap * pb) @ vv.T
    delta += (a * hh - hh / lam).sum(axis=1)[:, None]
    ratio = pb / lam
    log_ratio = (xp.log1p(ratio) @ sizes)[:, None]
    kl = None
    if with_kl:
        b = ap * pb  # p^2 / (lambda + p)
        b_mu = b / lam  # sum_d b_d (v_d - mu_d)^2 = b.v^2 - 2 (b / lam) h.v + (b / lam^2) h.h
        sq = b @ vv.T - 2 * _scaled_product(h, b_mu, groups, v) + (b_mu / lam * hh).sum(axis=1)[:, None]
        kl = 0.5 * ((ratio - xp.log1p(ratio)) @ sizes)[:, None] + 0.5 * sq
    return delta, log_ratio, kl


def _scaled_product(h, scale, groups: Groups, v, max_elements: int = 1 << 22):
    """``(h * groups.expand(scale)) @ v.T`` (G, L), over blocks of at most ``max_elements`` atom
    coordinates: a wide layer's atoms are not copied whole (twice: the expanded scale and the
    product) for one product."""
    G, D = h.shape
    if G * D <= max_elements:
        return (h * groups.expand(scale)) @ v.T
    step = max(1, max_elements // D)
    out = v.new_empty((G, v.shape[0])) if is_tensor(v) else np.empty((G, v.shape[0]))
    for s in range(0, G, step):
        out[s : s + step] = (h[s : s + step] * groups.expand(scale[s : s + step])) @ v.T
    return out


def gain_terms_per_neuron(h, lam_d, v, p, with_kl: bool, max_elements: int = 1 << 22):
    """:func:`gain_terms` when every neuron has its own per-entry precision (no GEMM form).

    Works on blocks of atoms so that a block's (atoms, L, D) array stays below ``max_elements``.
    """
    xp = namespace(v)
    G, (L, D) = h.shape[0], v.shape
    pv = p * v
    base = xp.einsum("gd,gd->g", h / lam_d, h)
    empty = (lambda: v.new_empty((G, L))) if xp is not np else (lambda: np.empty((G, L)))
    delta, log_ratio = empty(), empty()
    kl = empty() if with_kl else None
    step = max(1, max_elements // (L * D))
    for s in range(0, G, step):
        hc, lc = h[s : s + step, None, :], lam_d[s : s + step, None, :]
        den = lc + p[None]
        delta[s : s + step] = ((hc + pv[None]) ** 2 / den).sum(-1) - base[s : s + step, None]
        ratio = p[None] / lc
        log_ratio[s : s + step] = xp.log1p(ratio).sum(-1)
        if with_kl:
            assert kl is not None  # made above with_kl
            sq = p[None] ** 2 / den * (v[None] - hc / lc) ** 2
            kl[s : s + step] = 0.5 * (ratio - xp.log1p(ratio) + sq).sum(-1)
    return delta, log_ratio, kl


@validate_params(cost=Options(("pfnm", "marginal")), kl_weight=KEYS["kl_weight"])
@ieee_float32()
def assignment_cost(
    v: np.ndarray,
    p: np.ndarray,
    h: np.ndarray,
    lam: np.ndarray,
    m: np.ndarray,
    prior: Prior,
    *,
    cost: Cost = "pfnm",
    kl_weight: float = 0.0,
) -> np.ndarray:
    """Cost matrix (L, G + L) of giving client neuron l to existing atom i < G or new atom G + k.

    Parameters
    ----------
    v : (L, D) the client's neurons. p : (1, B) their precision ``1/sigma_j^2`` in the prior's
        B coordinate groups, or (L, B) one per neuron.
    h, lam, m : natural parameters (G, D), (G, B) and counts (G,) of the atoms of the
        other clients (all counts >= 1).

    With ``Delta_il = ||h_i + p v_l||^2_{A} - ||h_i||^2_{1/lam_i}`` (weighted norms,
    ``A = 1/(lam_i + p)``), the PFNM cost (supplement, Prop. 2, end of section 1) is

    .. math::

        C_{li} = -\\Delta_{il} - 2 \\log\\frac{m_i}{J - m_i}, \\quad i \\le G; \\qquad
        C_{l,G+k} = -\\Delta_{0l} - 2 \\log\\frac{\\gamma_0}{J} + 2 \\log k,

    where ``Delta_0l`` uses the prior ``(mu0/sigma0^2, 1/sigma0^2)`` in place of atom i.
    The ``"marginal"`` cost is minus the exact change of :func:`log_marginal_posterior`:
    ``-Delta/2 + 1/2 sum_d log((lam_id + p_d)/lam_id) - log(m_i / (J - m_i))`` and for new atoms
    ``... - log(gamma0 / J)`` (no ``log k``: atoms are unordered). NAFI adds
    ``kl_weight * KL(p(theta_i | others) || p(theta_i | others, v_l))`` (NAFI eq. 14; the full
    Gaussian KL of Lemma 5.1, trace and log-determinant terms included):

    .. math::

        \\mathrm{KL}_{il} = \\tfrac12 \\sum_d \\Big[\\frac{p_d}{\\lambda_{id}}
            - \\log\\Big(1 + \\frac{p_d}{\\lambda_{id}}\\Big)
            + \\frac{p_d^2}{\\lambda_{id} + p_d} (v_{ld} - \\mu_{id})^2\\Big].
    """
    old, new, steps = cost_blocks(v, p, h, lam, m, prior, cost=cost, kl_weight=kl_weight)
    old, new = to_host(old), to_host(new)
    G, L = old.shape
    out = np.empty((L, G + L))
    out[:, :G] = old.T
    out[:, G:] = new[:, None] + (0.0 if steps is None else steps[None, :])
    return out


def cost_blocks(v, p, h, lam, m, prior: Prior, *, cost: Cost, kl_weight: float, hh=None, vv=None):
    """:func:`assignment_cost` in its parts: ``old`` (G, L), the cost of each existing atom
    (transposed); ``new`` (L,), the cost of a first new atom; ``steps`` (L,), what the k-th new
    atom adds (``2 log k`` for the PFNM cost) or None (``"marginal"``: every new atom costs
    ``new``).

    ``old`` and ``new`` are of the neurons' backend (NumPy, or torch on ``v``'s device and dtype):
    the other arrays are moved there (``lam``, ``p``, ``m`` and ``hh`` may be host arrays).
    """
    J, L = prior.n_clients, v.shape[0]
    groups = prior.groups
    put = backend_of([v]).put
    p = put(p)
    # The existing atoms, and the prior as the "atom" a new neuron starts from (one row).
    delta, log_ratio, kl = gain_terms(
        put(h), put(lam), v, p, groups, bool(kl_weight), None if hh is None else put(hh), vv
    )
    delta0, log_ratio0, kl0 = gain_terms(
        put(prior.h0[None, :]), put(prior.lam0[None, :]), v, p, groups, bool(kl_weight), vv=vv
    )
    popularity = put(np.log(m / (J - m)))
    new_prior = math.log(prior.gamma0 / J)
    if cost == "pfnm":
        delta *= -1.0
        delta -= 2 * popularity[:, None]
        new = -(delta0[0] + 2 * new_prior)
        steps = 2 * np.log(np.arange(1, L + 1))
    else:  # "marginal"
        delta *= -0.5
        delta += 0.5 * log_ratio - popularity[:, None]
        new = -(0.5 * delta0 - 0.5 * log_ratio0 + new_prior)[0]
        steps = None
    if kl_weight:
        delta += kl_weight * kl
        new = new + kl_weight * kl0[0]
    return delta, namespace(delta).broadcast_to(new, (L,)), steps


#: Share of (atom, neuron) pairs that may be candidates for the float32 screen of
#: :func:`negative_pairs` to pay; above it the dense float64 path runs.
#: See docs/decisions.md#screen-density
SCREEN_DENSITY = 0.02


def negative_pairs(
    v,
    p,
    h,
    lam,
    m,
    prior: Prior,
    hh: np.ndarray | None = None,
    vv: np.ndarray | None = None,
    v32: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The pairs (atom i, neuron l) with ``R_il < 0`` under the ``"marginal"`` cost without KL
    (``R`` as in :func:`assign`: ``old_il - new_l``), found through a float32 product.

    ``p`` is one precision row (1, B); ``hh``, ``vv`` and ``v32`` the atoms' ``HH``, the
    neurons' ``VV`` and ``v`` in float32, if known. With the terms of :func:`gain_terms`,

    .. math::

        R_{il} = r_i + c_l - \\tfrac12 \\sum_b a_{ib} p_b^2 VV_{lb} - \\kappa_i\\, x_i \\cdot v_l,

    ``r_i = 1/2 sum_b [|b| log(1 + p_b/lambda_ib) - a_ib HH_ib + HH_ib/lambda_ib] - log(m_i/(J - m_i))``,
    ``c_l = -new_l``, and ``x_i = h_i`` with ``kappa_i = a_i p`` for one group, else
    ``x_id = a_{i b(d)} p_{b(d)} h_id`` with ``kappa_i = 1``. Only the product ``x . v`` is
    costly; in float32 its error is at most ``gamma_{D+2} ||x_i|| ||v_l||`` with
    ``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (rounding of both factors and any order of
    summation; Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 3.5), plus
    ``2^-126 (sqrt(D) (||x_i|| + ||v_l||) + D)`` for underflow; twice that, with the largest
    ``||x_i||``, is used. A pair whose lower bound on ``R`` is not negative cannot be negative:
    it enters the optimum of :func:`assign` as a zero and needs no exact value. A pair alone
    among the candidates of its atom and of its neuron, with a negative upper bound, is taken
    in any optimum (:func:`assign`: a component of one pair): its value is not needed either.
    The others (few, when atoms are well separated) get ``x_i . v_l`` in float64.

    Returns
    -------
    (atoms, neurons, R) : the pairs with ``R < 0`` and ``R`` there (for a pair alone in its
    atom and its neuron, an upper bound < 0), or None when more than ``SCREEN_DENSITY`` of
    all pairs pass the screen (the dense path is then cheaper), or when float32 could overflow.
    """
    groups = prior.groups
    J, (L, D), G = prior.n_clients, v.shape, len(m)
    empty = np.zeros(0, dtype=np.int64)
    if G == 0:
        return empty, empty, np.zeros(0)
    pb, sizes = p[0], groups.sizes
    a = 1.0 / (lam + pb)
    ap = a * pb
    hh = groups.sum_sq(h) if hh is None else hh
    vv = groups.sum_sq(v) if vv is None else vv
    row = 0.5 * (np.log1p(pb / lam) @ sizes - np.sum(a * hh - hh / lam, axis=1)) - np.log(m / (J - m))
    # c_l = -new_l: Delta_0l and the log ratio of the prior "atom" (as in gain_terms, one row)
    a0, hh0 = 1.0 / (prior.lam0 + pb), groups.sum_sq(prior.h0[None, :])[0]
    delta0 = (
        np.sum(a0 * hh0 - hh0 / prior.lam0) + vv @ (a0 * pb * pb) + v @ (prior.h0 * groups.expand(2 * a0[None] * pb)[0])
    )
    col = 0.5 * delta0 - 0.5 * (np.log1p(pb / prior.lam0) @ sizes) + math.log(prior.gamma0 / J)
    if groups.n == 1:
        kappa, x_norm = ap[:, 0], np.sqrt(hh[:, 0])
    else:
        kappa, x_norm = np.ones(G), np.sqrt(np.sum(ap * ap * hh, axis=1))

    def x(rows):  # rows of x, made when needed (one group: rows of h)
        return h[rows] if groups.n == 1 else h[rows] * groups.expand(ap[rows])

    v_norm = np.sqrt(vv.sum(axis=1))
    if x_norm.max() * v_norm.max() * D > 1e36:  # float32 sums could overflow
        return None
    n = D + 2
    eps = 2 * n * 2.0**-24 / (1 - n * 2.0**-24)
    tiny = 2 * 2.0**-126 * (math.sqrt(D) * (x_norm.max() + v_norm.max()) + D)  # underflow, for every pair
    err = eps * x_norm.max() * v_norm + tiny  # (L,): bounds the float32 error of x_i . v_l for every i
    shift = err + (0.5 * pb[0] * vv[:, 0] if groups.n == 1 else 0.0)  # one group: kappa_i factors the VV term
    v32 = v.astype(np.float32) if v32 is None else v32
    # x . v in float32, a block of atoms at a time (about 8 MB of x): no (G, D) array besides h (any
    # order of summation is within the bound above)
    bound = np.empty((G, L))
    step = max(1, (1 << 20) // max(D, 1))
    for start in range(0, G, step):
        rows = slice(start, start + step)
        np.add(x(rows).astype(np.float32) @ v32.T, shift[None, :], out=bound[rows], dtype=np.float64)
    bound *= -kappa[:, None]
    bound += row[:, None]
    bound += col[None, :]
    if groups.n > 1:
        bound -= (0.5 * ap * pb) @ vv.T  # now bound <= R_il
    atoms, neurons = np.nonzero(bound < 0)
    if len(atoms) > SCREEN_DENSITY * G * L:
        return None
    # A pair alone in its atom's and its neuron's candidates, surely negative, is taken whatever
    # its value; the others get R exactly.
    upper = bound[atoms, neurons] + 2 * kappa[atoms] * err[neurons]  # >= R_il
    alone = (np.bincount(atoms, minlength=G)[atoms] == 1) & (np.bincount(neurons, minlength=L)[neurons] == 1)
    check = ~(alone & (upper < 0))
    ia, il = atoms[check], neurons[check]
    dots = np.empty(len(ia))
    for start in range(0, len(ia), step):  # blocks of pairs: no (pairs, D) array of a wide layer
        k = slice(start, start + step)
        dots[k] = np.einsum("kd,kd->k", x(ia[k]), widen(v[il[k]]))  # float64 x float32 would sum in buffers
    R = upper
    R[check] = row[ia] + col[il] - 0.5 * np.einsum("kb,kb->k", (ap * pb)[ia], vv[il]) - kappa[ia] * dots
    keep = R < 0
    return atoms[keep], neurons[keep], R[keep]
