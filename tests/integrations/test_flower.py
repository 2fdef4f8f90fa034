"""The Flower strategy and FedMA loop, tested with mocked replies (as Flower tests its strategies)."""

from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'bayesfuse[flower]'")

from flwr.app import Error, Message, MetricRecord, RecordDict  # noqa: E402

from bayesfuse import fuse  # noqa: E402
from bayesfuse.data import dirichlet_partition, load_digits  # noqa: E402
from bayesfuse.inference.layerwise import match_layerwise  # noqa: E402
from bayesfuse.integrations.flower import (  # noqa: E402
    FEDMA_LOCAL,
    FEDMA_ROUND,
    MatchedAveraging,
    fedma_server,
    record_to_state,
    state_digest,
    state_to_record,
)
from bayesfuse.nets.mlp import MLP  # noqa: E402
from bayesfuse.nets.state import numpy_state as _np  # noqa: E402
from bayesfuse.train import TrainConfig, train_clients, train_model  # noqa: E402


@pytest.fixture(autouse=True)
def task_identity(request):
    """Instruction messages take their sender from the running task; give the mocks one."""
    from flwr.supercore.task_identity import TaskIdentity

    if request.node.name.startswith("test_three_node_simulation"):
        yield  # the simulation runtime sets its own
        return
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="module")
def clients():
    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 3, 0.5, seed=0)
    models = train_clients(split.train, part, TrainConfig(hidden=(20, 16), epochs=3), shared_init=False, verbose=False)
    return split, part, models


def _reply(node: int, state, counts=None, n=100) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node, message_type="train")
    metrics = {"num-examples": n}
    if counts is not None:
        metrics["class-counts"] = [int(c) for c in counts]
    return Message(RecordDict({"arrays": state_to_record(state), "metrics": MetricRecord(metrics)}),
                   reply_to=instruction)


def _error(node: int) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node, message_type="train")
    return Message(Error(code=1, reason="client crashed"), reply_to=instruction)


def _canonical(models):
    """The order the strategy fuses replies in: by the hash of their contents."""
    return sorted(range(len(models)), key=lambda j: state_digest(_np(models[j])))


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_fused_arrays_equal_bayesfuse_on_the_same_state_dicts(clients, method):
    _, part, models = clients
    replies = [_reply(10 + j, m.state_dict(), part.counts[j]) for j, m in enumerate(models)]
    arrays, metrics = MatchedAveraging(method).aggregate_train(1, replies[::-1])  # arrival order is irrelevant
    order = _canonical(models)
    expected = fuse([models[j] for j in order], method, class_counts=part.counts[order], seed=0)
    got = record_to_state(arrays)
    for k, v in expected.model.state_dict().items():
        np.testing.assert_allclose(got[k], v.numpy(), rtol=1e-6, atol=1e-7)
    assert metrics["global-sizes"] == expected.sizes and metrics["fused-replies"] == 3
    assert metrics["num-examples"] == 300


def test_failed_and_mismatched_replies_are_skipped_and_reported(clients):
    _, part, models = clients
    other = MLP(64, [20, 16], 7)  # another number of classes
    replies = [_reply(1, models[0].state_dict()), _error(2), _reply(3, models[1].state_dict()),
               _reply(4, other.state_dict())]
    strategy = MatchedAveraging("pfnm")
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["fused-replies"] == 2 and metrics["failed-replies"] == 1 and metrics["rejected-replies"] == 1
    assert strategy.failed == [(2, "client crashed")]
    node, reason = strategy.rejected[0]
    assert node == 4 and "node 4: a different architecture from the one 2 of 3 nodes share" in reason
    assert "'layers.2.weight' has fixed dimensions (7, None) instead of (10, None)" in reason
    pair = [models[j] for j in _canonical(models[:2])]
    expected = match_layerwise([_np(m) for m in pair], models[0].permutation_spec(), seed=0)
    np.testing.assert_allclose(record_to_state(arrays)["layers.0.weight"], expected.state_dict["layers.0.weight"],
                               rtol=1e-6, atol=1e-7)
    assert strategy.aggregate_train(2, [_error(5)]) == (None, None)


def test_kl_fusion_of_bnn_replies(clients):
    from bayesfuse.models.bnn import BNNConfig, train_bnn

    split, part, _ = clients
    bnns = [train_bnn(split.train.x[i], split.train.y[i], 10, 6, BNNConfig(epochs=2, seed=j), verbose=False)
            for j, i in enumerate(part)]
    arrays, metrics = MatchedAveraging("kl").aggregate_train(1, [_reply(j, b.state_dict()) for j, b in enumerate(bnns)])
    expected = fuse([bnns[j] for j in _canonical(bnns)], "kl").model.state_dict()
    got = record_to_state(arrays)
    for k, v in expected.items():
        np.testing.assert_allclose(got[k], v.numpy(), rtol=1e-6, atol=1e-7)
    assert metrics["global-sizes"] == [expected["loc.w1"].shape[0]]


class FakeGrid:
    """Answers messages in-process: node n trains on partition n; node ``dead`` never answers FedMA rounds."""

    def __init__(self, split, part, dead=None):
        self.split, self.part, self.dead = split, part, dead
        self.types = []

    def get_node_ids(self):
        return list(range(len(self.part)))

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.types.append(msg.metadata.message_type)
            x, y = self.split.train.x[self.part[node]], self.split.train.y[self.part[node]]
            cfg = TrainConfig(hidden=(20,), epochs=2, seed=node)
            if msg.metadata.message_type == FEDMA_LOCAL:
                torch.manual_seed(node)
                model = MLP(64, [20], 10)
                train_model(model, x, y, 10, cfg)
            else:
                if node == self.dead:
                    continue  # a timeout: no reply at all
                import json

                state = record_to_state(msg.content["arrays"])
                model = MLP.from_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
                train_model(model, x, y, 10, cfg, frozen=json.loads(msg.content["config"]["frozen"]))
            counts = np.bincount(y, minlength=10)
            replies.append(Message(RecordDict({"arrays": state_to_record(model.state_dict()),
                                               "metrics": MetricRecord({"num-examples": len(y),
                                                                        "class-counts": counts.tolist()})}),
                                   reply_to=msg))
        return replies


def test_fedma_server_loop_over_a_grid(clients):
    split, part, _ = clients
    grid = FakeGrid(split, part)
    out = fedma_server(grid, min_nodes=3)
    assert grid.types == [FEDMA_LOCAL] * 3 + [FEDMA_ROUND] * 3
    assert out.result.rounds == 2 and out.nodes == [0, 1, 2] and out.failed == []
    model = MLP.from_state_dict({k: torch.as_tensor(v) for k, v in record_to_state(out.arrays).items()})
    acc = (model(torch.as_tensor(split.test.x)).argmax(1).numpy() == split.test.y).mean()
    assert acc > 0.6


def test_fedma_server_drops_a_node_that_times_out(clients):
    split, part, _ = clients
    out = fedma_server(FakeGrid(split, part, dead=1), min_nodes=3)
    assert out.failed == [(1, "no reply")] and out.result.dropped == [1]


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'fedprox'"):
        MatchedAveraging("fedprox")


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"


def test_three_node_simulation_beats_one_shot_fedavg(monkeypatch):
    """End to end on Flower's simulation engine (Ray backend): 3 nodes, Dirichlet-split digits."""
    import os
    import time

    pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    # the example app is not installed: make it importable here and in Ray's worker processes
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs here; silences Ray's notice
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])))
    from bayesfuse_flower.client_app import make_client_app
    from bayesfuse_flower.server_app import RESULTS, make_server_app

    settings = {"method": "pfnm", "num-nodes": 3, "local-epochs": 5, "timeout": 300}
    start = time.perf_counter()
    run_simulation(server_app=make_server_app(settings), client_app=make_client_app(settings), num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    assert RESULTS["pfnm"].get("fused-replies") == 3, RESULTS
    assert time.perf_counter() - start < 120
    assert RESULTS["pfnm"]["accuracy"] > RESULTS["fedavg"]["accuracy"], RESULTS
