"""Fused and local posteriors as what they are: exact Gaussian summaries, and ArviZ exports.

Layers. A fused layer's global units are independent Gaussians, one per entry of a unit's vector
(incoming weights, bias, outgoing weights, ...):

.. math::

    \\theta_{g,d} \\sim \\mathcal{N}(\\mu_{g,d}, \\sigma^2_{g,d}),
    \\qquad g = 0..G-1, \\; d = 0..D-1.

The posterior is known in closed form, so :func:`summary` gives its table exactly: the mean
``mu``, the sd ``sigma`` and the highest-density interval ``mu +- z sigma`` with
``z = Phi^{-1}((1 + hdi_prob) / 2)``, for every entry of every unit, in milliseconds.
:func:`bayesfuse.plot.plot_posterior` draws the exact densities.

An export (:func:`to_arviz`, ``result.to_arviz()``) holds

* ``posterior.theta`` with dims ``(chain, draw, global_unit, weight)``: **independent** draws of
  that Gaussian, :data:`DEFAULT_CHAINS` chains of :data:`DEFAULT_DRAWS`. They are not MCMC
  draws: chains of independent draws have ``r_hat`` about 1 and ``ess`` about the number of
  draws by construction, so those columns of ``az.summary`` describe the draws, not a sampler;
  the chains are there because ArviZ's ``r_hat`` needs two (one chain makes it NaN, with a
  logged shape warning). ``mcse_mean`` is how far the draws' mean may lie from the exact one.
* ``constant_data``: ``loc`` and ``scale`` (dims ``global_unit``, ``weight``) of *every* entry of
  every unit, the exact posterior the draws come from (for KL-fusion the components'
  parameters); for every local unit (dim ``local_unit``) its ``client``, ``local_index`` and
  ``assigned_global_unit``; ``counts`` per global unit; the ``objective`` per sweep or step.
* attrs of ``posterior``: ``method``, ``hyper`` (a JSON string: ``json.loads`` gives the
  hyper-parameters back), ``converged`` (0 or 1), ``n_iterations``, ``objective``,
  ``sampling`` (``"independent"``), the seed and which units and weights were drawn. Everything
  is a string or a number, so ``to_netcdf`` writes it.

The ``weight`` coordinate names each entry (:func:`bayesfuse.nets.unit_posteriors.entry_names`):
the caller's ``weight_names``; for a fused horseshoe BNN ``in_0 .. in_{D-1}``, ``bias``,
``log_scale``, ``out_0 .. out_{K-1}``; for a matching whose ``hyper["blocks"]`` records the
entries (fused networks with ``"auto"`` hyper-parameters) the network's entry names,
``layers.0.weight[3]``, ``layers.0.bias``, ...; otherwise ``dim_0 .. dim_{D-1}``.

Size. ``az.summary`` costs a few milliseconds per scalar and ``az.plot_forest`` draws a line per
scalar and chain, so the default export draws the first :data:`DEFAULT_UNITS` units and their
first :data:`DEFAULT_WEIGHTS` entries (64 scalars: both finish in about a second), and says so in
one logged line and in ``posterior.attrs``. Pass ``units=[g, ...]`` (every entry of those units)
or ``units="all"``, and ``weights=[name or index, ...]`` or ``weights="all"``, for more. Unit
``g``'s chain ``c`` draws from its own random stream (``seed``, ``g``, ``c``), every entry, so
an export of some units, some weights or fewer draws holds exactly the corresponding draws of a
larger one.

BNNs. :func:`bnn_to_arviz` exports a :class:`~bayesfuse.models.bnn.HorseshoeBNN` (or the
:class:`~bayesfuse.fusion.FusionResult` holding a fused one) with test data: posterior draws of
the model's sites, the pointwise ``log_likelihood`` and ``posterior_predictive`` of the test
labels and ``observed_data``, so that ``az.loo`` and ``az.compare({"fused": ..., "local 0": ...})``
(LOO by default; ``ic="loo"`` in 0.2x) rank fused and local BNNs. It follows the size rules
above: :data:`DEFAULT_CHAINS` chains, the first :data:`DEFAULT_UNITS` units of every hidden
layer and :data:`DEFAULT_WEIGHTS` inputs by default (said in one logged line), ``units="all"``
and ``inputs="all"`` for the whole posterior; the log-likelihood is always the whole network's.

Everything is built with ``arviz.from_dict``, which exists in the 0.2x line
(``InferenceData``, Python 3.11) and in 1.x (``DataTree``, newer Pythons); groups with
different unit coordinates are built separately and joined (``_common._combine``). Results are
read through what they share (:func:`~bayesfuse.nets.unit_posteriors.layer_gaussians`), so this
module imports no result class.
"""

from __future__ import annotations

from bayesfuse.analysis._common import (
    DEFAULT_CHAINS,
    DEFAULT_DRAWS,
    DEFAULT_HDI_PROB,  # noqa: F401 (module constants, read as bayesfuse.analysis.*)
    DEFAULT_UNITS,
    DEFAULT_WEIGHTS,
    SAMPLING_NOTE,  # noqa: F401 (module constants, read as bayesfuse.analysis.*)
    HeldOutDataWarning,
    Units,  # noqa: F401 (the exports' type aliases, read as bayesfuse.analysis.*)
    Weights,  # noqa: F401
)
from bayesfuse.analysis.bnn import BNN_SITE_DIMS, aligned_to_arviz, bnn_to_arviz  # noqa: F401
from bayesfuse.analysis.compare import compare, compare_pointwise, log_predictive_density
from bayesfuse.analysis.layers import (
    fusion_to_arviz,
    gaussian_to_arviz,
    klfusion_to_arviz,
    local_to_arviz,
    match_to_arviz,
    summary,
    to_arviz,
)
from bayesfuse.inference.result import register_exporter

__all__ = [
    "DEFAULT_DRAWS",
    "DEFAULT_CHAINS",
    "DEFAULT_UNITS",
    "DEFAULT_WEIGHTS",
    "summary",
    "to_arviz",
    "match_to_arviz",
    "klfusion_to_arviz",
    "fusion_to_arviz",
    "gaussian_to_arviz",
    "local_to_arviz",
    "bnn_to_arviz",
    "aligned_to_arviz",
    "compare",
    "compare_pointwise",
    "log_predictive_density",
    "HeldOutDataWarning",
]

# the results' to_arviz() conveniences (bayesfuse.inference.result.exporter) call these
register_exporter("match", match_to_arviz)
register_exporter("klfusion", klfusion_to_arviz)
