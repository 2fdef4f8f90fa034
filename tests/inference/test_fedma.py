"""FedMA's protocol: rounds of matching and client retraining, clients that fail."""

import numpy as np
import pytest

from bayesfuse.inference.fedma import fedma
from bayesfuse.models.bbp import simulate_deep_federation
from bayesfuse.nets.mlp import MLP


def test_fedma_drops_clients_that_fail_and_reports_them():
    fed = simulate_deep_federation(4, 12, 2, 3, gamma0=4.0, noise_var=0.01, seed=1)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    calls = []

    def update(jobs, frozen):  # "retraining" that changes nothing; client 2 fails in round 1
        calls.append([j for j, _ in jobs])
        return [None if (j == 2 and len(calls) == 1) else state for j, state in jobs]

    res = fedma(fed.states, spec, update, class_counts=np.ones((4, 3)))
    assert calls == [[0, 1, 2, 3], [0, 1, 3]]
    assert res.dropped == [2] and res.history[0]["dropped"] == [2]
    assert res.state_dict["layers.2.weight"].shape == (3, res.sizes["P2"])
    with pytest.raises(RuntimeError, match="every client failed"):
        fedma(fed.states, spec, lambda jobs, frozen: [None] * len(jobs))
