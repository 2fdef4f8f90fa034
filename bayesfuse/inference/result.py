"""What every per-layer result shares, and the warning for a result that did not converge.

:class:`~bayesfuse.inference.matching.MatchResult` (PFNM/NAFI) and
:class:`~bayesfuse.inference.klfusion.KLFusionResult` (KL-fusion) both satisfy
:class:`LayerResult`; analysis, plots and reports read that protocol instead of importing each
result class.
"""

from __future__ import annotations

import warnings
from typing import Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["LayerResult", "ConvergenceWarning", "warn_not_converged"]


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
    steps = {name: getattr(results[name], "n_sweeps", None) or len(getattr(results[name], "objective", ())) for name in late}
    detail = ", ".join(f"{name} after {n}" for name, n in steps.items())
    warnings.warn(f"{what} did not converge ({detail} iterations); raise n_iter to let it run longer",
                  ConvergenceWarning, stacklevel=stacklevel)
