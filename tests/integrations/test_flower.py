"""The Flower strategies, tested with mocked replies (as Flower tests its strategies), and the example app."""

import ast
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'bayesfuse[flower]'")

from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import Result  # noqa: E402

from bayesfuse import fuse, fuse_states, summarize  # noqa: E402
from bayesfuse.data import dirichlet_partition, load_digits  # noqa: E402
from bayesfuse.federated import run_fedma  # noqa: E402
from bayesfuse.inference.layerwise import match_layerwise  # noqa: E402
from bayesfuse.inference.output_fusion import (  # noqa: E402
    class_blocks,
    evidence_precision,
    fuse_output_fits,
    prior_precision_from_weights,
)
from bayesfuse.integrations import flower as integration  # noqa: E402
from bayesfuse.integrations.flower import (  # noqa: E402
    CLIENT_HEADS,
    COUNTS_ARRAYS_KEY,
    COUNTS_POSTERIOR_KEY,
    DIAGONAL_HEADS,
    EKFAC_HEADS,
    FEDMA_LOCAL,
    FEDMA_ROUND,
    HEADS_KEY,
    OUTPUT_FIT,
    OUTPUT_FIT_KEY,
    ROUND_KEY,
    SHARED,
    SHARED_COUNTS,
    SHARED_POSTERIOR_KEY,
    SUMMARY_KEY,
    SUMMARY_META_KEY,
    TEMPERATURE,
    TEMPERATURE_NLL_KEY,
    TRACE_MATCHED,
    FedMA,
    MatchedAveraging,
    metrics_aggregation,
    output_fit_reply,
    output_fit_to_records,
    record_to_state,
    records_to_output_fit,
    records_to_summary,
    state_digest,
    state_to_record,
    summary_to_records,
    temperature_candidates,
    temperature_reply,
)
from bayesfuse.integrations.flower.strategy import _fit_digest  # noqa: E402
from bayesfuse.nets.arch import rebuild  # noqa: E402
from bayesfuse.nets.heads import ClientHeads, class_shares  # noqa: E402
from bayesfuse.nets.laplace import LastLayerLaplace  # noqa: E402
from bayesfuse.nets.mlp import MLP  # noqa: E402
from bayesfuse.nets.predict import predict_proba  # noqa: E402
from bayesfuse.nets.state import numpy_state as _np  # noqa: E402
from bayesfuse.nets.state import tensor_state  # noqa: E402
from bayesfuse.summaries import output_fit  # noqa: E402
from bayesfuse.train import TrainConfig, train_clients, train_model  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"


@pytest.fixture(autouse=True)
def task_identity(request):
    """Instruction messages take their sender from the running task; give the mocks one."""
    from flwr.supercore.task_identity import TaskIdentity

    if "simulation" in request.node.name:
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
    return Message(
        RecordDict({"arrays": state_to_record(state), "metrics": MetricRecord(metrics)}), reply_to=instruction
    )


def _error(node: int, message_type: str = "train") -> Message:
    instruction = Message(RecordDict(), dst_node_id=node, message_type=message_type)
    return Message(Error(code=1, reason="client crashed"), reply_to=instruction)


def _canonical(models):
    """The order the strategies take replies in: by the hash of their contents."""
    return sorted(range(len(models)), key=lambda j: state_digest(_np(models[j])))


def _accuracy(split, state) -> float:
    model = MLP.from_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    return float((model(torch.as_tensor(split.test.x)).argmax(1).numpy() == split.test.y).mean())


# --------------------------------------------------------------------------- MatchedAveraging


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


def test_failed_and_mismatched_replies_are_skipped_and_reported(clients, caplog):
    _, part, models = clients
    other = MLP(64, [20, 16], 7)  # another number of classes
    replies = [
        _reply(1, models[0].state_dict()),
        _error(2),
        _reply(3, models[1].state_dict()),
        _reply(4, other.state_dict()),
    ]
    strategy = MatchedAveraging("pfnm")
    with caplog.at_level(logging.INFO):
        arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["fused-replies"] == 2 and metrics["failed-replies"] == 1 and metrics["rejected-replies"] == 1
    assert strategy.failed == [(2, "client crashed")]
    node, reason = strategy.rejected[0]
    assert node == 4 and "node 4: a different architecture from the one 2 of 3 nodes share" in reason
    assert "'layers.2.weight' has fixed dimensions (7, None) instead of (10, None)" in reason
    assert "aggregate_train: Received 3 results and 1 failures" in caplog.messages
    pair = [models[j] for j in _canonical(models[:2])]
    expected = match_layerwise([_np(m) for m in pair], models[0].permutation_spec(), seed=0)
    np.testing.assert_allclose(
        record_to_state(arrays)["layers.0.weight"], expected.state_dict["layers.0.weight"], rtol=1e-6, atol=1e-7
    )
    nothing = {"fused-replies": 0, "failed-replies": 1, "rejected-replies": 0}
    assert strategy.aggregate_train(2, [_error(5)]) == (None, MetricRecord(nothing))


class _Wrapped(torch.nn.Module):
    """A user's class around an ``nn.Sequential``, its hidden layer as wide as its input: from
    the entry names (``net.0.weight``, ...) a skip connection is possible."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class _WrappedGrid:
    """Node ``p`` trains a :class:`_Wrapped` on partition ``p`` from what it is sent."""

    def __init__(self, split, part):
        self.split, self.part, self.sent, self.states = split, part, [], {}

    def get_node_ids(self):
        return list(range(len(self.part)))

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            p = msg.metadata.dst_node_id
            x, y = self.split.train.x[self.part[p]], self.split.train.y[self.part[p]]
            model = _Wrapped()
            if msg.metadata.message_type == "train":  # FedMA's rounds send no network in round 1
                model.load_state_dict(tensor_state(record_to_state(msg.content["arrays"])))
            torch.manual_seed(p)
            train_model(model, x, y, 10, TrainConfig(epochs=2, seed=p), verbose=False)
            self.states[p] = _np(model)
            metrics = {"num-examples": len(y), "class-counts": np.bincount(y, minlength=10).tolist()}
            replies.append(
                Message(
                    RecordDict({"arrays": state_to_record(model.state_dict()), "metrics": MetricRecord(metrics)}),
                    reply_to=msg,
                )
            )
        return replies


@pytest.mark.parametrize("strategy_class", [MatchedAveraging, FedMA])
def test_a_users_class_whose_names_leave_a_skip_possible_is_refused_before_any_round(clients, strategy_class):
    split, part, _ = clients
    grid = _WrappedGrid(split, part)
    initial = state_to_record(_Wrapped().state_dict())
    with pytest.raises(ValueError, match="skip connection possible") as err:
        strategy_class(min_train_nodes=3, fraction_evaluate=0.0).start(grid=grid, initial_arrays=initial)
    # the advice names what the strategy takes, not load's or the command line's arguments
    assert "give the network itself (like=model)" in str(err.value)
    assert "spec=spec_for_state_dict(state, arch='mlp')" in str(err.value)
    assert grid.sent == []  # refused before a node trained


@pytest.mark.parametrize("strategy_class", [MatchedAveraging, FedMA])
def test_initial_arrays_of_another_network_than_like_are_refused_before_any_round(clients, strategy_class):
    split, part, _ = clients
    grid = _WrappedGrid(split, part)
    other = state_to_record(MLP(64, [32], 10).state_dict())  # not the network the strategy traced
    strategy = strategy_class(like=_Wrapped(), second_round="refit", min_train_nodes=3, fraction_evaluate=0.0)
    with pytest.raises(
        ValueError, match=r"initial_arrays \(the network the strategy was given as spec= or like=\) lacks"
    ):
        strategy.start(grid=grid, initial_arrays=other, num_rounds=3 if strategy_class is MatchedAveraging else None)
    assert grid.sent == [] and strategy._refit_round is None  # refused before a node trained; no round kept
    if strategy_class is FedMA:
        with pytest.raises(ValueError, match="initial_arrays"):
            strategy.num_rounds(other)


def test_a_users_class_given_as_like_is_traced_and_fused(clients):
    from bayesfuse.nets.tracing import spec_from_module

    split, part, _ = clients
    grid = _WrappedGrid(split, part)
    strategy = MatchedAveraging("pfnm", like=_Wrapped(), min_train_nodes=3, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=state_to_record(_Wrapped().state_dict()), num_rounds=1)
    assert result.train_metrics_clientapp[1]["fused-replies"] == 3
    order = sorted(range(3), key=lambda p: state_digest(grid.states[p]))  # the strategy's canonical order
    expected = fuse_states(
        [grid.states[p] for p in order], "pfnm", spec=spec_from_module(_Wrapped()), class_counts=part.counts[order]
    )
    fused = record_to_state(result.arrays)
    for k, v in expected.state.items():
        np.testing.assert_allclose(fused[k], v, rtol=1e-5, atol=1e-6)  # float32 arrays of a float64 fusion
    fedma = FedMA(like=_Wrapped(), min_train_nodes=3, fraction_evaluate=0.0)
    assert fedma.num_rounds(state_to_record(_Wrapped().state_dict())) == 2
    result = fedma.start(grid=_WrappedGrid(split, part), initial_arrays=state_to_record(_Wrapped().state_dict()))
    assert fedma.fedma_result is not None and "net.0.weight" in record_to_state(result.arrays)
    with pytest.raises(ValueError, match="spec= or like=, not both"):
        MatchedAveraging("pfnm", like=_Wrapped(), spec=spec_from_module(_Wrapped()))
    with pytest.raises(TypeError, match="like= takes the clients' network"):
        MatchedAveraging("pfnm", like=_Wrapped().state_dict())
    with pytest.raises(ValueError, match="KL-fusion reads HorseshoeBNN"):
        MatchedAveraging("kl", like=_Wrapped())

    class Split(torch.nn.Module):  # split by a width written in the code: its forward fixes that width
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = torch.nn.Linear(64, 16), torch.nn.Linear(8, 10)

        def forward(self, x):
            a, b = self.fc(x).split(8, 1)
            return self.head(a * b)

    assert set(FedMA(like=Split(), min_train_nodes=3, fraction_evaluate=0.0).spec.fixed) == {"P1"}  # matched at 8

    class Beside(torch.nn.Module):  # the input beside hidden units: the head's weight is matched in pieces
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = torch.nn.Linear(64, 16), torch.nn.Linear(80, 10)

        def forward(self, x):
            return self.head(torch.cat([x, torch.relu(self.fc(x))], 1))

    assert FedMA(like=Beside(), min_train_nodes=3, fraction_evaluate=0.0).spec.pieces  # matched in pieces
    nets = []
    for j in range(3):
        torch.manual_seed(j)
        nets.append(Beside().eval())
    arrays, _ = MatchedAveraging("pfnm", like=nets[0]).aggregate_train(
        1, [_reply(j, n.state_dict()) for j, n in enumerate(nets)]
    )
    expected = fuse([nets[j] for j in _canonical(nets)], "pfnm", seed=0).model.state_dict()
    got = record_to_state(arrays)
    assert got["head.weight"].shape == tuple(expected["head.weight"].shape) and got["head.weight"].shape[1] > 80
    for k, v in expected.items():
        np.testing.assert_allclose(got[k], v.numpy(), rtol=1e-6, atol=1e-7)


def test_kl_fusion_of_bnn_replies(clients):
    from bayesfuse.models.bnn import BNNConfig, train_bnn

    split, part, _ = clients
    bnns = [
        train_bnn(split.train.x[i], split.train.y[i], 10, 6, BNNConfig(epochs=2, seed=j), verbose=False)
        for j, i in enumerate(part)
    ]
    arrays, metrics = MatchedAveraging("kl").aggregate_train(1, [_reply(j, b.state_dict()) for j, b in enumerate(bnns)])
    # the server fuses what the wire carries: the float64 guides rounded to float32, in the order of
    # those copies' digests (which need not be the float64 guides' order)
    wire = [record_to_state(state_to_record(b.state_dict())) for b in bnns]
    expected = fuse_states(sorted(wire, key=state_digest), "kl").state
    got = record_to_state(arrays)
    for k, v in expected.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-7)
    assert metrics["global-sizes"] == [expected["loc.w1"].shape[0]]


def test_the_kind_of_input_is_the_callers_or_the_rows_first(clients):
    from bayesfuse.models.bnn import BNNConfig, train_bnn

    assert MatchedAveraging("pfnm").kind == MatchedAveraging("ot").kind == "network"
    assert MatchedAveraging("kl").kind == "bnn"
    with pytest.raises(ValueError, match="method 'ot' fuses point-estimate networks"):
        MatchedAveraging("ot", kind="bnn")
    split, part, _ = clients
    bnns = [
        train_bnn(split.train.x[i], split.train.y[i], 10, 6, BNNConfig(epochs=1, seed=j), verbose=False)
        for j, i in enumerate(part)
    ]
    strategy = MatchedAveraging("pfnm", kind="bnn")
    arrays, _ = strategy.aggregate_train(1, [_reply(j, b.state_dict()) for j, b in enumerate(bnns)])
    # the replies travel as float32 records: the strategy fuses those, in their digests' order
    sent = [record_to_state(state_to_record(b.state_dict())) for b in bnns]
    order = sorted(range(len(sent)), key=lambda j: state_digest(sent[j]))
    expected = fuse_states([sent[j] for j in order], "pfnm").state
    got = record_to_state(arrays)
    for k, v in expected.items():
        np.testing.assert_allclose(got[k], np.asarray(v), rtol=1e-6, atol=1e-7)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'fedprox'"):
        MatchedAveraging("fedprox")


def test_client_heads_are_refused():
    # the strategy sends one HorseshoeBNN back to every client: a fused model of J heads is no such network
    with pytest.raises(ValueError, match="head='clients' builds a fused model with one output layer per client"):
        MatchedAveraging("kl", hyper={"head": "clients"})
    MatchedAveraging("kl", hyper={"head": "shared"})


def test_metrics_aggregation_sums_class_counts_and_averages_the_rest():
    records = [
        RecordDict({"metrics": MetricRecord({"num-examples": n, "class-counts": c, "accuracy": a})})
        for n, c, a in [(30, [10, 20, 0], 0.5), (10, [0, 5, 5], 0.9)]
    ]
    out = metrics_aggregation()(records, "num-examples")
    assert out["num-examples"] == 40 and out["class-counts"] == [10, 25, 5]
    assert out["accuracy"] == pytest.approx(0.75 * 0.5 + 0.25 * 0.9)
    with pytest.raises(ValueError, match="'class-counts'"):
        metrics_aggregation()(
            [records[0], RecordDict({"m": MetricRecord({"num-examples": 1, "class-counts": [1]})})], "num-examples"
        )


# --------------------------------------------------------------------------- client summaries


@pytest.fixture(scope="module")
def summaries(clients):
    split, part, models = clients
    return [summarize(m, split.train.x[idx], split.train.y[idx]) for m, idx in zip(models, part)]


def _summary_reply(node: int, state, summary, counts=None) -> Message:
    reply = _reply(node, state, counts)
    reply.content[SUMMARY_KEY], reply.content[SUMMARY_META_KEY] = summary_to_records(summary)
    return reply


def test_a_summary_travels_as_an_array_record_and_a_config_record(summaries):
    arrays, meta = summary_to_records(summaries[0])
    back = records_to_summary(arrays, meta, "node 1")
    assert (back.fingerprint, back.version, back.n_examples, back.prior_precision) == (
        summaries[0].fingerprint,
        summaries[0].version,
        summaries[0].n_examples,
        summaries[0].prior_precision,
    )
    np.testing.assert_array_equal(back.class_counts, summaries[0].class_counts)
    for k, v in summaries[0].precision.items():  # float32 on the wire, as in the summary file
        np.testing.assert_allclose(back.precision[k], v, rtol=1e-6)
    for g, stats in summaries[0].moments.items():
        assert set(back.moments[g]) == set(stats)


def test_the_strategys_networks_hold_the_fused_widths():
    """A network whose forward reshapes by the width it holds (``self.hidden_dim``): the
    strategy's one-shot heads rebuild it at the fused width with its spec, and it runs."""
    from tests.nets.test_graph_spec import _random
    from tests.nets.user_nets import PatchTokens

    models = [_random(PatchTokens, s) for s in range(3)]
    strategy = MatchedAveraging("pfnm", like=PatchTokens())
    arrays, _ = strategy.aggregate_train(1, [_reply(10 + j, m.state_dict(), [5] * 10) for j, m in enumerate(models)])
    heads = strategy.client_heads(PatchTokens())
    assert heads.network.hidden_dim == heads.network.patch.out_channels > 12
    assert heads(torch.randn(4, 64)).shape == (4, 10)


def test_the_strategy_fuses_with_the_replies_summaries(clients, summaries):
    _, part, models = clients
    replies = [
        _summary_reply(10 + j, m.state_dict(), s, part.counts[j]) for j, (m, s) in enumerate(zip(models, summaries))
    ]
    strategy = MatchedAveraging("pfnm")
    arrays, metrics = strategy.aggregate_train(1, replies[::-1])
    assert metrics["summaries-used"] == 1 and metrics["fused-replies"] == 3
    assert metrics["summary-bytes"] == sum(s.nbytes for s in summaries)
    order = _canonical(models)
    wire = [records_to_summary(*summary_to_records(summaries[j])) for j in order]
    expected = fuse_states(
        [_np(models[j]) for j in order],
        "pfnm",
        class_counts=part.counts[order],
        seed=0,
        names=[f"node {10 + j}" for j in order],
        summaries=wire,
    )
    assert strategy.last_fusion.hyper["summaries"]["used"]
    got = record_to_state(arrays)
    for k, v in expected.state.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6)
    # the nodes' own output layers as one-shot heads, each its summary's Kronecker Laplace posterior,
    # as bayesfuse.fuse(..., head="clients", summaries=...) builds them from the same fusion
    heads = strategy.client_heads(models[0])
    expected_heads = ClientHeads.from_clients(
        rebuild(models[0], tensor_state(got)),
        expected.spec,
        [_np(models[j]) for j in order],
        {g: layer.assignments for g, layer in zip(expected.groups, expected.layers)},
        part.counts[order],
        wire,
        pool="log",
    )
    assert heads.predictive == "laplace" and heads.n_heads == 3 and heads.pool == "log" and heads.form == "kronecker"
    x = clients[0].test.x[:40]
    np.testing.assert_allclose(predict_proba(heads, x), predict_proba(expected_heads, x), rtol=1e-4, atol=1e-6)
    # without: the data-free fusion, and its heads are points
    plain_strategy = MatchedAveraging("pfnm", summaries="none")
    _, plain = plain_strategy.aggregate_train(1, replies)
    assert plain["summaries-used"] == 0 and plain["summary-bytes"] == 0
    assert plain_strategy.client_heads(models[0]).predictive == "map"
    # replies without class counts: the heads take the summaries' counts, as the fusion does
    uncounted = MatchedAveraging("pfnm")
    uncounted.aggregate_train(
        1, [_summary_reply(10 + j, m.state_dict(), s) for j, (m, s) in enumerate(zip(models, summaries))]
    )
    np.testing.assert_allclose(uncounted.client_heads(models[0]).shares.numpy(), class_shares(part.counts[order]))
    with pytest.raises(ValueError, match="one-shot client heads need networks fused by pfnm or nafi"):
        ot = MatchedAveraging("ot")
        ot.aggregate_train(1, [_reply(10 + j, m.state_dict(), part.counts[j]) for j, m in enumerate(models)])
        ot.client_heads(models[0])


def test_replies_that_cannot_be_fused_are_rejected_naming_the_node_and_the_round_goes_on(clients, caplog):
    _, part, models = clients
    counts = [part.counts[j % 3] for j in range(6)]
    states = [{k: v.clone() for k, v in models[j % 3].state_dict().items()} for j in range(6)]
    states[0]["layers.0.weight"][0, 0] = float("nan")
    replies = [
        _reply(1, states[0], counts[0]),
        _reply(2, states[1], counts[1][:7]),  # 7 class counts for 10 classes
        _reply(3, states[2], [-1] + list(counts[2][1:])),
        _reply(4, states[3], counts[3], n=-5),
        _reply(5, states[4], counts[4]),
        _reply(6, states[5], counts[5]),
    ]
    strategy = MatchedAveraging("pfnm")
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, replies)
    reasons = dict(strategy.rejected)
    assert sorted(reasons) == [1, 2, 3, 4] and metrics["rejected-replies"] == 4 and metrics["fused-replies"] == 2
    assert reasons[1] == "node 1: entry 'layers.0.weight' has NaN or infinite values"
    assert reasons[2].startswith("node 2: class-counts must be 10 finite counts >= 0")
    assert reasons[3].startswith("node 3: class-counts must be 10 finite counts >= 0")
    assert reasons[4] == "node 4: num-examples must be a finite number > 0, got -5"
    assert arrays is not None and "node 4: reply rejected" in caplog.text


def test_the_strategy_rejects_a_bad_summary_naming_the_node(clients, summaries, caplog):
    _, part, models = clients
    bad_version = summary_to_records(summaries[2])
    bad_version[1]["version"] = 99
    replies = [
        _summary_reply(1, models[0].state_dict(), summaries[0]),
        _summary_reply(2, models[1].state_dict(), summaries[0]),  # the summary of another network
        _reply(3, models[2].state_dict()),
    ]
    replies[2].content[SUMMARY_KEY], replies[2].content[SUMMARY_META_KEY] = bad_version
    strategy = MatchedAveraging("pfnm")
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="only one model"):
        arrays, metrics = strategy.aggregate_train(1, replies)
    reasons = dict(strategy.rejected)
    assert sorted(reasons) == [2, 3] and metrics["rejected-replies"] == 2 and metrics["fused-replies"] == 1
    assert reasons[2].startswith("node 2: the summary is of another network")
    assert reasons[3].startswith("node 3: summary version 99 is not one this bayesfuse reads")
    assert "node 2: reply rejected" in caplog.text


def test_a_round_where_only_some_nodes_send_a_summary_is_fused_data_free(clients, summaries, caplog):
    _, _, models = clients
    replies = [
        _summary_reply(1, models[0].state_dict(), summaries[0]),
        _reply(2, models[1].state_dict()),
        _summary_reply(3, models[2].state_dict(), summaries[2]),
    ]
    with caplog.at_level(logging.WARNING):
        _, metrics = MatchedAveraging("pfnm").aggregate_train(1, replies)
    assert metrics["summaries-used"] == 0 and metrics["fused-replies"] == 3
    assert "nodes [2] sent no summary: this round is fused data-free" in caplog.text
    with pytest.raises(ValueError, match="unknown summaries='always'"):
        MatchedAveraging("pfnm", summaries="always")


# --------------------------------------------------------------------------- FedMA


class FakeGrid:
    """Answers messages in-process; the node with id ``ids[p]`` trains on partition ``p``.

    Nodes in ``crash`` fail their local round, nodes in ``odd`` send a network with 7 classes,
    nodes in ``dead`` never answer FedMA rounds, nodes in ``misshapen`` return a network of
    other widths from them. Evaluation messages get the node's test accuracy.
    """

    def __init__(self, split, part, hidden=(20,), ids=None, crash=(), odd=(), dead=(), misshapen=()):
        self.split, self.part, self.hidden = split, part, tuple(hidden)
        self.ids = list(ids if ids is not None else range(len(part)))
        self.crash, self.odd, self.dead, self.misshapen = set(crash), set(odd), set(dead), set(misshapen)
        self.sent: list[Message] = []

    @property
    def types(self) -> list[str]:
        return [m.metadata.message_type for m in self.sent]

    def get_node_ids(self):
        return list(self.ids)

    def _answer(self, msg: Message) -> Message | None:
        node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
        p = self.ids.index(node)
        x, y = self.split.train.x[self.part[p]], self.split.train.y[self.part[p]]
        cfg = TrainConfig(hidden=self.hidden, epochs=2, seed=p)
        if kind == FEDMA_LOCAL:
            if node in self.crash:
                return Message(Error(code=1, reason="client crashed"), reply_to=msg)
            torch.manual_seed(p)
            model = MLP(64, list(self.hidden), 7 if node in self.odd else 10)
            if node not in self.odd:
                train_model(model, x, y, 10, cfg)
        elif kind == FEDMA_ROUND:
            if node in self.dead:
                return None  # a timeout: no reply at all
            state = record_to_state(msg.content["arrays"])
            if node in self.misshapen:
                model = MLP(64, [3] * len(self.hidden), 10)
            else:
                model = MLP.from_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
                train_model(model, x, y, 10, cfg, frozen=json.loads(msg.content["config"]["frozen"]))
        elif kind == "evaluate":
            acc = _accuracy(self.split, record_to_state(msg.content["arrays"]))
            return Message(
                RecordDict({"metrics": MetricRecord({"num-examples": len(y), "accuracy": acc})}), reply_to=msg
            )
        else:
            raise AssertionError(f"unexpected message type {kind!r}")
        counts = np.bincount(y, minlength=10)
        return Message(
            RecordDict(
                {
                    "arrays": state_to_record(model.state_dict()),
                    "metrics": MetricRecord({"num-examples": len(y), "class-counts": counts.tolist()}),
                }
            ),
            reply_to=msg,
        )

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            reply = self._answer(msg)
            if reply is not None:
                replies.append(reply)
        return replies


class _Retraining(FakeGrid):
    """Node 20 + j holds ``models[j]``: it sends it in FedMA's local round and retrains what it is
    sent after, with the seed ``seed_of(j, net, frozen, pass)``; the refit round gets its output fit
    of the network it was sent (:func:`output_fit_reply`)."""

    def __init__(self, split, part, models, config, seed_of):
        super().__init__(split, part, ids=[20 + j for j in range(len(part))])
        self.models, self.config, self.seed_of = models, config, seed_of

    def _answer(self, msg):
        j = msg.metadata.dst_node_id - 20
        x, y = self.split.train.x[self.part[j]], self.split.train.y[self.part[j]]
        if msg.metadata.message_type == "train":  # the refit round
            fused = rebuild(self.models[j], tensor_state(record_to_state(msg.content["arrays"])))
            return Message(output_fit_reply(fused, x, y, msg.content["config"]), reply_to=msg)
        if msg.metadata.message_type == FEDMA_LOCAL:
            net = self.models[j]
        else:
            frozen = set(json.loads(msg.content["config"]["frozen"]))
            net = rebuild(self.models[j], tensor_state(record_to_state(msg.content["arrays"])))
            seed = self.seed_of(j, net, frozen, msg.content["config"]["fedma-pass"] - 1)
            train_model(net, x, y, 10, replace(self.config, seed=seed), frozen=frozen, verbose=False)
        metrics = {"num-examples": len(y), "class-counts": np.bincount(y, minlength=10).tolist()}
        return Message(
            RecordDict({"arrays": state_to_record(net.state_dict()), "metrics": MetricRecord(metrics)}),
            reply_to=msg,
        )


def _initial(hidden=(20,)):
    return state_to_record(MLP(64, list(hidden), 10).state_dict())


def test_fedma_strategy_runs_flowers_loop_and_returns_a_result(clients, caplog):
    split, part, _ = clients
    grid = FakeGrid(split, part, ids=[7, 8, 9])
    strategy = FedMA(min_train_nodes=3, fraction_evaluate=1.0, min_evaluate_nodes=3)
    evaluated = []

    def evaluate_fn(server_round, arrays):
        evaluated.append(server_round)
        return MetricRecord({"accuracy": _accuracy(split, record_to_state(arrays))})

    with caplog.at_level(logging.INFO):
        result = strategy.start(grid=grid, initial_arrays=_initial(), evaluate_fn=evaluate_fn)
    assert isinstance(result, Result)
    assert grid.types == [FEDMA_LOCAL] * 3 + [FEDMA_ROUND] * 3 + ["evaluate"] * 3  # evaluated once: at the end
    # Flower's own per-round log lines, and the strategy's
    for line in [
        "Starting FedMA strategy:",
        "\t├── Number of rounds: 2",
        "[ROUND 1/2]",
        "[ROUND 2/2]",
        "configure_train: Sampled 3 nodes (out of 3)",
        "aggregate_train: Received 3 results and 0 failures",
        "\t└──> FedMA matched group 'P1': 20 global units",
        "Global evaluation",
        "configure_train: 3 nodes retrain the layers above group 'P1' (2 entries frozen)",
    ]:
        assert line in caplog.messages, line
    assert any(m.startswith("Strategy execution finished") for m in caplog.messages)
    # the Result: global network, each round's metrics, server- and client-side evaluation
    assert strategy.fedma_result.rounds == 2 and sorted(strategy.nodes) == [7, 8, 9]
    assert strategy.failed == [] and strategy.dropped == []
    assert result.train_metrics_clientapp[1]["local-replies"] == 3
    assert result.train_metrics_clientapp[1]["global-size"] == 20
    last = result.train_metrics_clientapp[2]
    assert last["global-sizes"] == [strategy.fedma_result.sizes["P1"]] and last["fedma-rounds"] == 2
    state = record_to_state(result.arrays)
    for k, v in strategy.fedma_result.state_dict.items():
        np.testing.assert_allclose(state[k], v, rtol=1e-6, atol=1e-6)
    assert evaluated == [0, 2] and set(result.evaluate_metrics_serverapp) == {0, 2}
    assert result.evaluate_metrics_serverapp[2]["accuracy"] > 0.6
    assert result.evaluate_metrics_clientapp[2]["accuracy"] > 0.6


def test_fedma_round_messages_are_per_node(clients):
    split, part, _ = clients
    grid = FakeGrid(split, part, hidden=(20, 16))
    strategy = FedMA(min_train_nodes=3, fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=_initial((20, 16)), train_config=ConfigRecord({"lr": 0.1}))
    assert grid.types == [FEDMA_LOCAL] * 3 + [FEDMA_ROUND] * 6
    local = grid.sent[0].content
    assert list(local.array_records) == [] and local["config"]["lr"] == 0.1  # round 1: the config only
    first, second = grid.sent[3:6], grid.sent[6:9]
    assert sorted(m.metadata.dst_node_id for m in first) == [0, 1, 2]
    frozen = [json.loads(m.content["config"]["frozen"]) for m in first + second]
    assert frozen[:3] == [["layers.0.bias", "layers.0.weight"]] * 3
    assert frozen[3:] == [["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]] * 3
    assert all(m.content["config"]["lr"] == 0.1 for m in first + second)
    states = [record_to_state(m.content["arrays"]) for m in first]
    # the global first layer is shared; each node's second layer is its own, mapped onto the global units
    np.testing.assert_array_equal(states[0]["layers.0.weight"], states[1]["layers.0.weight"])
    assert not np.allclose(states[0]["layers.1.weight"], states[1]["layers.1.weight"])


@pytest.mark.parametrize("passes", [1, 2])
def test_fedma_strategy_equals_run_fedma(clients, passes):
    """The strategy over a grid and :func:`bayesfuse.federated.run_fedma` in process give the same
    network; with two passes (FedMA with communication) too, the restart round sending each node
    its network cut out of the global one."""
    split, part, models = clients
    config = TrainConfig(hidden=(20, 16), epochs=1)
    order = _canonical(models)  # the strategy's client order; run_fedma takes its clients as given
    expected = run_fedma(
        [models[j] for j in order],
        split.train,
        [part[j] for j in order],
        config,
        method="pfnm",
        seed=0,
        verbose=False,
        passes=passes,
    )
    restarts = []

    def seed_of(j, net, frozen, p):
        if frozen:
            return config.seed + 1000 * (len(frozen) + 1) + order.index(j)  # run_fedma's retraining seed
        restarts.append((j, {k: v.detach().clone() for k, v in net.state_dict().items()}))
        return config.seed + 100_000 * p + order.index(j)  # the restart round: run_fedma's for the start of pass p

    strategy = FedMA(hyper={"passes": passes}, min_train_nodes=3, fraction_evaluate=0.0)
    result = strategy.start(grid=_Retraining(split, part, models, config, seed_of), initial_arrays=_initial((20, 16)))
    assert strategy.fedma_result.sizes == expected.result.sizes and len(strategy.fedma_passes) == passes
    assert [p.sizes for p in strategy.fedma_passes] == [p.sizes for p in expected.passes]
    assert len(result.train_metrics_clientapp) == 3 * passes  # per pass a local (restart) round and 2 groups
    assert expected.result.rounds == 3 and result.train_metrics_clientapp[3 * passes]["fedma-pass"] == passes
    assert len(restarts) == 3 * (passes - 1)
    for j, state in restarts:  # each node restarts from its own units' global units, at its own widths
        assert {k: tuple(v.shape) for k, v in state.items()} == {
            k: tuple(v.shape) for k, v in models[j].state_dict().items()
        }
        first = strategy.fedma_passes[0]
        a = first.layers["P1"].assignments[order.index(j)]
        np.testing.assert_allclose(state["layers.0.weight"].numpy(), first.state_dict["layers.0.weight"][a], rtol=1e-6)
    # every pass's bytes and the restart rounds' cut networks, as run_fedma counts them; every round
    last = result.train_metrics_clientapp[3 * passes]
    assert (last["bytes-up"], last["bytes-down"]) == (expected.bytes_up, expected.bytes_down)
    assert last["fedma-rounds"] == 3 * passes
    got = record_to_state(result.arrays)
    assert list(got) == list(expected.result.state_dict)
    for k, v in expected.result.state_dict.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cls", ["BiasFreeCNN", "BiasFreePlainNormCNN", "StackedLSTM", "DenseBlockCNN", "ConcatMLP", "UpConvUNet"]
)
def test_fedma_strategy_on_bias_free_convolutions_and_stacked_lstms_equals_run_fedma(clients, cls):
    """Convolutions without a bias before a batch norm (as ResNets are written): the strategy
    matches them through a zero bias as run_fedma does, and the nodes get their own entries. A
    stacked LSTM's layers: one group, as run_fedma matches them. Streams side by side (a dense
    block, branches of different widths): the entries reading them matched in pieces, the nodes
    given them whole, frozen whole. Transposed convolutions, one without a bias before a batch
    norm: their units on the weight's axis 1."""
    from bayesfuse.nets.tracing import spec_from_module
    from tests.nets import user_nets

    split, part, _ = clients
    config = TrainConfig(epochs=1)
    models = []
    for j in range(3):
        torch.manual_seed(j)
        model = getattr(user_nets, cls)()
        train_model(model, split.train.x[part[j]], split.train.y[part[j]], 10, replace(config, seed=j), verbose=False)
        models.append(model.eval())
    order = _canonical(models)
    expected = run_fedma(
        [models[j] for j in order], split.train, [part[j] for j in order], config, method="pfnm", seed=0, passes=2
    )

    def seed_of(j, net, frozen, p):
        if frozen:
            return config.seed + 1000 * (len(frozen) + 1) + order.index(j)
        return config.seed + 100_000 * p + order.index(j)

    grid = _Retraining(split, part, models, config, seed_of)
    strategy = FedMA(like=models[0], hyper={"passes": 2}, min_train_nodes=3, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=state_to_record(models[0].state_dict()))
    assert strategy.error is None and strategy.fedma_result.sizes == expected.result.sizes
    for msg in grid.sent[3:]:  # what the nodes got: their own entries, nothing frozen they do not hold
        sent = record_to_state(msg.content["arrays"])
        assert set(sent) == set(models[0].state_dict())
        assert set(json.loads(msg.content["config"]["frozen"])) <= set(sent)
    got = record_to_state(result.arrays)
    assert list(got) == list(expected.result.state_dict) == list(models[0].state_dict())
    for k, v in expected.result.state_dict.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6)
    last = result.train_metrics_clientapp[max(result.train_metrics_clientapp)]
    assert (last["bytes-up"], last["bytes-down"]) == (expected.bytes_up, expected.bytes_down)
    if cls == "StackedLSTM":  # its two layers, one group: a local round and one matching round per pass
        assert len(spec_from_module(models[0]).groups) == 2 and len(result.train_metrics_clientapp) == 4
    if cls in ("DenseBlockCNN", "ConcatMLP"):  # entries in pieces: the case under test
        assert spec_from_module(models[0]).pieces
    if cls not in ("StackedLSTM", "ConcatMLP"):
        assert spec_from_module(models[0]).folds  # the batch norms are folded: the case under test


@pytest.mark.parametrize("passes", [1, 2])
def test_fedma_strategy_folds_position_encodings_as_run_fedma_does(passes):
    """Position-aware clients computing one network's function with their units in other
    positions, retrained with a vanishing learning rate: the strategy given the traced spec (with
    its encodings) must match the plain units and send back position-aware networks, so that the
    global one computes the same function (as run_fedma does: tests/test_fusion.py)."""
    from bayesfuse.inference.encodings import fold_encodings, unfold_encodings
    from bayesfuse.inference.spec import permute, random_permutations
    from bayesfuse.nets.pans import PANConfig
    from bayesfuse.nets.spec import spec_from_module

    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 3, 0.5, seed=0)
    torch.manual_seed(0)
    model = MLP(64, [12, 10], 10, pan=PANConfig("mul", 1.0, 0.1))
    spec = spec_from_module(model)
    plain = fold_encodings(_np(model), spec)
    rng = np.random.default_rng(0)
    states = [unfold_encodings(permute(plain, spec, random_permutations(spec.sizes(plain), rng)), spec) for _ in part]
    models = [rebuild(model, tensor_state(sd)).eval() for sd in states]
    config = TrainConfig(hidden=(12, 10), epochs=1, lr=1e-12)
    hyper = {"prior_var": 1e8, "noise_var": 1.0, "passes": passes}

    x = torch.as_tensor(split.test.x[:100])
    for given, keeps in ((spec, True), (None, False)):  # without the encodings, the function is lost
        strategy = FedMA(spec=given, hyper=hyper, min_train_nodes=3, fraction_evaluate=0.0)
        grid = _Retraining(split, part, models, config, lambda j, net, frozen, p: j)
        result = strategy.start(grid=grid, initial_arrays=state_to_record(_np(model)))
        assert strategy.fedma_result.sizes == {"P1": 12, "P2": 10}
        fused = rebuild(model, tensor_state(record_to_state(result.arrays))).eval()
        with torch.no_grad():
            gap = (fused(x) - model(x)).abs().max().item()
        # float32 networks whose logits are ~0.1: round-off ~1e-8 (run_fedma's too); the encodings
        # (A = 0.1) left unfolded move them by ~3e-4
        assert (gap < 1e-6) == keeps, (given is not None, gap)
    # the refit round is sent the position-aware global network, which computes the function
    strategy = FedMA(spec=spec, hyper=hyper, second_round="refit", min_train_nodes=3, fraction_evaluate=0.0)
    grid = _Retraining(split, part, models, config, lambda j, net, frozen, p: j)
    strategy.start(grid=grid, initial_arrays=state_to_record(_np(model)))
    refit = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(refit) == 3 and strategy.second_round_report["replies"] == 3
    with torch.no_grad():
        sent = rebuild(model, tensor_state(record_to_state(refit[0].content["arrays"]))).eval()
        assert (sent(x) - model(x)).abs().max().item() < 1e-6


def test_fedma_drops_a_node_that_times_out_or_misbehaves(clients, caplog):
    split, part, _ = clients
    with caplog.at_level(logging.INFO):
        strategy = FedMA(min_train_nodes=4, fraction_evaluate=0.0)
        grid = FakeGrid(split, list(part) + [part[0]], ids=[1, 2, 3, 4], dead=[1], misshapen=[4])
        result = strategy.start(grid=grid, initial_arrays=_initial())
    assert strategy.failed == [(1, "no reply")] and sorted(strategy.dropped) == [1, 4]
    node, reason = strategy.rejected[0]
    assert node == 4 and re.search(
        r"node 4: 'layers.0.weight' has shape \(3, 64\), it was sent with \(\d+, 64\)", reason
    ), reason
    assert sorted(strategy.fedma_result.dropped) == sorted(strategy.nodes.index(n) for n in (1, 4))
    assert result.train_metrics_clientapp[2]["retrained-replies"] == 2
    assert result.train_metrics_clientapp[2]["dropped-nodes"] == 2
    assert "aggregate_train: Received 2 results and 1 failures" in caplog.messages
    assert _accuracy(split, record_to_state(result.arrays)) > 0.6


def test_fedma_skips_failed_and_odd_local_replies(clients):
    split, part, _ = clients
    grid = FakeGrid(split, list(part) + [part[0], part[1]], ids=[1, 2, 3, 4, 5], crash=[2], odd=[5])
    strategy = FedMA(min_train_nodes=5, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=_initial())
    assert strategy.failed == [(2, "client crashed")]
    assert strategy.rejected[0][0] == 5 and "has fixed dimensions (7, None)" in strategy.rejected[0][1]
    assert sorted(strategy.nodes) == [1, 3, 4]
    assert grid.types.count(FEDMA_ROUND) == 3
    assert result.train_metrics_clientapp[1]["failed-replies"] == 1
    assert result.train_metrics_clientapp[1]["rejected-replies"] == 1
    assert strategy.fedma_result is not None


def test_fedma_ends_cleanly_when_every_node_is_lost(clients, caplog):
    split, part, _ = clients
    strategy = FedMA(min_train_nodes=3, fraction_evaluate=0.0)
    with caplog.at_level(logging.INFO):
        result = strategy.start(
            grid=FakeGrid(split, part, hidden=(20, 16), dead=[0, 1, 2]), initial_arrays=_initial((20, 16))
        )
    assert isinstance(result, Result) and len(result.arrays) == 0
    assert strategy.fedma_result is None and "every node was lost in round 2" in str(strategy.error)
    assert any(m.startswith("FedMA stopped in round 2") for m in caplog.messages)
    assert "configure_train: no FedMA round to run (the run has ended)" in caplog.messages
    assert set(result.train_metrics_clientapp) == {1, 2}


def test_fedma_drops_a_node_between_passes(clients, caplog):
    """A node that never answers the restart round is dropped: the second pass matches the others."""
    split, part, _ = clients

    class Grid(FakeGrid):
        def _answer(self, msg):
            config = msg.content.config_records.get("config")
            if msg.metadata.dst_node_id == 2 and config is not None and config.get("fedma-pass") == 2:
                return None
            return super()._answer(msg)

    strategy = FedMA(hyper={"passes": 2}, min_train_nodes=3, fraction_evaluate=0.0)
    evaluated = []

    def evaluate_fn(server_round, arrays):
        evaluated.append(server_round)
        return MetricRecord({"accuracy": _accuracy(split, record_to_state(arrays))})

    with caplog.at_level(logging.INFO):
        result = strategy.start(
            grid=Grid(split, part, ids=[0, 1, 2]), initial_arrays=_initial(), evaluate_fn=evaluate_fn
        )
    assert strategy.dropped == [2] and strategy.failed == [(2, "no reply")] and sorted(strategy.nodes) == [0, 1]
    assert len(strategy.fedma_passes) == 2 and strategy.fedma_result is strategy.fedma_passes[1]
    assert result.train_metrics_clientapp[3]["retrained-replies"] == 2
    assert result.train_metrics_clientapp[3]["fedma-pass"] == 2
    assert "configure_train: 3 nodes train their networks cut out of the global one" in caplog.messages
    assert _accuracy(split, record_to_state(result.arrays)) > 0.6
    # the round that ends each pass has a global network: it is evaluated, and is the round's arrays
    assert evaluated == [0, 2, 4] and result.evaluate_metrics_serverapp[2]["accuracy"] > 0.6

    # a second run on the same strategy starts afresh; every node lost in the restart round ends it
    class Lost(FakeGrid):
        def _answer(self, msg):
            config = msg.content.config_records.get("config")
            if config is not None and config.get("fedma-pass") == 2:
                return None
            return super()._answer(msg)

    with caplog.at_level(logging.INFO):
        again = strategy.start(
            grid=Lost(split, part, ids=[0, 1, 2]), initial_arrays=_initial(), evaluate_fn=evaluate_fn
        )
    assert strategy.fedma_result is None and len(strategy.fedma_passes) == 1 and "round 3" in str(strategy.error)
    assert sorted(strategy.dropped) == [0, 1, 2] and len(strategy.failed) == 3
    assert again.train_metrics_clientapp[3]["fedma-pass"] == 2 and set(again.train_metrics_clientapp) == {1, 2, 3}
    assert "configure_train: no FedMA round to run (the run has ended)" in caplog.messages


def test_fedma_checks_its_settings(clients):
    assert FedMA(hyper={"passes": 3}).num_rounds(_initial((20, 16))) == 9
    with pytest.raises(ValueError, match="unknown hyper-parameters"):
        FedMA(hyper={"reg": 1.0})
    split, part, _ = clients
    with pytest.raises(ValueError, match=r"FedMA takes 3 rounds for this network .*got num_rounds=2"):
        FedMA().start(grid=FakeGrid(split, part), initial_arrays=_initial((20, 16)), num_rounds=2)
    assert FedMA().num_rounds(_initial((20, 16, 8))) == 4


def test_fedma_in_mock_rounds_without_start(clients):
    """configure_train / aggregate_train driven by hand, as Flower's tests drive strategies."""
    split, part, _ = clients
    grid = FakeGrid(split, part)
    strategy = FedMA(min_train_nodes=3)
    arrays = _initial()
    replies = grid.send_and_receive(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert strategy.aggregate_train(1, replies)[0] is None
    replies = grid.send_and_receive(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    final, metrics = strategy.aggregate_train(2, replies)
    assert metrics["fedma-rounds"] == 2 and _accuracy(split, record_to_state(final)) > 0.6


# --------------------------------------------------------------------------- the refit round (second_round="refit")


class RefitGrid(FakeGrid):
    """Node ``ids[p]`` holds client ``p`` of ``models``: a training message gets its network, the
    refit round's its output fit of the network it was sent (:func:`output_fit_reply`); ``spoil``
    maps a node to a function that spoils its refit reply's content."""

    def __init__(self, split, part, models, spoil=None, **kwargs):
        super().__init__(split, part, **kwargs)
        self.models, self.spoil = models, dict(spoil or {})

    def _answer(self, msg):
        if msg.metadata.message_type != "train":
            return super()._answer(msg)
        node = msg.metadata.dst_node_id
        p = self.ids.index(node)
        x, y = self.split.train.x[self.part[p]], self.split.train.y[self.part[p]]
        config = msg.content["config"]
        if config.get(ROUND_KEY) == OUTPUT_FIT:
            fused = rebuild(self.models[p], tensor_state(record_to_state(msg.content["arrays"])))
            content = output_fit_reply(fused, x, y, config)
            if node in self.spoil:
                self.spoil[node](content)
        else:
            metrics = MetricRecord({"num-examples": len(y), "class-counts": np.bincount(y, minlength=10).tolist()})
            content = RecordDict({"arrays": state_to_record(self.models[p].state_dict()), "metrics": metrics})
        return Message(content, reply_to=msg)


def _direct_fits(split, part, models, sent, prior):
    """Each client's output fit of the fused network ``sent``, computed here without Flower, and
    rounded to float32 as the reply carries it."""
    fits = [
        output_fit(
            rebuild(models[p], tensor_state(sent)),
            "layers.2",
            split.train.x[idx],
            split.train.y[idx],
            prior,
            n_clients=len(part),
        )
        for p, idx in enumerate(part)
    ]
    return [
        dataclasses.replace(
            f, **{k: getattr(f, k).astype(np.float32).astype(np.float64) for k in ("weight", "gram", "curvature")}
        )
        for f in fits
    ]


def _check_refitted(strategy, result, direct, prior, sent) -> dict:
    """The refitted output layer of ``result`` is the product of the fits ``direct`` (computed
    without Flower) at the precision the server chose by the evidence of the replies; the rest is
    the network ``sent``, the output layer not. Returns the refitted state."""
    direct = sorted(direct, key=_fit_digest)  # the server's order: the same sums in the same order
    lam = strategy.second_round_report["prior_precision"]
    assert lam == pytest.approx(evidence_precision(direct, prior), rel=1e-6)
    mean, covariance = fuse_output_fits(direct, prior, posterior_precision=lam)
    got = record_to_state(result.arrays)
    # the same float64 arithmetic on the same float32 replies; the record holds float32 weights
    np.testing.assert_allclose(got["layers.2.weight"], mean[:-1].T, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["layers.2.bias"], mean[-1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(class_blocks(strategy.output_covariance), covariance, rtol=1e-9, atol=1e-12)
    for k in sent:
        if not k.startswith("layers.2."):
            np.testing.assert_array_equal(got[k], sent[k])
    assert not np.allclose(got["layers.2.weight"], sent["layers.2.weight"], atol=1e-3)  # not the plain average
    return got


def test_refit_round_is_the_product_of_the_clients_output_fits(clients):
    split, part, models = clients
    grid = RefitGrid(split, part, models, ids=[7, 8, 9])
    strategy = MatchedAveraging("pfnm", second_round="refit", min_train_nodes=3, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=_initial((20, 16)), num_rounds=2)
    assert grid.types == ["train"] * 6
    assert all(ROUND_KEY not in m.content["config"] for m in grid.sent[:3])
    configs = [m.content["config"] for m in grid.sent[3:]]
    prior = prior_precision_from_weights(
        [m.layers[2].weight.detach().numpy() for m in models],
        fan_in=record_to_state(grid.sent[3].content["arrays"])["layers.2.weight"].shape[1],
    )
    for c in configs:
        assert (c[ROUND_KEY], c["output-layer"], c["n-clients"], c["server-round"]) == (OUTPUT_FIT, "layers.2", 3, 2)
        assert c["prior-precision"] == pytest.approx(prior, rel=1e-12)
    sent = record_to_state(grid.sent[3].content["arrays"])
    # without the option, the same fusion: the refit round is sent what a plain one-shot strategy returns
    plain = RefitGrid(split, part, models, ids=[7, 8, 9])
    one_shot = MatchedAveraging("pfnm", min_train_nodes=3, fraction_evaluate=0.0).start(
        grid=plain, initial_arrays=_initial((20, 16)), num_rounds=1
    )
    assert plain.types == ["train"] * 3
    for k, v in record_to_state(one_shot.arrays).items():
        np.testing.assert_array_equal(sent[k], v)
    # the refitted output layer is the product of the clients' fits computed directly (rounded to
    # float32 as the wire carries them) at the precision the server chose by the evidence of the replies
    direct = _direct_fits(split, part, models, sent, prior)
    got = _check_refitted(strategy, result, direct, prior, sent)
    lam = strategy.second_round_report["prior_precision"]
    # what the round did and cost, in the round's metrics and in the fusion's hyper
    g1 = sent["layers.2.weight"].shape[1] + 1
    metrics = result.train_metrics_clientapp[2]
    assert metrics["output-fit-replies"] == 3 and metrics["rejected-replies"] == 0 and metrics["failed-replies"] == 0
    # float32, the Gram as its upper triangle
    assert metrics["bytes-up"] == 4 * (g1 * 10 + g1 * (g1 + 1) // 2 + 10 * 10)
    assert metrics["num-examples"] == sum(len(idx) for idx in part)
    report = strategy.last_fusion.hyper["second_round"]
    assert report is strategy.second_round_report
    assert report["kind"] == "refit" and report["fit_prior_precision"] == pytest.approx(prior)
    assert report["prior_precision_from"] == "evidence" and report["prior_precision"] == lam
    assert report["bytes_up"] == metrics["bytes-up"] and report["bytes_down"] == 4 * sum(v.size for v in sent.values())
    np.testing.assert_array_equal(strategy.last_fusion.state["layers.2.weight"], got["layers.2.weight"])
    # the last-layer Laplace of the refitted network
    laplace = strategy.laplace(models[0])
    assert isinstance(laplace, LastLayerLaplace) and laplace.output == "layers.2"
    x = torch.as_tensor(split.test.x[:50])
    np.testing.assert_allclose(
        laplace.mean_logits(x).detach().numpy(),
        MLP.from_state_dict(tensor_state(got))(x).detach().numpy(),
        rtol=1e-5,
        atol=1e-5,
    )
    assert _accuracy(split, got) > 0.6
    # the nodes' own fits as heads, mixed by their class shares (bayesfuse.fuse(..., head="clients"))
    heads = strategy.client_heads(models[0])
    assert isinstance(heads, ClientHeads) and heads.n_heads == 3 and heads.output == "layers.2"
    order = sorted(range(3), key=lambda j: _fit_digest(direct[j]))  # the product's order of the fits
    for h, j in enumerate(order):
        np.testing.assert_allclose(heads.weight[h].numpy(), direct[j].weight[:-1].T, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(heads.bias[h].numpy(), direct[j].weight[-1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(heads.shares.numpy(), class_shares(np.asarray(part.counts)[order]))
    # each head its fit's Laplace posterior, under the prior share the nodes fitted with
    assert heads.predictive == "laplace" and np.allclose(heads.prior.numpy(), prior / 3)
    for h, j in enumerate(order):
        assert float(heads.n[h]) == direct[j].n
    assert strategy.client_heads(models[0], pool="log").pool == "log"


def _nan_gram(content):
    gram = content[OUTPUT_FIT_KEY]["gram"].numpy().copy()  # the upper triangle, row by row
    gram[0] = np.nan
    content[OUTPUT_FIT_KEY]["gram"] = Array(gram)


def _short_weight(content):
    content[OUTPUT_FIT_KEY]["weight"] = Array(content[OUTPUT_FIT_KEY]["weight"].numpy()[:-1].copy())


def test_refit_round_rejects_bad_output_fits_naming_the_node(clients, caplog):
    split, part, models = clients
    grid = RefitGrid(split, part, models, ids=[7, 8, 9], spoil={8: _nan_gram, 9: _short_weight})
    strategy = MatchedAveraging("pfnm", second_round="refit", min_train_nodes=3, fraction_evaluate=0.0)
    with caplog.at_level(logging.WARNING):
        result = strategy.start(grid=grid, initial_arrays=_initial((20, 16)), num_rounds=2)
    reasons = dict(strategy.rejected)
    assert sorted(reasons) == [8, 9]
    assert reasons[8] == "node 8: the output fit's gram has values that are not finite (NaN or inf)"
    assert re.fullmatch(
        r"node 9: the output fit's weight has shape \(\d+, 10\); the fused output layer needs "
        r"\(\d+, 10\)",
        reasons[9],
    ), reasons[9]
    assert "node 8: reply rejected" in caplog.text
    metrics = result.train_metrics_clientapp[2]
    assert metrics["output-fit-replies"] == 1 and metrics["rejected-replies"] == 2
    # the product of the one good fit
    sent = record_to_state(grid.sent[3].content["arrays"])
    prior = grid.sent[3].content["config"]["prior-precision"]
    # the fits were made for the 3 nodes sampled: the two refused nodes' shares of the prior are put back
    kept = _direct_fits(split, part, models, sent, prior)[:1]
    lam = strategy.second_round_report["prior_precision"]
    assert lam == pytest.approx(evidence_precision(kept, prior, n_clients=3), rel=1e-6)
    mean, _ = fuse_output_fits(kept, prior, posterior_precision=lam, n_clients=3)
    np.testing.assert_allclose(record_to_state(result.arrays)["layers.2.weight"], mean[:-1].T, rtol=1e-4, atol=1e-4)
    # every fit bad: the fused network stays, and there is no Laplace to give
    grid = RefitGrid(split, part, models, ids=[7, 8, 9], spoil={n: _nan_gram for n in (7, 8, 9)})
    strategy = MatchedAveraging("pfnm", second_round="refit", min_train_nodes=3, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=_initial((20, 16)), num_rounds=2)
    for k, v in record_to_state(grid.sent[3].content["arrays"]).items():
        np.testing.assert_array_equal(record_to_state(result.arrays)[k], v)
    assert strategy.output_covariance is None and result.train_metrics_clientapp[2]["rejected-replies"] == 3
    with pytest.raises(ValueError, match="no refit round has run"):
        strategy.laplace(models[0])
    with pytest.raises(ValueError, match="no refit round has run"):
        strategy.client_heads(models[0])


def test_output_fit_records_round_trip_and_refusals(clients):
    split, part, models = clients
    fit = output_fit(models[0], "layers.2", split.train.x[part[0]], split.train.y[part[0]], 2.0, n_clients=3)
    arrays, meta = output_fit_to_records(fit, prior_precision=2.0, n_clients=3)
    back = records_to_output_fit(arrays, meta, "node 4", shape=fit.weight.shape, prior_precision=2.0, n_clients=3)
    assert back.n == fit.n
    for name in ("weight", "gram", "curvature"):
        np.testing.assert_allclose(getattr(back, name), getattr(fit, name), rtol=1e-6, atol=1e-7)
    # the Gram travels as its upper triangle, row by row; the record's bytes are the fit's nbytes less the count
    g = fit.gram.shape[0]
    assert arrays["gram"].numpy().shape == (g * (g + 1) // 2,)
    assert sum(arrays[k].numpy().nbytes for k in arrays.keys()) == fit.nbytes - 8
    full = output_fit_to_records(fit, prior_precision=2.0, n_clients=3)[0]
    full["gram"] = Array(fit.gram.astype(np.float32))
    with pytest.raises(ValueError, match=r"^node 4: the output fit's gram has shape \(\d+, \d+\); .* upper triangle"):
        records_to_output_fit(full, meta, "node 4")
    with pytest.raises(ValueError, match="^node 4: the output fit's arrays came without its metadata"):
        records_to_output_fit(arrays, None, "node 4")
    with pytest.raises(ValueError, match="^node 4: the output fit was made with prior precision 2, the server sent 1$"):
        records_to_output_fit(arrays, meta, "node 4", prior_precision=1.0)
    with pytest.raises(ValueError, match="^node 4: the output fit was made for 3 clients, the server sent 2$"):
        records_to_output_fit(arrays, meta, "node 4", n_clients=2)
    old = ConfigRecord({**dict(meta), "version": 0})
    with pytest.raises(ValueError, match="^node 4: output fit version 0 is not one this bayesfuse reads"):
        records_to_output_fit(arrays, old, "node 4")
    indefinite = output_fit_to_records(fit, prior_precision=2.0, n_clients=3)[0]
    indefinite["curvature"] = Array(-np.eye(10, dtype=np.float32))
    with pytest.raises(
        ValueError, match="^node 4: the output fit's curvature is not symmetric positive semi-definite$"
    ):
        records_to_output_fit(indefinite, meta, "node 4")
    with pytest.raises(ValueError, match="not a refit round"):
        output_fit_reply(models[0], split.train.x[:5], split.train.y[:5], ConfigRecord({"lr": 0.1}))


def test_refit_settings_are_checked(clients):
    with pytest.raises(ValueError, match="unknown second_round='probit'"):
        MatchedAveraging("pfnm", second_round="probit")
    with pytest.raises(ValueError, match="second_round='refit' is for point-estimate networks"):
        MatchedAveraging("kl", second_round="refit")
    with pytest.raises(ValueError, match="second_round='temperature' is for point-estimate networks"):
        MatchedAveraging("kl", second_round="temperature")
    with pytest.raises(ValueError, match="output_prior_precision must be a positive number"):
        MatchedAveraging("pfnm", second_round="refit", output_prior_precision=0.0)
    split, part, models = clients
    with pytest.raises(ValueError, match="needs num_rounds >= 2"):
        MatchedAveraging("pfnm", second_round="refit").start(
            grid=RefitGrid(split, part, models), initial_arrays=_initial((20, 16)), num_rounds=1
        )
    assert MatchedAveraging("pfnm").second_round is None


def test_fedma_then_the_refit_round_is_the_product_of_the_nodes_fits_on_fedmas_network(clients):
    """FedMA(second_round="refit"): FedMA's rounds, then one that sends FedMA's network and
    multiplies the nodes' output fits on it, as MatchedAveraging's refit round does (the fits
    computed here directly, at the prior of the local round's output weights); the body stays
    FedMA's; evaluation follows FedMA's last round and the refit."""

    class Recording(RefitGrid):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.replies = []

        def _answer(self, msg):
            reply = super()._answer(msg)
            self.replies.append(reply)
            return reply

    split, part, models = clients
    grid = Recording(split, part, models, hidden=(20, 16), ids=[7, 8, 9])
    strategy = FedMA(second_round="refit", min_train_nodes=3, fraction_evaluate=1.0, min_evaluate_nodes=3)
    assert strategy.num_rounds(_initial((20, 16))) == 4
    evaluated = []

    def evaluate_fn(server_round, arrays):
        evaluated.append(server_round)
        return MetricRecord({"accuracy": _accuracy(split, record_to_state(arrays))})

    result = strategy.start(grid=grid, initial_arrays=_initial((20, 16)), evaluate_fn=evaluate_fn)
    assert grid.types == [FEDMA_LOCAL] * 3 + [FEDMA_ROUND] * 6 + ["train"] * 3 + ["evaluate"] * 3
    sent = record_to_state(grid.sent[9].content["arrays"])
    for k, v in strategy.fedma_result.state_dict.items():  # the refit round is sent FedMA's network
        np.testing.assert_allclose(sent[k], v, rtol=1e-6, atol=1e-6)
    local = [record_to_state(r.content["arrays"])["layers.2.weight"] for r in grid.replies[:3]]
    prior = prior_precision_from_weights(local, fan_in=sent["layers.2.weight"].shape[1])
    for m in grid.sent[9:12]:
        c = m.content["config"]
        assert (c[ROUND_KEY], c["output-layer"], c["n-clients"], c["server-round"]) == (OUTPUT_FIT, "layers.2", 3, 4)
        assert c["prior-precision"] == pytest.approx(prior, rel=1e-12)
    _check_refitted(strategy, result, _direct_fits(split, part, models, sent, prior), prior, sent)
    metrics = result.train_metrics_clientapp[4]
    assert metrics["output-fit-replies"] == 3 and metrics["rejected-replies"] == 0
    assert strategy.second_round_report["kind"] == "refit"
    assert evaluated == [0, 3, 4] and set(result.evaluate_metrics_clientapp) == {4}
    assert result.evaluate_metrics_serverapp[4]["accuracy"] > 0.6
    laplace = strategy.laplace(models[0])
    assert isinstance(laplace, LastLayerLaplace) and laplace.output == "layers.2"
    heads = strategy.client_heads(models[0], pool="log")
    assert isinstance(heads, ClientHeads) and heads.n_heads == 3 and heads.pool == "log"
    np.testing.assert_allclose(heads.shares.numpy().sum(0), 1.0, rtol=1e-6)
    # a second run starts afresh: nothing of the first's refit is left before its own refit round
    seen = []

    def before_refit(server_round, arrays):
        if server_round == 3:  # FedMA's last round, before the refit round
            seen.append((strategy.second_round_report, strategy.output_covariance))
        return None

    second = Recording(split, part, models, hidden=(20, 16), ids=[7, 8, 9])
    strategy.start(grid=second, initial_arrays=_initial((20, 16)), evaluate_fn=before_refit)
    assert seen == [(None, None)]
    assert [m.metadata.message_type for m in second.sent].count("train") == 3
    assert strategy.second_round_report["replies"] == 3


def test_fedma_refit_round_goes_to_the_nodes_left_and_keeps_the_runs_skips(clients):
    """A node that failed the local round or was dropped in FedMA's rounds gets no refit message;
    ``failed`` still names both after the refit round, whose metrics count its own skips only."""
    split, part, models = clients
    grid = RefitGrid(
        split,
        list(part) + [part[0]],
        [*models, models[0]],
        hidden=(20, 16),
        ids=[1, 2, 3, 4],
        crash=[4],
        dead=[1],
    )
    strategy = FedMA(second_round="refit", min_train_nodes=4, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=_initial((20, 16)))
    refit = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert sorted(m.metadata.dst_node_id for m in refit) == [2, 3]
    assert all(m.content["config"]["n-clients"] == 2 for m in refit)
    assert sorted(strategy.failed) == [(1, "no reply"), (4, "client crashed")] and strategy.dropped == [1]
    metrics = result.train_metrics_clientapp[4]
    assert metrics["output-fit-replies"] == 2 and metrics["failed-replies"] == 0 == metrics["rejected-replies"]
    assert strategy.client_heads(models[0]).n_heads == 2
    assert strategy.client_heads(models[0]).pseudo_count == 1.0
    smoothed = FedMA(second_round="refit", pseudo_count=0.5, min_train_nodes=4, fraction_evaluate=0.0)
    smoothed.start(grid=grid, initial_arrays=_initial((20, 16)))
    assert smoothed.client_heads(models[0]).pseudo_count == 0.5  # the refit's heads smoothed so
    with pytest.raises(ValueError, match="pseudo_count must be a finite number >= 0"):
        FedMA(pseudo_count=-1)


def test_fedma_refit_settings_are_checked(clients):
    split, part, models = clients
    with pytest.raises(ValueError, match="unknown second_round='temperature' for FedMA"):
        FedMA(second_round="temperature")
    with pytest.raises(ValueError, match="output_prior_precision must be a positive number"):
        FedMA(second_round="refit", output_prior_precision=-1.0)
    with pytest.raises(ValueError, match="one per hidden group .*, then the refit round\\); got num_rounds=3"):
        FedMA(second_round="refit").start(
            grid=RefitGrid(split, part, models, hidden=(20, 16)), initial_arrays=_initial((20, 16)), num_rounds=3
        )
    with pytest.raises(ValueError, match="no refit round has run: .* after FedMA's own rounds"):
        FedMA().client_heads(models[0])
    with pytest.raises(ValueError, match="no refit round has run"):
        FedMA(second_round="refit").laplace(models[0])


# --------------------------------------------------------------------------- the temperature round


class TemperatureGrid(RefitGrid):
    """:class:`RefitGrid` whose training replies carry each client's summary (when ``summaries``
    are given) and whose temperature round is answered with :func:`temperature_reply`."""

    def __init__(self, split, part, models, summaries=None, **kwargs):
        super().__init__(split, part, models, **kwargs)
        self.summaries = summaries

    def _answer(self, msg):
        config = msg.content["config"] if msg.metadata.message_type == "train" else {}
        if config.get(ROUND_KEY) != TEMPERATURE:
            reply = super()._answer(msg)
            if self.summaries is not None and msg.metadata.message_type == "train":
                summary = self.summaries[self.ids.index(msg.metadata.dst_node_id)]
                reply.content[SUMMARY_KEY], reply.content[SUMMARY_META_KEY] = summary_to_records(summary)
            return reply
        node = msg.metadata.dst_node_id
        p = self.ids.index(node)
        fused = rebuild(self.models[p], tensor_state(record_to_state(msg.content["arrays"])))
        x, y = self.split.train.x[self.part[p]], self.split.train.y[self.part[p]]
        content = temperature_reply(fused, x, y, config, msg.content.array_records)
        if node in self.spoil:
            self.spoil[node](content)
        return Message(content, reply_to=msg)


def _temperature_strategy(split, part, models, summaries=None, **grid_options):
    grid = TemperatureGrid(split, part, models, summaries, ids=[7, 8, 9], **grid_options)
    strategy = MatchedAveraging("pfnm", second_round="temperature", min_train_nodes=3, fraction_evaluate=0.0)
    return grid, strategy, strategy.start(grid=grid, initial_arrays=_initial((20, 16)), num_rounds=2)


def test_temperature_round_keeps_the_candidate_and_temperature_of_least_nll(clients, summaries):
    from bayesfuse.fusion import TEMPERATURES
    from bayesfuse.inference.client_heads import ekfac_eigenvalues, trace_ratios
    from bayesfuse.summaries import temperature_nll

    split, part, models = clients
    grid, strategy, result = _temperature_strategy(split, part, models, summaries)
    assert grid.types == ["train"] * 6
    sent = record_to_state(grid.sent[3].content["arrays"])
    for msg in grid.sent[3:]:
        config = msg.content["config"]
        assert config[ROUND_KEY] == TEMPERATURE and config["pool"] == "log" and config["heads-form"] == "kronecker"
        assert list(config["candidates"]) == [
            SHARED,
            SHARED_COUNTS,
            CLIENT_HEADS,
            TRACE_MATCHED,
            EKFAC_HEADS,
            DIAGONAL_HEADS,
        ]
        assert list(config["temperatures"]) == [float(t) for t in TEMPERATURES]
    # the candidates, made here without the round: the one-shot strategy's network and its heads
    # (the heads' posteriors as is and trace-matched to the summaries' GGN diagonals)
    one_shot = MatchedAveraging("pfnm", min_train_nodes=3, fraction_evaluate=0.0)
    plain = one_shot.start(
        grid=TemperatureGrid(split, part, models, summaries, ids=[7, 8, 9]),
        initial_arrays=_initial((20, 16)),
        num_rounds=1,
    )
    for k, v in record_to_state(plain.arrays).items():
        np.testing.assert_array_equal(sent[k], v)
    network = rebuild(models[0], tensor_state(sent)).eval()
    # the shared head as bayesfuse.fuse scores it: the output layer's Laplace, from the fusion's precisions
    precision = one_shot.last_fusion.precision
    shared = LastLayerLaplace(network, "layers.2", 1 / precision["layers.2.weight"], 1 / precision["layers.2.bias"])
    heads = one_shot.client_heads(models[0])
    by_bias = {tuple(np.round(m.layers[2].bias.detach().double().numpy(), 6)): j for j, m in enumerate(models)}
    ratios = trace_ratios(summaries, "layers.2.weight", "layers.2.bias")
    order = [by_bias[tuple(np.round(b, 6))] for b in heads.bias.numpy()]  # each head's client
    matched = heads.with_scale(ratios[order])
    # the EKFAC heads: the summaries' GGN eigenvalues placed at the heads' supports, made here from
    # the one-shot fusion's assignments (the heads' client order)
    fusion = one_shot.last_fusion
    placed = ekfac_eigenvalues(
        fusion.spec,
        [_np(models[j].state_dict()) for j in order],
        {g: layer.assignments for g, layer in zip(fusion.groups, fusion.layers)},
        heads.weight.shape[2],
        [summaries[j] for j in order],
    )
    measured = heads.with_eigenvalues(placed)
    # the diagonal heads: the one-shot strategy's heads from the summaries without their output
    # factors, which leaves each head the diagonal posterior of its GGN diagonal
    diagonal = MatchedAveraging("pfnm", min_train_nodes=3, fraction_evaluate=0.0)
    diagonal.start(
        grid=TemperatureGrid(
            split, part, models, [dataclasses.replace(s, output_factors=None) for s in summaries], ids=[7, 8, 9]
        ),
        initial_arrays=_initial((20, 16)),
        num_rounds=1,
    )
    diagonal_heads = diagonal.client_heads(models[0])
    assert diagonal_heads.form == "diagonal"
    # the fusion with the output layer pooled by class counts, made here from the clients' own
    # states and summaries; the message carries its output layer and whatever else differs
    counts_fusion = fuse_states(
        [_np(m.state_dict()) for m in models], "pfnm", summaries=summaries, output_pool="counts", seed=strategy.seed
    )
    entries = record_to_state(grid.sent[3].content[COUNTS_ARRAYS_KEY])
    assert {"layers.2.weight", "layers.2.bias"} <= set(entries)
    assert all(not np.array_equal(entries[k], sent[k]) for k in set(entries) - {"layers.2.weight", "layers.2.bias"})
    counts_precision = counts_fusion.precision
    by_counts = LastLayerLaplace(
        rebuild(models[0], tensor_state(counts_fusion.state)).float().eval(),
        "layers.2",
        1 / counts_precision["layers.2.weight"],
        1 / counts_precision["layers.2.bias"],
    ).eval()
    candidates = {
        SHARED: shared.eval(),
        SHARED_COUNTS: by_counts,
        CLIENT_HEADS: heads,
        TRACE_MATCHED: matched,
        EKFAC_HEADS: measured,
        DIAGONAL_HEADS: diagonal_heads,
    }
    direct = {
        name: sum(temperature_nll(m, split.train.x[idx], split.train.y[idx], TEMPERATURES) for idx in part)
        for name, m in candidates.items()
    }
    report = strategy.second_round_report
    assert report is strategy.last_fusion.hyper["second_round"] and report["kind"] == "temperature"
    # the nodes compute what is computed here, on the same arrays (float64 heads and variances,
    # float32 bodies), but for the counts-pooled body, made here in float64: its NLL agrees to the
    # float32 rounding of its weights (relative 6e-8 each, about 1e-8 seen in the sum)
    assert set(report["nll"]) == set(direct)
    for name, nll in direct.items():
        assert report["nll"][name] == pytest.approx(nll.min(), rel=1e-7 if name == SHARED_COUNTS else 1e-9)
    best = min(direct, key=lambda n: direct[n].min())
    temperature = float(TEMPERATURES[direct[best].argmin()])
    assert (report["candidate"], report["temperature"]) == (best, temperature)
    metrics = result.train_metrics_clientapp[2]
    assert metrics["temperature-replies"] == 3 and metrics["temperature"] == temperature
    assert metrics["bytes-up"] == report["bytes_up"] == 6 * 65 * 8
    posterior_bytes = sum(  # float64 heads and variances, beside the float32 network
        v.numpy().nbytes
        for key in (HEADS_KEY, SHARED_POSTERIOR_KEY, COUNTS_ARRAYS_KEY, COUNTS_POSTERIOR_KEY)
        for v in grid.sent[3].content[key].values()
    )
    assert report["bytes_down"] == 4 * sum(v.size for v in sent.values()) + posterior_bytes
    # the model kept: the winner at its temperature
    model = strategy.tempered(models[0])
    x = torch.as_tensor(split.test.x[:60])
    with torch.no_grad():
        expected = torch.log_softmax(candidates[best](x).double() / temperature, -1)
        np.testing.assert_allclose(torch.log_softmax(model(x).double(), -1).numpy(), expected.numpy(), atol=1e-5)
    assert isinstance(model, ClientHeads) == (best not in (SHARED, SHARED_COUNTS))
    # the same heads candidate as bayesfuse.fuse's temperature round: its NLL to float32 round-off
    # of the body the wire carries (the sum of ~1300 examples' log-probabilities)
    simulated = fuse(
        models, "pfnm", summaries=summaries, rounds=2, second_round="temperature", data=(split.train, part)
    )
    nll = simulated.hyper["second_round"]["nll"]
    assert nll["client heads"] == pytest.approx(report["nll"][CLIENT_HEADS], rel=1e-4)
    assert nll["client heads, trace-matched"] == pytest.approx(report["nll"][TRACE_MATCHED], rel=1e-4)
    assert nll["precision"] == pytest.approx(report["nll"][SHARED], rel=1e-4)
    assert nll["counts"] == pytest.approx(report["nll"][SHARED_COUNTS], rel=1e-4)
    assert nll["client heads, EKFAC"] == pytest.approx(report["nll"][EKFAC_HEADS], rel=1e-4)
    assert nll["client heads, diagonal"] == pytest.approx(report["nll"][DIAGONAL_HEADS], rel=1e-4)


def test_a_shared_laplace_kept_by_the_round_is_tempered_not_folded(clients, summaries, monkeypatch):
    import bayesfuse.inference.summary_fusion as summary_fusion

    split, part, models = clients
    # the nodes' replies decide; here they are made to prefer the shared head's Laplace at T = 2
    monkeypatch.setattr(summary_fusion, "best_candidate", lambda nll: (0, 40))
    grid, strategy, result = _temperature_strategy(split, part, models, summaries)
    assert strategy.second_round_report["candidate"] == SHARED and SHARED_POSTERIOR_KEY in grid.sent[3].content
    sent = record_to_state(grid.sent[3].content["arrays"])
    for k, v in record_to_state(result.arrays).items():  # a probit predictive cannot take T into its weights
        np.testing.assert_array_equal(v, sent[k])
    model = strategy.tempered(models[0])
    assert isinstance(model, LastLayerLaplace) and float(model.temperature) == 2.0
    assert strategy.last_fusion.hyper["predictive"].startswith("shared at temperature 2")


def test_the_counts_pooled_fusion_kept_by_the_round_becomes_the_result(clients, summaries, monkeypatch):
    import bayesfuse.inference.summary_fusion as summary_fusion

    split, part, models = clients
    # the replies are made to prefer the fusion pooled by class counts at T = 2
    monkeypatch.setattr(summary_fusion, "best_candidate", lambda nll: (1, 40))
    grid, strategy, result = _temperature_strategy(split, part, models, summaries)
    content = grid.sent[3].content
    assert strategy.second_round_report["candidate"] == SHARED_COUNTS
    # what the node scored, rebuilt from the message alone
    network = rebuild(models[0], tensor_state(record_to_state(content["arrays"]))).eval()
    scored = temperature_candidates(network, content["config"], content.array_records)[SHARED_COUNTS]
    # the round's network is the counts-pooled fusion's (as the wire carries it), and so is last_fusion
    got = record_to_state(result.arrays)
    assert strategy.last_fusion.hyper["summaries"]["output"] == "log pool, shares by counts"
    for k, v in strategy.last_fusion.state.items():
        np.testing.assert_array_equal(got[k], np.asarray(v, dtype=np.float32))
    for k, v in scored.network.state_dict().items():
        np.testing.assert_array_equal(got[k], v.numpy())
    model = strategy.tempered(models[0])
    assert isinstance(model, LastLayerLaplace) and float(model.temperature) == 2.0
    x = torch.as_tensor(split.test.x[:60])
    with torch.no_grad():
        expected = torch.log_softmax(scored(x).double() / 2.0, -1)
        np.testing.assert_allclose(torch.log_softmax(model(x).double(), -1).numpy(), expected.numpy(), atol=1e-6)


def test_a_counts_pooled_fusion_of_other_widths_is_scored_and_kept(clients, summaries, monkeypatch):
    # the output layer's pool can change how the last hidden layer is matched, and so its width
    # (seen on digits at Dirichlet(0.2)); here forced, the counts fusion matched at another noise
    import bayesfuse.inference.summary_fusion as summary_fusion
    import bayesfuse.integrations.flower.strategy as strategy_module

    fuse_states_as_is = strategy_module.fuse_states

    def other_widths(states, method, **options):
        if options.get("output_pool") == "counts":
            options = {**options, "noise_var": 0.5}
        return fuse_states_as_is(states, method, **options)

    monkeypatch.setattr(strategy_module, "fuse_states", other_widths)
    monkeypatch.setattr(summary_fusion, "best_candidate", lambda nll: (1, 40))
    split, part, models = clients
    grid, strategy, result = _temperature_strategy(split, part, models, summaries)
    shared_sizes = result.train_metrics_clientapp[1]["global-sizes"]
    counts_sizes = strategy.last_fusion.sizes
    assert strategy.second_round_report["candidate"] == SHARED_COUNTS and list(counts_sizes) != list(shared_sizes)
    assert result.train_metrics_clientapp[2]["global-sizes"] == [int(w) for w in counts_sizes]
    # the whole network crosses the wire where its widths differ, and Result.arrays is it
    entries = record_to_state(grid.sent[3].content[COUNTS_ARRAYS_KEY])
    assert set(entries) == set(strategy.last_fusion.state)
    model = strategy.tempered(models[0])
    assert isinstance(model, LastLayerLaplace) and float(model.temperature) == 2.0
    assert tuple(model.network.layers[0].weight.shape)[0] == counts_sizes[0]
    for k, v in model.network.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), record_to_state(result.arrays)[k])
    with torch.no_grad():  # it runs
        assert torch.isfinite(model(torch.as_tensor(split.test.x[:5]))).all()


def test_the_strategies_pseudo_count_smooths_every_heads_they_give_and_send(clients, summaries, monkeypatch):
    """``pseudo_count`` reaches the heads of client_heads(), tempered() and the temperature round's
    candidates as the nodes build them from the message; refused where it means nothing."""
    from bayesfuse.inference import summary_fusion
    from bayesfuse.integrations.flower.records import heads_to_record, record_to_heads

    split, part, models = clients
    monkeypatch.setattr(summary_fusion, "best_candidate", lambda nll: (2, 40))  # the clients' heads as sent
    grid = TemperatureGrid(split, part, models, summaries, ids=[7, 8, 9])
    strategy = MatchedAveraging(
        "pfnm", second_round="temperature", pseudo_count=0.25, min_train_nodes=3, fraction_evaluate=0.0
    )
    strategy.start(grid=grid, initial_arrays=_initial((20, 16)), num_rounds=2)
    content = grid.sent[3].content
    np.testing.assert_array_equal(content.array_records[HEADS_KEY]["pseudo-count"].numpy(), [0.25])
    network = rebuild(models[0], tensor_state(record_to_state(content["arrays"]))).eval()
    built = temperature_candidates(network, content["config"], content.array_records)
    heads = [m for m in built.values() if isinstance(m, ClientHeads)]
    assert len(heads) == 4 and all(m.pseudo_count == 0.25 for m in heads)  # as sent, trace-matched, EKFAC, diagonal
    assert strategy.client_heads(models[0]).pseudo_count == 0.25
    kept = strategy.tempered(models[0])
    assert isinstance(kept, ClientHeads) and kept.pseudo_count == 0.25
    x = torch.as_tensor(split.test.x[:20])
    with torch.no_grad():
        smoothed = kept(x)
        kept.pseudo_count = 1.0
        assert not torch.allclose(smoothed, kept(x))  # the smoothing shows in what it predicts
    # without it: no array in the record, the heads' own default
    plain_grid, plain, _ = _temperature_strategy(split, part, models, summaries)
    assert "pseudo-count" not in plain_grid.sent[3].content.array_records[HEADS_KEY]
    assert plain.client_heads(models[0]).pseudo_count == 1.0
    # the record round trip; a record whose pseudo-count is not one real number >= 0 is refused,
    # naming the node; the strategies refuse bad values, set or given
    record = content.array_records[HEADS_KEY]
    parsed = record_to_heads(record, "layers.2", "kronecker", "node 7")[0]
    assert parsed["pseudo_count"] == 0.25
    assert "pseudo-count" not in heads_to_record({k: v for k, v in parsed.items() if k != "pseudo_count"})
    for bad, message in (
        (np.array([-1.0]), "pseudo_count must be a finite number >= 0, got -1.0"),
        (np.array([np.nan]), "pseudo_count must be a finite number >= 0"),
        (np.array([0.5, 0.5]), r"must be one real number, shape \(1,\); got float64 of shape \(2,\)"),
        (np.array([True]), r"must be one real number, shape \(1,\); got bool"),
    ):
        record["pseudo-count"] = Array(bad)
        with pytest.raises(ValueError, match=rf"^node 7: .*{message}"):
            record_to_heads(record, "layers.2", "kronecker", "node 7")
    blind = heads_to_record({**{k: v for k, v in parsed.items() if k != "examples"}, "pseudo_count": 0.5})
    with pytest.raises(
        ValueError, match=r"^node 7: pseudo_count .* these heads know none \(the record has no examples"
    ):
        record_to_heads(blind, "layers.2", "kronecker", "node 7")
    with pytest.raises(ValueError, match="pseudo_count must be a finite number >= 0"):
        MatchedAveraging("pfnm", pseudo_count=-1)
    with pytest.raises(ValueError, match="pseudo_count must be a finite number >= 0"):
        strategy.pseudo_count = float("nan")
    with pytest.raises(ValueError, match="pseudo_count smooths the clients' own heads of point-estimate networks"):
        MatchedAveraging("kl", pseudo_count=1.0)
    with pytest.raises(ValueError, match="pseudo_count smooths the clients' own heads, which ot keeps none of"):
        MatchedAveraging("ot", pseudo_count=1.0)
    MatchedAveraging("ot", pseudo_count=1.0, second_round="refit")  # the refit's heads


def test_temperature_candidates_refuse_candidates_the_message_cannot_build(clients, summaries):
    split, part, models = clients
    grid, _, _ = _temperature_strategy(split, part, models, summaries)
    content = grid.sent[3].content
    network = rebuild(models[0], tensor_state(record_to_state(content["arrays"]))).eval()
    config = {**dict(content["config"]), "candidates": [SHARED_COUNTS]}
    records = dict(content.array_records)
    without = {k: v for k, v in records.items() if k != COUNTS_POSTERIOR_KEY}
    with pytest.raises(ValueError, match="scores 'shared, by counts', and the message has no"):
        temperature_candidates(network, config, without)
    stray = {**records, COUNTS_ARRAYS_KEY: state_to_record({"layers.9.weight": np.zeros(3)})}
    with pytest.raises(ValueError, match="entries the fused network does not: \\['layers.9.weight'\\]"):
        temperature_candidates(network, config, stray)
    # the EKFAC heads without their eigenvalues in the heads record
    heads = content[HEADS_KEY]
    no_eigenvalues = ArrayRecord(array_dict={k: heads[k] for k in heads.keys() if k != "ekfac-eigenvalues"})
    with pytest.raises(ValueError, match="the EKFAC heads need Kronecker-factored heads and their ekfac-eigenvalues"):
        temperature_candidates(
            network, {**dict(content["config"]), "candidates": [EKFAC_HEADS]}, {**records, HEADS_KEY: no_eigenvalues}
        )
    # the diagonal heads without their precisions
    no_diagonal = ArrayRecord(array_dict={k: heads[k] for k in heads.keys() if k != "diagonal-precision"})
    with pytest.raises(ValueError, match="the diagonal heads need their diagonal-precision"):
        temperature_candidates(
            network, {**dict(content["config"]), "candidates": [DIAGONAL_HEADS]}, {**records, HEADS_KEY: no_diagonal}
        )


def test_temperature_round_state_does_not_outlive_its_run(clients, summaries, caplog):
    """A second start whose fusion round gets no valid reply has no fusion to score: it warns and
    ends with the fused network unchanged, and nothing of the first run is sent or kept."""

    class Crashing(TemperatureGrid):
        def _answer(self, msg):
            if msg.metadata.message_type == "train" and ROUND_KEY not in msg.content["config"]:
                return Message(Error(code=1, reason="client crashed"), reply_to=msg)
            return super()._answer(msg)

    split, part, models = clients
    grid, strategy, _ = _temperature_strategy(split, part, models, summaries)
    assert strategy.second_round_report is not None
    crashing = Crashing(split, part, models, summaries, ids=[7, 8, 9])
    with caplog.at_level(logging.WARNING):
        result = strategy.start(grid=crashing, initial_arrays=_initial((20, 16)), num_rounds=2)
    assert "no fusion round had valid replies; no temperature round" in caplog.text
    assert crashing.types == ["train"] * 3  # round 2 sends nothing
    assert strategy.last_fusion is None and strategy.second_round_report is None
    for k, v in record_to_state(result.arrays).items():
        np.testing.assert_array_equal(v, record_to_state(_initial((20, 16)))[k])
    with pytest.raises(ValueError, match="no temperature round has chosen a model"):
        strategy.tempered(models[0])


def _complex_nll(content):
    content[TEMPERATURE_NLL_KEY]["nll"] = Array(content[TEMPERATURE_NLL_KEY]["nll"].numpy().astype(np.complex128))


def _nan_nll(content):
    nll = content[TEMPERATURE_NLL_KEY]["nll"].numpy().copy()
    nll[0, 0] = np.nan
    content[TEMPERATURE_NLL_KEY]["nll"] = Array(nll)


def _three_temperatures(content):
    content[TEMPERATURE_NLL_KEY]["nll"] = Array(content[TEMPERATURE_NLL_KEY]["nll"].numpy()[:, :3].copy())


def _float32_nll(content):
    content[TEMPERATURE_NLL_KEY]["nll"] = Array(content[TEMPERATURE_NLL_KEY]["nll"].numpy().astype(np.float32))


def test_temperature_round_counts_the_bytes_that_arrived(clients):
    # float32 sums from every node: 4 bytes a number up, where float64 replies count 8
    split, part, models = clients
    grid, strategy, result = _temperature_strategy(split, part, models, spoil={n: _float32_nll for n in (7, 8, 9)})
    assert strategy.rejected == [] and result.train_metrics_clientapp[2]["temperature-replies"] == 3
    assert strategy.second_round_report["bytes_up"] == result.train_metrics_clientapp[2]["bytes-up"] == 65 * 4


def test_temperature_round_without_summaries_tempers_the_shared_head_and_rejects_bad_replies(clients, caplog):
    from bayesfuse.fusion import TEMPERATURES
    from bayesfuse.summaries import temperature_nll

    split, part, models = clients
    with caplog.at_level(logging.WARNING):
        grid, strategy, result = _temperature_strategy(split, part, models, spoil={8: _nan_nll, 9: _complex_nll})
    config = grid.sent[3].content["config"]
    assert list(config["candidates"]) == [SHARED] and HEADS_KEY not in grid.sent[3].content
    reasons = dict(strategy.rejected)
    assert list(reasons) == [8, 9] and "node 8: its reply to the temperature round needs" in reasons[8]
    assert "bad values" in reasons[8] and "bad values" in reasons[9] and "node 8: reply rejected" in caplog.text
    # node 7 alone chooses the temperature; it is folded into the output layer
    sent = record_to_state(grid.sent[3].content["arrays"])
    network = rebuild(models[0], tensor_state(sent)).eval()
    kept = [part[0]]
    nll = sum(temperature_nll(network, split.train.x[idx], split.train.y[idx], TEMPERATURES) for idx in kept)
    temperature = float(TEMPERATURES[nll.argmin()])
    assert strategy.second_round_report["temperature"] == temperature and temperature != 1.0
    got = record_to_state(result.arrays)
    np.testing.assert_allclose(got["layers.2.weight"], sent["layers.2.weight"] / temperature, rtol=1e-6)
    np.testing.assert_allclose(got["layers.2.bias"], sent["layers.2.bias"] / temperature, rtol=1e-6)
    np.testing.assert_array_equal(got["layers.0.weight"], sent["layers.0.weight"])
    model = strategy.tempered(models[0])
    assert not isinstance(model, ClientHeads)
    np.testing.assert_array_equal(model.layers[2].weight.detach().numpy(), got["layers.2.weight"])
    # every reply bad: the fused network stays, and there is no tempered model
    grid, strategy, result = _temperature_strategy(
        split, part, models, spoil={n: _three_temperatures for n in (7, 8, 9)}
    )
    assert (
        result.train_metrics_clientapp[2]["rejected-replies"] == 3 and "got shape (1, 3)" in dict(strategy.rejected)[7]
    )
    for k, v in record_to_state(grid.sent[3].content["arrays"]).items():
        np.testing.assert_array_equal(record_to_state(result.arrays)[k], v)
    with pytest.raises(ValueError, match="no temperature round has chosen a model"):
        strategy.tempered(models[0])


def test_temperature_reply_refuses_what_it_cannot_score(clients):
    split, part, models = clients
    x, y = split.train.x[:5], split.train.y[:5]
    with pytest.raises(ValueError, match="not a temperature round"):
        temperature_reply(models[0], x, y, ConfigRecord({"lr": 0.1}))
    with pytest.raises(ValueError, match="needs candidates, temperatures"):
        temperature_reply(models[0], x, y, ConfigRecord({ROUND_KEY: TEMPERATURE}))
    config = {ROUND_KEY: TEMPERATURE, "temperatures": [1.0, 2.0]}
    with pytest.raises(ValueError, match="unknown ones: \\['probit'\\]"):
        temperature_reply(models[0], x, y, ConfigRecord({**config, "candidates": ["probit"]}))
    with pytest.raises(ValueError, match="needs output-layer"):
        temperature_reply(models[0], x, y, ConfigRecord({**config, "candidates": [SHARED, CLIENT_HEADS]}))
    config["output-layer"] = "layers.2"
    with pytest.raises(ValueError, match="the message has no 'client-heads'"):
        temperature_reply(models[0], x, y, ConfigRecord({**config, "candidates": [SHARED, CLIENT_HEADS]}), {})
    reply = temperature_reply(models[0], x, y, ConfigRecord({**config, "candidates": [SHARED]}))
    assert reply[TEMPERATURE_NLL_KEY]["nll"].numpy().shape == (1, 2)


# --------------------------------------------------------------------------- no private Flower modules


def _flwr_imports(path: Path) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flwr":
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "flwr"]
    return found


def test_no_private_flower_imports():
    package = sorted(Path(integration.__file__).parent.glob("*.py"))  # the bayesfuse.integrations.flower package
    files = [*package, *sorted(EXAMPLE.rglob("*.py"))]
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert "strategy_utils" not in text, path
        for module, name in _flwr_imports(path):
            parts = module.split(".") + ([name] if name else [])
            assert not any(p.startswith("_") for p in parts), (path, module, name)
            assert module in (
                "flwr.app",
                "flwr.common",
                "flwr.clientapp",
                "flwr.serverapp",
                "flwr.serverapp.strategy",
                "flwr.simulation",
            ), (path, module)
    assert all(_flwr_imports(path) for path in package)  # the check sees the imports at all


# --------------------------------------------------------------------------- the example app


@pytest.fixture
def example(monkeypatch):
    """The example app (not installed), importable here and in Ray's worker processes."""
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs here; silences Ray's notice
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])))
    from bayesfuse_flower import client_app, server_app

    return client_app, server_app


def test_example_method_is_checked_in_one_line(example, caplog):
    _, server = example
    assert all(server.method_error(m) is None for m in ("pfnm", "nafi", "fedma"))
    for bad in ("fedprox", "", None, 3):
        error = server.method_error(bad)
        assert error.startswith(f"unknown method {bad!r} in the run config: choose one of pfnm, nafi, fedma")
        assert "\n" not in error

    class NoGrid:
        def __getattr__(self, name):
            raise AssertionError("a bad method must end the run before any message is sent")

    with caplog.at_level(logging.INFO):
        server.main(NoGrid(), {"method": "fedprox"})
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [server.method_error("fedprox")]
    assert server.RESULTS == {}
    caplog.clear()
    with caplog.at_level(logging.INFO):
        server.main(NoGrid(), {"method": "pfnm", "second-round": "probit"})
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(
        "unknown second-round 'probit' in the run config: choose one of none, refit, temperature"
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        server.main(NoGrid(), {"method": "fedma", "second-round": "temperature"})
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["second-round 'temperature' is for pfnm and nafi; fedma takes 'none' or 'refit'"]


def test_example_nodes_keep_examples_back_for_the_temperature_round(example):
    """With second-round "temperature" a node trains on all but ``holdout`` of its examples and
    scores the round's candidates on the rest; other rounds train on all of them."""
    from types import SimpleNamespace

    client, _ = example
    context = SimpleNamespace(node_config={"partition-id": 1, "num-partitions": 3})
    base = {"seed": 0, "holdout": 0.1}
    trained = client._node_data(context, {**base, "second-round": "temperature"})[1]
    held = client._node_data(context, {**base, "second-round": "temperature"}, held=True)[1]
    whole = client._node_data(context, {**base, "second-round": "refit"})[1]
    assert len(held[1]) == round(0.1 * len(whole[1])) and len(trained[1]) + len(held[1]) == len(whole[1])
    rows = lambda x: {r.tobytes() for r in np.asarray(x)}  # noqa: E731
    assert rows(trained[0]) | rows(held[0]) == rows(whole[0]) and not rows(trained[0]) & rows(held[0])


def test_example_fedavg_baseline_sums_class_counts(example):
    _, server = example
    records = [
        RecordDict({"metrics": MetricRecord({"num-examples": n, "class-counts": c})})
        for n, c in [(3, [1, 2, 0]), (1, [0, 0, 1])]
    ]
    out = server.fedavg_baseline(2).train_metrics_aggr_fn(records, "num-examples")
    assert out["class-counts"] == [1, 2, 1] and out["num-examples"] == 4


SIMULATE = """
import sys
from flwr.simulation import run_simulation
from bayesfuse_flower.client_app import make_client_app
from bayesfuse_flower.server_app import make_server_app
settings = {settings!r}
run_simulation(server_app=make_server_app(settings), client_app=make_client_app(settings), num_supernodes=2,
               backend_config={{"client_resources": {{"num_cpus": 1, "num_gpus": 0.0}}}})
"""


@pytest.mark.slow
def test_simulation_with_a_bad_method_ends_with_one_line(example, tmp_path):
    pytest.importorskip("ray")
    code = textwrap.dedent(SIMULATE.format(settings={"method": "fedprox", "num-nodes": 2}))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLWR_HOME": str(tmp_path)},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "unknown method 'fedprox' in the run config: choose one of pfnm, nafi, fedma" in out
    assert "Traceback" not in out and "exception" not in out.lower(), out


@pytest.mark.slow
def test_simulation_three_nodes_pfnm_rounds_beat_fedavg(example):
    """End to end on Flower's simulation engine (Ray backend): 3 nodes, Dirichlet-split digits, 2 rounds."""
    import time

    pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    client_app, server_app = example
    # round 1 fuses the nodes' own networks, round 2 retrains and fuses again, round 3 refits the output layer
    settings = {
        "method": "pfnm",
        "num-nodes": 3,
        "local-epochs": 5,
        "round-epochs": 2,
        "num-rounds": 3,
        "second-round": "refit",
        "timeout": 300,
    }
    start = time.perf_counter()
    run_simulation(
        server_app=server_app.make_server_app(settings),
        client_app=client_app.make_client_app(settings),
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    results = server_app.RESULTS
    assert results["pfnm"].get("output-fit-replies") == 3, results  # the last round's metrics: the refit
    assert time.perf_counter() - start < 240
    assert sorted(results["pfnm"]["accuracy-by-round"]) == [0, 1, 2, 3]
    assert results["pfnm"]["accuracy-by-round"][2] > results["pfnm"]["accuracy-by-round"][0] + 0.5
    assert results["pfnm"]["accuracy"] > results["fedavg"]["accuracy"], results
    assert results["pfnm"]["laplace"]["accuracy"] > results["fedavg"]["accuracy"], results
    assert sum(results["fedavg"]["class-counts"]) == results["fedavg"]["num-examples"]  # summed, not averaged


@pytest.mark.slow
def test_simulation_three_nodes_fedma(example):
    pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    client_app, server_app = example
    settings = {
        "method": "fedma",
        "num-nodes": 3,
        "hidden": "32",
        "local-epochs": 3,
        "round-epochs": 2,
        "second-round": "refit",
        "fedma-passes": 2,
        "compare-fedavg": False,
        "timeout": 300,
    }
    run_simulation(
        server_app=server_app.make_server_app(settings),
        client_app=client_app.make_client_app(settings),
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    results = server_app.RESULTS["fedma"]
    assert results.get("output-fit-replies") == 3 and results["failed"] == [], results  # the refit round's metrics
    # two passes of a local (restart) round and one hidden layer's round; evaluated before round 1,
    # after each pass and after the refit round
    assert results["fedma-passes"] == 2 and results["fedma-rounds"] == 4, results
    assert sorted(results["accuracy-by-round"]) == [0, 2, 4, 5] and results["accuracy"] > 0.8, results
    assert results["laplace"]["accuracy"] > 0.8, results
