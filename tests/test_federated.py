"""FedMA and multi-round FedAvg on small digits federations."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from bayesfuse import federated, fuse
from bayesfuse.data import dirichlet_partition
from bayesfuse.data.datasets import load_digits
from bayesfuse.federated import fedma_rounds, run_fedavg, run_fedma
from bayesfuse.metrics import accuracy
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.predict import predict_proba
from bayesfuse.nets.spec import spec_from_module
from bayesfuse.train import TrainConfig, train_clients, train_model


@pytest.fixture(scope="module")
def digits():
    split = load_digits(seed=0).standardize()
    part = dirichlet_partition(split.train.y, 4, 0.5, seed=0)
    return split, part


CONFIGS = {
    "mlp": TrainConfig(arch="mlp", hidden=(24, 24), epochs=5),
    "cnn": TrainConfig(arch="cnn", channels=(6, 8), hidden=(24,), epochs=5),
    "lstm": TrainConfig(arch="lstm", hidden=(24,), epochs=5),
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fedma_builds_a_working_model_whose_widths_are_the_matching(digits, arch):
    split, part = digits
    cfg = CONFIGS[arch]
    models = train_clients(split.train, part, cfg, shared_init=False, verbose=False)
    run = run_fedma(models, split.train, part, replace(cfg, epochs=3), verbose=False)
    spec = run.spec
    state = {k: v.numpy() for k, v in run.model.state_dict().items()}
    assert spec.sizes(state) == run.result.sizes
    for g, layer in run.result.layers.items():
        assert layer.n_global == run.result.sizes[g]
        assert max(max(a) for a in layer.assignments) == layer.n_global - 1
        for a, m in zip(layer.assignments, models):
            assert len(np.unique(a)) == len(a)
    assert run.result.rounds == len(spec.groups) + 1
    assert run.result.bytes_up > 0 and run.result.bytes_down > 0
    acc = accuracy(predict_proba(run.model, split.test.x), split.test.y)
    local = np.mean([accuracy(predict_proba(m, split.test.x), split.test.y) for m in models])
    # each client sees about half the classes (alpha = 0.5), so locals sit near 0.5-0.6;
    # the federated model must do clearly better than the average client
    assert acc > local + 0.1, (acc, local)


@pytest.mark.catalogue
def test_fedma_freezes_matched_layers(digits, monkeypatch):
    """FedMA Algorithm 1: after a layer is matched the clients retrain only the layers above it.

    Watch every round at the server's side of the protocol: what each client is sent (the
    global layers so far, its own layers above) and what its retraining sends back.
    """
    split, part = digits
    cfg = CONFIGS["mlp"]
    models = train_clients(split.train, part, cfg, shared_init=False, verbose=False)
    rounds = []
    server = federated.fedma  # run_fedma's server loop; wrap the client_update it is given

    def watched_server(states, spec, client_update, **kwargs):
        def watched(jobs, frozen):
            sent = [(j, {k: np.array(v, copy=True) for k, v in state.items()}) for j, state in jobs]
            back = client_update(jobs, frozen)
            rounds.append((set(frozen), sent, back))
            return back

        return server(states, spec, watched, **kwargs)

    monkeypatch.setattr(federated, "fedma", watched_server)
    run = run_fedma(models, split.train, part, replace(cfg, epochs=2), verbose=False)
    final = run.model.state_dict()
    groups = run.spec.groups
    assert len(rounds) == len(groups) == 2
    floating = [k for k, v in final.items() if v.is_floating_point()]
    for r, (frozen, sent, back) in enumerate(rounds):
        # round r freezes the layers of groups 0..r: for this MLP, layers.0 .. layers.r
        assert frozen == {f"layers.{i}.{p}" for i in range(r + 1) for p in ("weight", "bias")}
        assert [j for j, _ in sent] == list(range(len(models))) and len(back) == len(models)
        assert sent[0][1][f"layers.{r}.weight"].shape[0] == run.result.sizes[groups[r]]  # the global width
        for (j, got), new in zip(sent, back):
            for k in floating:
                before, after = np.asarray(got[k]), np.asarray(new[k])
                assert after.shape == before.shape, (r, j, k)
                if k in frozen:
                    # every client gets the same global layer, and its retraining leaves it bit for
                    # bit as it came (in the client's float32)
                    np.testing.assert_array_equal(before, sent[0][1][k])
                    np.testing.assert_array_equal(
                        after, before.astype(after.dtype), err_msg=f"round {r}, client {j}, {k}"
                    )
                else:  # two epochs of SGD move every entry that is not frozen
                    assert not np.array_equal(after, before.astype(after.dtype)), (r, j, k)
        # the global layers the clients kept fixed are those of the final model
        for k in frozen:
            np.testing.assert_array_equal(final[k].numpy(), sent[0][1][k].astype(np.float32))


def test_fuse_fedma_and_fedavg_methods(digits):
    split, part = digits
    cfg = CONFIGS["mlp"]
    models = train_clients(split.train, part, cfg, shared_init=True, verbose=False)
    res = fuse(models, "fedma", data=(split.train, part), retrain=replace(cfg, epochs=1))
    assert res.method == "fedma" and res.hyper["rounds"] == 3 and len(res.sizes) == 2
    avg = fuse(models, "fedavg")
    assert avg.sizes == [24, 24]
    with pytest.raises(ValueError, match="data is used by method='fedma' only"):
        fuse(models, "pfnm", data=(split.train, part))


def test_fedma_then_the_refit_round_keeps_fedmas_body_and_refits_its_output_layer(digits):
    """rounds=2 after FedMA: the body is FedMA's, bit for bit (FedMA is seeded); the output layer is
    the product of the clients' Laplace fits on that body's features of their own data (written out
    here from output_fit and output_posterior on the plain FedMA network), as the one-shot
    methods' refit round does; one round more is counted."""
    from bayesfuse.client_order import canonical_order
    from bayesfuse.inference.output_fusion import output_posterior, prior_precision_from_weights
    from bayesfuse.nets.heads import ClientHeads, class_shares
    from bayesfuse.nets.laplace import LastLayerLaplace
    from bayesfuse.summaries import output_fit

    split, part = digits
    cfg = CONFIGS["mlp"]
    models = train_clients(split.train, part, cfg, verbose=False)
    kwargs = dict(data=(split.train, part), retrain=replace(cfg, epochs=1), seed=0)
    one = fuse(models, "fedma", **kwargs)
    two = fuse(models, "fedma", rounds=2, **kwargs)
    assert isinstance(two.model, LastLayerLaplace) and two.hyper["rounds"] == one.hyper["rounds"] + 1
    assert two.hyper["second_round"]["kind"] == "refit" and two.hyper["bytes_up"] > one.hyper["bytes_up"]
    output = "layers.2"
    body, refitted = one.model.state_dict(), two.model.network.state_dict()
    for k, v in body.items():
        if not k.startswith(output):
            torch.testing.assert_close(refitted[k], v, rtol=0, atol=0)
    prior = prior_precision_from_weights(
        [m.get_submodule(output).weight.detach().numpy() for m in models], fan_in=body[output + ".weight"].shape[1]
    )
    fits = [output_fit(one.model, output, split.train.x[i], split.train.y[i], prior, n_clients=len(part)) for i in part]
    mean, _, _ = output_posterior(fits, prior, by_evidence=True)
    np.testing.assert_allclose(refitted[output + ".weight"].numpy(), mean[:-1].T, rtol=1e-5, atol=1e-6)
    assert not np.allclose(body[output + ".weight"].numpy(), mean[:-1].T, atol=1e-3)  # not FedMA's average
    with pytest.raises(ValueError, match="rounds=2 adds one more, the refit round"):
        fuse(models, "fedma", rounds=2, second_round="temperature", **kwargs)
    # the fits themselves as heads: the same body and fits, one head per client (canonical order)
    heads = fuse(models, "fedma", rounds=2, head="clients", pool="log", **kwargs)
    assert isinstance(heads.model, ClientHeads) and heads.model.n_heads == len(part) and heads.model.pool == "log"
    for k, v in body.items():
        if not k.startswith(output):
            torch.testing.assert_close(heads.model.network.state_dict()[k], v, rtol=0, atol=0)
    order = canonical_order(models)  # the heads' order: the canonical order of the clients
    for h, j in enumerate(order):
        np.testing.assert_allclose(heads.model.bias[h].numpy(), fits[j].weight[-1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(heads.model.weight[h].numpy(), fits[j].weight[:-1].T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(heads.model.shares.numpy(), class_shares(np.asarray(part.counts)[order]), rtol=1e-6)
    with pytest.raises(ValueError, match="fedma without it has one head"):
        fuse(models, "fedma", head="clients", **kwargs)
    with pytest.raises(ValueError, match="pool='log': the clients' heads are pooled"):
        fuse(models, "fedma", rounds=2, pool="log", **kwargs)  # refused before any training
    # a prior precision given is the one the clients fit with
    given = fuse(models, "fedma", rounds=2, output_prior_precision=3.0, **kwargs)
    assert given.hyper["second_round"]["fit_prior_precision"] == 3.0
    assert given.hyper["second_round"]["prior_precision"] == 3.0
    with pytest.raises(ValueError, match="output_prior_precision is the refit round's prior"):
        fuse(models, "fedma", output_prior_precision=3.0, **kwargs)
    with pytest.raises(ValueError, match="output_prior_precision must be a positive number"):
        fuse(models, "fedma", rounds=2, output_prior_precision=-1.0, **kwargs)


def test_fedavg_rounds_improve_on_one_round(digits):
    split, part = digits
    cfg = replace(CONFIGS["mlp"], epochs=2)
    torch.manual_seed(0)
    init = MLP(64, (24, 24), 10)
    one = run_fedavg(init, split.train, part, cfg, rounds=1, verbose=False)
    three = run_fedavg(init, split.train, part, cfg, rounds=3, verbose=False)
    acc = lambda m: accuracy(predict_proba(m, split.test.x), split.test.y)  # noqa: E731
    assert three.rounds == 3 and three.bytes_up == 3 * one.bytes_up
    assert acc(three.model) > acc(one.model)


def test_train_model_keeps_frozen_entries_and_batchnorm_statistics():
    from bayesfuse.nets.arch import make_cnn

    model = make_cnn(64, 3, channels=(4,), hidden=(5,))
    spec = spec_from_module(model)
    frozen = {k for k in spec.axes if k.startswith(("1.", "2."))}  # conv and its batch norm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 64)).astype(np.float32), rng.integers(0, 3, 64)
    train_model(model, x, y, 3, TrainConfig(epochs=2), frozen=frozen)
    after = model.state_dict()
    for k in frozen:
        assert torch.equal(before[k], after[k]), k
    assert not torch.equal(before["6.weight"], after["6.weight"])
    with pytest.raises(ValueError, match="not in the network"):
        train_model(model, x, y, 3, TrainConfig(epochs=1), frozen={"nope.weight"})


def test_fedma_with_communication_restarts_clients_at_their_own_widths(digits):
    split, part = digits
    cfg = CONFIGS["mlp"]
    models = train_clients(split.train, part, cfg, shared_init=False, verbose=False)
    run = run_fedma(models, split.train, part, replace(cfg, epochs=2), passes=2, verbose=False)
    assert len(run.passes) == 2 and run.result is run.passes[-1]
    # two passes of (2 layers + output); the second's first round sends the global model down
    assert run.rounds == 2 * 3
    assert fedma_rounds(run.spec, passes=2) == run.rounds  # what FedAvg is given in the benchmarks
    # in the second pass the clients came back at their original widths, 24 units per layer
    assert all(len(a) == 24 for layer in run.result.layers.values() for a in layer.assignments)
    assert run.bytes_down > run.passes[0].bytes_down + run.passes[1].bytes_down
    acc = accuracy(predict_proba(run.model, split.test.x), split.test.y)
    local = np.mean([accuracy(predict_proba(m, split.test.x), split.test.y) for m in models])
    assert acc > local + 0.1, (acc, local)
    with pytest.raises(ValueError, match="passes"):
        run_fedma(models, split.train, part, cfg, passes=0)


def _trained_clients(cls, split, part, cfg) -> list:
    """One network of class ``cls`` per client, seeded by its index, trained on its own part."""
    models = []
    for j, p in enumerate(part):
        torch.manual_seed(j)
        models.append(cls())
        train_model(models[-1], split.train.x[p], split.train.y[p], split.train.n_classes, cfg, verbose=False)
    return models


def _accuracy_and_clients(model, models, split) -> tuple[float, float]:
    """The test accuracy of ``model`` and the mean of its clients'."""
    local = np.mean([accuracy(predict_proba(m.eval(), split.test.x), split.test.y) for m in models])
    return accuracy(predict_proba(model, split.test.x), split.test.y), float(local)


class _SplitGate(torch.nn.Module):
    """A gated layer cut by a width written in the code (``split(8, 1)``): its forward fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.mid, self.head = torch.nn.Linear(64, 16), torch.nn.Linear(8, 24), torch.nn.Linear(24, 10)

    def forward(self, x):
        a, b = self.fc(x).split(8, 1)
        return self.head(torch.relu(self.mid(torch.tanh(a) * torch.sigmoid(b))))


def test_fedma_matches_a_width_the_forward_fixes_at_that_width(digits):
    """FedMA matched every group at a width of its choosing, so it refused a network whose forward
    fixes one; it now matches that group at the clients' width (one to one, as PFNM does), and the
    network it builds runs and beats its clients."""
    split, part = digits
    cfg = TrainConfig(epochs=5)
    models = _trained_clients(_SplitGate, split, part, cfg)
    spec = spec_from_module(models[0])
    assert set(spec.fixed) == {"P1"}
    run = run_fedma(models, split.train, part, replace(cfg, epochs=2), verbose=False)
    assert run.result.sizes["P1"] == 8 and run.model.fc.out_features == 16
    assert run.result.hyper["fixed"] == spec.fixed  # and says so, as PFNM's result does
    acc, local = _accuracy_and_clients(run.model, models, split)
    assert acc > local + 0.1, (acc, local)  # as for the networks above: clearly above the average client


def test_fedma_matches_a_tensor_held_under_two_names_once(digits, monkeypatch):
    """A module held under two names (``SharedModule``: ``mix`` and ``block.mix``): its bias
    describes the units once in FedMA's matching (before, under both names, counted twice), and
    the network FedMA builds holds it once, with one value."""
    from bayesfuse.inference import fedma as fedma_steps
    from tests.nets.user_nets import SharedModule

    split, part = digits
    cfg = TrainConfig(epochs=5)
    models = _trained_clients(SharedModule, split, part, cfg)
    described = []
    entries = fedma_steps.unit_entries
    monkeypatch.setattr(fedma_steps, "unit_entries", lambda *args: described.append(entries(*args)) or described[-1])
    run = run_fedma(models, split.train, part, replace(cfg, epochs=2), verbose=False)
    assert described and all("block.mix.bias" not in e for e in described) and "mix.bias" in described[0]
    assert run.model.mix is run.model.block["mix"]
    acc, local = _accuracy_and_clients(run.model, models, split)
    assert acc > local + 0.1, (acc, local)  # as for the networks above: clearly above the average client
