"""Client summaries: what a client computes once from its own data and sends beside its weights.

A :class:`ClientSummary` holds aggregates of one pass over the client's data, nothing per
example:

* ``precision``: for every floating parameter, the diagonal of the generalized Gauss-Newton of
  the summed cross-entropy at the client's weights (:func:`bayesfuse.curvature.diag_ggn`); with
  ``prior_precision`` it is the precision of the diagonal Laplace approximation of the client's
  posterior, ``N(theta_j, (diag G_j + delta)^-1)`` (Daxberger et al., NeurIPS 2021). The server
  reads each point-estimate network as that posterior (:mod:`bayesfuse.inference.summary_fusion`).
* ``moments``: per hidden unit (per channel for convolutions), the mean and variance of its
  pre-activation (the output of the layer that makes the unit) and of its activation (the input
  of the layer that reads it), as REPAIR (Jordan et al., ICLR 2023) measures them.
* ``output_factors``: the Kronecker factors of the GGN of the client's own output layer (when
  it is an ``nn.Linear`` reading one hidden group unit by unit, with its bias at most
  :data:`MAX_FACTOR_WIDTH` inputs): ``gram``, the mean of ``a~ a~^T`` over the client's
  examples (``a~`` the layer's input with a 1 appended for the bias), and ``curvature``, the mean
  softmax Hessian ``diag(p) - p p^T`` (K-FAC, Martens & Grosse 2015; for the output layer, Ritter,
  Botev & Barber 2018, eq. 7). With them the fused model keeps each client's output layer as a
  Kronecker-factored Laplace posterior (:class:`~bayesfuse.nets.heads.ClientHeads`). Since
  version 3 also ``eigenvalues`` (G+1, K): the exact GGN's second moments in the factors'
  eigenbasis, ``sum_n (u_i^T a~_n)^2 v_k^T (diag(p_n) - p_n p_n^T) v_k`` for the eigenvectors
  ``u_i`` of ``gram`` and ``v_k`` of ``curvature`` (EKFAC, George et al., NeurIPS 2018, eq. 9):
  the eigenvalues K-FAC takes as ``N lambda_i(gram) lambda_k(curvature)``, measured instead.
* ``class_counts`` and ``n_examples``.

What it reveals. Every number is a sum over the client's examples: the GGN diagonal
``sum_n sum_c (J_n^T q_nc)^2``, unit moments, class counts. No example can be read back from
it, but it says more about the client's data than the weights do: where its inputs vary
(the GGN of a first-layer weight grows with the squared input it multiplies), which classes it
is unsure about (the output biases' GGN is ``sum_n p_nk (1 - p_nk)``), and its class counts.
The output factors hold the second moments of its last hidden features, all their
correlations: more than the per-unit moments, and with fewer examples than features (``n <=
G``) close to the span of its examples' features; their eigenvalues say, for each direction of
those features and of the classes, how much of the client's uncertainty lies there (sums over
its examples, (G+1) K numbers).
The one-shot default model (:class:`~bayesfuse.nets.heads.ClientHeads`) carries the output
factors of every client to whoever receives it, and so do the temperature round's candidates of
it, sent to every client, the EKFAC candidate with every client's eigenvalues and the diagonal
candidate with every client's GGN diagonal of its output layer (K (G+1) numbers)
(:func:`bayesfuse.fuse`, ``head="shared"`` leaves them out).
A client that may not share these should send weights alone (the data-free path).

On disk a summary is a safetensors file beside the model (``model.pt`` ->
``model.summary.safetensors``, :func:`summary_path`): tensors ``precision/<entry>``,
``moments/<group>/<stat>``, ``output/gram`` (``output/gram_factor`` since version 6),
``output/curvature``, ``output/eigenvalues``, ``class_counts``; metadata
``format``, ``version``, ``n_examples``, ``prior_precision`` and the model's ``fingerprint`` (a
hash of its entries' names, shapes and values), so that a summary of another network is refused
(:func:`check_summary`). Version 2 added the output factors, version 3 their eigenvalues;
version 4 stores the symmetric ``output/gram`` as its upper triangle, row by row ((G+1)(G+2)/2
numbers instead of (G+1)^2; in memory it is the whole matrix). Version 5 holds the precisions
as bfloat16 (8 significant bits, a relative rounding error of at most 2^-8, stored as the upper
16 bits of their float32, ``uint16``): they weight averages and set variances, where the third
significant digit does not show, and the summary is then about 0.6x the weights of a 784-100-10
network instead of 1.08x. A :class:`ClientSummary` of version 5 rounds the precisions it is
given, so that a summary in memory is the summary its file and its Flower record hold;
``summarize(..., precisions="float32")`` makes a version 4 one. Version 6 holds the output
Gram as its triangular factor ``R`` (``gram = R^T R``, :func:`gram_factor`), rounded to bfloat16,
``output/gram_factor``, its upper triangle row by row, and the output eigenvalues as bfloat16:
a Gram rounded entry by entry is no longer positive semi-definite, while ``R^T R`` is for any
``R``; the Gram is then half its float32 bytes, and the summary of a network whose last hidden
layer is wider than its input (digits' 64-100-10) no longer outgrows the network. The client
takes the EKFAC eigenbasis of the rounded Gram (:func:`output_factors`), the one the server
computes. See docs/decisions.md#summary-bfloat16. Versions 1-5 are read too.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, cast

import numpy as np
import torch
from torch import nn

from bayesfuse._io import atomic_write_bytes
from bayesfuse._text import first_line
from bayesfuse._validation import as_input
from bayesfuse.curvature import diag_ggn
from bayesfuse.inference.bnn.sites import is_bnn_state, state_sizes, unit_group
from bayesfuse.inference.client_heads import heads_refused
from bayesfuse.inference.output_fusion import packed_upper, unpacked_upper
from bayesfuse.inference.spec import Axis, PermutationSpec
from bayesfuse.nets.state import as_array, model_input, tied_entries

__all__ = [
    "ClientSummary",
    "summarize",
    "temperature_nll",
    "output_features",
    "output_fit",
    "batchnorm_moments",
    "save_summary",
    "load_summary",
    "summary_path",
    "check_summary",
    "summary_arrays",
    "summary_from_arrays",
    "SUMMARY_FORMAT",
    "SUMMARY_VERSION",
    "READ_VERSIONS",
    "MAX_FACTOR_WIDTH",
    "output_factors",
    "gram_factor",
    "rounded_gram",
    "SummaryError",
    "STATS",
]

SUMMARY_FORMAT = "bayesfuse-client-summary"
SUMMARY_VERSION = 6
#: The summary versions this code reads (1: without ``output_factors``; 2: without their
#: ``eigenvalues``; 3: the Gram whole, not its upper triangle; 4: the precisions as float32;
#: 5: the output Gram and eigenvalues as float32).
READ_VERSIONS = (1, 2, 3, 4, 5, 6)
#: The first version that stores the output Gram as its upper triangle.
PACKED_GRAM_VERSION = 4
#: The first version that stores the precisions as bfloat16 (:func:`bfloat16_bits`);
#: see docs/decisions.md#summary-bfloat16
BFLOAT16_VERSION = 5
#: The first version that stores the output Gram as its bfloat16 triangular factor
#: (:func:`rounded_gram`) and the output eigenvalues as bfloat16.
FACTOR_GRAM_VERSION = 6
#: The widest output-layer input (bias included) whose Kronecker factors a summary holds: the
#: Gram is ``(G+1)(G+2)/2`` numbers stored (its upper triangle), about half the size of a hidden
#: layer of this width's incoming weights from the usual inputs; wider layers are summarised
#: without the factors.
MAX_FACTOR_WIDTH = 2048
#: How :func:`summarize` keeps the weights' precisions and output factors (version 6, version 4).
PRECISIONS = ("bfloat16", "float32")
#: The moments kept per hidden unit.
STATS = ("pre_mean", "pre_var", "act_mean", "act_var")


def bfloat16_bits(a) -> np.ndarray:
    """The bfloat16 nearest each value of ``a`` as float32 (ties to even), as the upper 16 bits of
    that float32 (``uint16``, ``a``'s shape), as ``torch.bfloat16`` rounds: 8 significant bits,
    a relative error of at most 2^-8 from float32's normal range (1.2e-38 to 3.4e38; finite
    values from 3.3961e38 up become inf, subnormals keep fewer bits). NaN stays NaN."""
    f = np.asarray(a, dtype=np.float32)
    bits = np.ascontiguousarray(f).reshape(-1).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet = (bits >> 16) | 0x40  # a NaN keeps its sign and (quietened) upper payload, never inf or 0
    return np.where(np.isnan(f.reshape(-1)), quiet, rounded).astype(np.uint16).reshape(f.shape)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """The float32 values whose upper 16 bits are ``bits`` (:func:`bfloat16_bits`), exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bfloat16_rounded(a) -> np.ndarray:
    """``a`` rounded to the nearest bfloat16 (:func:`bfloat16_bits`), as float64 (what a version
    5 summary stores)."""
    return from_bfloat16_bits(bfloat16_bits(a)).astype(np.float64)


def gram_factor(gram) -> np.ndarray:
    """The upper triangular ``R`` with ``R^T R = gram`` and ``diag(R) >= 0``, for a symmetric
    positive semi-definite ``gram`` (its Cholesky factor where it is definite); a ``gram`` with an
    eigenvalue under ``-1e-6`` times its largest (more than float32 round-off) is refused
    (``ValueError``).

    From ``gram = V diag(w) V^T`` (negative round-off eigenvalues taken as 0),
    ``F = V diag(sqrt(w))`` and ``F^T = Q R``: ``F F^T = R^T Q^T Q R = R^T R``, which needs no
    definiteness (a client with fewer examples than features has a singular Gram). The rows and
    columns of ``gram`` that are exactly 0 (a unit that never fired) are exactly 0 in ``R``.
    """
    gram = np.asarray(gram, dtype=np.float64)
    w, V = np.linalg.eigh((gram + gram.T) / 2)
    if len(w) and w[0] < -1e-6 * max(abs(w[-1]), 1e-300):
        raise ValueError(f"the Gram is not positive semi-definite (eigenvalue {w[0]:.3g}, largest {w[-1]:.3g})")
    R: np.ndarray = np.asarray(np.linalg.qr((V * np.sqrt(np.clip(w, 0.0, None))).T, mode="r"))
    R = np.triu(R * np.where(np.diag(R) < 0, -1.0, 1.0)[:, None])
    R[:, np.diag(gram) == 0] = 0.0
    return R


def rounded_gram(gram) -> tuple[np.ndarray, np.ndarray]:
    """``(R, R^T R)``: the triangular factor of ``gram`` (:func:`gram_factor`) rounded to
    bfloat16 (:func:`bfloat16_rounded`), and the positive semi-definite Gram it gives (what a
    version 6 summary holds); a relative error of about 2^-8 of the Gram's scale."""
    R = bfloat16_rounded(gram_factor(gram))
    return R, R.T @ R


def _held_factor(R, gram: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(R, gram)`` where ``R`` is a bfloat16 upper triangular factor of ``gram`` (``R^T R ==
    gram`` exactly: what a version 6 summary holds), else :func:`rounded_gram` of ``gram``
    (``ValueError`` for a Gram with no factor)."""
    if R is not None and np.shape(R) == gram.shape:
        R = np.asarray(R, dtype=np.float64)
        if np.array_equal(R, np.triu(bfloat16_rounded(R))) and np.array_equal(R.T @ R, gram):
            return R, gram
    return rounded_gram(gram)


def check_precisions(precisions: str) -> str:
    """``precisions`` when it is one of :data:`PRECISIONS`; else one line naming them."""
    if precisions not in PRECISIONS:
        raise ValueError(f"precisions must be {' or '.join(map(repr, PRECISIONS))}, got {precisions!r}")
    return precisions


class SummaryError(ValueError):
    """A summary this code cannot use: wrong shapes, NaN, negative precisions, another network, an unknown version."""


def check_version(version: int, name: str) -> int:
    """``version`` when this code reads it (:data:`READ_VERSIONS`); else one line naming ``name``."""
    if version not in READ_VERSIONS:
        raise SummaryError(
            f"{name}: summary version {version} is not one this bayesfuse reads "
            f"({', '.join(map(str, READ_VERSIONS))}); recompute it with bayesfuse.summarize"
        )
    return version


def fingerprint(state: Mapping[str, object]) -> str:
    """A short hash of the entries' names, shapes and values (as float32): which network this is."""
    digest = hashlib.sha256()
    for k, v in state.items():
        a = as_array(v) if torch.is_tensor(v) else np.asarray(v)
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(np.float32)
        digest.update(json.dumps([k, list(a.shape)]).encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()[:16]


@dataclass
class ClientSummary:
    """One client's summary of its data (see the module docstring).

    Attributes
    ----------
    precision : dict of str to ndarray
        GGN diagonal of every floating parameter, the parameter's shape, non-negative; rounded to
        bfloat16 in a version 5 or later summary (what its file holds).
    prior_precision : float
        ``delta``: the Laplace precision of weight ``i`` is ``precision[i] + delta``.
    moments : dict of str to dict of str to ndarray
        Per permutation group (hidden layer), :data:`STATS` of each unit, arrays (units,).
    class_counts : (K,) int array
    n_examples : int
    fingerprint : str
        Of the model it summarises (:func:`fingerprint`).
    version : int
    output_factors : dict, optional
        ``gram`` (G+1, G+1) and ``curvature`` (K, K): the Kronecker factors of the output layer's
        GGN per example, and (version 3) ``eigenvalues`` (G+1, K), its GGN in their eigenbasis
        (:func:`output_factors`); None where the output layer has none (it reads the inputs, or
        positions, or more than :data:`MAX_FACTOR_WIDTH` features) and in version 1 summaries.
        A version 6 summary built by hand wants ``output_factors(..., rounded=True)``: its
        eigenvalues are then measured in the eigenbasis of the Gram the summary holds (to
        round-off where the Gram is singular; :func:`summarize` keeps the very factor).
    seconds : float
        Time it took to compute (not saved).
    gram_factor : ndarray, optional
        Version 6: the bfloat16 triangular factor ``R`` of the output Gram, ``gram = R^T R``
        (:func:`rounded_gram`), as the file holds it; computed from ``gram`` when not given.
    """

    precision: dict
    prior_precision: float
    moments: dict
    class_counts: np.ndarray
    n_examples: int
    fingerprint: str
    version: int = SUMMARY_VERSION
    output_factors: dict | None = None
    seconds: float = field(default=0.0, compare=False)
    gram_factor: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # a version 5 summary holds bfloat16 precisions, in memory as in its file (idempotent)
        if self.version >= BFLOAT16_VERSION:
            self.precision = {k: bfloat16_rounded(v) for k, v in self.precision.items()}
        factors = self.output_factors
        if self.version < FACTOR_GRAM_VERSION or not factors or "gram" not in factors:
            self.gram_factor = None
            return
        # version 6: the Gram its rounded factor gives, the eigenvalues bfloat16 (idempotent);
        # left as they are where they are no finite square matrix, for check_summary to refuse
        gram = np.asarray(factors["gram"], dtype=np.float64)
        if not _is_symmetric(gram):
            self.gram_factor = None
            return
        try:
            self.gram_factor, gram = _held_factor(self.gram_factor, gram)
        except ValueError:  # not positive semi-definite: the heads refuse it, summary_arrays too
            self.gram_factor = None
            return
        self.output_factors = {**factors, "gram": gram}
        if "eigenvalues" in factors:
            self.output_factors["eigenvalues"] = bfloat16_rounded(factors["eigenvalues"])

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays as the file and the Flower record hold them (:func:`summary_arrays`:
        float32, the output Gram as its upper triangle since version 4, the precisions as
        bfloat16 since version 5, the Gram's triangular factor and the output eigenvalues as
        bfloat16 since version 6, int64 class counts)."""

        def stored(key: str, value) -> int:  # numbers stored: the Gram (or its factor) as its upper triangle
            g = len(value) if key == "gram" and self.version >= PACKED_GRAM_VERSION else 0
            return g * (g + 1) // 2 if g else int(np.size(value))

        def width(half: bool) -> int:  # bytes per number: bfloat16 or float32
            return 2 if half else 4

        total = width(self.version >= BFLOAT16_VERSION) * sum(np.size(v) for v in self.precision.values())
        total += 4 * sum(np.size(v) for stats in self.moments.values() for v in stats.values())
        total += sum(
            width(self.version >= FACTOR_GRAM_VERSION and k in ("gram", "eigenvalues")) * stored(k, v)
            for k, v in (self.output_factors or {}).items()
        )
        return int(total + 8 * np.size(self.class_counts))

    def output_precision(self, spec: PermutationSpec) -> np.ndarray | None:
        """The GGN of the output biases, ``sum_n p_nk (1 - p_nk)`` per class; None without an output bias."""
        for k in spec.output:
            if k in self.precision and np.ndim(self.precision[k]) == 1:
                return np.asarray(self.precision[k], dtype=np.float64)
        return None


# --------------------------------------------------------------------------- computing


@dataclass(frozen=True)
class _Read:
    """Where a module reads a group's units among its input's features: ``length = outer x n x
    inner`` of them from ``start`` (a layer reading streams side by side reads one piece of them;
    a dense layer after ``Flatten``, each channel's maps as a block of ``inner``)."""

    module: str
    start: int
    length: int
    axis: Axis

    def units(self, features: torch.Tensor) -> torch.Tensor:
        """(M, n): the group's units of (N, F) ``features``, over examples and blocks."""
        a = self.axis
        n = self.length // (a.outer * a.inner)
        mine = features[:, self.start : self.start + self.length].reshape(-1, a.outer, n, a.inner)
        return mine.transpose(2, 3).reshape(-1, n)


def _group_modules(model: nn.Module, spec: PermutationSpec) -> dict[str, tuple[_Read | None, _Read | None]]:
    """Per group, the module that makes its units (axis 0 of its weight; a transposed
    convolution's axis 1) and where among its output's features they lie (in blocks, for a
    convolution of groups; each direction's, for a recurrent layer), and the first other module
    that reads them (the other axis of the two) and where among its input's features it reads
    them; None where a module's output or input does not hold them.

    A recurrent layer reads its own units (``weight_hh``); its output holds only its top layer's
    units, so a group it makes has moments only where another module reads that output (the
    top layer of an ``nn.LSTM``: its outputs at every step, and their reader's input), and a
    projected LSTM's output holds its projections, not its cells."""
    modules = dict(model.named_modules())
    state = model.state_dict()
    offsets = spec.piece_offsets(state)
    makers: dict[str, _Read] = {}
    readers: dict[str, list[_Read]] = {g: [] for g in spec.groups}
    for key, axes in spec.axes.items():
        whole = spec.whole(key)
        owner = whole.rpartition(".")[0]
        if owner not in modules or len(axes) < 2:
            continue
        embedding = isinstance(modules[owner], (nn.Embedding, nn.EmbeddingBag))  # ids in; it makes its columns
        rows = 1 if embedding else spec.rows_dim(key)
        made, read = axes[rows], None if embedding else axes[1 - rows]
        if made is not None and made.group in readers and made.group not in makers:
            groups = getattr(modules[owner], "groups", 1) if rows == 1 else 1
            if whole != key and spec.pieces[whole][0] == rows:  # one piece of the units it makes (split after)
                makers[made.group] = _Read(owner, *offsets[key], made)
            elif groups > 1:  # a transposed convolution of groups: its output holds them once per group
                axis = Axis(made.group, made.outer * groups, made.inner)
                makers[made.group] = _Read(owner, 0, int(state[whole].shape[rows]) * groups, axis)
            else:
                makers[made.group] = _Read(owner, 0, int(state[whole].shape[rows]), made)
        if read is None or read.group not in readers:
            continue
        if whole == key:
            readers[read.group].append(_Read(owner, 0, int(state[key].shape[1 - rows]), read))
        elif spec.pieces[whole][0] == 1 - rows:  # one piece of the streams side by side it reads
            readers[read.group].append(_Read(owner, *offsets[key], read))
    found: dict[str, tuple[_Read | None, _Read | None]] = {}
    for g, maker in makers.items():
        reader = next((r for r in readers[g] if r.module != maker.module), None)
        layer = modules[maker.module]
        if isinstance(layer, nn.RNNBase):  # its rows hold its gates; its output each direction's units
            if reader is None:
                continue  # a lower recurrent layer: not in its module's output
            directions = 2 if layer.bidirectional else 1
            width = getattr(layer, "proj_size", 0) or layer.hidden_size
            projections = {a[0].group for k, a in spec.axes.items() if k.startswith(f"{maker.module}.weight_hr_l")}
            cells = width != layer.hidden_size and g not in projections  # a projected LSTM's: not in its output
            found[g] = (
                None if cells else _Read(maker.module, 0, directions * width, Axis(g, outer=directions)),
                reader,
            )
        else:
            found[g] = (maker, reader)
    return found


def _features(t: torch.Tensor, axis: int) -> torch.Tensor:
    """(M, F): ``t``'s features on ``axis`` (a map's channels, 1; a dense or recurrent layer's
    units, -1) as columns, over examples, positions, steps and tokens."""
    return t.movedim(axis, -1).reshape(-1, t.shape[axis])


def _channel_moments(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
    """Sum and sum of squares of each column of (M, units) values, and M."""
    t = t.detach().double()
    return t.sum(0).numpy(), (t**2).sum(0).numpy(), t.shape[0]


def unit_moments(model: nn.Module, x, spec: PermutationSpec, *, batch_size: int = 1024) -> dict[str, dict]:
    """Mean and variance of each hidden unit's pre-activation and activation over ``x``.

    The pre-activation of group ``g`` is the output of the module that makes it (the owner of a
    weight whose rows are ``g``'s units), its activation the input of the first module that reads
    it, where it reads them (:func:`_group_modules`): for an MLP, ``layers.i`` output and ``relu``
    of it. Convolutions: per channel, over examples and positions; a dense layer after
    ``Flatten``: per channel, over its maps; a layer reading streams side by side: the group's
    stream alone.
    """
    where = _group_modules(model, spec)
    modules = dict(model.named_modules())
    sums: dict[tuple, list] = {}

    def keep(group, stat, read: _Read | None = None):
        def hook(module, inputs, output):
            t = output if stat == "pre" else inputs[0]
            if isinstance(t, tuple):  # a recurrent layer's (outputs, state)
                t = t[0]
            t = _features(t, 1 if isinstance(module, nn.modules.conv._ConvNd) and t.dim() > 2 else -1)
            s1, s2, n = _channel_moments(t if read is None else read.units(t))
            acc = sums.setdefault((group, stat), [0.0, 0.0, 0])
            acc[0] = acc[0] + s1
            acc[1] = acc[1] + s2
            acc[2] += n

        return hook

    hooks = []
    for g, (maker, reader) in where.items():
        if maker is not None:
            hooks.append(modules[maker.module].register_forward_hook(keep(g, "pre", maker)))
        if reader is not None:
            hooks.append(modules[reader.module].register_forward_hook(keep(g, "act", reader)))
    first = next(model.parameters())
    x = as_input(x, model, first.dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                model(x[start : start + batch_size])
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    out: dict[str, dict] = {}
    for (g, stat), (s1, s2, n) in sums.items():
        mean = s1 / n
        out.setdefault(g, {})[f"{stat}_mean"] = mean
        out[g][f"{stat}_var"] = np.maximum(s2 / n - mean**2, 0.0)
    return out


def output_factors(
    model: nn.Module, x, spec: PermutationSpec, *, batch_size: int = 1024, rounded: bool = False
) -> dict[str, np.ndarray] | None:
    """The Kronecker factors of the GGN of ``model``'s output layer over ``x``, and its
    eigenvalues in their eigenbasis (two passes).

    ``gram = mean_n a~_n a~_n^T`` over the layer's inputs with a 1 appended (the bias's input)
    and ``curvature = mean_n (diag(p_n) - p_n p_n^T)``, the softmax Hessian at the model's
    probabilities: the GGN of the summed cross-entropy over the layer's weights is approximately
    ``N gram (x) curvature`` (K-FAC; Ritter, Botev & Barber 2018, eq. 7, exact for one example).
    With ``gram = U diag(alpha) U^T`` and ``curvature = V diag(sigma) V^T``,
    ``eigenvalues[i, k] = sum_n (u_i^T a~_n)^2 v_k^T (diag(p_n) - p_n p_n^T) v_k``, the diagonal
    of the exact GGN in the basis ``u_i (x) v_k`` (EKFAC, George et al. 2018, eq. 9), where
    K-FAC has ``N alpha_i sigma_k``: the same basis, and the exact trace. Its rows follow the
    eigenvalues of ``gram`` in ascending order, as ``numpy.linalg.eigh`` returns them.
    With ``rounded`` (a version 6 summary) ``gram`` is the Gram its bfloat16 factor gives
    (:func:`rounded_gram`), and the eigenvalues are in that Gram's eigenbasis, the one the
    server computes from it (EKFAC's diagonal is exact in any basis's trace, so the pairing,
    not the basis, is what must hold).
    None when the output layer is not an ``nn.Linear`` reading one hidden group unit by unit, or
    reads more than :data:`MAX_FACTOR_WIDTH` features.
    """
    return _output_factors(model, x, spec, batch_size=batch_size, rounded=rounded)[0]


def _output_factors(
    model: nn.Module, x, spec: PermutationSpec, *, batch_size: int = 1024, rounded: bool = False
) -> tuple[dict[str, np.ndarray] | None, np.ndarray | None]:
    """:func:`output_factors`, and with ``rounded`` the bfloat16 factor of its Gram
    (:func:`rounded_gram`), else None."""
    state = model.state_dict()
    try:
        weight_key, _ = spec.output_layer(state)
    except ValueError:
        return None, None
    output = weight_key.rpartition(".")[0]
    layer = dict(model.named_modules()).get(output)
    if heads_refused(spec, state) or not isinstance(layer, nn.Linear):
        return None, None
    if layer.in_features + 1 > MAX_FACTOR_WIDTH:
        return None, None
    from bayesfuse.nets.heads import logits_and_features

    first = next(model.parameters())
    x = as_input(x, model, first.dtype)
    g, k = layer.in_features + 1, layer.out_features
    gram, curvature = torch.zeros(g, g, dtype=torch.float64), torch.zeros(k, k, dtype=torch.float64)
    eigenvalues = torch.zeros(g, k, dtype=torch.float64)

    def batches():
        for start in range(0, len(x), batch_size):
            logits, features = logits_and_features(model, output, x[start : start + batch_size])
            ones = features.new_ones(len(features), 1, dtype=torch.float64)
            yield torch.cat([features.double(), ones], 1), torch.softmax(logits.double(), -1)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for a, p in batches():
                gram += a.T @ a
                curvature += torch.diag(p.sum(0)) - p.T @ p
            gram, curvature = gram / len(x), curvature / len(x)
            factor = None
            if rounded:
                factor, rounded_numpy = rounded_gram(gram.numpy())
                gram = torch.as_tensor(rounded_numpy)
            U = torch.as_tensor(np.linalg.eigh(((gram + gram.T) / 2).numpy())[1])
            V = torch.as_tensor(np.linalg.eigh(((curvature + curvature.T) / 2).numpy())[1])
            for a, p in batches():
                # v_k^T (diag(p) - p p^T) v_k = sum_c p_c v_ck^2 - (p . v_k)^2 >= 0 (clamped: round-off)
                spread = (p @ V.square() - (p @ V).square()).clamp_min(0.0)
                eigenvalues += (a @ U).square().T @ spread
    finally:
        model.train(was_training)
    return {"gram": gram.numpy(), "curvature": curvature.numpy(), "eigenvalues": eigenvalues.numpy()}, factor


def _check_runs_on(model: nn.Module, example: torch.Tensor, shape: tuple) -> None:
    """Refuse in one line inputs the network cannot run on (another width, say), before any pass."""
    from bayesfuse.nets.graph_spec import example_input_for
    from bayesfuse.nets.state import forward_error

    err = forward_error(model, example_input_for(model, example))
    if err is not None:
        raise ValueError(f"the network cannot run on x of shape {shape} ({type(err).__name__}: {first_line(err)})")


def summarize(
    model: nn.Module,
    x,
    y,
    *,
    spec: PermutationSpec | None = None,
    prior_precision: float = 1.0,
    n_classes: int | None = None,
    batch_size: int = 1024,
    precisions: str = "bfloat16",
) -> ClientSummary:
    """The summary a client sends beside its weights, from one pass over its own data.

    Parameters
    ----------
    model : nn.Module
        The client's trained classifier (logits out), or a
        :class:`~bayesfuse.models.bnn.HorseshoeBNN`: its summary holds the moments of every
        hidden unit at the guide's means (:meth:`~bayesfuse.models.bnn.HorseshoeBNN.unit_moments`)
        and the class counts, and no precisions (the guide is the client's posterior already);
        the fusion prunes its units by what they contribute on the client's data.
    x, y : arrays
        The client's inputs ``(N, ...)`` and labels ``(N,)``: its training data.
    spec : PermutationSpec, optional
        Which units the moments are of; traced from ``model`` when omitted
        (:func:`bayesfuse.nets.spec.spec_from_module`).
    prior_precision : float
        ``delta`` of the Laplace approximation, the precision of a Gaussian prior on every
        weight (1 by default, the usual unit prior with a summed loss).
    n_classes : int, optional
        Length of ``class_counts``; the model's number of outputs by default.
    precisions : {"bfloat16", "float32"}
        How the weights' precisions, the output Gram and its eigenvalues are kept: rounded to
        bfloat16 (the default, a version 6 summary, half their bytes; the Gram through its
        triangular factor, :func:`rounded_gram`), or as float32 (a version 4 summary, read by
        older bayesfuse too).

    Returns
    -------
    ClientSummary
    """
    from bayesfuse.models.bnn import HorseshoeBNN
    from bayesfuse.nets.attention import multihead_modules, split_heads
    from bayesfuse.nets.spec import spec_from_module

    start = time.perf_counter()
    x = np.asarray(x) if not isinstance(x, torch.Tensor) else x
    y = np.asarray(y)
    if len(x) == 0:
        raise ValueError("a summary needs at least one example")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"y must be a 1-D array of integer labels, got {y.dtype} of shape {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} examples and y has {len(y)} labels")
    if not bool(torch.isfinite(torch.as_tensor(x)).all()):
        raise ValueError("x has NaN or infinite values")
    bad = [k for k, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"the network's {bad[0]!r} has NaN or infinite values; a summary of it would be too")
    if not (isinstance(prior_precision, (int, float)) and np.isfinite(prior_precision) and prior_precision > 0):
        raise ValueError(f"prior_precision must be a positive number, got {prior_precision!r}")
    check_precisions(precisions)
    bnn = isinstance(model, HorseshoeBNN)  # its posterior is its own: moments and counts, no precisions
    if bnn:
        if spec is not None:
            raise ValueError("spec= is for point-estimate networks; a BNN's units are its hidden layers")
        state = model.state_dict()
        n_classes = cast(HorseshoeBNN, model).n_classes if n_classes is None else n_classes
    else:
        if multihead_modules(model):  # fusion reads nn.MultiheadAttention as one module per head; so does this
            model = split_heads(model)
        # the client's own inputs trace its network: no guessed input shape (a convolution's, a sequence's)
        example = model_input(x[:2], model)  # integer features as the network's floats; ids as ids
        _check_runs_on(model, example, tuple(x.shape))
        spec = spec if spec is not None else spec_from_module(model, example)
        state = model.state_dict()
        if n_classes is None:
            pieces = spec.split(state)  # an output layer reading streams side by side, as its pieces
            out_key = next((k for k in spec.output if np.ndim(pieces[k]) == 1), spec.output[0] if spec.output else None)
            n_classes = int(np.shape(pieces[out_key])[0]) if out_key is not None else int(y.max()) + 1
    assert n_classes is not None  # given, the BNN's or the output layer's
    if y.min() < 0 or y.max() >= n_classes:
        raise ValueError(f"labels must lie in 0..{n_classes - 1}, got {y.min()}..{y.max()}")
    factors = factor = None
    if bnn:
        precision: dict = {}
        moments = cast(HorseshoeBNN, model).unit_moments(
            x.numpy() if isinstance(x, torch.Tensor) else x, batch_size=batch_size
        )
    else:
        precision = diag_ggn(model, x, batch_size=batch_size)  # rounded to bfloat16 by a version 5 ClientSummary
        for names in tied_entries(model):  # one tensor under several names: its precision under each
            held = next((n for n in names if n in precision), None)
            precision.update({n: precision[held] for n in names if held is not None})
        if precisions == "float32":  # what a version 4 file holds
            precision = {k: np.asarray(v, dtype=np.float32).astype(np.float64) for k, v in precision.items()}
        moments = unit_moments(model, x, cast(PermutationSpec, spec), batch_size=batch_size)
        factors, factor = _output_factors(
            model, x, cast(PermutationSpec, spec), batch_size=batch_size, rounded=precisions == "bfloat16"
        )
    counts = np.bincount(y.astype(np.int64), minlength=n_classes)
    return ClientSummary(
        precision=precision,
        prior_precision=float(prior_precision),
        moments=moments,
        class_counts=counts,
        n_examples=int(len(y)),
        fingerprint=fingerprint(state),
        output_factors=factors,
        version=SUMMARY_VERSION if precisions == "bfloat16" else BFLOAT16_VERSION - 1,
        seconds=time.perf_counter() - start,
        gram_factor=factor,  # the one the eigenvalues' basis came from, not a second factorisation
    )


def temperature_nll(model: nn.Module, x, y, temperatures, *, batch_size: int = 4096) -> np.ndarray:
    """A client's second-round reply: its summed negative log-likelihood at each temperature.

    ``-sum_n log softmax(f(x_n) / T)_{y_n}`` for every candidate ``T``, on the client's own data
    with the (fused) model the server sent: one number per candidate, nothing per example.
    """
    t = np.asarray(temperatures, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or not np.isfinite(t).all() or (t <= 0).any():
        raise ValueError("temperatures must be a non-empty 1-D array of positive numbers")
    y = np.asarray(y).astype(np.int64)
    first = next(model.parameters())
    out = np.zeros(t.size)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(y), batch_size):
                xb = as_input(x[start : start + batch_size], model, first.dtype)
                logits = model(xb).double()
                yb = torch.as_tensor(y[start : start + batch_size])
                scaled = logits.unsqueeze(0) / torch.as_tensor(t).view(-1, 1, 1)
                picked = torch.log_softmax(scaled, -1).gather(2, yb.view(1, -1, 1).expand(t.size, -1, 1))
                out -= picked.sum((1, 2)).numpy()
    finally:
        model.train(was_training)
    return out


def output_features(model: nn.Module, output: str, x, *, batch_size: int = 4096) -> np.ndarray:
    """The input of ``model``'s output layer (the Linear named ``output``) for every row of ``x``:
    the features the second round refits the output layer on."""
    layer = model.get_submodule(output)
    first = next(model.parameters())
    seen: list[torch.Tensor] = []
    hook = layer.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach().double()))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                model(as_input(x[start : start + batch_size], model, first.dtype))
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(seen).reshape(len(x), -1).numpy()


def output_fit(model: nn.Module, output: str, x, y, prior_precision: float, *, n_clients: int = 1):
    """A client's reply in the second round of the output refit: its Laplace fit of the output
    layer on the features of the (fused) ``model`` the server sent, on its own data
    (:func:`bayesfuse.inference.output_fusion.fit_output_layer`): the weights, two small Gram
    matrices and a count, nothing per example."""
    from bayesfuse.inference.output_fusion import fit_output_layer

    layer = cast(nn.Linear, model.get_submodule(output))
    return fit_output_layer(
        output_features(model, output, x),
        np.asarray(y).astype(np.int64),
        layer.out_features,
        prior_precision,
        n_clients=n_clients,
    )


def batchnorm_moments(model: nn.Module, x, *, batch_size: int = 256) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """A client's reply in the batch-norm round: per batch norm of ``model`` (the fused network the
    server sent), the count, mean and mean square of its input per channel over the client's data.

    One pass in training mode, as a batch-norm reset does (Ioffe & Szegedy 2015, section 3.1:
    the population statistics are averages over mini-batches): each batch norm normalises with
    its batch's statistics while the pass records its input, so the statistics of a layer are
    those of the layers below it as they will be once re-estimated. The module comes back as it
    was (its running statistics and training flag restored); nothing per example is returned.

    Parameters
    ----------
    model : nn.Module
    x : array-like
        The client's inputs, at least 2.
    batch_size : int
        The largest batch: the data are cut into batches of nearly equal size, of at most
        ``batch_size`` examples where that leaves no batch of one example.

    Returns
    -------
    dict
        ``{name: (n, mean, mean_square)}`` per ``BatchNorm1d/2d/3d`` module: ``n`` values per
        channel (examples times positions), and two float64 arrays of one value per channel.
    """
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if not norms:
        return {}
    x = np.asarray(x)
    if len(x) < 2:
        raise ValueError(f"batch-norm moments need at least 2 examples, got {len(x)}")
    saved = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in norms.items()}
    modes = {name: m.training for name, m in model.named_modules()}
    sums: dict[str, list] = {name: [0.0, 0.0, 0] for name in norms}

    def keep(name):
        def hook(module, inputs):
            s1, s2, n = _channel_moments(_features(inputs[0], 1))  # (N, C) or (N, C, ...) maps
            acc = sums[name]
            acc[0], acc[1], acc[2] = acc[0] + s1, acc[1] + s2, acc[2] + n

        return hook

    hooks = [m.register_forward_pre_hook(keep(name)) for name, m in norms.items()]
    first = next(model.parameters())
    model.eval()
    for m in norms.values():
        m.train()
    try:
        with torch.no_grad():
            for rows in np.array_split(np.arange(len(x)), min(-(-len(x) // batch_size), len(x) // 2)):
                model(as_input(x[rows], model, first.dtype))
    finally:
        for h in hooks:
            h.remove()
        for name, m in norms.items():
            m.load_state_dict(saved[name])
        for name, m in model.named_modules():
            m.training = modes[name]
    return {name: (int(n), s1 / n, s2 / n) for name, (s1, s2, n) in sums.items()}


# --------------------------------------------------------------------------- checking


def check_summary(summary: ClientSummary, state: Mapping[str, object], name: str = "client") -> ClientSummary:
    """Refuse, with one line naming the client, a summary that does not fit ``state``.

    Checks the version, that it summarises this network (same entry names and shapes), that
    precisions cover every floating entry with its shape and are finite and non-negative, and
    that moments and counts are finite (variances and counts non-negative).
    """
    if not isinstance(summary, ClientSummary):
        raise SummaryError(f"{name}: expected a ClientSummary, got {type(summary).__name__}")
    check_version(summary.version, name)
    if summary.fingerprint != fingerprint(state):
        raise SummaryError(
            f"{name}: the summary is of another network (its entries' names, shapes or values "
            "differ); compute it on this model with bayesfuse.summarize"
        )
    if is_bnn_state(state):
        _check_bnn_moments(summary, state, name)
    for k, v in [] if is_bnn_state(state) else state.items():
        if not torch.is_tensor(v) and not isinstance(v, np.ndarray):
            continue
        floating = v.is_floating_point() if torch.is_tensor(v) else np.issubdtype(v.dtype, np.floating)
        if not floating or (k not in summary.precision and _is_buffer(k)):
            continue
        if k not in summary.precision:
            raise SummaryError(f"{name}: the summary has no precision for {k!r}")
        p = np.asarray(summary.precision[k])
        if p.shape != tuple(np.shape(v)):
            raise SummaryError(f"{name}: precision of {k!r} has shape {p.shape}, the weight {tuple(np.shape(v))}")
        if not np.isfinite(p).all():
            raise SummaryError(f"{name}: precision of {k!r} has NaN or infinite values")
        if (p < 0).any():
            raise SummaryError(f"{name}: precision of {k!r} has negative values (min {p.min():.3g})")
    if not (np.isfinite(summary.prior_precision) and summary.prior_precision > 0):
        raise SummaryError(f"{name}: prior_precision must be positive, got {summary.prior_precision}")
    for g, stats in summary.moments.items():
        for s, v in stats.items():
            v = np.asarray(v)
            if not np.isfinite(v).all() or (s.endswith("_var") and (v < 0).any()):
                raise SummaryError(f"{name}: moment {s} of group {g!r} has NaN, infinite or negative values")
    counts = np.asarray(summary.class_counts)
    if counts.ndim != 1 or (counts < 0).any() or counts.sum() != summary.n_examples:
        raise SummaryError(f"{name}: class counts must be non-negative and sum to n_examples={summary.n_examples}")
    if summary.output_factors is not None:
        _check_factors(summary.output_factors, len(counts), state, name)
    return summary


def _check_factors(factors: Mapping[str, object], n_classes: int, state: Mapping[str, object], name: str) -> None:
    """The output factors are a finite symmetric ``gram`` (G+1, G+1) and ``curvature`` (K, K), with a
    (K, G) weight in ``state``, and optionally finite ``eigenvalues`` >= 0 (G+1, K)."""
    if set(factors) - {"eigenvalues"} != {"gram", "curvature"}:
        raise SummaryError(f"{name}: output factors must be gram, curvature (and eigenvalues), got {sorted(factors)}")
    gram, curvature = (np.asarray(factors[k], dtype=np.float64) for k in ("gram", "curvature"))
    for what, a in (("gram", gram), ("curvature", curvature)):
        if a.ndim != 2 or a.shape[0] != a.shape[1] or not np.isfinite(a).all():
            raise SummaryError(f"{name}: the output {what} must be a finite square matrix, got shape {a.shape}")
        if not _is_symmetric(a):
            raise SummaryError(f"{name}: the output {what} is not symmetric")
    if curvature.shape[0] != n_classes:
        raise SummaryError(f"{name}: the output curvature is {curvature.shape}, for {n_classes} classes")
    wanted = (n_classes, gram.shape[0] - 1)
    if not any(tuple(np.shape(cast(np.ndarray, v))) == wanted for v in state.values()):
        raise SummaryError(f"{name}: the output gram {gram.shape} fits no {wanted} output weight of the network")
    if "eigenvalues" in factors:
        eigenvalues = np.asarray(factors["eigenvalues"], dtype=np.float64)
        if eigenvalues.shape != (gram.shape[0], n_classes):
            raise SummaryError(
                f"{name}: the output eigenvalues are {eigenvalues.shape}, for a gram {gram.shape} and "
                f"{n_classes} classes: need {(gram.shape[0], n_classes)}"
            )
        if not np.isfinite(eigenvalues).all() or (eigenvalues < 0).any():
            raise SummaryError(f"{name}: the output eigenvalues must be finite and >= 0")


def _is_symmetric(a: np.ndarray) -> bool:
    """Whether ``a`` is a finite square matrix equal to its transpose up to float32 round-off."""
    if a.ndim != 2 or a.shape[0] != a.shape[1] or not np.isfinite(a).all():
        return False
    return bool(np.allclose(a, a.T, rtol=1e-5, atol=1e-6 * max(np.abs(a).max(initial=0.0), 1e-30)))


def _check_bnn_moments(summary: ClientSummary, state: Mapping[str, object], name: str) -> None:
    """A BNN's summary has the moments of every hidden layer's units (:data:`STATS`, one per unit)."""
    for layer, width in enumerate(state_sizes(state, name)[0], 1):
        group = unit_group(layer)
        stats = summary.moments.get(group)
        if stats is None or any(s not in stats for s in STATS):
            raise SummaryError(
                f"{name}: the summary has no moments {', '.join(STATS)} of hidden layer {layer} ({group!r}); "
                "compute it with bayesfuse.summarize on the BNN"
            )
        for s in STATS:
            if np.shape(stats[s]) != (width,):
                raise SummaryError(
                    f"{name}: moment {s} of {group!r} has shape {np.shape(stats[s])}, the layer has {width} units"
                )


def _is_buffer(key: str) -> bool:
    """Running statistics of batch norms are buffers, not parameters: no precision for them."""
    leaf = key.rpartition(".")[2]
    return leaf in ("running_mean", "running_var", "num_batches_tracked")


# --------------------------------------------------------------------------- files


def summary_arrays(summary: ClientSummary, name: str = "summary") -> dict[str, np.ndarray]:
    """The summary's arrays under the names its file and its Flower record use: ``precision/<entry>``
    ``moments/<group>/<stat>`` and ``output/<factor>`` (float32; since version 4 ``output/gram``
    as its upper triangle, row by row; since version 5 ``precision/<entry>`` as bfloat16, the
    ``uint16`` of :func:`bfloat16_bits`; since version 6, in place of ``output/gram``,
    ``output/gram_factor``, the upper triangle of its bfloat16 factor (:func:`rounded_gram`), and
    ``output/eigenvalues`` as bfloat16), ``class_counts`` (int64). A version 6 summary whose
    output Gram has no factor (not positive semi-definite) is refused in one line naming ``name``."""
    half = summary.version >= BFLOAT16_VERSION
    arrays = {} if half else {f"precision/{k}": v for k, v in summary.precision.items()}
    arrays.update({f"moments/{g}/{s}": v for g, stats in summary.moments.items() for s, v in stats.items()})
    arrays.update({f"output/{k}": v for k, v in (summary.output_factors or {}).items()})
    out = {f"precision/{k}": bfloat16_bits(v) for k, v in summary.precision.items()} if half else {}
    if "output/gram" in arrays and summary.version >= FACTOR_GRAM_VERSION:
        gram = np.asarray(arrays.pop("output/gram"), dtype=np.float64)
        try:  # the held factor, or (output factors changed after the summary was made) the Gram's
            R = _held_factor(summary.gram_factor, gram)[0]
        except (ValueError, np.linalg.LinAlgError) as err:
            raise SummaryError(
                f"{name}: a version {FACTOR_GRAM_VERSION} summary holds its output Gram as a triangular factor; "
                f"this Gram has none ({err})"
            ) from None
        out["output/gram_factor"] = bfloat16_bits(packed_upper(R))
        if "output/eigenvalues" in arrays:
            out["output/eigenvalues"] = bfloat16_bits(arrays.pop("output/eigenvalues"))
    elif "output/gram" in arrays and summary.version >= PACKED_GRAM_VERSION:
        arrays["output/gram"] = packed_upper(arrays["output/gram"])
    out.update({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()})
    out["class_counts"] = np.ascontiguousarray(summary.class_counts, dtype=np.int64)
    return out


def summary_from_arrays(
    arrays: Mapping[str, np.ndarray],
    name: str,
    *,
    version: int,
    n_examples: int,
    prior_precision: float,
    fingerprint: str,
) -> ClientSummary:
    """The summary whose arrays :func:`summary_arrays` gave, with its metadata; refuses, naming
    ``name``, arrays without class counts."""
    precision: dict[str, np.ndarray] = {}
    moments: dict[str, dict[str, np.ndarray]] = {}
    factors: dict[str, np.ndarray] = {}
    for k, v in arrays.items():
        if k.startswith("precision/") and version >= BFLOAT16_VERSION:
            if np.asarray(v).dtype != np.uint16:
                raise SummaryError(
                    f"{name}: {k} of a version {BFLOAT16_VERSION}+ summary must be bfloat16 bits (uint16), "
                    f"got {np.asarray(v).dtype}"
                )
            precision[k[len("precision/") :]] = from_bfloat16_bits(v).astype(np.float64)
        elif k.startswith("precision/"):
            if not np.issubdtype(np.asarray(v).dtype, np.floating):
                raise SummaryError(
                    f"{name}: {k} of a version {version} summary must be floating point, got {np.asarray(v).dtype}"
                )
            precision[k[len("precision/") :]] = np.asarray(v, dtype=np.float64)
        elif k.startswith("moments/"):
            g, _, s = k[len("moments/") :].rpartition("/")
            moments.setdefault(g, {})[s] = np.asarray(v, dtype=np.float64)
        elif k.startswith("output/") and version >= FACTOR_GRAM_VERSION and k in _HALF_FACTORS:
            factors[k[len("output/") :]] = _from_half(v, k, name)
        elif k.startswith("output/"):
            factors[k[len("output/") :]] = np.asarray(v, dtype=np.float64)
    if "class_counts" not in arrays:
        raise SummaryError(f"{name}: the summary has no class_counts")
    factor = None
    if version >= FACTOR_GRAM_VERSION and factors:
        if "gram" in factors or "gram_factor" not in factors:
            raise SummaryError(
                f"{name}: a version {FACTOR_GRAM_VERSION}+ summary holds its output Gram as output/gram_factor, "
                f"got output/{', output/'.join(sorted(factors))}"
            )
        factor = np.triu(_unpacked(factors.pop("gram_factor"), name, "gram_factor"))
        factors["gram"] = factor.T @ factor
    elif "gram" in factors and version >= PACKED_GRAM_VERSION:
        factors["gram"] = _unpacked(factors["gram"], name)
    return ClientSummary(
        precision=precision,
        prior_precision=prior_precision,
        moments=moments,
        class_counts=np.asarray(arrays["class_counts"]),
        n_examples=n_examples,
        fingerprint=fingerprint,
        version=version,
        output_factors=factors or None,
        gram_factor=factor,
    )


#: The output factors a version 6 summary holds as bfloat16 bits.
_HALF_FACTORS = ("output/gram_factor", "output/eigenvalues")


def _from_half(bits, key: str, name: str) -> np.ndarray:
    """The float64 values of the bfloat16 ``bits`` of entry ``key``; one line naming ``name``
    when they are not ``uint16``."""
    if np.asarray(bits).dtype != np.uint16:
        raise SummaryError(
            f"{name}: {key} of a version {FACTOR_GRAM_VERSION}+ summary must be bfloat16 bits (uint16), "
            f"got {np.asarray(bits).dtype}"
        )
    return from_bfloat16_bits(bits).astype(np.float64)


def _unpacked(upper: np.ndarray, name: str, what: str = "gram") -> np.ndarray:
    """The symmetric matrix whose upper triangle, row by row, is ``upper``; one line naming
    ``name`` when ``upper`` is no upper triangle."""
    m = len(upper) if upper.ndim == 1 else 0
    g = int(round((np.sqrt(8 * m + 1) - 1) / 2))
    if upper.ndim != 1 or g * (g + 1) // 2 != m or m == 0:
        raise SummaryError(
            f"{name}: the output {what} of a version {PACKED_GRAM_VERSION if what == 'gram' else FACTOR_GRAM_VERSION}+ "
            f"summary is the upper triangle of a matrix, a vector of g (g + 1) / 2 numbers; got shape {upper.shape}"
        )
    return unpacked_upper(upper, g)


def summary_path(model_path: str | os.PathLike) -> Path:
    """``model.pt`` -> ``model.summary.safetensors`` beside it."""
    p = Path(model_path)
    return p.with_name(p.name.rsplit(".", 1)[0] + ".summary.safetensors")


def save_summary(summary: ClientSummary, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``summary`` to a safetensors file, atomically; an existing file is kept unless ``overwrite``."""
    from safetensors.numpy import save

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"a summary is a .safetensors file, got {path.name!r}")
    tensors = summary_arrays(summary, path.name)
    meta = {
        "format": SUMMARY_FORMAT,
        "version": str(summary.version),
        "n_examples": str(summary.n_examples),
        "prior_precision": repr(float(summary.prior_precision)),
        "fingerprint": summary.fingerprint,
    }
    return atomic_write_bytes(path, save(tensors, metadata=meta), overwrite=overwrite)


def load_summary(path: str | os.PathLike) -> ClientSummary:
    """Read a summary written by :func:`save_summary`; refuses other files and versions with one line."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no summary file {str(path)!r} (bayesfuse summarize MODEL --data ... writes one)")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise SummaryError(f"{path.name}: not a safetensors summary ({err})") from None
    if meta.get("format") != SUMMARY_FORMAT:
        raise SummaryError(f"{path.name}: not a bayesfuse client summary (format {meta.get('format')!r})")
    try:
        version = int(meta["version"])
        n_examples = int(meta["n_examples"])
        prior = float(meta["prior_precision"])
        fp = meta["fingerprint"]
    except (KeyError, ValueError):
        raise SummaryError(f"{path.name}: summary metadata is incomplete") from None
    check_version(version, path.name)
    return summary_from_arrays(
        tensors, path.name, version=version, n_examples=n_examples, prior_precision=prior, fingerprint=fp
    )
