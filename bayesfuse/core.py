"""The fusion core: J clients' state_dicts in, one fused state_dict and its per-layer results out.

Every entry point is this core between an adapter in and an adapter out:

* :func:`bayesfuse.fuse`: modules -> state_dicts -> :func:`fuse_states` -> rebuilt module;
* ``bayesfuse fuse`` (:func:`bayesfuse.fuse_files.fuse_files`): files -> :func:`fuse_states` -> files;
* the Flower strategy (:class:`bayesfuse.integrations.flower.MatchedAveraging`): ArrayRecords ->
  :func:`fuse_states` -> ArrayRecord.

Hyper-parameters are resolved by :func:`bayesfuse.methods.resolve` from the one method table,
whose row names the routine of this module that fuses each kind of input (``Method.fusers``);
the algorithms are the plain functions of :mod:`bayesfuse.inference`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from bayesfuse import methods
from bayesfuse._lazy import load
from bayesfuse._runtime import progress
from bayesfuse._text import warn_from_caller
from bayesfuse.inference._backend import check_device
from bayesfuse.inference.bias_free import biases_into_batchnorms, with_zero_biases
from bayesfuse.inference.bnn.sites import unit_group
from bayesfuse.inference.dead_cells import pad_projected_cells
from bayesfuse.inference.encodings import check_unfoldable, encoded_groups, fold_encodings, unfold_encodings
from bayesfuse.inference.heads import align_heads, orders_report, rename_heads, renamed_groups
from bayesfuse.inference.layerwise import check_states, class_share_matrix, match_layerwise
from bayesfuse.inference.otfusion import ot_fuse_layerwise
from bayesfuse.inference.spec import PermutationSpec, tie_stacked_recurrent
from bayesfuse.inference.spec_io import spec_for_state_dict_or_advice
from bayesfuse.inference.summary_fusion import laplace_fuse_entries, output_shares
from bayesfuse.inference.walk import Basis
from bayesfuse.models.bnn_fusion import fuse_bnn_posteriors, kl_units, matched_units
from bayesfuse.models.bnn_posterior import DeepBNNPosterior
from bayesfuse.models.bnn_sites import is_bnn_state

__all__ = ["StateFusion", "fuse_states", "input_kind"]

State = Mapping[str, Any]


@dataclass
class StateFusion:
    """What :func:`fuse_states` returns.

    Attributes
    ----------
    state : dict of str to ndarray
        The fused state_dict, in the first client's entry order (floating entries float64,
        except FedAvg's, which keep the clients' dtype; integer buffers keep theirs).
    layers : list of LayerResult
        One per fused layer (:class:`~bayesfuse.inference.result.LayerResult`): a
        ``MatchResult`` per hidden group, or the BNN's one ``MatchResult``/``KLFusionResult``.
    sizes : list of int
        Global width of each hidden group.
    groups : tuple of str
        The permutation group of each entry of ``layers`` (``("units",)`` for BNNs).
    posteriors : list of (mean, var)
        Each layer's global units as independent Gaussians, arrays (G, D): the atom
        posterior of a matching, or the fused BNN's unit posterior. For networks with position
        encodings (``spec.encodings``) the units are those of the plain network, encodings
        folded in (:mod:`bayesfuse.inference.encodings`, eq. F); ``state`` is for the
        position-aware network at the global widths.
    method, kind : str
        The method and the kind of input (``"network"`` or ``"bnn"``, :mod:`bayesfuse.methods`).
    hyper : dict
        Every hyper-parameter used, the method table's defaults filled in, and the seed.
    spec : PermutationSpec or None
        The architecture of point-estimate networks.
    seconds : float
    precision : dict of str to ndarray, optional
        With client summaries: the fused posterior precision of every entry in ``state``
        (:func:`~bayesfuse.inference.summary_fusion.laplace_fuse_entries`).
    """

    state: dict
    layers: list
    sizes: list
    groups: tuple
    posteriors: list
    method: str
    kind: str
    hyper: dict = field(default_factory=dict)
    spec: PermutationSpec | None = None
    seconds: float = 0.0
    precision: dict | None = None

    @property
    def converged(self) -> bool:
        """Whether every layer's matching or fusion converged."""
        return all(bool(getattr(layer, "converged", True)) for layer in self.layers)


def input_kind(states: Sequence[State]) -> str:
    """``"bnn"`` when every state_dict is a HorseshoeBNN's, ``"network"`` when none is."""
    from bayesfuse.models.bnn_sites import has_heads

    if any(has_heads(sd) for sd in states):
        raise TypeError(
            "a HeadMixtureBNN is a fused model with one head per client; fuse the clients' "
            "HorseshoeBNNs instead (or its shared-head body: its state_dict without the 'heads.' entries)"
        )
    flags = [is_bnn_state(sd) for sd in states]
    if any(flags) and not all(flags):
        raise TypeError("cannot fuse Bayesian (HorseshoeBNN) and point-estimate networks together")
    return "bnn" if flags and all(flags) else "network"


#: The hyper-parameters one network is matched with when the rest are left to empirical Bayes: a
#: vague prior, so that it comes back as itself.
ONE_NETWORK = {"prior_var": 1e8, "noise_var": 1.0}


def _one_network(settings: dict, given: Mapping) -> dict:
    """One network, data-free: empirical Bayes cannot tell the prior's spread from the noise with
    one client (it halved every weight and gave every hidden bias one value), so the choices
    left to it are a vague prior (:data:`ONE_NETWORK`), under which the network comes back as
    itself; what the caller gave is kept."""
    out = dict(settings)
    if all(settings.get(k) == "auto" and k not in given for k in ONE_NETWORK):
        out.update(ONE_NETWORK)
    return out


def warn_single(n_models: int) -> None:
    """The one line of fusing a single model: it comes back as itself (:func:`_one_network`).

    Passed through rather than refused, since a federated round can end with one valid reply
    (:mod:`bayesfuse.integrations`); the warning points at the caller's line, not the package's.
    """
    if n_models == 1:
        warn_from_caller(
            "only one model: fusion returns it (as it is, under a vague prior, unless its prior is given); give "
            "two or more models to fuse them"
        )


def fuse_states(
    states: Sequence[State],
    method: str = "pfnm",
    *,
    spec: PermutationSpec | None = None,
    class_counts: np.ndarray | None = None,
    names: Sequence[str] | None = None,
    seed: int | None = 0,
    verbose: bool | None = None,
    device=None,
    dtype: str = "float64",
    summaries: Sequence | None = None,
    output_pool: str = "precision",
    **hyper,
) -> StateFusion:
    """Fuse the clients' state_dicts with ``method`` (any of :data:`bayesfuse.methods.METHODS`
    that needs no data).

    Parameters
    ----------
    states : sequence of mappings of str to arrays (NumPy or torch)
        Point-estimate networks of one architecture (hidden widths may differ), or HorseshoeBNN
        state_dicts (``loc.*``, ``log_scale.*``, ``prior_scales``).
    method : str
        ``"pfnm"``, ``"nafi"``, ``"fedavg"``, ``"ot"`` (networks) or ``"kl"`` (BNNs);
        ``"pfnm"``/``"nafi"`` also fuse BNNs. ``"fedma"`` retrains clients: :func:`bayesfuse.fuse` with ``data``.
    spec : PermutationSpec, optional
        Networks only: which axes each hidden permutation acts on; derived from the first
        state_dict's names and shapes when omitted (:func:`~bayesfuse.inference.spec.spec_for_state_dict`).
        Position-aware neurons (PANs) are fused correctly only when the spec records their
        ``encodings`` (:func:`bayesfuse.nets.spec.spec_from_module` does): matching methods
        then fold each client's encodings into its weights (at its own widths), match the
        plain networks and unfold the fused one at the global widths
        (:mod:`bayesfuse.inference.encodings`), so that the position-aware network rebuilt at
        those widths computes the fused function. FedAvg averages position-aware networks
        coordinate-wise as they are (what their encodings align them for).
    class_counts : (J, K) array, optional
        Examples of each class per client: weights the output layer by class shares (matching)
        or the clients by their sizes (FedAvg).
    names : sequence of str, optional
        How messages call the clients (file names); ``"client j"`` by default.
    seed : int, optional
        Seed of the matching.
    verbose : bool, optional
        Progress bars: None (default) where stderr is a terminal, True or False forces them.
    device : None, str or torch.device
        Where PFNM/NAFI on point-estimate networks run their cost products and posterior means
        (:func:`~bayesfuse.inference.layerwise.match_layerwise`): None (default), NumPy on the
        host; a torch device (``"cpu"``, ``"cuda"``...), torch there in ``dtype``. An execution
        option, not a hyper-parameter: the result is NumPy either way, and the same as the
        host's up to round-off (float64) or float32 round-off (float32).
    dtype : {"float64", "float32"}
        With ``device``: the dtype the matching computes in.
    summaries : sequence of ClientSummary, optional
        One per client (:func:`bayesfuse.summarize`), for the methods that read them
        (``Method.summaries``: PFNM and NAFI on point-estimate networks). Each network is then
        its diagonal Laplace posterior: the units are matched as without summaries (the output
        layer weighted by the clients' output-bias precisions instead of class counts), and the
        fused entries are the members' precision-weighted means and precision-weighted log pool
        (:mod:`bayesfuse.inference.summary_fusion`). ``hyper["summaries"]`` says what was used.
        Class counts default to the summaries'.
    output_pool : {"precision", "counts"}
        With summaries: client j's share of the pooled class-k logit, ``s_jk``, in proportion to
        the precision its data give its class-k output bias (``"precision"``, the Laplace
        posteriors' own weighting) or to its examples of class k (``"counts"``, PFNM's class
        shares). Neither wins everywhere (see the README); ``bayesfuse.fuse(..., rounds=2)``
        lets the clients choose.
    **hyper
        The method's hyper-parameters (:func:`bayesfuse.methods.resolve`; ``bayesfuse fuse
        --help`` lists them with their defaults).

    Returns
    -------
    StateFusion

    Raises
    ------
    ValueError
        Besides bad inputs and hyper-parameters: a ``device`` for a method or kind of input
        that cannot use one, or a device this machine lacks (before any work).
    """
    start = time.perf_counter()
    verbose = progress(verbose)
    if len(states) == 0:
        raise ValueError("fuse needs at least one model")
    method = methods.canonical(method)
    methods.check_keys(method, hyper, caller=fuse_states)
    m = methods.METHODS[method]
    if m.needs_data:
        raise ValueError(
            f"method={method!r} retrains the clients between layers: pass data=(train, partition) with "
            "each client's training data to bayesfuse.fuse, or fuse in one shot with pfnm or nafi"
        )
    kind = input_kind(states)
    settings = methods.resolve(method, kind, hyper)
    methods.check_execution(method, kind, device)
    check_device(device, dtype)
    names = list(names) if names is not None else [f"client {j}" for j in range(len(states))]
    if kind == "network":
        _check_batch_norms(states, names)
    options: dict[str, Any] = {}
    if output_pool not in ("precision", "counts"):
        raise ValueError(f"output_pool must be 'precision' or 'counts', got {output_pool!r}")
    if summaries is None and output_pool != "precision":
        raise ValueError("output_pool applies to fusion with client summaries; pass summaries=")
    if summaries is not None:
        options["summaries"] = _checked_summaries(summaries, states, names, method, kind)
        options["output_pool"] = output_pool
        if class_counts is None:
            class_counts = np.stack([np.asarray(s.class_counts) for s in options["summaries"]])
    warn_single(len(states))
    if len(states) == 1 and kind == "network" and summaries is None:
        settings = _one_network(settings, hyper)
    fuse = load(methods.METHODS[method].fusers[kind])  # the table's routine for this kind of input
    tied = spec if spec is not None and spec.tied else None
    keys = list(states[0])  # the clients' entries, in their order
    if tied is not None:  # one tensor under two names: matched once, under its entry's name
        states, spec = [{k: v for k, v in sd.items() if k not in tied.tied} for sd in states], tied.untied()
        if "summaries" in options:
            options["summaries"] = [
                dataclasses.replace(s, precision={k: v for k, v in s.precision.items() if k not in tied.tied})
                for s in options["summaries"]
            ]
    fused = fuse(
        states,
        names,
        method,
        settings,
        spec=spec,
        class_counts=class_counts,
        seed=seed,
        verbose=verbose,
        device=device,
        dtype=dtype,
        **options,
    )
    if kind == "network":
        _dead_cells(fused)  # before the aliases are back: a module held twice is padded once, then retied
    if tied is not None:  # the alias back, in its place, with its entry's value
        fused.spec = (fused.spec or tied.untied()).with_ties(tied.tied)  # the method's spec (groups it tied)
        fused.state = _in_order(fused.spec.retie(fused.state), keys)
        fused.precision = None if fused.precision is None else _in_order(fused.spec.retie(fused.precision), keys)
        fused.hyper["tied"] = dict(tied.tied)
    fused.seconds = time.perf_counter() - start
    return fused


def _in_order(state: dict, order: list) -> dict:
    """``state`` with the entries ``order`` names first, in its order, then the rest."""
    return {**{k: state[k] for k in order if k in state}, **{k: v for k, v in state.items() if k not in order}}


def _dead_cells(fused: StateFusion) -> None:
    """Give a projected LSTM fused to as many projections as cells, or more, the dead cells that
    ``nn.LSTM`` needs (:func:`~bayesfuse.inference.dead_cells.pad_projected_cells`): the same
    function; the cells' group's size and ``hyper["dead_cells"]`` say so. Only where nothing but
    the LSTM reads its cells (its final ``c`` read elsewhere would hold the dead cells too): there
    the rebuild refuses the widths in one line, as before."""
    spec = fused.spec
    if spec is None:
        return
    inside = []
    for key, axes in spec.axes.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight_hr_l0" and axes[1] is not None and axes[1].group not in spec.fixed:  # a width kept: none
            readers = {k for k, v in spec.axes.items() if any(a is not None and a.group == axes[1].group for a in v)}
            if all(k.startswith(f"{module}.") for k in readers):
                inside.append(module)
    fused.state, padded = pad_projected_cells(fused.state, only=inside)
    if not padded:
        return
    if fused.precision is not None:
        fused.precision, _ = pad_projected_cells(fused.precision, only=inside)
    for module, (_, wide) in padded.items():
        axis = spec.axes[f"{module}.weight_hr_l0"][1]
        if axis is not None and axis.group in fused.groups:
            fused.sizes[fused.groups.index(axis.group)] = wide
    fused.hyper["dead_cells"] = {module: list(widths) for module, widths in padded.items()}


def _check_batch_norms(states: Sequence[State], names: Sequence[str]) -> None:
    """Refuse a batch norm's negative running variance, naming the client (a file's path) and the value."""
    for sd, name in zip(states, names):
        for key, value in sd.items():
            if key.endswith(".running_var"):
                var = value.detach().cpu().double().numpy() if hasattr(value, "detach") else np.asarray(value, float)
                if var.size and (var < 0).any():
                    unit = int(np.argmin(var))
                    raise ValueError(
                        f"{name}: batch norm {key.removesuffix('.running_var')!r} has a negative running "
                        f"variance ({var.flat[unit]:g} at unit {unit}), which no trained batch norm "
                        "has: the file is damaged or its entries are misnamed"
                    )


def _checked_summaries(summaries, states, names, method, kind) -> list:
    """The clients' summaries, one per client, each checked against its network (one line naming it)."""
    from bayesfuse.summaries import check_summary

    if kind not in methods.METHODS[method].summaries:
        readers = [m.name for m in methods.METHODS.values() if kind in m.summaries]
        raise ValueError(
            f"method={method!r} does not read client summaries for {kind} inputs; "
            f"{', '.join(readers) or 'no method'} does"
        )
    summaries = list(summaries)
    if len(summaries) != len(states):
        raise ValueError(
            f"{len(summaries)} summaries for {len(states)} models: give one per client, in the models' order"
        )
    missing = [n for n, s in zip(names, summaries) if s is None]
    if missing:
        raise ValueError(
            f"no summary for {', '.join(missing)}: give every client's summary, or none (the data-free path)"
        )
    return [check_summary(s, sd, n) for s, sd, n in zip(summaries, states, names)]


# --------------------------------------------------------------------------- the table's fusers
# Each takes (states, names, method, settings) and the keywords spec, class_counts, seed, verbose,
# device and dtype (those it has no use for in **_), and returns a StateFusion.


def _network_spec(states, names, spec, class_counts, *, matched: bool = True) -> PermutationSpec:
    """The spec of point-estimate networks (derived from the first state_dict when not given), and
    the class counts checked against its output layer (every method's check); ``matched``: the
    method matches units, so the spec must have some (FedAvg averages entries as they are)."""
    if spec is None:
        spec = spec_for_state_dict_or_advice(states[0], names[0], like="spec=spec_from_module(model)")
    if matched and not spec.groups:
        if spec.in_place:
            entry, why = next(iter(spec.in_place.items()))
            raise ValueError(
                f"every hidden unit of the networks is held in place ({entry}: {why}; spec.in_place names all "
                f"{len(spec.in_place)}), so there is nothing to match: fuse them with 'fedavg', which averages them "
                "in place"
            )
        raise ValueError("the networks have no hidden units to match (no hidden layer)")
    if class_counts is not None and spec.output:
        class_share_matrix(class_counts, len(states), int(np.shape(spec.split(states[0])[spec.output[0]])[0]))
    return spec


def _aligning(fuse_plain):
    """A fuser of networks whose hidden units ``fuse_plain`` aligns, for networks with or without
    position encodings: for position-aware neurons, match the plain networks (eq. F at each
    client's widths), then give the fused network the weights that its encodings at the global
    widths turn into the plain ones (eq. U)."""

    @functools.wraps(fuse_plain)
    def fuse(states, names, method, settings, *, spec, class_counts, **options) -> StateFusion:
        spec = _network_spec(states, names, spec, class_counts)
        if spec.pieces:  # entries reading streams side by side: matched as their pieces, then put together
            states = [spec.split(sd) for sd in states]
            if options.get("summaries") is not None:
                options["summaries"] = [
                    dataclasses.replace(s, precision=spec.split(s.precision)) for s in options["summaries"]
                ]
        fused = fuse_widths(states, names, method, settings, spec=spec, class_counts=class_counts, **options)
        if spec.fixed and not methods.METHODS[method].keeps_widths:  # matched at it (layerwise.match_group)
            tied = {g: names[0] for names in fused.hyper.get("tied_layers", {}).values() for g in names[1:]}
            # the clients' widths read off their states, checked by now
            spec.check_fixed_kept(method, spec.sizes(states[0]), dict(zip(fused.groups, fused.sizes)), tied)
            fused.hyper["fixed"] = dict(spec.fixed)
        if spec.in_place:
            fused.hyper["in_place"] = dict(spec.in_place)
        if spec.pieces:
            fused.state = spec.join(fused.state)
            fused.precision = None if fused.precision is None else spec.join(fused.precision)
        return fused

    def fuse_widths(states, names, method, settings, *, spec, class_counts, **options) -> StateFusion:
        fused = fuse_untied(states, names, method, settings, spec=spec, class_counts=class_counts, **options)
        if methods.METHODS[method].keeps_widths:
            return fused
        # a stacked LSTM keeps one width for its layers: where matching gave them different
        # widths, they are matched again as one group (one permutation for all its layers)
        widths = dict(zip(fused.groups, fused.sizes))
        _, stacked = tie_stacked_recurrent(spec, states[0])
        uneven = {m for m, groups in stacked.items() if len({widths.get(g) for g in groups}) > 1}
        # a projected LSTM's cells and projections are tied together: tying one changes the other's matching
        uneven = {m for m in stacked if m.removesuffix(" (cells)") in {u.removesuffix(" (cells)") for u in uneven}}
        if uneven:
            tied, layers = tie_stacked_recurrent(spec, states[0], only=sorted(uneven))
            fused = fuse_untied(states, names, method, settings, spec=tied, class_counts=class_counts, **options)
            fused.hyper["tied_layers"] = layers
        return fused

    def fuse_untied(states, names, method, settings, *, spec, class_counts, **options) -> StateFusion:
        given, keys = spec, list(states[0])
        biased, spec, summaries, added = with_zero_biases(states, spec, options.get("summaries"))
        if not added:  # as the caller gave them
            return fused_aligned(states, names, method, settings, spec=spec, class_counts=class_counts, **options)
        options["summaries"] = summaries
        fused = fused_aligned(biased, names, method, settings, spec=spec, class_counts=class_counts, **options)
        fused.state = biases_into_batchnorms(fused.state, added, keys)  # the clients' entries, exactly
        if fused.precision is not None:
            fused.precision = {k: v for k, v in fused.precision.items() if k in keys}
        fused.spec = given
        return fused

    def fused_aligned(states, names, method, settings, *, spec, class_counts, **options) -> StateFusion:
        if spec.heads:
            return _heads_aligned(fuse_plain)(
                states, names, method, settings, spec=spec, class_counts=class_counts, **options
            )
        if not encoded_groups(spec):
            return fuse_plain(states, names, method, settings, spec=spec, class_counts=class_counts, **options)
        if options.get("summaries") is not None:
            raise ValueError(
                "fusing position-aware networks (PANs) with summaries is not supported: fuse them without summaries"
            )
        check_unfoldable(spec)
        plain = [fold_encodings(sd, spec) for sd in check_states(states, spec, names)]
        fused = fuse_plain(plain, names, method, settings, spec=spec, class_counts=class_counts, **options)
        unfolded = unfold_encodings(fused.state, spec)
        fused.state = {k: unfolded[k] for k in fused.state}
        return fused

    return fuse


def _heads_aligned(fuse_plain):
    """A fuser of networks with exchangeable heads (``spec.heads``): each client's heads are put in
    the order that aligns them (:func:`~bayesfuse.inference.heads.align_heads`), then fused by
    ``fuse_plain``. ``hyper["head_orders"]`` holds, per client, each set's order (position b holds
    the client's head ``order[b]``); the layers' assignments of head groups refer to that order."""

    def fuse(states, names, method, settings, *, spec, class_counts, **options) -> StateFusion:
        if encoded_groups(spec):
            raise ValueError("position-aware neurons in a network with attention heads are not supported")
        checked = check_states(states, spec, names)
        orders = align_heads(checked, spec)
        aligned = [rename_heads(sd, spec, o) for sd, o in zip(checked, orders)]
        if options.get("summaries") is not None:
            renamed = []
            for s, o in zip(options["summaries"], orders):
                groups = renamed_groups(spec, o)
                moments = {groups.get(g, g): v for g, v in s.moments.items()}
                renamed.append(dataclasses.replace(s, precision=rename_heads(s.precision, spec, o), moments=moments))
            options["summaries"] = renamed
        fused = fuse_plain(aligned, names, method, settings, spec=spec, class_counts=class_counts, **options)
        fused.hyper["head_orders"] = orders_report(spec, orders)
        return fused

    return fuse


@_aligning
def _ot_states(states, names, method, settings, *, spec, class_counts, **_) -> StateFusion:
    """OT fusion (:func:`ot_fuse_layerwise`) of plain networks."""
    weights = None if class_counts is None else np.asarray(class_counts, dtype=np.float64).sum(1)
    result = ot_fuse_layerwise(states, spec, weights=weights, names=names, **settings)
    layers = [result.layers[g] for g in spec.groups]
    return StateFusion(
        state={k: result.state_dict[k] for k in states[0]},
        layers=layers,
        sizes=[result.sizes[g] for g in spec.groups],
        groups=tuple(spec.groups),
        posteriors=[(layer.mean, layer.var) for layer in layers],
        method=method,
        kind="network",
        hyper={**settings, "anchor": result.anchor, "weights": "class_counts" if weights is not None else "uniform"},
        spec=spec,
    )


@_aligning
def _match_states(
    states,
    names,
    method,
    settings,
    *,
    spec,
    class_counts,
    seed,
    verbose,
    device=None,
    dtype="float64",
    summaries=None,
    output_pool="precision",
) -> StateFusion:
    """PFNM/NAFI (:func:`match_layerwise`, on ``device`` in ``dtype`` when one is given) of plain
    networks; with ``summaries``, the matched networks fused as Laplace posteriors
    (:func:`~bayesfuse.inference.summary_fusion.laplace_fuse_entries`)."""
    if summaries is not None:
        if output_pool == "precision":
            h = np.stack([_output_precision(s, spec, n) for s, n in zip(summaries, names)])
        else:
            h = np.stack([np.asarray(s.class_counts, dtype=np.float64) for s in summaries])
        class_counts = h  # the output layer's weights in the matching: shares of the output-bias precisions
    result = match_layerwise(
        states,
        spec,
        class_counts=class_counts,
        seed=seed,
        names=names,
        verbose=verbose,
        device=device,
        dtype=dtype,
        **settings,
    )
    layers = [result.layers[g] for g in spec.groups]
    hyper = {**settings, "seed": seed}
    posteriors = [(layer.mean, layer.var) for layer in layers]  # the matching's atoms (data-free)
    if summaries is not None:
        bases = {g: Basis(result.layers[g].assignments, result.layers[g].n_global) for g in spec.groups}
        values, precision = laplace_fuse_entries(
            check_states(states, spec, names),
            [s.precision for s in summaries],
            [s.prior_precision for s in summaries],
            spec,
            bases,
            output_shares(h),
        )
        result.state_dict.update(values)
        posteriors = [
            _network_posterior(result.state_dict, precision, spec, g, layer) for g, layer in zip(spec.groups, layers)
        ]
        hyper["summaries"] = {
            "used": True,
            "weights": "laplace precision (GGN diagonal + prior)",
            "output": f"log pool, shares by {output_pool}",
            "prior_precision": [s.prior_precision for s in summaries],
            "examples": [s.n_examples for s in summaries],
            "bytes": [s.nbytes for s in summaries],
        }
    chosen = {g: chosen_hyper(layer) for g, layer in zip(spec.groups, layers) if "auto" in layer.hyper}
    if chosen:
        hyper["chosen"] = chosen
    return StateFusion(
        state={k: result.state_dict[k] for k in states[0]},
        layers=layers,
        sizes=[result.sizes[g] for g in spec.groups],
        groups=tuple(spec.groups),
        posteriors=posteriors,
        method=method,
        kind="network",
        hyper=hyper,
        spec=spec,
        precision=precision if summaries is not None else None,
    )


def _network_posterior(values: Mapping, precision: Mapping, spec: PermutationSpec, group: str, layer) -> tuple:
    """With summaries the fused network is a posterior: each unit's entries at the values the network
    holds (:func:`~bayesfuse.inference.summary_fusion.laplace_fuse_entries`), variance one over their
    fused precision, laid out as the matching's atoms (``layer.hyper["blocks"]``); the matching's own
    atom posterior where the network's entries do not lay out so (folded batch norms)."""
    from bayesfuse.inference.layerwise import unit_rows

    blocks = layer.hyper.get("blocks")
    if not blocks or spec.folds or any(k not in precision for k in blocks):
        return layer.mean, layer.var
    mean = unit_rows(values, spec, group, blocks)
    if mean.shape != np.shape(layer.mean):
        return layer.mean, layer.var
    with np.errstate(divide="ignore"):
        var = 1.0 / unit_rows(precision, spec, group, blocks)
    return mean, var


def _output_precision(summary, spec, name) -> np.ndarray:
    h = summary.output_precision(spec)
    if h is None:
        raise ValueError(
            f"{name}: fusing with summaries needs an output bias (its precision weighs the clients' "
            "logits); this network has none"
        )
    return h


def chosen_hyper(layer) -> dict:
    """The hyper-parameters empirical Bayes chose for one layer, per block of its units' entries."""
    h = layer.hyper
    return {
        "blocks": h["blocks"],
        "noise_var": h["noise_var"],
        "prior_var": h["prior_var"],
        "prior_mean": h["prior_mean"],
        "gamma0": h["gamma0"],
        "rounds": h["rounds"],
    }


def _fedavg_states(states, names, method, settings, *, spec, class_counts, **_) -> StateFusion:
    """One-shot FedAvg: the clients' entries averaged as they are (identical widths, their dtype kept)."""
    spec = _network_spec(states, names, spec, class_counts, matched=False)
    check_states(states, spec, names)  # architecture, NaN, integer or complex weights
    return averaged_states(states, names, method, spec, class_counts)


def unpermuted_spec(state: Mapping) -> PermutationSpec:
    """A spec that permutes nothing: every entry of ``state`` averaged as it is (FedAvg of a
    network whose units cannot be traced)."""
    return PermutationSpec(axes={k: (None,) * np.ndim(v) for k, v in state.items()}, groups=())


def averaged_states(states, names, method: str, spec: PermutationSpec, class_counts) -> StateFusion:
    """FedAvg's average of every entry (:func:`~bayesfuse.baselines.fedavg_state_dicts`), weighted
    by the clients' examples when ``class_counts`` are given; the same entries and shapes in every
    state, or one line naming the client and the entry."""
    import torch

    from bayesfuse.baselines import fedavg_state_dicts

    for sd, n in zip(states[1:], names[1:]):
        if set(sd) != set(states[0]):
            extra = sorted(set(sd) ^ set(states[0]))[0]
            raise ValueError(
                f"{n}: entry {extra!r} is in {n if extra in sd else names[0]} only; fedavg needs the same "
                "entries in every client"
            )
        for k, t in sd.items():
            if tuple(t.shape) != tuple(states[0][k].shape):
                raise ValueError(
                    f"{n}: fedavg needs identical widths, {k!r} has shape {tuple(t.shape)} and "
                    f"{tuple(states[0][k].shape)} in {names[0]}"
                )
    weights = None if class_counts is None else np.asarray(class_counts, dtype=np.float64).sum(1)
    tensors = [
        {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for k, v in sd.items()}
        for sd in states
    ]
    state = {k: v.numpy() for k, v in fedavg_state_dicts(tensors, weights).items()}
    sizes = spec.sizes(state)
    return StateFusion(
        state=state,
        layers=[],
        sizes=[sizes[g] for g in spec.groups],
        groups=tuple(spec.groups),
        posteriors=[],
        method=method,
        kind="network",
        hyper={"weights": "class_counts" if weights is not None else "uniform"},
        spec=spec,
    )


def _fuse_bnn_states(
    states,
    names,
    method,
    settings,
    *,
    fuse_units,
    class_counts,
    seed,
    verbose,
    summaries=None,
    output_pool: str = "precision",
    **_,
) -> StateFusion:
    """Fuse horseshoe BNNs of any depth as mean-field posteriors, layer by layer
    (:func:`~bayesfuse.models.bnn_fusion.fuse_bnn_posteriors`: pruning, the scale-free unit form,
    the units of each layer fused by ``fuse_units``, class-share outputs). With ``head="clients"`` the state holds the
    clients' heads too (:data:`~bayesfuse.models.bnn_fusion.HEAD_KEYS`).

    The ``assignments`` of each layer index each client's kept units; ``hyper["kept_units"]``
    lists which of its units those are (per client for one hidden layer; per layer, then per
    client, for deeper networks). With ``summaries`` (:func:`bayesfuse.summarize` of each BNN on
    its own data) the units are pruned by what they contribute on the clients' data
    (``prune_share``) instead of by their information (``prune_kl``); ``hyper["pruning"]`` and
    ``hyper["summaries"]`` say which.
    """
    if summaries is not None and output_pool != "precision":
        raise ValueError(f"output_pool={output_pool!r} is for point-estimate networks; BNNs pool their own outputs")
    posts = [DeepBNNPosterior.from_state(sd, n) for sd, n in zip(states, names)]
    ref = posts[0]
    for n, p in zip(names, posts):
        if (p.in_features, p.n_classes, len(p.layers)) != (ref.in_features, ref.n_classes, len(ref.layers)):
            raise ValueError(
                f"{n} maps {p.in_features} -> {p.n_classes} through {len(p.layers)} hidden layers, "
                f"{names[0]} maps {ref.in_features} -> {ref.n_classes} through {len(ref.layers)}"
            )
    settings = dict(settings)
    head = settings.pop("head")
    moments = None if summaries is None else [s.moments for s in summaries]
    fusion = fuse_bnn_posteriors(
        posts,
        fuse_units,
        class_counts=class_counts,
        seed=seed,
        verbose=verbose,
        names=names,
        moments=moments,
        **settings,
    )
    hyper = dict(fusion.hyper)
    hyper.update(
        average_outputs=settings["average_outputs"],
        unit_form=settings["unit_form"],
        prune_kl=settings["prune_kl"],
        prune_share=settings["prune_share"],
        head=head,
    )
    if summaries is not None:
        hyper["summaries"] = {
            "used": True,
            "pruning": "units' contributions on the clients' data (their unit moments)",
            "examples": [s.n_examples for s in summaries],
            "bytes": [s.nbytes for s in summaries],
        }
    kept = [[k.tolist() for k in layer] for layer in fusion.kept]
    hyper["kept_units"] = kept[0] if len(kept) == 1 else kept
    depth = len(posts[0].layers)
    groups = tuple(unit_group(layer) for layer in range(1, depth + 1))
    state = fusion.posterior.to_state()
    if head == "clients":  # a HeadMixtureBNN's state_dict (bayesfuse.models.bnn_heads)
        state.update(fusion.heads)
    return StateFusion(
        state=state,
        layers=fusion.layers,
        sizes=[len(u[0]) for u in fusion.units],
        groups=groups,
        posteriors=fusion.units,
        method=method,
        kind="bnn",
        hyper=hyper,
    )


#: BNNs whose units are matched (PFNM, NAFI) or KL-fused, layer by layer.
_matched_bnn_states = functools.partial(_fuse_bnn_states, fuse_units=matched_units)
_kl_bnn_states = functools.partial(_fuse_bnn_states, fuse_units=kl_units)
