"""Horseshoe BNNs in ArviZ: aligned to the fused units (:func:`aligned_to_arviz`) and with test
data for LOO (:func:`bnn_to_arviz`)."""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

import numpy as np

from bayesfuse._text import warn_from_caller
from bayesfuse.analysis._common import (
    DEFAULT_CHAINS,
    DEFAULT_DRAWS,
    HeldOutDataWarning,
    Units,
    Weights,
    _check_count,
    _describe_ids,
    _from_dict,
    _log,
    _note_default_subset,
    _select_units,
    _select_weights,
    _to_json,
)
from bayesfuse.analysis.layers import (
    gaussian_to_arviz,
)
from bayesfuse.nets.unit_posteriors import (
    select_layer,
)

# ------------------------------------------------------------------------------ BNNs aligned to the fused units


def _effective_units(post, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Hidden layer ``index`` (0-based) of a deep BNN posterior in the scale-free form: per unit
    the effective incoming weights and bias ``e^{m} (w~, b~)``, the log scale ``m = E[log tau +
    log lambda]`` and, for the top hidden layer, the outgoing weights; means and variances."""
    from bayesfuse.inference.bnn.units import effective_layer

    weights, log_scale = effective_layer(post.layers[index])
    loc, var = [weights.loc, log_scale.loc], [weights.var, log_scale.var]
    if index == len(post.layers) - 1:
        loc.append(post.out_weights.loc)
        var.append(post.out_weights.var)
    return np.hstack(loc), np.hstack(var)


def _aligned_names(index: int, n_below: int, n_classes: int, top: bool) -> list[str]:
    """Entry names of hidden layer ``index``'s units: ``in_<d>`` (layer 1) or ``unit<l>_<g>`` (the
    global unit g of the layer below, named as :func:`bnn_to_arviz` names its dim), ``bias``,
    ``log_scale`` and, for the top hidden layer, ``out_<k>``."""
    below = "in" if index == 0 else ("unit" if index == 1 else f"unit{index}")
    return (
        [f"{below}_{d}" for d in range(n_below)]
        + ["bias", "log_scale"]
        + ([f"out_{k}" for k in range(n_classes)] if top else [])
    )


def _kept(hyper: Mapping, depth: int, n_clients: int, widths: Sequence[Sequence[int]]) -> list[list[np.ndarray]]:
    """``kept[l][j]``: which of client j's units of hidden layer l the fusion kept (all where it records none)."""
    recorded = hyper.get("kept_units")
    if recorded is None:
        return [[np.arange(widths[j][l]) for j in range(n_clients)] for l in range(depth)]
    per_layer = [recorded] if depth == 1 else list(recorded)
    return [[np.asarray(k, dtype=np.int64) for k in layer] for layer in per_layer]


def aligned_to_arviz(
    fused,
    bnns: Sequence,
    *,
    layer: int = 0,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    seed: int = 0,
    names: Sequence[str] | None = None,
) -> dict:
    """A fused BNN's hidden units and the local BNNs' units they merged, in one ``global_unit`` coordinate.

    Each unit is shown in the scale-free form the fusion compares: with
    :math:`m_k = \\mathrm{E}[\\log\\tau + \\log\\lambda_k]`, its effective incoming weights and bias
    :math:`e^{m_k}(\\tilde w_k, \\tilde b_k)` (the same whatever split of the scale between
    :math:`\\tau` and :math:`\\lambda_k` a client settled on), its log scale :math:`m_k` and, in the top
    hidden layer, its outgoing weights; all independent Gaussians. Client j's kept unit l is
    placed at the global unit it was assigned (``fused.layers[layer].assignments[j][l]``); units
    the fusion pruned are left out. Above the first layer, a unit's incoming weights are written
    in the global basis of the layer below (client j's weight from its unit matched to global
    unit g below stands at ``unit_<g>``; where it has no unit matched to g, 0 with variance 0:
    that unit contributes nothing to it), as the fusion matched them. So, with ``members =
    {k: e for k, e in exports.items() if g in e.posterior.global_unit}`` (ArviZ plots only
    coordinates every model has), ``az.plot_forest(list(members.values()),
    model_names=list(members), var_names=["theta"], coords={"global_unit": [g]}, combined=True)``
    compares global unit g with the local units merged into it.

    Parameters
    ----------
    fused : FusionResult
        ``fuse(bnns, method)`` of horseshoe BNNs with one output layer (``head="shared"``).
    bnns : sequence of HorseshoeBNN
        The local BNNs, in the order they were fused.
    layer : int
        Hidden layer, 0-based (``layer=1``: the second).
    units : None, "all", int or sequence of int
        Global units: ``None``, the first :data:`DEFAULT_UNITS`; ``"all"``; or the given ones. A
        client's export holds those of them it has a unit in; a client with none is left out.
    weights : None, "all", str, int or sequence of them
        Entries (names as in the returned exports' ``weight`` coordinate, or positions):
        ``None``, the first :data:`DEFAULT_WEIGHTS` when ``units`` is ``None`` too, else all.
    num_draws, chains, seed
        As in :func:`gaussian_to_arviz`; every export draws from its own streams.
    names : sequence of str, optional
        Names of the local models (``"client 0"``, ... by default).

    Returns
    -------
    dict of str to ArviZ object
        ``"fused"`` then one entry per client, each as :func:`gaussian_to_arviz` builds it:
        ``posterior.theta`` (chain, draw, global_unit, weight) and ``constant_data`` ``loc`` /
        ``scale`` of every unit it holds; attrs ``form="effective"``, ``layer`` (1-based),
        ``model`` and ``method``.

    Raises
    ------
    TypeError
        For a fusion that holds no HorseshoeBNN, or one with client heads.
    ValueError
        For a number of BNNs or names that does not match the fusion, or bad ``units`` / ``weights``.
    """
    from bayesfuse.inference.bnn.posterior import DeepBNNPosterior
    from bayesfuse.models.bnn import HorseshoeBNN
    from bayesfuse.models.bnn_sites import has_heads

    model = getattr(fused, "model", None)
    if not isinstance(model, HorseshoeBNN):
        raise TypeError(f"expected the fusion of horseshoe BNNs, got {type(fused).__name__}")
    if has_heads(model.state_dict()):
        raise TypeError("a fusion with client heads has no one output layer to align; align head='shared'")
    index, fused_layer = select_layer(fused, layer)
    assert index is not None  # a FusionResult has layers, so the layer has an index
    assignments = [np.asarray(a) for a in fused_layer.assignments]
    if len(bnns) != len(assignments):
        raise ValueError(f"the fusion has {len(assignments)} clients, got {len(bnns)} BNNs")
    names = [f"client {j}" for j in range(len(bnns))] if names is None else [str(n) for n in names]
    if len(names) != len(bnns) or len(set(names) | {"fused"}) != len(names) + 1:
        raise ValueError("names must name every BNN once, and none of them 'fused'")
    depth = model.depth
    posts = [DeepBNNPosterior.from_state(b.state_dict(), n) for b, n in zip(bnns, names)]
    kept = _kept(fused.hyper, depth, len(bnns), [p.hidden_sizes for p in posts])
    below = model.in_features if index == 0 else model.hidden_sizes[index - 1]
    entries = _aligned_names(index, below, model.n_classes, index == depth - 1)

    loc, var = _effective_units(DeepBNNPosterior.from_state(model.state_dict(), "the fused BNN"), index)
    chosen = np.arange(len(loc))[_select_units(units, np.arange(len(loc)))]
    columns = _select_weights(weights, entries, default_subset=units is None)
    if units is None and (len(chosen) < len(loc) or (weights is None and len(columns) < len(entries))):
        _note_default_subset(len(loc), len(chosen), len(entries), len(columns))
    options: dict[str, Any] = dict(weights=columns, num_draws=num_draws, chains=chains, seed=seed, weight_names=entries)
    attrs = {"form": "effective", "layer": index + 1, "method": str(fused.method)}
    exports = {"fused": gaussian_to_arviz(loc, var, units=chosen, **options, attrs={**attrs, "model": "fused"})}
    for j, (post, name) in enumerate(zip(posts, names)):
        loc, var = _effective_units(post, index)
        if index > 0:  # incoming weights from the client's kept units below, placed at their global units
            basis_loc, basis_var = np.zeros((len(loc), below)), np.zeros((len(loc), below))
            placed = np.asarray(fused.layers[index - 1].assignments[j])
            basis_loc[:, placed], basis_var[:, placed] = loc[:, kept[index - 1][j]], var[:, kept[index - 1][j]]
            loc = np.hstack([basis_loc, loc[:, post.hidden_sizes[index - 1] :]])
            var = np.hstack([basis_var, var[:, post.hidden_sizes[index - 1] :]])
        rows, at = kept[index][j], assignments[j]
        present = [int(g) for g in chosen if g in set(at.tolist())]
        if not present:
            continue
        order = np.argsort(at)
        exports[name] = gaussian_to_arviz(
            loc[rows][order],
            var[rows][order],
            units=present,
            unit_ids=at[order],
            **options,
            attrs={**attrs, "model": name},
        )
    return exports


# ------------------------------------------------------------------------------ BNNs with test data

#: The posterior variables of :func:`bnn_to_arviz` (the Pyro model's sample sites) and their dims.
BNN_SITE_DIMS = {
    "tau": [],
    "lam": ["unit"],
    "w1": ["unit", "input"],
    "b1": ["unit"],
    "w_out": ["class", "unit"],
    "b_out": ["class"],
}


def _bnn_site_dims(depth: int) -> dict[str, list[str]]:
    """The posterior's variables and their dims for ``depth`` hidden layers (:data:`BNN_SITE_DIMS` for one).

    Names are stable across depths: hidden layer l is ``w<l>``, ``b<l>`` (``unit<l>``; layer 1's
    dim is ``unit``) with scales ``tau<l>``, ``lam<l>`` (layer 1's ``tau``, ``lam``), and the
    output layer is ``w_out``, ``b_out`` at every depth."""
    dims: dict[str, list[str]] = {}
    below = "input"
    for layer in range(1, depth + 1):
        tag = "" if layer == 1 else str(layer)
        unit = f"unit{tag}"
        dims.update({f"tau{tag}": [], f"lam{tag}": [unit], f"w{layer}": [unit, below], f"b{layer}": [unit]})
        below = unit
    dims.update({"w_out": ["class", below], "b_out": ["class"]})
    return dims


def _bnn_site(name: str, depth: int) -> str:
    """The Pyro site behind an exported variable (``w_out`` is ``w<depth + 1>``)."""
    return {"w_out": f"w{depth + 1}", "b_out": f"b{depth + 1}"}.get(name, name)


def _bnn_selection(model, units: Units, inputs: Weights) -> dict[str, np.ndarray]:
    """Positions kept along each dim of a BNN export: ``unit`` (and ``unit2``, ...) of every hidden
    layer by ``units``, ``input`` by ``inputs`` (the first :data:`DEFAULT_WEIGHTS` by default when
    ``units`` is the default too), every class."""
    keep: dict[str, np.ndarray] = {}
    for layer, width in enumerate(model.hidden_sizes, 1):
        dim = "unit" if layer == 1 else f"unit{layer}"
        try:
            keep[dim] = _select_units(units, np.arange(width))
        except ValueError as err:
            raise ValueError(f"hidden layer {layer}: {err}") from None
    names = [f"in_{d}" for d in range(model.in_features)]
    keep["input"] = _select_weights(inputs, names, default_subset=units is None)
    keep["class"] = np.arange(model.n_classes)
    return keep


def _note_bnn_subset(model, keep: Mapping[str, np.ndarray]) -> None:
    """The one line saying that the default BNN export drew part of the network, and how to draw more."""
    widths = list(model.hidden_sizes)
    drawn = [len(keep["unit" if layer == 1 else f"unit{layer}"]) for layer in range(1, len(widths) + 1)]
    if drawn == widths and len(keep["input"]) == model.in_features:
        return
    _log.warning(
        "bnn_to_arviz drew %s of %s units x %d of %d inputs (the default, sized for az.summary and "
        "az.plot_forest); units='all' or [ids], inputs='all' or [names] draw more",
        "+".join(map(str, drawn)),
        "+".join(map(str, widths)),
        len(keep["input"]),
        model.in_features,
    )


def _describe_drawn(positions: np.ndarray, n: int) -> str:
    """``"all"`` when ``positions`` are ``0 .. n-1`` in order, else which they are."""
    return "all" if len(positions) == n and (positions == np.arange(n)).all() else _describe_ids(positions)


def _bnn_posterior(
    values: Mapping[str, np.ndarray], site_dims: Mapping[str, list[str]], keep: Mapping[str, np.ndarray], chains: int
) -> dict[str, np.ndarray]:
    """``values`` (draws first) as ``(chain, draw, ...)`` arrays, sliced to the positions ``keep`` of each dim."""
    out = {}
    for name, value in values.items():
        value = value.reshape(chains, -1, *value.shape[1:])
        for axis, dim in enumerate(site_dims[name], 2):
            value = np.take(value, keep[dim], axis=axis)
        out[name] = value
    return out


def bnn_to_arviz(
    model,
    x,
    y,
    *,
    data: Literal["train", "held-out"] | None = None,
    num_samples: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    units: Units = None,
    inputs: Weights = None,
    seed: int = 0,
    sites: Sequence[str] | None = None,
    batch_size: int = 4096,
):
    """A horseshoe BNN and data -> ArviZ: its posterior draws and the pointwise log-likelihood of ``y``.

    PSIS-LOO (``az.loo``, ``az.compare``) estimates the out-of-sample fit of a posterior from
    the pointwise log-likelihood of the data it was fitted to, by leaving each point out in
    turn. On held-out data there is nothing to leave out: the held-out log predictive density
    :math:`\\sum_i \\log \\frac{1}{S}\\sum_s p(y_i \\mid x_i, \\theta_s)` is itself the estimate,
    and LOO's correction of it is wrong (on 450 test digits a fused BNN's ``elpd_loo`` was
    -1936 with 100 draws and -3200 with 1000, against -230.5 held out). So say which data
    ``x``, ``y`` are: ``data="train"`` for the data the posterior was fitted to (for a fused BNN,
    the clients' data together), the export that ``az.loo`` is for; ``data="held-out"``
    for test data, an export that carries its pointwise log-likelihood but says, in its attrs
    and in a :class:`HeldOutDataWarning`, that LOO does not apply and that
    :func:`compare` is the comparison for it. Without ``data`` the same warning asks which.

    Parameters
    ----------
    model : HorseshoeBNN or FusionResult
        A :class:`~bayesfuse.models.bnn.HorseshoeBNN`, or a result whose ``.model`` is one
        (``fuse(bnns, "kl")``; its method and hyper-parameters go into the attrs).
    x : array (n, D)
        Inputs.
    y : array (n,) of int
        Labels.
    data : "train" or "held-out"
        Whether ``x``, ``y`` are the data the posterior was fitted to (``az.loo`` applies) or
        held-out data (it does not: use :func:`compare`). Recorded as ``data`` in the attrs of
        ``posterior`` and ``log_likelihood``, with a ``loo`` note.
    num_samples : int
        Independent draws per chain from the mean-field guide. The ``chains * num_samples``
        draws, chain after chain, are those of ``model.predict(x, chains * num_samples,
        seed=seed)``: the mean of ``exp(log_likelihood)`` over all draws is its probability of ``y``.
    chains : int
        Chains of independent draws (:data:`DEFAULT_CHAINS`: ArviZ's ``r_hat`` needs two; with
        one, ``az.summary`` logs a shape warning and gives NaN).
    units : None, "all" or sequence of int
        Which units of every hidden layer the posterior holds: ``None``, the first
        :data:`DEFAULT_UNITS`; ``"all"``; or the given ids, in the given order. The
        log-likelihood is always the whole network's.
    inputs : None, "all", str, int or sequence of them
        Which inputs of ``w1`` the posterior holds: ``None``, the first :data:`DEFAULT_WEIGHTS`
        when ``units`` is ``None`` too, else all; ``"all"``; or names (``in_3``) or positions.
        When the defaults leave something out, one line is logged (logger
        ``bayesfuse.analysis``) saying how to draw more. Any selection is an exact slice of
        the full export.
    seed : int
        Seed of the guide's draws (as ``predict``) and of the posterior predictive labels.
    sites : sequence of str, optional
        Posterior variables to keep, of ``tau``, ``lam``, ``w1``, ``b1`` (and ``tau2``, ``lam2``,
        ``w2``, ``b2``, ... for deeper networks), ``w_out``, ``b_out`` (all by default; ``w1``
        takes ``num_samples * hidden * D`` numbers).
    batch_size : int
        Test points per forward pass.

    Returns
    -------
    arviz.InferenceData (ArviZ 0.2x) or xarray.DataTree (ArviZ 1.x)
        ``posterior``: the model's sites (``tau``, ``lam`` (unit), ``w1`` (unit, input), ``b1``
        (unit); ``tau2``, ``lam2`` (unit2), ``w2`` (unit2, unit), ``b2`` (unit2) and so on for
        deeper networks; the output layer ``w_out`` (class, unit of the top hidden layer),
        ``b_out`` (class), named alike at every depth), ``chains`` chains of independent draws,
        of the units and inputs selected; ``log_likelihood.y`` and ``posterior_predictive.y``
        (chain, draw, obs); ``observed_data.y`` (obs). ``az.loo``'s relative efficiency of
        such draws is about 1, as it should be for independent draws.

    Warns
    -----
    HeldOutDataWarning
        With ``data="held-out"`` (LOO does not apply), or without ``data``.

    Raises
    ------
    TypeError
        When ``model`` is not a HorseshoeBNN and holds none.
    ValueError
        For inputs of the wrong shape, non-finite inputs, labels outside ``0 .. K-1``, unknown
        ``sites`` or ``data``, bad ``units`` or ``inputs``, or non-positive counts.
    """
    import torch

    from bayesfuse.models.bnn import HorseshoeBNN, forward_logits
    from bayesfuse.models.bnn_sites import has_heads

    result = None
    if not isinstance(model, HorseshoeBNN):
        inner = getattr(model, "model", None)
        if not isinstance(inner, HorseshoeBNN):
            raise TypeError(f"expected a HorseshoeBNN or a result holding one, got {type(model).__name__}")
        result, model = model, inner
    if has_heads(model.state_dict()):  # a HeadMixtureBNN
        raise TypeError(
            "a HeadMixtureBNN predicts a mixture of its clients' heads, whose log-likelihood per "
            "draw this export does not compute; export the shared-head fusion (head='shared')"
        )
    num_samples = _check_count(num_samples, "num_samples")
    chains = _check_count(chains, "chains")
    batch_size = _check_count(batch_size, "batch_size")
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    D, K, H = model.in_features, model.n_classes, model.hidden
    if x.ndim != 2 or x.shape[1] != D or len(x) == 0:
        raise ValueError(f"x must be (n, {D}) with n > 0, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x contains NaN or infinite values")
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= K:
        raise ValueError(f"y must be ({len(x)},) integer labels in 0..{K - 1}")
    loo_note = _loo_note(data)
    site_dims = _bnn_site_dims(model.depth)
    keep = list(site_dims) if sites is None else list(sites)
    unknown = sorted(set(keep) - set(site_dims))
    if unknown:
        raise ValueError(f"unknown sites {unknown}; the sites are {list(site_dims)}")
    keep_at = _bnn_selection(model, units, inputs)
    if units is None:
        _note_bnn_subset(model, keep_at)

    total = chains * num_samples
    p = model.sample_params(total, torch.Generator().manual_seed(int(seed)))  # as model.predict draws them
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    rng = np.random.default_rng(int(seed))
    loglik = np.empty((total, len(x)))
    y_rep = np.empty((total, len(x)), dtype=np.int64)
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = forward_logits(xt[i : i + batch_size], p, model.depth)  # (S, b, K)
            logp = torch.log_softmax(logits, -1)
            b = logp.shape[1]
            loglik[:, i : i + b] = logp.gather(-1, yt[i : i + b].expand(total, b)[..., None])[..., 0].numpy()
            cdf = logp.exp().cumsum(-1).numpy()
            y_rep[:, i : i + b] = np.minimum((cdf < rng.random((total, b, 1))).sum(-1), K - 1)
    values = {}
    for k in site_dims:  # the scales as themselves, from the guide's log-scale sites
        if k.startswith(("tau", "lam")):
            log = p["log_" + k]
            values[k] = torch.exp(log[:, 0] if k.startswith("tau") else log)
        else:
            values[k] = p[_bnn_site(k, model.depth)]
    posterior = _bnn_posterior({k: values[k].numpy() for k in keep}, site_dims, keep_at, chains)
    attrs = {
        "method": str(result.method) if result is not None else "local",
        "hyper": _to_json(getattr(result, "hyper", None) or {}),
        "sampling": "independent",
        "sampling_note": (
            "independent draws from the BNN's mean-field guide (tau and lam log-normal, the rest "
            "Gaussian), not MCMC: r_hat ~ 1 and ess ~ draws by construction"
        ),
        "num_draws": num_samples,
        "chains": chains,
        "seed": int(seed),
        "hidden": H if model.depth == 1 else list(model.hidden_sizes),
        "data": data or "unstated",
        "loo": loo_note,
        "drawn_units": _describe_drawn(keep_at["unit"], model.hidden_sizes[0]),
        "n_drawn_inputs": len(keep_at["input"]),
        "drawn_inputs": _describe_drawn(keep_at["input"], D),
    }
    if result is not None:
        attrs["converged"] = int(bool(getattr(result, "converged", True)))
    coords = {
        "unit": keep_at["unit"],
        "input": [f"in_{d}" for d in keep_at["input"]],
        "class": np.arange(K),
        "obs": np.arange(len(x)),
        **{f"unit{layer}": keep_at[f"unit{layer}"] for layer in range(2, model.depth + 1)},
    }
    dims = {**{k: site_dims[k] for k in keep}, "y": ["obs"]}
    groups = {
        "posterior": posterior,
        "log_likelihood": {"y": loglik.reshape(chains, num_samples, -1)},
        "posterior_predictive": {"y": y_rep.reshape(chains, num_samples, -1)},
        "observed_data": {"y": y},
    }
    return _from_dict(
        groups,
        coords,
        dims,
        attrs={"posterior": attrs, "log_likelihood": {"data": data or "unstated", "loo": loo_note}},
    )


def _loo_note(data: str | None) -> str:
    """What an export of ``data`` says of LOO; warns where LOO does not apply or the data are unstated."""
    if data == "train":
        return "applies: the pointwise log-likelihood is of the data the posterior was fitted to"
    if data == "held-out":
        warn_from_caller(
            "LOO does not apply to held-out data: az.loo and az.compare estimate out-of-sample fit from "
            "the data the posterior was fitted to, and on held-out data their elpd_loo is not a valid "
            "estimate; the held-out log predictive density is: bayesfuse.analysis.compare(models, x, y)",
            HeldOutDataWarning,
        )
        return (
            "does not apply: the log-likelihood is of held-out data; compare models with "
            "bayesfuse.analysis.compare(models, x, y), the held-out log predictive density"
        )
    if data is None:
        warn_from_caller(
            "say which data x, y are: data='train' for the data the posterior was fitted to (az.loo "
            "applies), data='held-out' for test data (LOO does not apply: compare models with "
            "bayesfuse.analysis.compare(models, x, y))",
            HeldOutDataWarning,
        )
        return "unknown: the export was not told whether x, y are the data the posterior was fitted to"
    raise ValueError(f"data must be 'train' or 'held-out', got {data!r}")
