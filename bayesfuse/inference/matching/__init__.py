"""BBP-MAP matching of neurons: PFNM (Yurochkin et al., 2019) and NAFI (Xiao & Cheng).

Model (PFNM eq. 1 of the main text; supplement section 1). Global atoms
``theta_i ~ N(mu0, diag(sigma0^2))``; a Beta-Bernoulli process (the IBP with mass ``gamma0``)
decides which atoms each of the J clients uses; client j observes each selected atom once, in a
random order, as ``v_jl ~ N(theta_i, diag(sigma_j^2))``. Given the assignments the atoms have a
Gaussian posterior (supplement eq. 2, NAFI eq. 4 / Prop. 2) with natural parameters

.. math::

    \\lambda_i = 1/\\sigma_0^2 + \\sum_{(j,l) \\to i} 1/\\sigma_{jl}^2, \\qquad
    h_i = \\mu_0/\\sigma_0^2 + \\sum_{(j,l) \\to i} v_{jl}/\\sigma_{jl}^2, \\qquad
    \\hat\\theta_i = h_i / \\lambda_i .

MAP over assignments alternates over clients: remove client j, build the cost of giving each of
its neurons to each atom used by the others or to a new atom, solve that linear assignment
problem (Hungarian, ``scipy.optimize.linear_sum_assignment``), put client j back.

Arrays. NumPy neurons are matched in float64 on the host. When every client's neurons are torch
tensors of one device and dtype (float32 or float64), the atoms' natural parameters ``h``, the cost
matrices and the posterior means and variances are computed with torch on that device in that
dtype (:mod:`bayesfuse.inference._backend`); each assignment problem is then copied to the host
and solved by SciPy. Every cost matrix is a handful of matrix products
(``||a + b||^2 = ||a||^2 + 2 a.b + ||b||^2``), never a loop over neurons or atoms.

Computation. Precisions are kept per group of coordinates on which the prior and every client
agree (:class:`~.model.Groups`; the blocks of empirical Bayes), so an atom's precision is (B,) instead
of (D,) and one (G, D) x (D, L) product per client visit carries the cost. The assignment never
forms the dense (L, L) block of new atoms (:func:`~.assignment.assign`). With the ``"marginal"`` cost, when
few atoms beat a new one (well separated atoms), that product runs in float32 with a rigorous
error bound and only the pairs it cannot rule out are computed in float64
(:func:`~.cost.negative_pairs`; NumPy inputs only: with tensors the product runs in their dtype). A
client whose problem is the one it last solved (no other client's assignment changed since, the
hyper-parameters unchanged) keeps its assignment without a new product or solve. Each of these
is exact: the assignments are those of the dense float64 Hungarian step, up to the numbering of
new atoms (in neuron order) and round-off.

Modules: :mod:`.checks` (the inputs), :mod:`.model` (coordinate groups, the prior, the atoms'
posterior statistics, :func:`log_marginal_posterior`), :mod:`.cost` (:func:`assignment_cost`,
its gain terms and the float32 screen), :mod:`.assignment` (the assignment step,
:func:`solve_assignment`, :func:`recording_assignments`), :mod:`.sweeps` (the alternation with
fixed hyper-parameters), :mod:`.empirical_bayes` (the ``"auto"`` hyper-parameters: the
statistics and their loop), :mod:`.match` (:func:`match_neurons`), :mod:`.result`
(:class:`MatchResult`).
"""

from __future__ import annotations

import sys
import types

from bayesfuse.inference.matching import cost as _cost
from bayesfuse.inference.matching import sweeps as _sweeps
from bayesfuse.inference.matching.assignment import recording_assignments, solve_assignment
from bayesfuse.inference.matching.cost import assignment_cost
from bayesfuse.inference.matching.match import match_neurons
from bayesfuse.inference.matching.model import log_marginal_posterior
from bayesfuse.inference.matching.result import MatchResult

# The names under which the tests import these pieces (private names of the single module of before).
# isort: off
from bayesfuse.inference.matching.assignment import assign as _assign
from bayesfuse.inference.matching.assignment import assign_negative as _assign_negative
from bayesfuse.inference.matching.cost import cost_blocks as _cost_blocks
from bayesfuse.inference.matching.cost import gain_terms as _gain_terms
from bayesfuse.inference.matching.cost import negative_pairs as _negative_pairs
from bayesfuse.inference.matching.model import Groups as _Groups
from bayesfuse.inference.matching.model import atom_objective as _objective
from bayesfuse.inference.matching.model import data_constant as _data_constant
from bayesfuse.inference.matching.model import partition_key as _partition_key
from bayesfuse.inference.matching.model import posterior_moments as _posterior_moments
from bayesfuse.inference.matching.model import posterior_stats as _posterior_stats
from bayesfuse.inference.matching.model import setup as _setup
# isort: on

__all__ = [
    "MatchResult",
    "match_neurons",
    "log_marginal_posterior",
    "assignment_cost",
    "recording_assignments",
    "solve_assignment",
]

#: Tunable constants, read and set on the package as on the module of before, and held by the
#: module that reads them: setting ``matching.SCREEN_DENSITY`` (or monkeypatching it) changes what
#: the float32 screen of :mod:`.cost` and the sweeps of :mod:`.sweeps` use.
_TUNABLES = {"SCREEN_DENSITY": _cost, "SINGLE_THREAD_PRODUCT": _sweeps}


class _Package(types.ModuleType):
    """The package's module type: setting one of :data:`_TUNABLES` sets it in its owner too."""

    def __setattr__(self, name, value):
        if name in _TUNABLES:
            setattr(_TUNABLES[name], name, value)
        super().__setattr__(name, value)


SCREEN_DENSITY = _cost.SCREEN_DENSITY
SINGLE_THREAD_PRODUCT = _sweeps.SINGLE_THREAD_PRODUCT
sys.modules[__name__].__class__ = _Package
