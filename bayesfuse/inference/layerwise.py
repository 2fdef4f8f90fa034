"""Matching deep networks layer by layer: one-shot multilayer PFNM/NAFI, and FedMA's building blocks.

Every hidden permutation group of a :class:`~bayesfuse.inference.spec.PermutationSpec` (the
neurons of a dense layer, the channels of a convolution, the hidden states of an LSTM) is
matched with :func:`~bayesfuse.inference.matching.match_neurons`, one group at a time, in the
layer-wise loop all layer-wise fusions share (:class:`~bayesfuse.inference.walk.GroupWalk`).

Which numbers describe a unit. When group ``g`` is matched, a unit's vector gathers every
state_dict entry that ``g`` permutes exactly once and whose other permuted axes belong to groups
matched already. Those other axes are first written in the *global* basis of their group
(:func:`~bayesfuse.inference.spec.to_global_basis`): client j's column for its local unit ``l`` goes
to global position ``B_j(l)``, and positions of global units client j lacks are *unobserved*
(noise variance infinite, precision 0), FedMA's "dummy neurons ... discounted when taking
average" (FedMA section 2.1). Entries that ``g`` permutes twice (an LSTM's hidden-to-hidden
weights) never describe a unit; they are averaged in the global basis at the end, FedMA's
``H = 1/J sum_j Pi_j H_j Pi_j^T`` (section 2.2) over the clients that have each entry.

Order. ``direction="bottom-up"`` matches groups from the input upwards (FedMA's recursion,
eq. 4): a dense layer's neuron is its incoming weights in the matched basis below, its bias
and, for the top hidden layer, its outgoing weights to the (unpermuted) classes.
``direction="top-down"`` is PFNM supplement Algorithm 1: groups from the output downwards,
each described by its bias and outgoing weights in the matched basis above, and the bottom
layer by its incoming and outgoing weights. Both follow from the same rule; only the order
differs. Top-down describes a middle layer's neuron by few numbers (10 outgoing weights for
10 upper units...), which is why it merges distinct neurons (see ``benchmarks/bench_deep.py``).

Output layer. Its weights into class k from client j get noise variance ``sigma^2 / f_jk``
(``f_jk`` client j's share of class k), as in :func:`bayesfuse.fuse`; its bias is the
precision-weighted posterior mean. Batch-norm layers are folded into the layer before them
first (NAFI appendix E, eq. 47) and left as identities.

All functions here take and return NumPy arrays (``device`` runs the matching's arithmetic with
torch on a device; its results come back to NumPy). FedMA (:mod:`bayesfuse.inference.fedma`)
matches group by group with the same :func:`match_group`, with retraining between groups.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import numpy as np

from bayesfuse._validation import finite_array
from bayesfuse.constraints import KEYS, MATCHING, Options, validate_params
from bayesfuse.inference._backend import check_device, to_device, to_host
from bayesfuse.inference.lazy import GroupedColumns, LazyRows
from bayesfuse.inference.matching import MatchResult, match_neurons
from bayesfuse.inference.matching.empirical_bayes import atom_weights
from bayesfuse.inference.result import ConvergenceWarning, warn_not_converged
from bayesfuse.inference.spec import Axis, PermutationSpec, to_global_basis
from bayesfuse.inference.walk import Basis, GroupWalk

__all__ = [
    "LayerwiseResult",
    "fold_batchnorm",
    "match_layerwise",
    "match_group",
    "global_entries",
    "matched_average",
    "scale_outputs",
    "HIDDEN_BIAS_PRIOR_MEAN",
    "Basis",
    "check_states",
    "class_share_matrix",
    "folded_entries",
    "folded_eps",
    "folded_length",
    "folded_units",
    "group_seed",
    "identity_bn",
    "in_basis",
    "unit_entries",
]

State = Mapping[str, np.ndarray]
#: Prior mean of hidden biases: the initial bias 0.1 of PFNM supplement Table 1.
HIDDEN_BIAS_PRIOR_MEAN = 0.1
#: What a client that lacks a global unit says of it (:func:`match_layerwise`'s ``absent``).
ABSENT = Options(("zero", "unobserved"))


@dataclass
class LayerwiseResult:
    """Outcome of :func:`match_layerwise`.

    Attributes
    ----------
    state_dict : dict of str to ndarray
        The global network's entries (float64; integer buffers keep their dtype).
    layers : dict of str to MatchResult
        The matching of each hidden group.
    order : tuple of str
        Groups in the order they were matched.
    sizes : dict of str to int
        Global units per group.
    seconds : float
    """

    state_dict: dict
    layers: dict
    order: tuple
    sizes: dict
    hyper: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def assignments(self) -> dict[str, list[np.ndarray]]:
        return {g: r.assignments for g, r in self.layers.items()}


# --------------------------------------------------------------------------- inputs


def check_states(
    states: Sequence[State], spec: PermutationSpec, names: Sequence[str] | None = None, *, as_float64: bool = True
) -> list[dict]:
    """The clients' state_dicts as NumPy arrays, checked against ``spec`` and for NaN/Inf.

    Parameters
    ----------
    states : sequence of dict
        The clients' state_dicts (NumPy arrays or CPU tensors).
    spec : PermutationSpec
    names : sequence of str, optional
        How error messages call the clients; ``"client j"`` by default.
    as_float64 : bool
        True (default): floating entries are float64 copies, which callers may modify. False:
        they keep their dtype and are the given arrays (or views of the tensors' memory), not
        copies: for callers that only read them, converting where they compute (float32 to
        float64 is exact, so the values are the same). A float32 network then costs no float64
        copy of every weight.

    Returns
    -------
    list of dict
        One state_dict per client, in order.
    """
    if len(states) == 0:
        raise ValueError("need at least one client's network")
    names = names or [f"client {j}" for j in range(len(states))]
    out = []
    for name, sd in zip(names, states):
        sd = spec.split(sd)  # entries reading streams side by side, as their pieces
        spec.check(sd, name)
        arrays = {}
        for k, v in sd.items():
            a = np.asarray(v)
            if np.issubdtype(a.dtype, np.floating):
                if as_float64:
                    a = finite_array(a, f"{name}[{k!r}]")
                elif not np.isfinite(a).all():  # finite in its own dtype iff finite in float64
                    raise ValueError(f"{name}[{k!r}] contains NaN or infinite values")
            elif np.iscomplexobj(a) or (k in spec.axes and any(ax is not None for ax in spec.axes[k])):
                raise ValueError(f"{name}[{k!r}] holds {a.dtype} values; weights must be real floating point")
            arrays[k] = a
        out.append(arrays)
    ref = out[0]
    for name, sd in zip(names[1:], out[1:]):
        for k in spec.output:
            if sd[k].shape[0] != ref[k].shape[0]:
                raise ValueError(f"{name} has {sd[k].shape[0]} classes in {k!r}, {names[0]} has {ref[k].shape[0]}")
        for k, axes in spec.axes.items():
            fixed = [d for d, a in enumerate(axes) if a is None]
            if any(sd[k].shape[d] != ref[k].shape[d] for d in fixed):
                raise ValueError(
                    f"{name}[{k!r}] has shape {sd[k].shape}, {names[0]}'s is {ref[k].shape}: "
                    "the clients' architectures differ beyond hidden widths"
                )
    return out


def fold_batchnorm(state: State, spec: PermutationSpec, *, copy: bool = True) -> dict:
    """Fold each batch norm of ``spec.folds`` into the layer before it (NAFI appendix E, eq. 47).

    ``W' = gamma W / sqrt(var + eps)``, ``b' = gamma (b - mu) / sqrt(var + eps) + beta`` with
    each batch norm's own ``eps`` (``spec.batchnorm_eps``); the batch norm becomes the identity
    in eval mode (weight 1, bias 0, mean 0, variance ``1 - eps``).

    Parameters
    ----------
    state : dict
        A state_dict (NumPy arrays or CPU tensors); never modified.
    spec : PermutationSpec
    copy : bool
        True (default): every floating entry of the result is a new float64 array. False: the
        entries the folds write (the folded layers' weights and biases, the batch norms) are
        new float64 arrays and the others are the given arrays as they are (dtype kept, not
        copied), for callers that only read them.

    Returns
    -------
    dict
        The folded state_dict.
    """
    if copy:
        out = {
            k: np.array(v, dtype=np.float64) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.asarray(v)
            for k, v in state.items()
        }
    else:
        out = {k: np.asarray(v) for k, v in state.items()}
        written = {k for layer in spec.folds.values() for p in ("weight", "bias") for k in spec.parts(f"{layer}.{p}")}
        written |= folded_entries(spec)
        for k in written & out.keys():
            if np.issubdtype(out[k].dtype, np.floating):
                out[k] = np.asarray(out[k], dtype=np.float64)
    for bn, layer in spec.folds.items():
        if f"{layer}.bias" not in out:
            raise ValueError(
                f"cannot fold batch norm {bn!r}: layer {layer!r} has no bias (bayesfuse.fuse and fuse_states "
                "fold through a zero one: bayesfuse.inference.bias_free.with_zero_biases)"
            )
        eps = spec.batchnorm_eps(bn)
        if (out[f"{bn}.running_var"] < 0).any():
            raise ValueError(f"batch norm {bn!r} has a negative running_var")
        scale = out[f"{bn}.weight"] / np.sqrt(out[f"{bn}.running_var"] + eps)
        for k in spec.parts(f"{layer}.weight"):  # a layer reading streams side by side: each piece
            out[k] = out[k] * along(scale, out[k].ndim, spec.rows_dim(k))
        out[f"{layer}.bias"] = scale * (out[f"{layer}.bias"] - out[f"{bn}.running_mean"]) + out[f"{bn}.bias"]
        for p, value in identity_bn(len(scale), eps).items():
            out[f"{bn}.{p}"] = value
    return out


def along(v: np.ndarray, ndim: int, dim: int) -> np.ndarray:
    """``v`` shaped to broadcast along axis ``dim`` of an array of ``ndim`` axes (a layer's rows:
    axis 0, or a transposed convolution's axis 1)."""
    return v.reshape((1,) * dim + (-1,) + (1,) * (ndim - dim - 1))


def identity_bn(n: int, eps: float) -> dict[str, np.ndarray]:
    """Entries that make a batch norm of ``n`` units the identity in eval mode."""
    return {
        "weight": np.ones(n),
        "bias": np.zeros(n),
        "running_mean": np.zeros(n),
        "running_var": np.full(n, 1.0 - eps),
    }


def folded_length(spec: PermutationSpec, bn: str, n_units: int) -> int:
    """The length of folded batch norm ``bn``'s entries at ``n_units`` units of its group: its
    axis's blocks around them (a grouped convolution's ``g``), ``outer x n x inner``."""
    axis = spec.axes[f"{bn}.running_mean"][0]
    return n_units if axis is None else axis.outer * n_units * axis.inner


def folded_units(spec: PermutationSpec, entry: str, n_global: Mapping[str, int], value) -> int:
    """The length of folded batch-norm entry ``entry`` (of value ``value``) in the fused network:
    its group's ``n_global`` units in its axis's blocks (:func:`folded_length`), or, for a norm of
    units held in place (no group's), its own length."""
    axis = spec.axes[entry][0] if spec.axes[entry] else None
    if axis is None:
        return int(np.shape(value)[0])
    return folded_length(spec, entry.rpartition(".")[0], n_global[axis.group])


def folded_eps(state: State, bn: str) -> float:
    """The ``eps`` of a folded batch norm, read back from its running variance ``1 - eps``."""
    return 1.0 - float(np.asarray(state[f"{bn}.running_var"]).reshape(-1)[0])


def folded_entries(spec: PermutationSpec) -> set[str]:
    """The entries of the batch norms that ``spec`` folds into the layers before them."""
    return {f"{bn}.{p}" for bn in spec.folds for p in ("weight", "bias", "running_mean", "running_var")}


def group_seed(seed: int | None, i: int) -> int | None:
    """Seed of the i-th group's matching: ``seed + i`` (a one-group network matches with ``seed``)."""
    return None if seed is None else int(seed) + i


def class_share_matrix(class_counts, n_clients: int, n_classes: int) -> np.ndarray:
    """Client j's share of class k, ``n_jk / sum_j n_jk``; all ones when counts are not given."""
    if class_counts is None:
        return np.ones((n_clients, n_classes))
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] != n_clients:
        raise ValueError(
            f"class_counts must have one row per client, shape ({n_clients}, {n_classes}), got {counts.shape}"
        )
    if counts.shape[1] != n_classes:
        raise ValueError(f"class counts give {counts.shape[1]} counts per client; the models have {n_classes} classes")
    if (counts < 0).any() or not np.isfinite(counts).all():
        raise ValueError("class_counts must be finite and non-negative")
    total = counts.sum(0)
    return counts / np.where(total > 0, total, 1.0)


# --------------------------------------------------------------------------- one group


def _group_axis(spec: PermutationSpec, name: str, group: str) -> tuple[int, Axis]:
    return next((d, a) for d, a in enumerate(spec.axes[name]) if a is not None and a.group == group)


def unit_entries(spec: PermutationSpec, group: str, matched: Mapping[str, object], skip: set[str]) -> list[str]:
    """Entries that describe ``group``'s units given the groups matched so far."""
    out = []
    for k in spec.axes:
        groups = spec.groups_of(k)
        if k in skip or groups.count(group) != 1:
            continue
        if all(g == group or g in matched for g in groups):
            out.append(k)
    return out


def in_basis(
    a: np.ndarray,
    spec: PermutationSpec,
    name: str,
    j: int,
    matched: Mapping[str, Basis],
    keep: str | None = None,
    fill: float = np.nan,
) -> np.ndarray:
    """Entry ``name`` of client j with every matched axis except ``keep`` in the global basis."""
    a = np.asarray(a, dtype=np.float64)
    for d, axis in enumerate(spec.axes[name]):
        if axis is not None and axis.group != keep and axis.group in matched:
            basis = matched[axis.group]
            a = to_global_basis(a, d, axis, basis.assignments[j], basis.n_global, fill=fill)
    return a


def _to_rows(a: np.ndarray, d: int, axis: Axis) -> np.ndarray:
    """(n, rest): unit i's numbers of an entry whose axis ``d`` is the group's."""
    n = axis.size(a.shape[d])
    blocks = a.reshape(*a.shape[:d], axis.outer, n, axis.inner, *a.shape[d + 1 :])
    return np.moveaxis(blocks, d + 1, 0).reshape(n, -1)


def unit_rows(state: Mapping[str, object], spec: PermutationSpec, group: str, entries: Sequence[str]) -> np.ndarray:
    """(units, D): each unit of ``group`` as the vector of its ``entries`` in ``state`` (every axis
    in the same basis), laid out as :func:`match_group` lays out an atom."""
    return np.hstack([_to_rows(np.asarray(state[k], dtype=np.float64), *_group_axis(spec, k, group)) for k in entries])


def _from_rows(rows: np.ndarray, shape: tuple, d: int, axis: Axis) -> np.ndarray:
    """Inverse of :func:`_to_rows` for ``G = len(rows)`` units; ``shape`` is the local entry shape with
    other axes global."""
    g = rows.shape[0]
    n = axis.size(shape[d])
    block_shape = (*shape[:d], axis.outer, n, axis.inner, *shape[d + 1 :])
    moved = list(np.moveaxis(np.empty(block_shape), d + 1, 0).shape)
    moved[0] = g
    out = np.moveaxis(rows.reshape(moved), 0, d + 1)
    return out.reshape(*shape[:d], axis.outer * g * axis.inner, *shape[d + 1 :])


def _narrowed(r: np.ndarray) -> np.ndarray:
    """``r`` in float32 when that holds it exactly (a float32 network's weights, permuted and
    padded with zeros), else as it is: the matching widens float32 neurons wherever it computes
    (:func:`~bayesfuse.inference.matching.checks.widen`), so its numbers are the same, and a wide
    layer's neurons take half the memory."""
    r32 = r.astype(np.float32)
    return r32 if np.array_equal(r32, r) else r


def matched_average(
    rows: Sequence[np.ndarray],
    precision: np.ndarray,
    assignments: Sequence[np.ndarray],
    n_global: int,
    *,
    max_elements: int = 1 << 20,
) -> np.ndarray:
    """Prior-free global units: ``sum_{j->g} w_jd v_jld / sum_{j->g} w_jd`` (0 where none observes).

    Parameters
    ----------
    rows : sequence of (L_j, D) arrays
        The clients' units.
    precision : (J, D) or (J, 1) array
        The clients' relative precisions ``w_jd``.
    assignments : sequence of (L_j,) int arrays
        Global unit of each client's unit (distinct within a client).
    n_global : int
        Number of global units G.
    max_elements : int
        The sums run over blocks of coordinates of at most this many (G x block) numbers, so
        that besides the (G, D) result only two such blocks are held; each coordinate's sums
        are the same as over all coordinates at once.

    Returns
    -------
    (G, D) ndarray
    """
    D = rows[0].shape[1]
    out = np.empty((n_global, D))
    step = max(1, max_elements // max(n_global, 1))
    for start in range(0, D, step):
        cols = slice(start, min(start + step, D))
        num, den = np.zeros((n_global, cols.stop - start)), np.zeros((n_global, cols.stop - start))
        for j, a in enumerate(assignments):
            w = np.broadcast_to(precision[j], (D,))[cols]
            num[a] += w * rows[j][:, cols]
            den[a] += w
        seen = den > 0
        block = out[:, cols]
        np.divide(num, den, out=block, where=seen)
        block[~seen] = 0.0
    return out


def match_group(
    states: Sequence[State],
    spec: PermutationSpec,
    group: str,
    matched: Mapping[str, Basis],
    *,
    class_shares: np.ndarray | None = None,
    noise_var="auto",
    prior_var="auto",
    gamma0="auto",
    kl_weight: float = 0.0,
    cost: str = "auto",
    n_iter: int = 10,
    tol: float = 0.1,
    seed=0,
    bias_prior_mean: float = HIDDEN_BIAS_PRIOR_MEAN,
    absent: str = "zero",
    global_weights: str = "auto",
    verbose: bool = False,
    device=None,
    dtype: str = "float64",
) -> tuple[MatchResult, dict[str, np.ndarray]]:
    """Match the units of one group (BBP-MAP, PFNM supplement eqs. 1-8; NAFI eq. 14).

    Hyper-parameters. ``noise_var``, ``prior_var``, ``gamma0``: numbers, or ``"auto"`` for
    empirical Bayes (:mod:`bayesfuse.inference.matching.empirical_bayes`) with one block per entry that
    describes the units (incoming weights, bias, outgoing weights: their scales differ by
    orders of magnitude), outgoing weights into class k weighted by the client's class share.
    ``kl_weight`` is per coordinate: :func:`~bayesfuse.inference.matching.match_neurons` gets
    ``kl_weight / D``, so NAFI's charge for a new global unit (its Gaussian KL grows about
    linearly with the unit's dimension D) does not grow with D and wide layers do not collapse
    into few units.

    Global weights (``global_weights``): ``"posterior"``, the atoms' posterior means (PFNM);
    ``"auto"``: the posterior for one hidden layer, the average for deeper networks;
    ``"average"``, the precision-weighted average of the matched units
    ``sum_{j->g} w_jd v_jld / sum_{j->g} w_jd``, which keeps the hyper-parameters for deciding
    which units merge only. With estimated noise of the order of the prior spread the
    posterior mean shrinks a unit seen by one client by ``s / (s + s0)`` (about 1/3.6 on
    Fashion-MNIST's first layer), which compounds across layers.

    Weights from global units a client lacks (``absent``):

    * ``"zero"``: they are zeros, which is the client's network function (nothing flows from a
      unit it does not have); FedMA pads with zero "dummy" units the same way (section 2.1).
      A merged upper unit then gets the average of its clients' incoming weights and its
      pre-activation is the average of theirs.
    * ``"unobserved"``: precision 0 in the cost and in the atom posterior, as the BBP model
      says when each client sees part of an atom's inputs. It recovers simulated deep
      federations exactly, but when a lower layer hardly merges (separately trained real
      networks) upper units share no observed input and merge for free: on Fashion-MNIST
      784-100-100-10 every second-layer unit merged across all 10 clients (10% accuracy)
      where ``"zero"`` kept 154 units (65%).

    Where the arithmetic runs (``device``, ``dtype``): None, NumPy float64 on the host; a torch
    device (``"cpu"``, ``"cuda"``...), the units' vectors go there as ``dtype`` tensors and the cost
    products and posterior means are computed there
    (:func:`~bayesfuse.inference.matching.match_neurons`); the matching's ``mean`` and ``var``
    come back as NumPy float64 arrays either way.

    A group whose width the network's forward fixes (``spec.fixed``: heads of a width written in
    the code, a scale computed from the width) is matched at that width: its global units are
    as many as each client's, every client's units assigned to them one to one by the same
    posterior (``capacity``, :func:`~bayesfuse.inference.matching.match_neurons`).

    Returns the matching and the global value of every entry that described the units (its
    other axes in their global bases).
    """
    skip = folded_entries(spec)
    entries = unit_entries(spec, group, matched, skip)
    if not entries:
        raise ValueError(f"no parameter describes the units of group {group!r}")
    if global_weights == "auto":
        global_weights = "posterior" if len(spec.groups) <= 1 else "average"
    auto = any(isinstance(v, str) for v in (noise_var, prior_var, gamma0))
    unit_noise = 1.0 if auto else noise_var  # relative precisions when any key is "auto"
    rows, noise, prior_mean, layout, missing = [], [], [], [], []
    for j, sd in enumerate(states):
        blocks, variances = [], []
        for k in entries:
            a = in_basis(sd[k], spec, k, j, matched, keep=group)
            d, axis = _group_axis(spec, k, group)
            r = _to_rows(a, d, axis)
            v = np.full(r.shape[1], float(unit_noise))
            if class_shares is not None and k in spec.output and d == 1:
                n_classes = a.shape[0]
                with np.errstate(divide="ignore"):
                    v = unit_noise / np.repeat(class_shares[j], r.shape[1] // n_classes)
            blocks.append(r)
            variances.append(v)
            if j == 0:
                layout.append((k, a.shape, d, axis, r.shape[1]))
                # 1-D entries of hidden units are biases (batch norms are folded out beforehand)
                entry_mean = bias_prior_mean if (np.ndim(sd[k]) == 1 and k not in spec.output) else 0.0
                prior_mean.append(np.full(r.shape[1], entry_mean))
        r = np.hstack(blocks)
        v = np.hstack(variances)
        unseen = np.isnan(r)
        if unseen.any():
            if not (unseen == unseen[0]).all():
                raise AssertionError("unobserved coordinates differ between units of one client")
            r = np.where(unseen, 0.0, r)
        rows.append(_narrowed(r))
        noise.append(v)
        missing.append(unseen[0].copy() if len(r) else np.zeros(r.shape[1], dtype=bool))  # not a view of (L, D)
    del a, r, blocks, unseen  # the last client's float64 copies (a wide layer's: tens of MB each)
    noise_rows, unobserved = np.vstack(noise), np.vstack(missing)
    match_noise = np.where(unobserved, np.inf, noise_rows) if absent == "unobserved" else noise_rows
    del noise, noise_rows, unobserved
    mu0 = np.hstack(prior_mean)
    D = mu0.shape[0]
    with np.errstate(divide="ignore"):
        precision = 1.0 / match_noise  # relative precisions w_jd (0: unobserved)
    units = rows if device is None else [to_device(r, device, dtype) for r in rows]
    capacity = _fixed_width(spec, group, [len(r) for r in rows])
    if auto:
        entry_blocks = np.repeat(np.arange(len(layout)), [width for *_, width in layout])
        result = match_neurons(
            units,
            noise_var=noise_var,
            prior_var=prior_var,
            gamma0=gamma0,
            prior_mean=mu0,
            blocks=entry_blocks,
            relative_precision=precision,
            kl_weight=kl_weight / D,
            cost=cost,
            n_iter=n_iter,
            tol=tol,
            seed=seed,
            verbose=verbose,
            capacity=capacity,
        )
        result.hyper["blocks"] = [k for k, *_ in layout]
        result.hyper["block_widths"] = [int(width) for *_, width in layout]  # numbers per unit of each
    else:
        uniform = (match_noise == match_noise[0, 0]).all()
        result = match_neurons(
            units,
            noise_var=float(match_noise[0, 0]) if uniform else match_noise,
            prior_var=prior_var,
            prior_mean=mu0,
            gamma0=gamma0,
            kl_weight=kl_weight / D,
            cost=cost,
            n_iter=n_iter,
            tol=tol,
            seed=seed,
            verbose=verbose,
            capacity=capacity,
        )
    if device is not None:  # the posterior back on the host, as every result of this module
        result.mean, result.var = to_host(result.mean), to_host(result.var)
    n_global = result.n_global
    # NumPy, averages: the posterior means are read off the averages (below), so their (G, D) array
    # goes before the averages are made, and only one (G, D) array is held after the matching
    lazy_means = global_weights != "posterior" and isinstance(result.var, GroupedColumns)
    if lazy_means:
        result.mean = np.empty((0, D))  # the means' (G, D) array released; set again below
        if auto:  # client precisions p_jd = w_jd / s_b(d)
            blocks_d = entry_blocks
            client_precision = precision / np.asarray(result.hyper["noise_var"])[blocks_d]
            prior_var_d = np.asarray(result.hyper["prior_var"])[blocks_d]
            prior_mean_d = np.asarray(result.hyper["prior_mean"])[blocks_d]
        else:
            client_precision = precision
            prior_var_d, prior_mean_d = np.broadcast_to(np.asarray(prior_var, dtype=np.float64), (D,)), mu0
    values, averages, start = {}, [], 0
    for k, shape, d, axis, width in layout:
        cols = slice(start, start + width)
        if global_weights == "posterior":
            mean = result.mean[:, cols]
        else:  # entry by entry: each is averaged straight into its own (G, width) array
            mean = matched_average([r[:, cols] for r in rows], precision[:, cols], result.assignments, n_global)
            averages.append(mean)
        values[k] = _from_rows(mean, shape, d, axis)
        start += width
    if lazy_means:
        data = atom_weights(result.assignments, n_global, client_precision)
        result.mean = posterior_from_average(averages, data, prior_mean_d, prior_var_d)
    return result, values


class _MeansFromAverage:
    """Rows of :func:`posterior_from_average` (a class, so that the means pickle)."""

    def __init__(self, averages, data: GroupedColumns, prior_mean: np.ndarray, prior_var: np.ndarray):
        self.averages, self.data = list(averages), data
        self.prior_mean = np.asarray(prior_mean, dtype=np.float64)
        self.prior_precision = 1.0 / np.asarray(prior_var, dtype=np.float64)

    def __call__(self, index) -> np.ndarray:
        a = np.hstack([x[index] for x in self.averages])
        w = self.data[index]
        share = w / (w + self.prior_precision)  # the data's share of the posterior precision
        return self.prior_mean + (a - self.prior_mean) * share


def _fixed_width(spec: PermutationSpec, group: str, widths: list[int]) -> int | None:
    """The width group ``group`` is matched at where the network's forward fixes it (the clients'
    one; they must agree), else None."""
    if group not in spec.fixed:
        return None
    if len(set(widths)) > 1:
        raise ValueError(
            f"group {group!r} has {sorted(set(widths))} units in different clients, but the network's forward fixes "
            f"its width ({spec.fixed[group]}): fuse clients of one width"
        )
    return widths[0]


def posterior_from_average(
    averages: Sequence[np.ndarray], data: GroupedColumns, prior_mean: np.ndarray, prior_var: np.ndarray
) -> LazyRows:
    r"""The atoms' posterior means, read off the matched averages when read (a :class:`LazyRows`).

    With client precisions ``p_jd``, the posterior (PFNM supplement eq. 2) has ``lambda_id =
    1 / s0_d + W_id`` and ``h_id = mu0_d / s0_d + sum_{j -> i} p_jd v_jd`` with ``W_id = sum_{j
    -> i} p_jd`` (:func:`~bayesfuse.inference.matching.empirical_bayes.atom_weights`), and the
    matched average (:func:`matched_average`) is ``a_id = sum p_jd v_jd / W_id``. So

    .. math:: \hat\theta_{id} = h_{id} / \lambda_{id}
        = \mu_{0d} + (a_{id} - \mu_{0d}) \frac{W_{id}}{W_{id} + 1 / s_{0d}},

    the prior mean where no client observes (``W = 0``). The share is computed as it stands, so
    the means are accurate to rounding whichever of prior and data dominates; they equal ``h /
    lambda`` up to rounding. The averages are the fused weights themselves, so the means cost no
    (G, D) array of their own.

    Parameters
    ----------
    averages : sequence of (G, width) arrays
        The matched averages of each entry, in the order of the units' coordinates; read, never
        copied: writing into them changes the means.
    data : GroupedColumns (G, D)
        ``W``, the clients' precision on each atom coordinate.
    prior_mean, prior_var : (D,) arrays
        The atoms' prior on every coordinate, as the matching used it.
    """
    return LazyRows(data.shape, _MeansFromAverage(averages, data, prior_mean, prior_var))


def global_entries(
    states: Sequence[State],
    spec: PermutationSpec,
    matched: Mapping[str, Basis],
    done: set[str],
    *,
    class_shares: np.ndarray | None,
    noise_var: float,
    prior_var: float,
) -> dict[str, np.ndarray]:
    """Global values of the entries no group's matching produced.

    Folded batch norms: identities. Entries permuted twice by a group (LSTM hidden-to-hidden)
    or otherwise left: mean over the clients that have each entry, in the global bases (0
    where none has it). The output bias: Gaussian posterior mean with class-share precisions.
    Unpermuted entries: the mean, or client 0's value for integer buffers.
    """
    out = {}
    folded = folded_entries(spec)
    n_global = {g: basis.n_global for g, basis in matched.items()}
    for k in spec.axes:
        if k in done:
            continue
        first = np.asarray(states[0][k])
        if k in folded:
            bn, _, what = k.rpartition(".")
            out[k] = identity_bn(folded_units(spec, k, n_global, first), folded_eps(states[0], bn))[what]
        elif not np.issubdtype(first.dtype, np.floating):
            out[k] = first.copy()
        elif k in spec.output and class_shares is not None and first.ndim == 1:
            b = np.stack([np.asarray(sd[k], dtype=np.float64) for sd in states])
            if isinstance(noise_var, str) or isinstance(prior_var, str):  # "auto": the class-share average
                out[k] = (class_shares * b).sum(0) / np.maximum(class_shares.sum(0), np.finfo(float).tiny)
            else:
                precision = class_shares / noise_var
                out[k] = (precision * b).sum(0) / (1.0 / prior_var + precision.sum(0))
        else:
            stacked = np.stack([in_basis(sd[k], spec, k, j, matched) for j, sd in enumerate(states)])
            seen = ~np.isnan(stacked)
            total = np.where(seen, stacked, 0.0).sum(0)
            count = seen.sum(0)
            out[k] = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    return out


def scale_outputs(values: dict, spec: PermutationSpec, counts: Mapping[str, tuple[np.ndarray, int]]) -> None:
    """Multiply, in place, the output entries' columns of global unit g by ``m_g / J``.

    ``counts[group] = (m, J)``: clients merged into each global unit of the group, and the
    number of clients. Only axes of groups in ``counts`` are scaled.
    """
    for k in spec.output:
        for d, axis in enumerate(spec.axes[k]):
            if axis is None or axis.group not in counts or d == 0:
                continue
            m, J = counts[axis.group]
            r = _to_rows(values[k], d, axis)
            values[k] = _from_rows(r * (np.asarray(m, dtype=np.float64) / J)[:, None], values[k].shape, d, axis)


# --------------------------------------------------------------------------- one shot


@validate_params(**MATCHING, direction=KEYS["direction"], absent=ABSENT, global_weights=KEYS["global_weights"])
def match_layerwise(
    states: Sequence[State],
    spec: PermutationSpec,
    *,
    direction: Literal["bottom-up", "top-down"] = "bottom-up",
    class_counts: np.ndarray | None = None,
    noise_var="auto",
    prior_var="auto",
    gamma0="auto",
    kl_weight: float = 0.0,
    cost: str = "auto",
    n_iter: int = 10,
    tol: float = 0.1,
    seed: int | None = 0,
    fold_bn: bool = True,
    bias_prior_mean: float = HIDDEN_BIAS_PRIOR_MEAN,
    verbose: bool = False,
    names: Sequence[str] | None = None,
    absent: Literal["zero", "unobserved"] = "zero",
    global_weights: Literal["auto", "posterior", "average"] = "auto",
    average_outputs: bool = True,
    device=None,
    dtype: Literal["float32", "float64"] = "float64",
) -> LayerwiseResult:
    """One-shot matching of deep networks: multilayer PFNM (NAFI with ``kl_weight > 0``).

    Each group is matched by :func:`match_group`, in ``spec.groups`` order (``"bottom-up"``,
    FedMA eq. 4 without retraining) or reversed (``"top-down"``, PFNM supplement Algorithm 1).
    Every group's global width is its number of atoms. See the module docstring for what
    describes a unit.

    Parameters
    ----------
    states : sequence of dict
        The clients' state_dicts (NumPy arrays or tensors), hidden widths free.
    spec : PermutationSpec
    direction : {"bottom-up", "top-down"}
    class_counts : (J, K) array, optional
        Weights the output layer by class shares.
    noise_var, prior_var, gamma0, kl_weight, cost, n_iter, tol, seed
        As in :func:`~bayesfuse.inference.matching.match_neurons`, the same for every group.
    fold_bn : bool
        Fold batch norms first (NAFI appendix E); needed when clients have batch norms.
    names : sequence of str, optional
        How error messages call the clients (file names); ``"client j"`` by default.
    global_weights : {"auto", "posterior", "average"}
        The global units' weights (:func:`match_group`): ``"auto"`` is the posterior mean for
        one hidden layer and the matched average for deeper networks, where the posterior's
        shrinkage compounds from layer to layer.
    average_outputs : bool
        Scale the outgoing weights of each global unit of the top hidden layer by ``m_g / J``
        (``m_g`` clients' units merged into it): the fused logits are then the average of the
        clients' logits where units match, not their sum (a unit only one client has counts
        ``1/J``). The BNN fusion does the same (:func:`bayesfuse.core.fuse_states`).
    absent : {"zero", "unobserved"}
        How a client's (absent) weights from global units it lacks enter the global weights:
        as zeros, which averages the merged units' pre-activations (the default, function
        preserving), or not at all, the BBP posterior mean (see :func:`match_group`).
    device, dtype : torch device and "float32" | "float64", optional
        Run each group's cost products and posterior means with torch on ``device`` in
        ``dtype`` (:func:`match_group`); None (default): NumPy float64. Results are NumPy
        arrays either way. A device this machine or torch build lacks raises ``ValueError``
        before any matching (:func:`~bayesfuse.inference._backend.check_device`).

    Returns
    -------
    LayerwiseResult

    Warns
    -----
    ConvergenceWarning
        Once, naming the groups whose matching stopped at ``n_iter`` sweeps before it converged.
    """
    start = time.perf_counter()
    check_device(device, dtype)  # a device this machine lacks fails here, not in the first group's matching
    if global_weights == "auto":
        global_weights = "posterior" if len(spec.groups) <= 1 else "average"
    # Read-only from here on: float32 weights stay float32 until an entry is used (in_basis,
    # global_entries convert it, exactly), instead of a float64 copy of every client's network.
    arrays = check_states(states, spec, names, as_float64=False)
    if spec.folds:
        if not fold_bn:
            raise ValueError("the networks have batch norms; matching needs them folded (fold_bn=True)")
        arrays = [fold_batchnorm(sd, spec, copy=False) for sd in arrays]
    n_classes = arrays[0][spec.output[0]].shape[0] if spec.output else 0
    shares = class_share_matrix(class_counts, len(arrays), n_classes)
    walk: GroupWalk[Basis] = GroupWalk(spec, direction)
    layers: dict[str, MatchResult] = {}
    values: dict[str, np.ndarray] = {}
    with warnings.catch_warnings():  # one warning for all groups, below
        warnings.simplefilter("ignore", ConvergenceWarning)
        for i, group in walk:
            result, vals = match_group(
                arrays,
                spec,
                group,
                walk.fused,
                class_shares=shares,
                noise_var=noise_var,
                prior_var=prior_var,
                gamma0=gamma0,
                kl_weight=kl_weight,
                cost=cost,
                n_iter=n_iter,
                tol=tol,
                seed=group_seed(seed, i),
                bias_prior_mean=bias_prior_mean,
                absent=absent,
                global_weights=global_weights,
                verbose=verbose,
                device=device,
                dtype=dtype,
            )
            walk.record(group, Basis(result.assignments, result.n_global))
            layers[group] = result
            values.update(vals)
    warn_not_converged({g: layers[g] for g in spec.groups}, "the matching of hidden layers", stacklevel=4)
    values.update(
        global_entries(
            arrays, spec, walk.fused, set(values), class_shares=shares, noise_var=noise_var, prior_var=prior_var
        )
    )
    if average_outputs:
        scale_outputs(values, spec, {g: (layers[g].counts, len(arrays)) for g in spec.groups})
    return LayerwiseResult(
        state_dict={k: values[k] for k in spec.axes},
        layers=layers,
        order=walk.order,
        sizes={g: layers[g].n_global for g in spec.groups},
        hyper=dict(
            direction=direction,
            absent=absent,
            noise_var=noise_var,
            prior_var=prior_var,
            gamma0=gamma0,
            kl_weight=kl_weight,
            cost=cost,
            n_iter=n_iter,
            tol=tol,
            seed=seed,
            global_weights=global_weights,
            average_outputs=average_outputs,
            **({} if device is None else dict(device=str(device), dtype=dtype)),
        ),
        seconds=time.perf_counter() - start,
    )
