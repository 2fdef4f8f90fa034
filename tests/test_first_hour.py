"""A user's first hour, end to end: their own MLP class trained on class-skewed digits, fused on
the command line, loaded back without a template, and summarised and plotted with ArviZ."""

import json
import warnings

import arviz as az
import matplotlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bayesfuse
from bayesfuse.analysis import summary
from bayesfuse.checkpoints import save_state_dict
from bayesfuse.cli import main
from bayesfuse.data import dirichlet_partition, load_digits
from tests.nets.user_nets import MyMLP

matplotlib.use("Agg")


def test_own_class_cli_fuse_load_and_arviz(tmp_path, capsys):
    split = load_digits().standardize()
    x, y = torch.as_tensor(split.train.x, dtype=torch.float32), torch.as_tensor(split.train.y)
    parts = dirichlet_partition(split.train.y, 3, 0.5, seed=0)
    paths = []
    for j, idx in enumerate(parts):  # how a user trains: their class, their loop, model.state_dict()
        torch.manual_seed(j)
        model = MyMLP()
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        for _ in range(80):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        paths.append(str(save_state_dict(model.state_dict(), tmp_path / f"site{j}.pt")))
    counts = tmp_path / "counts.json"
    counts.write_text(
        json.dumps(
            {f"site{j}.pt": np.bincount(split.train.y[idx], minlength=10).tolist() for j, idx in enumerate(parts)}
        )
    )

    out = tmp_path / "fused.pt"
    assert (
        main(
            [
                "fuse",
                *paths,
                "--method",
                "pfnm",
                "--model",
                "tests.nets.user_nets:MyMLP",
                "--class-counts",
                str(counts),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "fused 3 models with pfnm" in capsys.readouterr().out

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading and exporting raise no warning
        fused = bayesfuse.load(out)  # the report names MyMLP, whose module is imported: no like= needed
        assert isinstance(fused, MyMLP)
        xt = torch.as_tensor(split.test.x, dtype=torch.float32)
        with torch.no_grad():
            accuracy = float((fused(xt).argmax(1).numpy() == split.test.y).mean())
        assert accuracy > 0.5, accuracy  # ten classes: far above chance, whatever the seed
        idata = fused.fusion.to_arviz()
        table = az.summary(idata)
        assert len(table) == 64 and table["r_hat"].notna().all()  # the default export: 8 units x 8 weights
        assert len(summary(fused.fusion)) == fused.fusion.posteriors[0][0].size  # every entry, exactly
        axes = az.plot_forest(idata, var_names=["theta"])
    assert np.size(axes) >= 1


def _mlp_files(tmp_path, n=2, act=None):
    """``n`` client files of a plain nn.Sequential (ReLU, or ``act``), their data file, and the models."""
    gen = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, x=gen.normal(size=(40, 8)).astype(np.float32), y=np.arange(40) % 3)
    models, paths = [], []
    for j in range(n):
        torch.manual_seed(j)
        models.append(torch.nn.Sequential(torch.nn.Linear(8, 6), act or torch.nn.ReLU(), torch.nn.Linear(6, 3)))
        paths.append(str(save_state_dict(models[-1].state_dict(), tmp_path / f"c{j}.safetensors")))
    return models, paths, data


def test_a_guessed_network_is_said_in_one_line_in_the_command_lines_words(tmp_path, capsys):
    """A state_dict shows no activations: summarize reads a Linear chain with ReLU and says so in
    one note naming --model (it was a Python warning with its source line, advising like=)."""
    _, paths, data = _mlp_files(tmp_path, act=torch.nn.Tanh())
    assert main(["summarize", paths[0], "--data", str(data)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bayesfuse summarize: note: ")
    assert "read as an nn.Sequential of Linear layers with ReLU" in err[0] and "give --model MODULE:NAME" in err[0]
    assert "like=" not in err[0] and "warnings.warn" not in err[0]


def test_side_files_given_as_models_are_named_for_what_they_are(tmp_path, capsys):
    """``bayesfuse fuse *.safetensors`` in a folder of clients picks up their summaries."""
    _, paths, data = _mlp_files(tmp_path)
    for p in paths:
        assert main(["summarize", p, "--data", str(data)]) == 0
    summary = tmp_path / "c0.summary.safetensors"
    assert main(["fuse", *paths, str(summary), "--method", "pfnm", "--out", str(tmp_path / "f.pt")]) == 2
    assert f"{summary} is a client summary (bayesfuse summarize); bayesfuse fuse reads it from beside its model, " \
        "not a model" in capsys.readouterr().err  # fmt: skip
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(tmp_path / "f.pt")]) == 0
    report = json.loads((tmp_path / "f.pt.json").read_text())
    assert report["heads"] is not None and "returns the clients' heads" in report["posterior"]["stores"]
    for side in ("f.pt.heads.safetensors", "f.pt.posterior.safetensors", "f.pt.fusion.safetensors"):
        with pytest.raises(ValueError, match=f"{side} is a fused model's .*not a model"):
            bayesfuse.load(tmp_path / side)


def test_side_file_formats_are_the_writers():
    from bayesfuse.checkpoints import _SIDE_FILES, HEADS_FORMAT, POSTERIOR_FORMAT
    from bayesfuse.fusion_record import FUSION_FORMAT
    from bayesfuse.summaries import SUMMARY_FORMAT

    assert set(_SIDE_FILES) == {SUMMARY_FORMAT, POSTERIOR_FORMAT, HEADS_FORMAT, FUSION_FORMAT}


def test_summarize_says_what_it_read_and_sizes_the_model_alone(tmp_path, capsys):
    """A CSV is named as not an .npz (numpy's advice about pickles is left out); a checkpoint dict
    with optimizer state is summarised from its state_dict, said in a note, and the size ratio is
    against the model's tensors."""
    models, paths, data = _mlp_files(tmp_path)
    (tmp_path / "data.csv").write_text("1,2,3\n4,5,6\n")
    assert main(["summarize", paths[0], "--data", str(tmp_path / "data.csv")]) == 2
    err = capsys.readouterr().err
    assert "is not a NumPy .npz archive: save the inputs as x" in err and "allow_pickle" not in err
    opt = torch.optim.Adam(models[0].parameters())
    models[0](torch.zeros(2, 8)).sum().backward()
    opt.step()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model_state_dict": models[0].state_dict(), "optimizer_state_dict": opt.state_dict()}, ckpt)
    assert main(["summarize", str(ckpt), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    model_bytes = sum(t.numel() * t.element_size() for t in models[0].state_dict().values())
    assert f"the model's {model_bytes:,};" in out
    assert f"summarised the state_dict in {ckpt}['model_state_dict']" in out


def test_a_python_fused_posterior_saved_whole_is_named_on_load(tmp_path):
    models, _, _ = _mlp_files(tmp_path)
    fused = bayesfuse.fuse(models, "pfnm", head="clients", class_counts=np.ones((2, 3)))
    path = tmp_path / "heads.pt"
    torch.save(fused.model.state_dict(), path)
    with pytest.raises(ValueError, match=r"holds the state_dict of a ClientHeads .*bayesfuse.save\(result, path\)"):
        bayesfuse.load(path)
    bayesfuse.save(fused, tmp_path / "saved.pt")  # as the error says: and it loads back
    assert type(bayesfuse.load(tmp_path / "saved.pt")).__name__ == "ClientHeads"


def test_command_line_errors_name_command_line_options(tmp_path, capsys):
    _, paths, _ = _mlp_files(tmp_path)
    assert main(["fuse", *paths, "--method", "pfnm", "--hyper", "kl_weight=1", "--out", str(tmp_path / "f.pt")]) == 2
    err = capsys.readouterr().err
    assert "--method pfnm has no KL penalty; use --method nafi" in err and "method='" not in err
    assert main(["demo", "--dataset", "mnist", "--out", str(tmp_path / "d")]) == 2
    assert "--data-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert " ot," in capsys.readouterr().out.replace("\n", " ")
