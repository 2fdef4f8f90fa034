"""The result of a matching: :class:`MatchResult`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from bayesfuse.inference._backend import is_tensor, to_host
from bayesfuse.inference.lazy import LazyRows


@dataclass
class MatchResult:
    """Outcome of :func:`match_neurons`.

    Attributes
    ----------
    assignments : list of ndarray of int
        ``assignments[j][l]`` is the global atom of client j's neuron l (NumPy, on the host).
    mean : ndarray, LazyRows or torch.Tensor (G, D)
        Posterior mean of each global atom, ``h_i / lambda_i`` (supplement eq. 2). A torch
        tensor on the inputs' device, in their dtype, when the neurons were given as tensors.
        A layer that :func:`~bayesfuse.inference.layerwise.match_group` fuses by the matched
        average holds its means as a :class:`~bayesfuse.inference.lazy.LazyRows` read off that
        average (:func:`~bayesfuse.inference.layerwise.posterior_from_average`).
    var : GroupedColumns, ndarray or torch.Tensor (G, D)
        Posterior variance of each entry, ``1 / lambda_i``: from NumPy neurons, a
        :class:`~bayesfuse.inference.lazy.GroupedColumns` holding one value per atom and
        coordinate group (it reads as the (G, D) array; ``np.asarray(var)`` makes it); a tensor
        as ``mean``; an ndarray where a layer-wise matching brought a tensor result back to the
        host.
    counts : ndarray (G,)
        ``m_i``: number of clients using atom i.
    objective : list of float
        ``log p(neurons, assignments)`` with atoms integrated out (see
        :func:`log_marginal_posterior`) after each sweep.
    converged : bool
        True when a sweep changed no assignment, when the sweeps came back to an earlier
        matching (NAFI's penalty can make them cycle; ``hyper["cycle"]`` is then its period
        and more sweeps would only repeat it), or when a sweep gained less than ``tol`` nats per
        neuron (``hyper["stopped"]``).
    n_sweeps : int
    hyper : dict
        The hyper-parameters used.
    seconds : float
        Wall time of the whole matching.
    """

    assignments: list[np.ndarray]
    mean: np.ndarray | LazyRows
    var: np.ndarray | LazyRows
    counts: np.ndarray
    objective: list[float]
    converged: bool
    n_sweeps: int
    hyper: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_arviz(self, **options):
        """Independent draws of the atoms' posterior, the assignments, method, hyper-parameters and
        convergence as an ArviZ object; ``options`` (``units``, ``num_draws``, ``weight_names``,
        ``seed``) as in :func:`bayesfuse.analysis.match_to_arviz`. A posterior held as torch
        tensors (neurons matched as tensors, on any device) is exported from a float64 host copy."""
        from bayesfuse.inference.result import exporter  # registered by bayesfuse.analysis

        host = self
        if is_tensor(self.mean) or is_tensor(self.var):
            host = replace(self, mean=to_host(self.mean), var=to_host(self.var))
        return exporter("match")(host, **options)

    @property
    def n_global(self) -> int:
        """Number of global atoms G."""
        return self.mean.shape[0]

    def assignment_matrix(self, j: int) -> np.ndarray:
        """Binary matrix ``B^j`` of shape (G, L_j) with ``B[i, l] = 1`` iff neuron l -> atom i."""
        a = self.assignments[j]
        b = np.zeros((self.n_global, len(a)), dtype=np.int8)
        b[a, np.arange(len(a))] = 1
        return b

    def __repr__(self) -> str:
        sizes = [len(a) for a in self.assignments]
        return (
            f"MatchResult({len(sizes)} clients with {sum(sizes)} neurons -> {self.n_global} global atoms, "
            f"{self.n_sweeps} sweeps, converged={self.converged}, {self.seconds:.2f} s)"
        )
