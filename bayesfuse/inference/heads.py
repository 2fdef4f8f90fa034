"""Aligning exchangeable heads before their features are matched.

The heads of an attention layer are summed, so any order of them computes the same function
(Vaswani et al. 2017, eq. 1 with the output projection split by head). Two clients' head ``h``
need not be the same head; matching their query/key features would then pair unrelated ones.
Imfeld et al. (2024, section 4.2) align heads before the features inside them; so does this
module, with a description of each head that no permutation inside the network changes.

Descriptor. For each group ``g`` a head has of its own (its query/key features, its value
features), stack the rows that ``g`` permutes, from every entry of the head, side by side:
``M_g`` has one row per feature. Permuting the head's features permutes the rows of ``M_g``;
permuting any other group (the residual stream the head reads and writes) permutes its
columns. Neither changes the singular values ``s(M_g)``. A head's descriptor is ``s(M_g)`` of its
groups in order, each padded with zeros to the widest such group of the set.

Alignment. The heads of every client are put in the order that matches a common template,
by an assignment on squared distances between descriptors (:func:`scipy.optimize.linear_sum_assignment`),
with the template the mean of the aligned descriptors, repeated until no assignment changes
(alternating minimisation of ``sum_j sum_h |d_{j, pi_j(h)} - t_h|^2``; the first client's heads
start the template). Permuted copies of one network thus align exactly, whatever the order of
their heads (distinct heads have distinct singular values almost surely).

Pure NumPy over state_dicts and a :class:`~bayesfuse.inference.spec.PermutationSpec` whose
``heads`` lists the sets.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from bayesfuse.inference.spec import Axis, PermutationSpec

__all__ = ["head_descriptors", "align_heads", "rename_heads", "renamed_groups", "orders_report"]


def _rows(a, d: int, axis: Axis) -> np.ndarray:
    """``a``'s numbers with the units of axis ``d`` as rows: ``(n, rest)``."""
    a = np.asarray(a, dtype=np.float64)
    n = axis.size(a.shape[d])
    blocks = a.reshape(*a.shape[:d], axis.outer, n, axis.inner, *a.shape[d + 1 :])
    return np.moveaxis(blocks, d + 1, 0).reshape(n, -1)


def head_descriptors(
    state: Mapping[str, object], spec: PermutationSpec, heads: Sequence[str]
) -> list[list[np.ndarray]]:
    """Per head of ``heads`` (one set of ``spec.heads``), per group of its own, the singular
    values of the rows that group permutes, largest first (see the module docstring)."""
    out = []
    for prefix in heads:
        per_group = []
        for g in spec.head_groups(prefix):
            blocks = [
                _rows(state[k], d, a)
                for k in spec.axes
                if k.startswith(prefix + ".")
                for d, a in enumerate(spec.axes[k])
                if a is not None and a.group == g and spec.groups_of(k).count(g) == 1
            ]
            per_group.append(np.linalg.svd(np.hstack(blocks), compute_uv=False) if blocks else np.zeros(0))
        out.append(per_group)
    return out


def _padded(descriptors: Sequence[list[list[np.ndarray]]]) -> np.ndarray:
    """``(J, H, L)``: each client's heads' descriptors, every group's values padded to the widest."""
    n_groups = len(descriptors[0][0])
    widths = [max(len(head[g]) for client in descriptors for head in client) for g in range(n_groups)]
    return np.array(
        [
            [
                np.concatenate([np.pad(head[g], (0, widths[g] - len(head[g]))) for g in range(n_groups)])
                for head in client
            ]
            for client in descriptors
        ]
    )


def align_heads(
    states: Sequence[Mapping[str, object]], spec: PermutationSpec, *, max_iter: int = 50
) -> list[dict[tuple[str, ...], np.ndarray]]:
    """Per client, per set of ``spec.heads``, the order of its heads that aligns it to the others.

    Returns
    -------
    list of dict
        ``orders[j][heads][b] = a``: client j's head ``a`` goes to position ``b``
        (:func:`rename_heads` applies it).
    """
    orders: list[dict] = [{} for _ in states]
    for heads in spec.heads:
        if not spec.head_groups(heads[0]):  # heads the forward never calls: nothing to align, kept in place
            for j in range(len(states)):
                orders[j][heads] = np.arange(len(heads))
            continue
        d = _padded([head_descriptors(sd, spec, heads) for sd in states])  # (J, H, L)
        template = d[0]
        perms = [np.arange(len(heads)) for _ in states]
        for _ in range(max_iter):
            new = []
            for dj in d:
                cost = ((dj[:, None, :] - template[None, :, :]) ** 2).sum(-1)  # (own head a, position b)
                rows, cols = linear_sum_assignment(cost)
                order = np.empty(len(heads), dtype=int)
                order[cols] = rows
                new.append(order)
            template = np.mean([dj[o] for dj, o in zip(d, new)], axis=0)
            done = all(np.array_equal(a, b) for a, b in zip(new, perms))
            perms = new
            if done:
                break
        for j, order in enumerate(perms):
            orders[j][heads] = order
    return orders


def rename_heads(state: Mapping[str, object], spec: PermutationSpec, orders: Mapping[tuple, np.ndarray]) -> dict:
    """``state`` with head ``orders[heads][b]`` of every set moved to position ``b`` (entries renamed)."""
    out = dict(state)
    for heads, order in orders.items():
        for b, a in enumerate(order):
            if a != b:
                for suffix in spec.head_entries(heads[a]):
                    out[f"{heads[b]}.{suffix}"] = state[f"{heads[a]}.{suffix}"]
    return out


def renamed_groups(spec: PermutationSpec, orders: Mapping[tuple, np.ndarray]) -> dict[str, str]:
    """``old group -> new group`` for the groups the heads of ``orders`` carry with them."""
    out: dict[str, str] = {}
    for heads, order in orders.items():
        for b, a in enumerate(order):
            out.update(zip(spec.head_groups(heads[a]), spec.head_groups(heads[b])))
    return out


def orders_report(spec: PermutationSpec, orders: Sequence[Mapping[tuple, np.ndarray]]) -> list[dict[str, list[int]]]:
    """Per client, each set's order as JSON-ready lists keyed by the set's module (``"blocks.0.attn.heads"``)."""
    return [{heads[0].rpartition(".")[0]: [int(a) for a in o[heads]] for heads in spec.heads} for o in orders]
