"""FedMA one round at a time: the generator gives what the callback-driven run gives."""

from __future__ import annotations

import numpy as np
import torch

from bayesfuse.inference.fedma import fedma, fedma_steps
from bayesfuse.nets.mlp import MLP


def test_driving_the_generator_by_hand_equals_fedma():
    torch.manual_seed(0)
    nets = [MLP(6, [4, 5], 3) for _ in range(3)]
    states = [{k: v.double().numpy() for k, v in m.state_dict().items()} for m in nets]
    spec = nets[0].permutation_spec()

    def retrain(jobs, frozen):  # a deterministic "retraining": perturb what is not frozen
        return [{k: v if k in frozen else np.asarray(v) + 0.01 * j for k, v in sd.items()} for j, sd in jobs]

    by_callback = fedma(states, spec, retrain, seed=3)
    steps = fedma_steps(states, spec, seed=3)
    requests = 0
    try:
        request = next(steps)
        while True:
            requests += 1
            request = steps.send(retrain(*request))
    except StopIteration as stop:
        by_hand = stop.value
    assert requests == len(spec.groups) == by_hand.rounds - 1
    for k in by_callback.state_dict:
        np.testing.assert_array_equal(by_hand.state_dict[k], by_callback.state_dict[k], err_msg=k)


def test_a_paused_run_can_be_closed():
    torch.manual_seed(0)
    nets = [MLP(4, [3], 2) for _ in range(2)]
    states = [{k: v.double().numpy() for k, v in m.state_dict().items()} for m in nets]
    steps = fedma_steps(states, nets[0].permutation_spec())
    jobs, frozen = next(steps)
    assert [j for j, _ in jobs] == [0, 1] and frozen
    steps.close()  # what a strategy does when its rounds will not come
