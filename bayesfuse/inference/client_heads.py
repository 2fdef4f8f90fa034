"""The clients' own output layers on a one-shot fusion's hidden units, as arrays.

After PFNM or NAFI have matched the hidden units, every client's unit ``l`` of the group its
output layer reads is one global unit ``a_j(l)`` (the assignments). Client j's output layer is
then a head on the fused features: its weight from its unit ``l`` becomes the head's weight
from global unit ``a_j(l)``, 0 from the global units it has no unit in, its bias its own.
:class:`~bayesfuse.nets.heads.ClientHeads` predicts with these heads; this module computes them
from the clients' state_dicts, so that ``fuse``, ``bayesfuse fuse`` (which writes them beside
the fused model) and the Flower strategy share one rule.

With client summaries each head is its client's Laplace posterior of its own output layer
(Daxberger et al. 2021), moved the same way. Where every summary carries the Kronecker factors
of that layer (:func:`bayesfuse.summaries.output_factors`), the posterior is Kronecker-factored
(Ritter, Botev & Barber 2018):

.. math::

    H_j = n_j \\, A_j \\otimes S_j + \\delta_j I ,

``A_j`` the client's mean ``a~ a~^T`` of its own features (bias last), ``S_j`` its mean softmax
Hessian, ``n_j`` its examples and ``delta_j`` its summary's prior precision. ``A_j`` is placed at
the rows and columns of the global units its units were matched to; the head's weights from the
other global units are not parameters of the client's model (they are 0, with no variance), so
its ``support`` (the columns it reads) masks them out of the variance: the variance of a head's
logits on fused features ``a~`` is that of the client's posterior on ``a~`` restricted to its
matched units. Otherwise (a version 1 summary, or any client's summary without the factors: an
output layer wider than :data:`~bayesfuse.summaries.MAX_FACTOR_WIDTH`) each weight's precision
is the summary's GGN diagonal plus ``delta_j`` (``inf`` where the head has no weight), which
adds the variances of the weights as if they were independent and makes heads reading many units
too wide.

K-FAC takes the mean of a Kronecker product over the examples for the product of the means, so
its curvature's trace, ``n_j tr(A_j) tr(S_j) = (sum_n ||a~_n||^2) mean_n tr(S_n)``, differs from
the exact GGN's, ``sum_n ||a~_n||^2 tr(S_n)`` (the sum of the summary's GGN diagonal of the
layer, or of its EKFAC eigenvalues where the summary has them), where a feature's size and the
softmax's confidence go together. With ``trace_match`` each head's curvature is scaled by their
ratio,

.. math::

    H_j = c_j n_j \\, A_j \\otimes S_j + \\delta_j I , \\qquad
    c_j = \\frac{\\sum_i \\mathrm{diag}(\\mathrm{GGN}_j)_i}{n_j \\, \\mathrm{tr}(A_j) \\, \\mathrm{tr}(S_j)} ,

one number per head, from the summary alone (the server needs nothing more): the Kronecker
structure stays and its trace is the exact one. It is one of the candidates of the temperature
round (:func:`bayesfuse.fuse`); on Fashion-MNIST it calibrates a one-layer MLP's heads and
widens a two-layer MLP's too far (docs/guide/quality.md), so it is not the one-shot default.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from bayesfuse.inference.spec import PermutationSpec

__all__ = [
    "one_shot_heads",
    "class_shares",
    "heads_refused",
    "default_head",
    "default_pool",
    "trace_ratios",
    "ekfac_eigenvalues",
    "kronecker_variants",
    "HEAD_FORMS",
]

#: The posterior forms of one-shot heads: none (points), diagonal, Kronecker-factored.
HEAD_FORMS = ("map", "diagonal", "kronecker")


def class_shares(class_counts: np.ndarray) -> np.ndarray:
    """(J, K) shares ``n_jk / sum_j n_jk`` of each class's examples; ``1 / J`` for a class no client saw."""
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 2 or not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(f"class counts must be a (clients, classes) array of counts >= 0, got shape {counts.shape}")
    total = counts.sum(0, keepdims=True)
    return np.where(total > 0, counts / np.where(total > 0, total, 1.0), 1.0 / len(counts))


def _read_axis(spec: PermutationSpec, state: Mapping[str, Any]) -> tuple[str, str, list, str | None]:
    """The output layer's weight and bias entries, what its weight reads, side by side (one
    ``(axis, length)`` per piece, :attr:`~bayesfuse.inference.spec.PermutationSpec.pieces`: a
    hidden group's axis and None, or None and the length of numbers no permutation moves), and
    why the clients' own heads cannot be kept on it (None when they can: it reads hidden groups
    unit by unit, beside the inputs at most)."""
    weight_key, bias_key = spec.output_layer(state)
    if weight_key in spec.pieces:
        _, pieces = spec.pieces[weight_key]
        reads = [(spec.axes[name][1], length) for name, length in pieces]
    else:
        axes = spec.axes.get(weight_key, ())
        reads = [(axes[1] if len(axes) > 1 else None, None)]
    groups = [a for a, _ in reads if a is not None]
    if groups and all(a.inner == 1 for a in groups):  # a group read unit by unit, once or more side by side
        return weight_key, bias_key, reads, None
    where = "inputs" if not groups else f"group {next(a for a in groups if a.inner > 1).group!r} with positions"
    output = weight_key.rpartition(".")[0]
    return (
        weight_key,
        bias_key,
        reads,
        (
            f"the clients' own heads need an output layer that reads one hidden group unit by unit; "
            f"{output!r} reads {where}"
        ),
    )


def heads_refused(spec: PermutationSpec | None, state: Mapping[str, Any]) -> str | None:
    """Why the clients' own heads cannot be kept on networks of ``spec`` (``state`` one of them),
    or None when they can: the output layer must read one hidden group unit by unit."""
    if spec is None:
        return "the clients' own heads need the networks' permutation spec"
    return _read_axis(spec, state)[3]


def default_head(keeps_heads: bool, summaries, spec: PermutationSpec | None, state) -> tuple[str, str | None]:
    """The head a one-shot fusion keeps when none is asked for, and why not the clients' own.

    With ``summaries``, by a method that keeps them (``keeps_heads``,
    :attr:`bayesfuse.methods.Method.own_heads`), the clients' own heads (``"clients"``, None);
    where the output layer does not allow them, ``("shared", why)``; otherwise ``("shared",
    None)``: without summaries the shared head is the default.
    """
    if summaries is None or not keeps_heads:
        return "shared", None
    refused = heads_refused(spec, state)
    return ("shared", refused) if refused else ("clients", None)


def default_pool(summaries) -> str:
    """How the clients' heads are pooled when no pool is asked for: geometrically (``"log"``)
    with summaries, their mixture (``"linear"``) without."""
    return "log" if summaries is not None else "linear"


def one_shot_heads(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, Any]],
    assignments: Mapping[str, Sequence],
    width: int,
    class_counts=None,
    summaries=None,
    *,
    trace_match: bool = False,
    ekfac: bool = False,
) -> dict[str, Any]:
    """The clients' own output layers as heads on ``width`` fused features (module docstring).

    Parameters
    ----------
    spec : PermutationSpec
        The networks' spec; its output layer must read one hidden group unit by unit.
    states : sequence of state_dicts
        The clients' networks, in the order of ``assignments``.
    assignments : mapping of group to sequence
        Per group, each client's global unit of each of its units (a fusion's assignments).
    width : int
        G, the fused output layer's inputs (the global units of the group it reads).
    class_counts : (J, K) array, optional
        The heads' shares; without, the summaries' counts, without those uniform.
    summaries : sequence of ClientSummary, optional
        One per client: each head becomes its client's Laplace posterior.
    trace_match : bool
        With Kronecker factors: each head's curvature scaled so that its trace is the exact GGN's
        (module docstring, :func:`trace_ratios`), as ``laplace["scale"]``. Diagonal and point
        heads are left as they are.
    ekfac : bool
        Each head's curvature the exact GGN's eigenvalues in its Kronecker factors' eigenbasis
        (EKFAC, :func:`ekfac_eigenvalues`), as ``laplace["eigenvalues"]``; every summary must
        carry the factors and their eigenvalues (version 3 or later). Not with ``trace_match`` (EKFAC's
        trace is the exact one already).

    Returns
    -------
    dict
        ``output`` (the output layer's module name), ``weight`` (J, K, G), ``bias`` (J, K),
        ``shares`` (J, K), ``form`` (:data:`HEAD_FORMS`) and ``laplace``: None, ``{"precision":
        (J, K, G+1)}``, or ``{"gram": (J, G+1, G+1), "curvature": (J, K, K), "n": (J,),
        "prior_precision": (J,), "support": (J, G+1)}`` and, with ``trace_match``, ``"scale": (J,)``,
        with ``ekfac``, ``"eigenvalues": (J, G+1, K)``; ``examples``, each client's class counts
        summed (J,), which smooth its head's predictive, None without counts (the arguments of
        :class:`~bayesfuse.nets.heads.ClientHeads`).

    Raises
    ------
    ValueError
        The output layer reads the inputs or positions, or a summary's factors do not fit its
        client's output layer.
    """
    weight_key, bias_key, columns = _layout(spec, states, assignments, width)
    output = weight_key.rpartition(".")[0]
    J, G = len(states), int(width)
    K = int(np.shape(states[0][bias_key])[0])
    if trace_match and ekfac:
        raise ValueError("trace_match and ekfac both set the curvature's trace: choose one")
    weight = np.zeros((J, K, G))
    for j, (state, c) in enumerate(zip(states, columns)):
        weight[j][:, c] = np.asarray(state[weight_key], dtype=np.float64)
    bias = np.stack([np.asarray(state[bias_key], dtype=np.float64) for state in states])
    if class_counts is None and summaries is not None:
        class_counts = np.stack([np.asarray(s.class_counts) for s in summaries])
    shares = class_shares(np.ones((J, K)) if class_counts is None else np.asarray(class_counts))
    form, laplace = "map", None
    if summaries is None and ekfac:
        raise ValueError("ekfac needs the clients' summaries (version 3 or later)")
    if summaries is not None:
        if all(getattr(s, "output_factors", None) is not None for s in summaries):
            form, laplace = "kronecker", _kronecker(summaries, columns, G, K)
            if trace_match:
                laplace["scale"] = trace_ratios(summaries, weight_key, bias_key)
            if ekfac:
                laplace["eigenvalues"] = _placed_eigenvalues(summaries, columns, G, K)
        elif ekfac:
            raise ValueError("ekfac needs every summary's output factors (Kronecker-factored heads)")
        else:
            form, laplace = "diagonal", _diagonal(summaries, columns, weight_key, bias_key, G, K)
    examples = None if class_counts is None else np.asarray(class_counts, dtype=np.float64).sum(1)
    return dict(output=output, weight=weight, bias=bias, shares=shares, form=form, laplace=laplace, examples=examples)


def _diagonal(summaries, columns, weight_key: str, bias_key: str, G: int, K: int) -> dict:
    """Each head weight's precision, GGN diagonal plus prior, ``inf`` where the head has none."""
    precision = np.full((len(summaries), K, G + 1), np.inf)
    for j, (s, c) in enumerate(zip(summaries, columns)):
        precision[j][:, c] = np.asarray(s.precision[weight_key]) + s.prior_precision
        precision[j][:, G] = np.asarray(s.precision[bias_key]) + s.prior_precision
    return {"precision": precision}


def _kronecker(summaries, columns, G: int, K: int) -> dict:
    """Each client's Kronecker factors placed at its matched columns (bias last), and its support."""
    J = len(summaries)
    gram, support = np.zeros((J, G + 1, G + 1)), np.zeros((J, G + 1))
    curvature = np.zeros((J, K, K))
    for j, (s, c) in enumerate(zip(summaries, columns)):
        own = np.asarray(s.output_factors["gram"], dtype=np.float64)
        if own.shape != (c.size + 1, c.size + 1) or np.shape(s.output_factors["curvature"]) != (K, K):
            raise ValueError(
                f"client {j}'s output factors (gram {own.shape}, curvature {np.shape(s.output_factors['curvature'])}) "
                f"do not fit its output layer of {c.size} inputs and {K} classes"
            )
        at = np.append(c, G)
        gram[j][np.ix_(at, at)] = own
        support[j, at] = 1.0
        curvature[j] = s.output_factors["curvature"]
    n = np.array([s.n_examples for s in summaries], dtype=np.float64)
    prior = np.array([s.prior_precision for s in summaries], dtype=np.float64)
    return {"gram": gram, "curvature": curvature, "n": n, "prior_precision": prior, "support": support}


def ekfac_eigenvalues(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, Any]],
    assignments: Mapping[str, Sequence],
    width: int,
    summaries,
) -> np.ndarray | None:
    """(J, G+1, K): each head's EKFAC eigenvalues (George et al. 2018) on ``width`` fused features,
    or None where a summary has none (versions 1 and 2, or no output factors).

    Summary j's ``output_factors["eigenvalues"]`` are the exact GGN of its output layer in the
    eigenbasis ``u_i (x) v_k`` of its factors (:func:`bayesfuse.summaries.output_factors`), rows
    in the ascending order of ``gram``'s eigenvalues. :class:`~bayesfuse.nets.heads.ClientHeads`
    decomposes each head's Gram on its support, and keeps its ``i``-th eigenpair at the ``i``-th
    feature of the support; row ``i`` goes there. The head's posterior precision is then
    ``sum_ik (eigenvalues_ik + delta) (u_i (x) v_k)(u_i (x) v_k)^T``, where K-FAC's is
    ``n alpha_i sigma_k + delta``: the same eigenbasis, the exact GGN's diagonal in it, and so
    its exact trace.
    """
    weight_key, _, columns = _layout(spec, states, assignments, width)
    K = int(np.shape(states[0][weight_key])[0])
    if len(summaries) != len(states):
        raise ValueError(f"{len(summaries)} summaries for {len(states)} clients")
    return _placed_eigenvalues(summaries, columns, int(width), K, strict=False)


def kronecker_variants(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, Any]],
    assignments: Mapping[str, Sequence],
    width: int,
    summaries,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """What the temperature round's variants of Kronecker-factored heads need beside them: each
    head's trace scale (:func:`trace_ratios`), its EKFAC eigenvalues (:func:`ekfac_eigenvalues`;
    None where a summary has none) and its diagonal posterior's precision (J, K, G+1), the
    summary's GGN diagonal plus the prior (``inf`` where the head has no weight; the heads of
    :func:`one_shot_heads` from summaries without output factors), for ``bayesfuse.fuse`` and the
    Flower strategy alike."""
    weight_key, bias_key, columns = _layout(spec, states, assignments, width)
    if len(summaries) != len(states):
        raise ValueError(f"{len(summaries)} summaries for {len(states)} clients")
    G, K = int(width), int(np.shape(states[0][bias_key])[0])
    scale = trace_ratios(summaries, weight_key, bias_key)
    eigenvalues = _placed_eigenvalues(summaries, columns, G, K, strict=False)
    return scale, eigenvalues, _diagonal(summaries, columns, weight_key, bias_key, G, K)["precision"]


def _layout(
    spec: PermutationSpec, states: Sequence[Mapping[str, Any]], assignments: Mapping[str, Sequence], width: int
) -> tuple[str, str, list[np.ndarray]]:
    """The output layer's weight and bias keys and each client's global unit of each of the units
    it reads; refuses an output layer that does not read one hidden group unit by unit, and
    assignments that do not fit the clients and ``width`` fused units."""
    weight_key, bias_key, reads, refused = _read_axis(spec, states[0])
    if refused:
        raise ValueError(refused)
    J, G = len(states), int(width)
    groups = [a.group for a, _ in reads if a is not None for _ in range(a.outer)]  # each block of a group read
    for g in groups:
        if len(assignments[g]) != J or any(np.size(a) and np.min(a) < 0 for a in assignments[g]):
            raise ValueError(f"the assignments of {g!r} do not fit {J} clients")
    fixed = sum(length for a, length in reads if a is None)
    # each group's fused width: the units its clients' units were matched to (every fused unit has a member)
    widths = {g: max((int(np.max(a)) + 1 for a in assignments[g] if np.size(a)), default=0) for g in groups}
    if len(set(groups)) == 1:  # one group (beside the inputs, read once or more): what the fused layer reads
        widths[groups[0]] = (G - fixed) // len(groups)
    if fixed + sum(widths[g] for g in groups) != G or any(
        np.size(a) and np.max(a) >= widths[g] for g in groups for a in assignments[g]
    ):
        raise ValueError(
            f"the assignments of {', '.join(map(repr, groups))} do not fit {J} clients and {G} fused units"
        )
    columns = []
    for j in range(J):  # client j's input l of the output layer -> the fused layer's input
        parts, offset = [], 0
        for a, length in reads:
            if a is None:
                parts.append(offset + np.arange(length))
                offset += length
                continue
            for _ in range(a.outer):  # a group read in blocks (tied streams side by side): each block alike
                parts.append(offset + np.asarray(assignments[a.group][j], dtype=np.int64))
                offset += widths[a.group]
        columns.append(np.concatenate(parts).astype(np.int64))
    return weight_key, bias_key, columns


def _placed_eigenvalues(summaries, columns, G: int, K: int, *, strict: bool = True) -> np.ndarray | None:
    """:func:`ekfac_eigenvalues` from each client's columns; a summary without them raises
    (``strict``) or gives None."""
    placed = np.zeros((len(summaries), G + 1, K))
    for j, (s, c) in enumerate(zip(summaries, columns)):
        own = (getattr(s, "output_factors", None) or {}).get("eigenvalues")
        if own is None:
            if strict:
                raise ValueError(f"client {j}'s summary has no output eigenvalues (EKFAC needs version 3)")
            return None
        own = np.asarray(own, dtype=np.float64)
        if own.shape != (c.size + 1, K):
            raise ValueError(
                f"client {j}'s output eigenvalues {own.shape} do not fit its output layer of {c.size} inputs and "
                f"{K} classes"
            )
        placed[j][np.sort(np.append(c, G))] = own
    return placed


def trace_ratios(summaries, weight_key: str, bias_key: str) -> np.ndarray:
    """(J,) ``c_j`` of the module docstring: the exact GGN's trace over the Kronecker factors'.

    The numerator is the exact GGN's trace: the sum of the output factors' ``eigenvalues`` where
    the summary has them (version 3 or later; float32 up to version 5, bfloat16 since version 6:
    non-negative terms each rounded by at most 2^-8, so the sum is within 2^-8 of the trace), else
    of summary j's GGN diagonal of the output layer (``weight_key`` and ``bias_key``; bfloat16
    since version 5); the denominator
    ``n_j tr(A_j) tr(S_j)`` of its output factors. A head where either is 0 (a client sure of
    every example: both are) keeps ``c_j = 1``.
    """
    ratios = np.ones(len(summaries))
    for j, s in enumerate(summaries):
        if getattr(s, "output_factors", None) is None:
            raise ValueError(f"client {j}'s summary has no output factors to match the trace of")
        factors = s.output_factors
        if "eigenvalues" in factors:
            exact = float(np.sum(factors["eigenvalues"], dtype=np.float64))
        else:
            exact = float(
                np.sum(s.precision[weight_key], dtype=np.float64) + np.sum(s.precision[bias_key], dtype=np.float64)
            )
        kfac = (
            float(s.n_examples)
            * float(np.trace(np.asarray(factors["gram"], dtype=np.float64)))
            * float(np.trace(np.asarray(factors["curvature"], dtype=np.float64)))
        )
        if exact > 0 and kfac > 0:
            ratios[j] = exact / kfac
    return ratios
