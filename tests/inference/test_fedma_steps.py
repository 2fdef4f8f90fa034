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


def test_an_embedding_tied_to_the_output_layer_keeps_one_value():
    """An alias of the output layer's weight (an embedding tied to the head, ``spec.tied``) takes
    the value FedMA's last step gives the head (the class-share average), not a mean of its own:
    one tensor, one value, whatever the clients' class counts."""
    import torch
    from torch import nn

    from bayesfuse.inference.fedma import fedma
    from bayesfuse.nets.graph_spec import spec_from_graph

    class TiedOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.fc, self.head = nn.Embedding(5, 6), nn.Linear(6, 6), nn.Linear(6, 5, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(torch.relu(self.fc(self.emb(x))))

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(TiedOut().eval())
    spec = spec_from_graph(models[0], torch.randint(0, 5, (8,)))
    assert spec.tied == {"emb.weight": "head.weight"}
    states = [{k: v.detach().numpy().copy() for k, v in m.state_dict().items()} for m in models]
    rng = np.random.default_rng(0)

    def retrain(jobs, frozen):  # every entry not frozen moves; the tied tensor moves as one
        out = []
        for _, state in jobs:
            state = {k: np.asarray(v, dtype=np.float32).copy() for k, v in state.items()}
            step = rng.normal(size=state["head.weight"].shape).astype(np.float32) * 0.1
            for k in ("head.weight", "emb.weight"):
                if k not in frozen:
                    state[k] = state[k] + step
            out.append(state)
        return out

    counts = np.array([[10, 1, 1, 1, 1], [1, 10, 1, 1, 1], [1, 1, 10, 1, 30]])
    fused = fedma(states, spec, retrain, class_counts=counts).state_dict
    np.testing.assert_array_equal(fused["emb.weight"], fused["head.weight"])
