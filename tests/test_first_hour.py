"""A user's first hour, end to end: their own MLP class trained on class-skewed digits, fused on
the command line, loaded back without a template, and summarised and plotted with ArviZ."""

import json
import warnings

import arviz as az
import matplotlib
import numpy as np
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
