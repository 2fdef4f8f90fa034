"""What every per-layer result shares, and the warning for a result that did not converge.

:class:`~bayesfuse.inference.matching.MatchResult` (PFNM/NAFI) and
:class:`~bayesfuse.inference.klfusion.KLFusionResult` (KL-fusion) both satisfy
:class:`LayerResult`; analysis, plots and reports read that protocol instead of importing each
result class.

Their ``to_arviz()`` conveniences reach the ArviZ export through :func:`exporter`: the analysis
layer (:mod:`bayesfuse.analysis`) registers its exporters here (:func:`register_exporter`) when it
is imported, and :func:`exporter` imports it on first use, as pandas loads its plotting backend.
The algorithms never import the layer above them.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["LayerResult", "ConvergenceWarning", "warn_not_converged", "register_exporter", "exporter", "EXPORT_BACKEND"]


class ConvergenceWarning(UserWarning):
    """A matching or fusion stopped at its iteration limit before it converged.

    Raise ``n_iter`` to let it run on; silence with
    ``warnings.filterwarnings("ignore", category=ConvergenceWarning)``.
    """


@runtime_checkable
class LayerResult(Protocol):
    """One fused layer: global units, the assignment of each client's units, the objective."""

    @property
    def n_global(self) -> int:
        """Number of global units G."""

    assignments: Sequence[np.ndarray]
    objective: Sequence[float]
    converged: bool
    seconds: float


def warn_not_converged(results: Mapping[str, object], what: str, *, stacklevel: int = 3) -> None:
    """One :class:`ConvergenceWarning` naming every result of ``results`` with ``converged=False``.

    ``results`` maps a name (a layer's group, ``"layer"``) to a result with ``converged`` and,
    where known, ``n_sweeps`` or ``objective`` (steps taken).
    """
    late = [name for name, r in results.items() if not getattr(r, "converged", True)]
    if not late:
        return
    steps = {
        name: getattr(results[name], "n_sweeps", None) or len(getattr(results[name], "objective", ())) for name in late
    }
    detail = ", ".join(f"{name} after {n}" for name, n in steps.items())
    warnings.warn(
        f"{what} did not converge ({detail} iterations); raise n_iter to let it run longer",
        ConvergenceWarning,
        stacklevel=stacklevel,
    )


# --------------------------------------------------------------------------- ArviZ exporters

#: The module that exports results to ArviZ; importing it registers its exporters.
EXPORT_BACKEND = "bayesfuse.analysis"
_EXPORTERS: dict[str, Callable] = {}


def register_exporter(name: str, function: Callable) -> None:
    """Make ``function`` the exporter that the ``to_arviz()`` of results of kind ``name``
    (``"match"``: :class:`~bayesfuse.inference.matching.MatchResult`, ``"klfusion"``:
    :class:`~bayesfuse.inference.klfusion.KLFusionResult`) calls."""
    _EXPORTERS[name] = function


def exporter(name: str) -> Callable:
    """The exporter registered as ``name``; :data:`EXPORT_BACKEND` is imported first if it has
    not registered one yet (``KeyError`` if it registers none)."""
    if name not in _EXPORTERS:
        importlib.import_module(EXPORT_BACKEND)
    return _EXPORTERS[name]
