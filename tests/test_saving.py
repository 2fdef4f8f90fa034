"""bayesfuse.save: a fusion made in Python written as the command line writes one, and read
back by bayesfuse.load into a model that predicts exactly as the saved one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

from bayesfuse import MLP, fuse, load, save
from bayesfuse.checkpoints import heads_path, posterior_path
from bayesfuse.data import dirichlet_partition, load_digits
from bayesfuse.fusion_record import fusion_path
from bayesfuse.nets.heads import ClientHeads
from bayesfuse.nets.laplace import LastLayerLaplace


@pytest.fixture(scope="module")
def federation(summarised_federation):
    return summarised_federation


def _same_predictions(saved: nn.Module, loaded: nn.Module, x) -> None:
    """Bit for bit: the loaded model holds the saved one's tensors, in the same layout."""
    x = torch.as_tensor(x, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(saved.eval()(x), loaded(x))
    if hasattr(saved, "predict"):  # the sampled predictive too, from fresh draws of the same seed
        np.testing.assert_array_equal(saved.predict(x, num_samples=7, seed=3), loaded.predict(x, num_samples=7, seed=3))


def test_the_one_shot_heads_come_back_exactly_with_their_settings(federation, tmp_path):
    split, _, models, summaries = federation
    result = fuse(models, "pfnm", summaries=summaries)
    assert isinstance(result.model, ClientHeads) and result.model.form == "kronecker"
    result.model.temperature.fill_(0.7)  # as a temperature round leaves it
    result.model.pseudo_count = 0.25
    report = save(result, tmp_path / "fused.pt")
    back = load(tmp_path / "fused.pt")
    assert isinstance(back, ClientHeads)
    assert (back.pool, back.pseudo_count, float(back.temperature), back.form) == ("log", 0.25, 0.7, "kronecker")
    _same_predictions(result.model, back, split.test.x)
    back.predictive = result.model.predictive = "map"
    _same_predictions(result.model, back, split.test.x)
    assert report["heads"]["temperature"] == 0.7 and report["heads"]["pseudo_count"] == 0.25
    assert (
        json.loads((tmp_path / "fused.pt.json").read_text())["model_tensors_sha256"] == report["model_tensors_sha256"]
    )
    # the matched layers' posteriors come back as the result's, the clients in the order given
    for saved, loaded in zip(result.layers, back.fusion.layers):
        for a, b in zip(saved.assignments, loaded.assignments):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(result.posteriors[0][0], back.fusion.posteriors[0][0])
    assert back.fusion.hyper["fused_order"] == result.hyper["fused_order"]


@pytest.mark.parametrize("variant", ["trace-matched", "ekfac", "diagonal", "points"])
def test_every_form_of_heads_comes_back_exactly(federation, tmp_path, variant):
    from bayesfuse.inference.client_heads import kronecker_variants

    split, _, models, summaries = federation
    result = fuse(models, "pfnm", summaries=summaries)
    heads = result.model
    if variant == "points":
        heads = fuse(models, "pfnm", head="clients").model
        assert heads.form == "map"
    else:
        assignments = {g: layer.assignments for g, layer in zip(result.groups, result.layers)}
        from bayesfuse.client_order import canonical_order

        order = canonical_order(models)  # the heads are in the fused order
        states = [{k: v.detach().numpy() for k, v in models[j].state_dict().items()} for j in order]
        ordered = {g: [a[j] for j in order] for g, a in assignments.items()}
        spec = result.model.spec if hasattr(result.model, "spec") else None
        from bayesfuse.nets.spec import spec_from_module

        spec = spec or spec_from_module(models[0])
        ratios, eigenvalues, diagonal = kronecker_variants(
            spec, states, ordered, int(heads.weight.shape[2]), [summaries[j] for j in order]
        )
        heads = {
            "trace-matched": lambda: heads.with_scale(ratios),
            "ekfac": lambda: heads.with_eigenvalues(eigenvalues),
            "diagonal": lambda: heads.with_diagonal(diagonal),
        }[variant]()
    saved = dataclasses.replace(result, model=heads)
    save(saved, tmp_path / "fused.safetensors")
    back = load(tmp_path / "fused.safetensors")
    assert back.form == heads.form and sorted(dict(back.named_buffers())) == sorted(dict(heads.named_buffers()))
    _same_predictions(heads, back, split.test.x[:300])


def test_the_shared_and_the_refitted_output_layers_come_back_exactly(federation, tmp_path):
    split, part, models, summaries = federation
    shared = fuse(models, "pfnm", summaries=summaries, head="shared")
    refit = fuse(models, "pfnm", rounds=2, data=(split.train, part))
    assert isinstance(shared.model, LastLayerLaplace) and not shared.model.joint
    assert isinstance(refit.model, LastLayerLaplace) and refit.model.joint
    refit.model.temperature.fill_(1.3)
    for name, result in (("shared", shared), ("refit", refit)):
        report = save(result, tmp_path / f"{name}.pt")
        back = load(tmp_path / f"{name}.pt")
        assert isinstance(back, LastLayerLaplace) and back.joint == result.model.joint
        assert report["posterior"]["covariance"] == (None if name == "shared" else "joint")
        _same_predictions(result.model, back, split.test.x[:200])
    assert torch.equal(load(tmp_path / "refit.pt").temperature, refit.model.temperature)  # float32, as set


class _Net(nn.Module):
    """A class of a user's own, with an option no entry holds."""

    def __init__(self, width: int = 16, act: str = "relu"):
        super().__init__()
        self.inp, self.out, self.act = nn.Linear(8, width), nn.Linear(width, 3), getattr(torch, act)

    def forward(self, x):
        return self.out(self.act(self.inp(x)))


def test_a_network_its_entries_do_not_give_back_loads_like_it_and_only_so(tmp_path):
    from bayesfuse.nets.pans import PANConfig
    from bayesfuse.train import TrainConfig, train_clients

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(_Net(act="tanh"))
    result = fuse(models, "pfnm")
    report = save(result, tmp_path / "net.pt")
    assert report["load"]["like"] == "tests.test_saving:_Net" and report["architecture"]["network"] is None
    # never built from the report with its defaults (relu): refused, naming what to give
    with pytest.raises(ValueError, match=r"saved from a network tests.test_saving:_Net .* like=_Net\(...\)"):
        load(tmp_path / "net.pt")
    back = load(tmp_path / "net.pt", like=_Net(act="tanh"))
    assert type(back) is _Net and back.inp.out_features == result.sizes[0]
    _same_predictions(result.model, back, torch.randn(5, 8))
    # bayesfuse's own MLP with position-aware neurons: no entry holds them, so an MLP read from the
    # entries computes otherwise, and the file says so
    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 2, 0.5, seed=0)
    pans = train_clients(split.train, part, TrainConfig(hidden=(12,), epochs=1, pan=PANConfig()), verbose=False)
    pan = fuse(pans, "pfnm")
    assert save(pan, tmp_path / "pan.pt")["load"]["like"] == "bayesfuse.nets.mlp:MLP"
    with pytest.raises(ValueError, match="its entries alone do not give back"):
        load(tmp_path / "pan.pt")
    _same_predictions(pan.model, load(tmp_path / "pan.pt", like=pans[0]), split.test.x)


def test_a_network_holding_its_width_comes_back_run_on_the_input_fuse_was_given(tmp_path):
    """A conv-first network that does not say its input and reshapes by the width it holds
    (``self.hidden_dim``): ``save`` records the shape of ``fuse``'s ``example_input``, and ``load``
    traces and runs the network on it, the width set to the fused one."""
    from tests.nets.test_graph_spec import _random
    from tests.nets.user_nets import PatchTokensUnguessed

    x = torch.randn(4, 64)
    result = fuse([_random(PatchTokensUnguessed, s) for s in range(3)], "pfnm", example_input=x[:2])
    report = save(result, tmp_path / "fused.pt")
    assert report["architecture"]["input_shape"] == [64]
    loaded = load(tmp_path / "fused.pt", like=PatchTokensUnguessed())
    assert loaded.hidden_dim == result.model.hidden_dim > 12
    with torch.no_grad():
        assert torch.equal(loaded(x), result.model(x))


def test_a_convnet_comes_back_at_the_input_size_it_ran_on(tmp_path):
    from bayesfuse.nets.arch import make_cnn

    # 28x28 through three poolings ends at 3x3, as 24x24 does: the entries leave the size open
    nets = []
    for seed in range(2):
        torch.manual_seed(seed)
        nets.append(make_cnn(784, 10, channels=(3, 4, 5), hidden=(8,)).eval())
    result = fuse(nets, "pfnm")
    assert save(result, tmp_path / "cnn.pt")["load"] == {"like": None, "why": None, "n_features": 784}
    _same_predictions(result.model, load(tmp_path / "cnn.pt"), torch.randn(3, 784))


def test_a_float64_fusion_comes_back_in_float64(federation, tmp_path):
    split, _, models, summaries = federation
    doubles = [MLP(64, [32], 10).double() for _ in models]
    for d, m in zip(doubles, models):
        d.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    result = fuse(doubles, "pfnm", summaries=summaries, head="shared")
    save(result, tmp_path / "f64.pt")
    back = load(tmp_path / "f64.pt")
    assert back.network.layers[0].weight.dtype == back.weight_var.dtype == torch.float64
    x = torch.as_tensor(split.test.x, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(result.model.eval()(x), back(x))
    # a narrower file is read into float32 as it is (exactly), and runs on float32 inputs as before
    torch.save({k: v.bfloat16() for k, v in models[0].state_dict().items()}, tmp_path / "bf16.pt")
    narrow = load(tmp_path / "bf16.pt")
    assert narrow.layers[0].weight.dtype == torch.float32
    assert torch.equal(narrow.layers[0].weight, models[0].layers[0].weight.bfloat16().float())


def test_a_fedma_fusion_saves_its_infinite_noise_variances_as_text(federation, tmp_path):
    split, part, models, _ = federation
    result = fuse(models, "fedma", data=(split.train, part))
    assert np.isinf(np.asarray(result.layers[0].hyper["noise_var"], dtype=float)).any()  # constant pixels
    save(result, tmp_path / "fedma.pt")
    back = load(tmp_path / "fedma.pt")
    assert "inf" in np.ravel(np.asarray(back.fusion.layers[0].hyper["noise_var"], dtype=object)).tolist()
    _same_predictions(result.model, back, split.test.x)


def test_fused_bnns_come_back_with_their_posterior(tmp_path):
    from bayesfuse.models.bnn import HorseshoeBNN

    bnns = []
    for seed in range(2):
        torch.manual_seed(seed)
        bnn = HorseshoeBNN(6, [5], 3)
        bnn.guide(torch.zeros(1, 6))  # the guide's parameters exist once it has run
        bnns.append(bnn)
    result = fuse(bnns, "kl", seed=0)
    save(result, tmp_path / "bnn.pt")
    back = load(tmp_path / "bnn.pt")
    assert type(back) is type(result.model)
    x = torch.randn(4, 6)
    np.testing.assert_array_equal(
        result.model.predict(x, num_samples=5, seed=1), back.predict(x, num_samples=5, seed=1)
    )


def test_nothing_is_replaced_unless_forced_and_then_nothing_stale_is_left(federation, tmp_path):
    _, _, models, summaries = federation
    out = tmp_path / "fused.pt"
    heads = fuse(models, "pfnm", summaries=summaries)
    save(heads, out)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    plain = fuse(models, "fedavg")
    with pytest.raises(FileExistsError, match="replace it with force=True"):
        save(plain, out)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # all or nothing
    for own in (out, out.with_name("fused.pt.json"), fusion_path(out)):  # another fusion's heads alone
        own.unlink()
    with pytest.raises(FileExistsError, match=r"fused.pt.heads.safetensors exists"):
        save(plain, out)
    save(plain, out, force=True)
    # FedAvg matches nothing and keeps no heads: their files of the fusion before are gone with it
    assert not heads_path(out).exists() and not fusion_path(out).exists() and not posterior_path(out).exists()
    assert type(load(out)) is MLP
    with pytest.raises(ValueError, match="suffix|format|name"):
        save(plain, tmp_path / "fused.npz")


def test_a_saved_heads_file_that_does_not_fit_is_refused_naming_it(federation, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    _, _, models, summaries = federation
    out = tmp_path / "fused.pt"
    save(fuse(models, "pfnm", summaries=summaries), out)
    with safe_open(str(heads_path(out)), "np") as f:
        meta = f.metadata()
    tensors = load_file(str(heads_path(out)))
    for broken, why in (
        ({**tensors, "curv_vals": tensors["curv_vals"][:, :-1]}, r"\['curv_vals'\] do not fit 3 heads of 10 classes"),
        ({**tensors, "gram_vals": -tensors["gram_vals"] - 1}, "eigenvalues >= 0"),
        ({**tensors, "temperature": np.array(-1.0)}, "temperature must be one number > 0"),
        ({**tensors, "weight": tensors["weight"][:, :, 1:]}, "do not fit the output layer"),
        ({**tensors, "gram_vecs/0": tensors["gram_vecs/0"] * 2}, "gram_vecs are not orthonormal"),
        ({**tensors, "temperature": np.array(True)}, "temperature must be one number > 0"),
    ):
        save_file(broken, str(heads_path(out)), metadata=meta)
        with pytest.raises(ValueError, match=f"^{heads_path(out)}: does not fit .*{why}"):
            load(out)
    no_examples = {k: v for k, v in tensors.items() if k != "examples"}
    for broken, changed, why in (
        ({**tensors, "gram_vecs/1": tensors["gram_vecs/1"][1:]}, {}, "head 1's Gram eigenbasis does not fit"),
        ({k: v for k, v in tensors.items() if k != "support"}, {}, "Gram eigenbases do not fit their support"),
        (no_examples, {}, "does not hold what its metadata says"),  # the smoothing dropped
        (tensors, {"version": "2"}, "tensors of no heads file of their version"),  # read as the old layout
    ):
        save_file(broken, str(heads_path(out)), metadata={**meta, **changed})
        with pytest.raises(ValueError, match=why):
            load(out)


def test_a_saved_posterior_without_the_covariance_it_was_written_with_is_refused(federation, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    split, part, models, _ = federation
    out = tmp_path / "refit.pt"
    save(fuse(models, "pfnm", rounds=2, data=(split.train, part)), out)
    with safe_open(str(posterior_path(out)), "np") as f:
        meta = f.metadata()
    tensors = load_file(str(posterior_path(out)))
    save_file({k: v for k, v in tensors.items() if k != "covariance"}, str(posterior_path(out)), metadata=meta)
    with pytest.raises(ValueError, match="written with joint covariance, and holds none"):
        load(out)
